"""Speculative decoding: configuration, exact verification (greedy and rejection sampling) and the
controller that decides each step whether a round of drafts pays or the step decodes plainly."""

from speculative.acceptance import DraftHistory
from speculative.config import DRAFT_LENGTHS, METHODS, SpeculativeConfig
from speculative.controller import DraftLengthController
from speculative.costs import PassCosts
from speculative.verification import Verdict, greedy_verdict, verify_greedy, verify_sampling

__all__ = ["DRAFT_LENGTHS", "METHODS", "DraftHistory", "DraftLengthController", "PassCosts",
           "SpeculativeConfig", "Verdict", "greedy_verdict", "verify_greedy", "verify_sampling"]
