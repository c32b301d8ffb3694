"""mmkv: LLM/VLM inference over a refcounted, copy-on-write radix tree of KV blocks.

The public names load on first use (PEP 562), so importing one of mmkv's modules, or running
``mmkv --help``, does not load torch, transformers and the engine.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from mmkv.engine import Engine
    from mmkv.models import ModelLoadError
    from mmkv.outputs import CompletionOutput, RequestOutput
    from mmkv.sampling_params import SamplingParams

_HOMES = {"CompletionOutput": "mmkv.outputs", "Engine": "mmkv.engine",
          "ModelLoadError": "mmkv.models", "RequestOutput": "mmkv.outputs",
          "SamplingParams": "mmkv.sampling_params"}

__all__ = sorted(_HOMES)


def __getattr__(name: str) -> Any:
    if name not in _HOMES:
        raise AttributeError(f"module 'mmkv' has no attribute {name!r}")
    value = getattr(importlib.import_module(_HOMES[name]), name)
    globals()[name] = value  # found once; later lookups do not come here
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_HOMES))
