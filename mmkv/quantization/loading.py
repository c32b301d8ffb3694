"""Quantizing a model while it loads, one weight at a time.

transformers loads a checkpoint into a model built on the meta device, tensor by tensor, and lets
a registered quantizer turn each weight it claims into other tensors as it arrives. mmkv registers
one (``MmkvQuantizer``, method name ``mmkv``): before loading it swaps every linear layer that
``quantizes`` selects for a ``QuantizedLinearModule`` (still on the meta device), and each such
layer's float weight is quantized the moment it is read (``mmkv.quantization.formats``) and
dropped. So the full-precision model never exists: peak memory is the quantized model plus the
float tensors in flight, at most a few of one layer's (``python -m mmkv.bench weights --json``
reports the peak).

Which layers: every linear layer of the language model's decoder layers (attention, cross
attention and MLP projections) and of a vision projector (LLaVA's and Mllama's
``multi_modal_projector``, Qwen-VL's ``merger``, mmkv_vlm's ``projector``); never the vision
tower's own layers, the embeddings or the norms. The LM head is quantized by the model adapter
after loading, and only when asked (``Quantization.lm_head``), since it may be tied to the
embeddings.
"""

from __future__ import annotations

import torch
from transformers.core_model_loading import ConversionOps
from transformers.quantizers import HfQuantizer
from transformers.quantizers.auto import AUTO_QUANTIZATION_CONFIG_MAPPING, AUTO_QUANTIZER_MAPPING
from transformers.utils.quantization_config import QuantizationConfigMixin

from mmkv.heap import release_free_heap
from mmkv.quantization.formats import Quantization, quantize
from mmkv.quantization.linear import QuantizedLinearModule

METHOD = "mmkv"
VISION_TOWERS = ("vision", "visual")  # module names holding a vision tower (but its projector)
PROJECTORS = ("projector", "merger")


def quantizes(name: str) -> bool:
    """Whether the linear layer at module path ``name`` is quantized (the module docstring)."""
    if any(p in name for p in PROJECTORS):
        return True
    return "layers." in name and not any(v in name for v in VISION_TOWERS)


def linear_layers(model: torch.nn.Module) -> list[str]:
    """The module paths of ``model``'s ``nn.Linear`` layers that ``quantizes`` selects."""
    return [n for n, m in model.named_modules() if type(m) is torch.nn.Linear and quantizes(n)]


def replace_modules(model: torch.nn.Module, names: list[str], build) -> None:
    """Replace the module at each path of ``names`` by ``build(name, module)``, one at a time."""
    for name in names:
        parent, _, child = name.rpartition(".")
        owner = model.get_submodule(parent) if parent else model
        setattr(owner, child, build(name, getattr(owner, child)))


def swap_linear_layers(model: torch.nn.Module, quantization: Quantization,
                       build=None) -> list[str]:
    """Replace every selected ``nn.Linear`` of ``model`` by a ``QuantizedLinearModule``: made by
    ``build(name, module)`` when given (a loaded layer, quantized now), else an empty one for a
    loader to fill. Returns the names replaced."""
    names = linear_layers(model)
    replace_modules(model, names, build or (lambda _, linear: QuantizedLinearModule.empty(
        linear.in_features, linear.out_features, linear.bias is not None, quantization)))
    return names


def quantize_loaded(model: torch.nn.Module, quantization: Quantization) -> list[str]:
    """Quantize a model that is already loaded, layer by layer, each float weight released as
    soon as its layer is quantized (for models mmkv loads itself)."""
    def build(name: str, linear: torch.nn.Linear) -> QuantizedLinearModule:
        module = QuantizedLinearModule.of(quantize(linear.weight, quantization), linear.bias)
        linear.weight = None
        return module
    return swap_linear_layers(model, quantization, build)


class MmkvQuantizationConfig(QuantizationConfigMixin):
    """transformers' handle on a ``Quantization`` (never saved: mmkv drops it after loading)."""

    def __init__(self, method: str = "int8", group_size: int = 32, **_: object) -> None:
        self.quant_method = METHOD
        self.method, self.group_size = method, group_size

    @property
    def quantization(self) -> Quantization:
        return Quantization(self.method, self.group_size)


class QuantizeOnLoad(ConversionOps):
    """Turns one checkpoint weight into a quantized layer's codes, scale (and offset)."""

    def __init__(self, quantization: Quantization) -> None:
        self.quantization = quantization

    def convert(self, input_dict: dict, source_patterns=None, target_patterns=None,
                full_layer_name: str | None = None, **_: object) -> dict[str, torch.Tensor]:
        (key, value), = input_dict.items()
        weight = value[0] if isinstance(value, list) else value
        prefix = key.rpartition(".")[0]
        state = QuantizedLinearModule.state_of(prefix, quantize(weight, self.quantization))
        release_free_heap()  # the quantizing's temporaries
        return state


class SwappingQuantizer(HfQuantizer):
    """A quantizer that swaps layers before transformers loads the weights into them; what it
    makes is mmkv's own, never saved or trained."""

    requires_calibration = False

    def is_serializable(self) -> bool:
        return False

    @property
    def is_trainable(self) -> bool:
        return False


class MmkvQuantizer(SwappingQuantizer):
    """Quantizes the selected linear layers' weights as transformers loads them."""

    def __init__(self, quantization_config: MmkvQuantizationConfig, **kwargs) -> None:
        super().__init__(quantization_config, **kwargs)
        self.quantization = quantization_config.quantization

    def param_needs_quantization(self, model: torch.nn.Module, param_name: str, **_: object) -> bool:
        parent, _, tensor = param_name.rpartition(".")
        module = model.get_submodule(parent) if parent else model
        return isinstance(module, QuantizedLinearModule) and tensor != "bias"

    def _process_model_before_weight_loading(self, model: torch.nn.Module, **_: object) -> None:
        swap_linear_layers(model, self.quantization)

    def get_quantize_ops(self) -> ConversionOps:
        return QuantizeOnLoad(self.quantization)


# transformers' registry of quantization methods (set, not ``register_*``: a module imported
# again, as a reload does, replaces its classes instead of failing)
AUTO_QUANTIZATION_CONFIG_MAPPING[METHOD] = MmkvQuantizationConfig
AUTO_QUANTIZER_MAPPING[METHOD] = MmkvQuantizer


def loading_arguments(quantization: Quantization | None) -> dict:
    """Keyword arguments for transformers' ``from_pretrained`` that quantize while loading."""
    if quantization is None:
        return {}
    return {"quantization_config": MmkvQuantizationConfig(quantization.method, quantization.group_size)}


def finish_loading(model: torch.nn.Module) -> None:
    """Check that every quantized layer received its weight (transformers logs a conversion that
    failed and goes on: ``ValueError`` naming the layers instead), then drop what transformers
    attached for the quantizer, so the config names no method other libraries would read back."""
    empty = [n for n, m in model.named_modules()
             if isinstance(m, QuantizedLinearModule) and m.weight.is_floating_point()]
    if empty:
        raise ValueError(f"{len(empty)} linear layers were not quantized while loading "
                         f"({', '.join(empty[:3])}, ...)")
    for config in (model.config, model.config.get_text_config()):
        if hasattr(config, "quantization_config"):
            del config.quantization_config
    for attribute in ("hf_quantizer", "quantization_method"):
        if hasattr(model, attribute):
            delattr(model, attribute)
    model.is_quantized = False
