"""How an engine speculates."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from speculative.controller import Settings

METHODS = ("early_exit", "draft_model")
DRAFT_LENGTHS = ("auto", "fixed")


@dataclass(slots=True)
class SpeculativeConfig:
    """``early_exit``: the target's first ``early_exit_layer`` layers plus its final norm and LM
    head draft (their KV is the target's own); ``draft_model``: a separate small model with the same
    tokenizer (its KV in a second store addressed by the same block tables).

    ``num_tokens``: the most drafts per round. ``draft_length="auto"``: each step a controller
    (``speculative.controller``) decides from measured costs and acceptance whether a round pays
    (every sequence drafting its limit) or the step decodes plainly; ``"fixed"``: every round
    drafts ``num_tokens``. With ``adaptive_threshold`` a round also stops a sequence's
    drafting once the draft's top probability falls below it. ``settings``: the controller's
    tunable constants (``speculative.controller.Settings``). ``draft_quantization``
    (``"int8"``/``"int4"``): the draft model's linear layers quantized, whatever the target's.
    """

    method: str = "early_exit"
    num_tokens: int = 4
    early_exit_layer: int | None = None  # default: the model's own "early_exit_layer"
    draft_model: str | Path | None = None
    adaptive_threshold: float | None = None
    draft_length: str = "auto"
    settings: Settings = field(default_factory=Settings)
    draft_quantization: str | None = None

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"speculative method must be one of {METHODS}, got {self.method!r}")
        if not isinstance(self.num_tokens, int) or self.num_tokens < 1:
            raise ValueError(f"num_tokens must be an integer >= 1, got {self.num_tokens!r}")
        if self.method == "draft_model" and self.draft_model is None:
            raise ValueError("method 'draft_model' needs draft_model (a model directory)")
        if self.draft_length not in DRAFT_LENGTHS:
            raise ValueError(f"draft_length must be one of {DRAFT_LENGTHS}, got {self.draft_length!r}")
        if not isinstance(self.settings, Settings):
            raise ValueError(f"settings must be a speculative.controller.Settings, got {self.settings!r}")
        if self.draft_quantization is not None and self.method != "draft_model":
            raise ValueError("draft_quantization applies to method 'draft_model' only (early exit "
                             "drafts with the target's own layers)")
        if self.draft_quantization not in (None, "int8", "int4"):
            raise ValueError(f"draft_quantization must be int8, int4 or None, got {self.draft_quantization!r}")
        if self.adaptive_threshold is not None and not 0 < self.adaptive_threshold < 1:
            raise ValueError(f"adaptive_threshold must be in (0, 1), got {self.adaptive_threshold}")
