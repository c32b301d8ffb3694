"""Vision encoders: canonical RGB image -> preprocessed tensors -> patch embeddings.

An encoder has an ``identity`` (which preprocessing and which weights), a ``preprocess`` step
that turns a PIL image into the exact tensors the model consumes, and ``encode`` that turns those
tensors into embeddings ``[tokens, dim]`` for one image. ``calls`` counts encoder forward passes.

open_clip (with timm, about 50 MB resident and half a second) is imported by the open_clip
encoder's functions when first called, so a process that runs only text or Hugging Face vision
models never loads it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any, Callable

import torch
from PIL import Image
from safetensors.torch import load_file

Inputs = dict[str, torch.Tensor]


class VisionEncoder(ABC):
    identity: str

    def __init__(self) -> None:
        self.calls = 0

    @abstractmethod
    def preprocess(self, image: Image.Image) -> Inputs:
        """The model's tensors for one canonical RGB image."""

    @abstractmethod
    def _forward(self, inputs: Inputs) -> torch.Tensor:
        ...

    @torch.inference_mode()
    def encode(self, inputs: Inputs) -> torch.Tensor:
        """Embeddings ``[tokens, dim]`` of one preprocessed image."""
        self.calls += 1
        return self._forward(inputs)


def open_clip_vision_tower(arch: str | None = None, vision_cfg: dict[str, Any] | None = None,
                           embed_dim: int = 512, weights: str | Path | None = None) -> torch.nn.Module:
    """An open_clip vision tower, by registry name or by explicit config; randomly initialised, or
    loaded from the ``visual.*`` tensors of a local open_clip checkpoint (``weights``).

    The tower returns its patch tokens (``output_tokens``), which is what cross-attention needs.
    """
    import open_clip
    from open_clip.model import CLIPVisionCfg, _build_vision_tower

    if (arch is None) == (vision_cfg is None):
        raise ValueError("give exactly one of an open_clip architecture name or a vision config")
    if arch is not None:
        if arch not in open_clip.list_models():
            raise ValueError(f"unknown open_clip architecture {arch!r}")
        model_cfg = open_clip.get_model_config(arch)
        vision_cfg, embed_dim = model_cfg["vision_cfg"], model_cfg["embed_dim"]
    cfg = CLIPVisionCfg(**{**vision_cfg, "output_tokens": True})
    tower = _build_vision_tower(embed_dim, cfg)
    if weights is not None:
        state = _read_checkpoint(Path(weights))
        visual = {k[len("visual."):]: v for k, v in state.items() if k.startswith("visual.")}
        if not visual:
            raise ValueError(f"{weights} holds no visual.* tensors of an open_clip model")
        tower.load_state_dict(visual)
    return tower


def _read_checkpoint(path: Path) -> dict[str, torch.Tensor]:
    if not path.is_file():
        raise ValueError(f"open_clip checkpoint {str(path)!r} does not exist")
    if path.suffix == ".safetensors":
        return load_file(path)
    state = torch.load(path, map_location="cpu", weights_only=True)
    return state.get("state_dict", state)


class OpenClipEncoder(VisionEncoder):
    """An open_clip vision tower followed by a projector; open_clip's own eval preprocessing
    (normalised by ``mean`` and ``std``, by default open_clip's OpenAI dataset statistics)."""

    def __init__(self, tower: torch.nn.Module, projector: Callable[[torch.Tensor], torch.Tensor],
                 image_size: int, identity: str, mean: tuple[float, ...] | None = None,
                 std: tuple[float, ...] | None = None) -> None:
        import open_clip
        from open_clip.transform import image_transform

        super().__init__()
        self.tower, self.projector = tower, projector
        self.transform = image_transform(image_size, is_train=False,
                                         mean=open_clip.OPENAI_DATASET_MEAN if mean is None else mean,
                                         std=open_clip.OPENAI_DATASET_STD if std is None else std)
        self.identity = f"open_clip:{image_size}:{identity}"

    def preprocess(self, image: Image.Image) -> Inputs:
        return {"pixel_values": self.transform(image)[None]}

    def _forward(self, inputs: Inputs) -> torch.Tensor:
        param = next(self.tower.parameters())
        pixels = inputs["pixel_values"].to(param.device, param.dtype)
        _, tokens = self.tower(pixels)
        return self.projector(tokens)[0]


class ProcessorEncoder(VisionEncoder):
    """A Hugging Face image processor plus a model-specific forward (LLaVA, Mllama towers)."""

    def __init__(self, processor: Any, forward: Callable[[Inputs], torch.Tensor], identity: str) -> None:
        super().__init__()
        self.processor = processor
        self.forward_fn = forward
        self.identity = identity

    def preprocess(self, image: Image.Image) -> Inputs:
        out = self.processor(images=[image], return_tensors="pt")
        return {k: v for k, v in out.items() if isinstance(v, torch.Tensor)}

    def _forward(self, inputs: Inputs) -> torch.Tensor:
        return self.forward_fn(inputs)
