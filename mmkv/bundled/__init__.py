"""The models that ship with mmkv (trained by ``examples/train_tiny.py``; ``docs/bundled-model.md``)
and the speculation settings measured fastest on them."""

from pathlib import Path

BUNDLED_MODEL = Path(__file__).parent / "tiny-vlm"  # a cross-attention VLM of scenes and reports
BUNDLED_DRAFT_MODEL = Path(__file__).parent / "tiny-draft"  # its draft model (same tokenizer)
# Early exit's settings measured fastest on the bundled model (python -m mmkv.bench spec)
BUNDLED_SPECULATION = {"num_tokens": 24, "adaptive_threshold": 0.9}
