"""mmkv: LLM/VLM inference over a refcounted, copy-on-write radix tree of KV blocks.

The public names load on first use (PEP 562), so importing one of mmkv's modules, or running
``mmkv --help``, does not load torch, transformers and the engine.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from mmkv.lazy import lazy_exports

if TYPE_CHECKING:
    from mmkv.engine import Engine
    from mmkv.models import ModelLoadError
    from mmkv.outputs import CompletionOutput, RequestOutput
    from mmkv.sampling_params import SamplingParams, StructuredOutput

_HOMES = {"CompletionOutput": "mmkv.outputs", "Engine": "mmkv.engine",
          "ModelLoadError": "mmkv.models", "RequestOutput": "mmkv.outputs",
          "SamplingParams": "mmkv.sampling_params", "StructuredOutput": "mmkv.sampling_params"}

__all__ = sorted(_HOMES)
__getattr__, __dir__ = lazy_exports(globals(), _HOMES)
