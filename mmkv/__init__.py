"""mmkv: LLM/VLM inference over a refcounted, copy-on-write radix tree of KV blocks."""

from mmkv.engine import Engine
from mmkv.models import ModelLoadError
from mmkv.outputs import CompletionOutput, RequestOutput
from mmkv.sampling_params import SamplingParams

__all__ = ["CompletionOutput", "Engine", "ModelLoadError", "RequestOutput", "SamplingParams"]
