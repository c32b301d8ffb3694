"""Speculative decoding: configuration and exact verification (greedy and rejection sampling)."""

from speculative.config import METHODS, SpeculativeConfig
from speculative.verification import Verdict, verify_greedy, verify_sampling

__all__ = ["METHODS", "SpeculativeConfig", "Verdict", "verify_greedy", "verify_sampling"]
