"""Hugging Face checkpoints quantized by AWQ, GPTQ or compressed-tensors, repacked into mmkv's
layouts as they load.

A checkpoint whose config.json has a ``quantization_config`` of one of these methods stores each
quantized linear layer's weight ``[out, in]`` as integer codes ``q``, zero points ``z`` and scales
``s`` per group of ``group_size`` inputs (``-1``: one group per output channel), ``w = (q - z) s``:

- **AWQ** (``version: gemm``, 4 bits, with zero points): ``qweight`` int32 ``[in, out / 8]`` and
  ``qzeros`` int32 ``[groups, out / 8]`` pack eight outputs a word, output ``8c + ORDER[j]`` in bits
  ``4j`` (AWQ's interleaved order); ``scales`` ``[groups, out]``.
- **GPTQ** (4 or 8 bits, ``desc_act: false``, symmetric or not): ``qweight`` int32 ``[in / p, out]``
  packs ``p = 32 / bits`` inputs a word in order, ``qzeros`` int32 ``[groups, out / p]`` ``p``
  outputs a word; ``scales`` ``[groups, out]``; ``g_idx`` ``[in]`` each input's group, which must be
  ``i // group_size`` (act-order checkpoints are refused). ``checkpoint_format: gptq`` stores each
  zero point minus one, ``gptq_v2`` as it is.
- **compressed-tensors** ``pack-quantized`` (``int``, 4 or 8 bits, ``group`` or ``channel``
  strategy, weights only): ``weight_packed`` int32 ``[out, in / p]`` holds ``q + 2^(bits-1)`` in
  order, ``weight_scale`` ``[out, groups]``, and, asymmetric, ``weight_zero_point`` int32
  ``[out / p, groups]`` holds ``z + 2^(bits-1)`` packed along outputs.

Repacking is exact (every product in float32): 4 bits go to ``Int4Weight`` with the codes as
unsigned nibbles, the scale as stored and the offset ``s x (-z)`` in two levels (the scale tensor
itself times int8 codes), 8 bits to ``Int8GroupWeight`` with codes ``q - 128`` (signed) and the
offset ``s (128 - z)`` in float32 (none when it is 0). Scales keep their dtype, but bfloat16 ones
become float32 (the kernels read float16 or float32). Which layers are quantized is the format's:
every decoder and projector linear layer ``mmkv.quantization.loading.quantizes`` selects, but the
modules the config leaves out (AWQ's ``modules_to_not_convert``, compressed-tensors' ``ignore``).

Loading: transformers builds the model on the meta device; ``CheckpointQuantizer`` swaps each such
layer for a ``CheckpointLinear`` holding the format's tensors under their checkpoint names (in the
checkpoint's dtypes, so nothing is cast), transformers loads them as they are, and
``repack_loaded`` turns each into a ``QuantizedLinearModule`` and drops the packed tensors, a layer
at a time. An option mmkv does not run (``desc_act``, 2 or 3 bits, AWQ's GEMV or Marlin layouts,
activation quantization, another format) is a ``ValueError`` naming it before anything loads.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from transformers.quantizers.auto import AUTO_QUANTIZATION_CONFIG_MAPPING, AUTO_QUANTIZER_MAPPING
from transformers.utils.quantization_config import QuantizationConfigMixin

from mmkv.quantization.formats import Int4Weight, Int8GroupWeight, QuantizedWeight
from mmkv.quantization.linear import QuantizedLinearModule
from mmkv.quantization.loading import SwappingQuantizer, linear_layers, replace_modules

METHODS = ("awq", "gptq", "compressed-tensors")
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # bits 4j of an AWQ word hold output 8c + AWQ_ORDER[j]


@dataclass(frozen=True, slots=True)
class CheckpointFormat:
    """What a checkpoint's ``quantization_config`` says, checked (``of``)."""

    method: str
    bits: int
    group_size: int  # -1: one group per output channel
    symmetric: bool
    zeros_stored_minus_one: bool = False  # GPTQ's original format
    skip: tuple[str, ...] = ()  # module names (substrings) the checkpoint left unquantized
    skip_patterns: tuple[str, ...] = ()  # ... regular expressions (compressed-tensors' "re:")

    @classmethod
    def of(cls, config: dict) -> CheckpointFormat:
        """The format of a ``quantization_config``, or ``ValueError`` naming what mmkv does not run."""
        method = config.get("quant_method")
        if method == "awq":
            return cls._awq(config)
        if method == "gptq":
            return cls._gptq(config)
        if method == "compressed-tensors":
            return cls._compressed_tensors(config)
        raise ValueError(f"quantization method {method!r} is not supported; supported: {', '.join(METHODS)}")

    @classmethod
    def _awq(cls, config: dict) -> CheckpointFormat:
        version = str(config.get("version", "gemm")).lower()
        if version != "gemm":
            raise ValueError(f"AWQ version {version!r} is not supported (only the GEMM layout)")
        _check_bits("AWQ", config.get("bits", config.get("w_bit", 4)), (4,))
        if not config.get("zero_point", True):
            raise ValueError("AWQ without zero points (zero_point: false) is not supported")
        return cls("awq", 4, _group_size("AWQ", config.get("group_size", config.get("q_group_size"))),
                   False, skip=tuple(config.get("modules_to_not_convert") or ()))

    @classmethod
    def _gptq(cls, config: dict) -> CheckpointFormat:
        if config.get("desc_act"):
            raise ValueError("GPTQ with desc_act: true (act-order) is not supported")
        bits = _check_bits("GPTQ", config.get("bits"), (4, 8))
        form = config.get("checkpoint_format", "gptq")
        if form not in ("gptq", "gptq_v2"):
            raise ValueError(f"GPTQ checkpoint_format {form!r} is not supported (gptq, gptq_v2)")
        return cls("gptq", bits, _group_size("GPTQ", config.get("group_size")), bool(config.get("sym", True)),
                   zeros_stored_minus_one=form == "gptq",
                   skip=tuple(config.get("modules_to_not_convert") or ()))

    @classmethod
    def _compressed_tensors(cls, config: dict) -> CheckpointFormat:
        groups = config.get("config_groups") or {}
        if len(groups) != 1:
            raise ValueError(f"compressed-tensors with {len(groups)} config groups is not supported (one)")
        (scheme,) = groups.values()
        form = scheme.get("format") or config.get("format")
        if form != "pack-quantized":
            raise ValueError(f"compressed-tensors format {form!r} is not supported (pack-quantized)")
        if scheme.get("input_activations") or scheme.get("output_activations"):
            raise ValueError("compressed-tensors activation quantization is not supported (weights only)")
        weights = scheme.get("weights") or {}
        if weights.get("type", "int") != "int" or weights.get("dynamic") or weights.get("actorder"):
            raise ValueError(f"compressed-tensors weights {weights} are not supported (static int, no actorder)")
        bits = _check_bits("compressed-tensors", weights.get("num_bits"), (4, 8))
        strategy = weights.get("strategy")
        if strategy not in ("group", "channel"):
            raise ValueError(f"compressed-tensors strategy {strategy!r} is not supported (group, channel)")
        group = _group_size("compressed-tensors", weights.get("group_size")) if strategy == "group" else -1
        ignore = list(config.get("ignore") or ())
        return cls("compressed-tensors", bits, group, bool(weights.get("symmetric", True)),
                   skip=tuple(i for i in ignore if not i.startswith("re:")),
                   skip_patterns=tuple(i[3:] for i in ignore if i.startswith("re:")))

    def describe(self) -> str:
        """The format in words: ``awq int4 (group 128)``, ``gptq int8 (per channel)``."""
        group = "per channel" if self.group_size == -1 else f"group {self.group_size}"
        return f"{self.method} int{self.bits} ({group})"

    def quantized(self, name: str) -> bool:
        """Whether the checkpoint holds the linear layer at module path ``name`` quantized."""
        return not (any(s in name for s in self.skip) or any(re.match(p, name) for p in self.skip_patterns))

    @property
    def per_word(self) -> int:
        return 32 // self.bits

    def groups(self, in_features: int) -> int:
        return 1 if self.group_size == -1 else in_features // self.group_size

    def tensor_shapes(self, in_features: int, out_features: int) -> dict[str, tuple[int, ...]]:
        """Each tensor the checkpoint holds for a layer, by its name, and its shape."""
        p, g = self.per_word, self.groups(in_features)
        if self.method == "awq":
            return {"qweight": (in_features, out_features // p), "qzeros": (g, out_features // p),
                    "scales": (g, out_features)}
        if self.method == "gptq":
            return {"qweight": (in_features // p, out_features), "qzeros": (g, out_features // p),
                    "scales": (g, out_features), "g_idx": (in_features,)}
        shapes = {"weight_packed": (out_features, in_features // p), "weight_scale": (out_features, g),
                  "weight_shape": (2,)}
        if not self.symmetric:
            shapes["weight_zero_point"] = (out_features // p, g)
        return shapes

    def repack(self, tensors: dict[str, torch.Tensor], in_features: int, out_features: int) -> QuantizedWeight:
        """A layer's checkpoint tensors in mmkv's layout (the module docstring)."""
        half = 1 << (self.bits - 1)
        if self.method == "awq":
            codes = _unpack_columns(tensors["qweight"], self.bits, AWQ_ORDER).T
            zeros = _unpack_columns(tensors["qzeros"], self.bits, AWQ_ORDER).T
            scale = tensors["scales"].T
        elif self.method == "gptq":
            group = in_features if self.group_size == -1 else self.group_size
            if not torch.equal(tensors["g_idx"].long(), torch.arange(in_features) // group):
                raise ValueError("GPTQ g_idx is not each input's group in order (an act-order "
                                 "checkpoint, desc_act); not supported")
            codes = _unpack_columns(tensors["qweight"].T, self.bits)  # [out, in]
            zeros = _unpack_columns(tensors["qzeros"], self.bits).T + int(self.zeros_stored_minus_one)
            scale = tensors["scales"].T
        else:
            codes = _unpack_columns(tensors["weight_packed"], self.bits)
            scale = tensors["weight_scale"]
            zeros = (_unpack_columns(tensors["weight_zero_point"].T, self.bits).T if not self.symmetric
                     else torch.full(scale.shape, half, dtype=torch.int32))
        scale = scale.contiguous() if scale.dtype in (torch.float16, torch.float32) else scale.float()
        group = in_features if self.group_size == -1 else self.group_size
        if self.bits == 4:
            packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).to(torch.uint8)
            return Int4Weight(packed, scale, scale, group, offset_codes=(-zeros).to(torch.int8).contiguous())
        offset = None if torch.all(zeros == half) else scale.float() * (half - zeros).float()
        return Int8GroupWeight((codes - half).to(torch.int8), scale, group, offset)


def _check_bits(method: str, bits, supported: tuple[int, ...]) -> int:
    if bits not in supported:
        raise ValueError(f"{method} with {bits} bits is not supported ({', '.join(map(str, supported))} bits)")
    return bits


def _group_size(method: str, size) -> int:
    if not isinstance(size, int) or not (size == -1 or size > 0):
        raise ValueError(f"{method} group size {size!r} is not supported")
    return size


def _unpack_columns(words: torch.Tensor, bits: int, order: tuple[int, ...] | None = None) -> torch.Tensor:
    """int32 words ``[rows, n]`` holding ``32 / bits`` values each, value ``j`` in bits
    ``bits * j`` (``order``: of column ``c * per + order[j]``), as int32 ``[rows, n * per]``."""
    per = 32 // bits
    shifts = torch.arange(0, 32, bits, dtype=torch.int32)
    values = (words.to(torch.int32)[..., None] >> shifts) & ((1 << bits) - 1)  # [rows, n, per]
    if order is not None:
        values = values[..., torch.argsort(torch.tensor(order))]
    return values.reshape(words.shape[0], -1)


class CheckpointLinear(torch.nn.Module):
    """A linear layer as a quantized checkpoint stores it, until ``repack_loaded`` repacks it."""

    def __init__(self, form: CheckpointFormat, in_features: int, out_features: int, bias: bool,
                 dtypes: dict[str, torch.dtype]) -> None:
        super().__init__()
        self.form, self.in_features, self.out_features = form, in_features, out_features
        for name, shape in form.tensor_shapes(in_features, out_features).items():
            tensor = torch.empty(shape, dtype=dtypes.get(name, torch.int32))
            self.register_parameter(name, torch.nn.Parameter(tensor, requires_grad=False))
        self.bias = torch.nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None

    def repacked(self) -> QuantizedLinearModule:
        tensors = dict(self.named_parameters(recurse=False))
        missing = [n for n, t in tensors.items() if t.is_meta]
        if missing:
            raise ValueError(f"the checkpoint lacks {', '.join(missing)}")
        weight = self.form.repack({n: t.data for n, t in tensors.items()}, self.in_features, self.out_features)
        return QuantizedLinearModule.of(weight, self.bias)


def checkpoint_dtypes(path: Path, form: CheckpointFormat) -> dict[str, torch.dtype]:
    """The dtype each of the format's tensor names has in the checkpoint (the first layer's)."""
    names = set(form.tensor_shapes(form.group_size if form.group_size > 0 else 32, 32))
    found: dict[str, torch.dtype] = {}
    for file in sorted(Path(path).glob("*.safetensors")):
        with safe_open(file, "pt") as f:
            for key in f.keys():
                suffix = key.rpartition(".")[2]
                if suffix in names and suffix not in found:
                    found[suffix] = f.get_slice(key).get_dtype()
        if len(found) == len(names):
            break
    table = {"F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32, "I32": torch.int32,
             "I64": torch.int64, "I8": torch.int8}
    return {name: table[dtype] for name, dtype in found.items() if dtype in table}


class CheckpointConfig(QuantizationConfigMixin):
    """transformers' handle on a ``CheckpointFormat`` (never saved: mmkv drops it after loading)."""

    def __init__(self, form: CheckpointFormat | None = None, dtypes: dict | None = None, **_: object) -> None:
        self.quant_method = "mmkv_checkpoint"
        self.form, self.dtypes = form, dtypes or {}


class CheckpointQuantizer(SwappingQuantizer):
    """Loads a quantized checkpoint's layers as they are stored (``CheckpointLinear``)."""

    def __init__(self, quantization_config: CheckpointConfig, **kwargs) -> None:
        super().__init__(quantization_config, **kwargs)
        self.form, self.dtypes = quantization_config.form, quantization_config.dtypes

    def param_needs_quantization(self, model: torch.nn.Module, param_name: str, **_: object) -> bool:
        return False

    def _process_model_before_weight_loading(self, model: torch.nn.Module, **_: object) -> None:
        names = [n for n in linear_layers(model) if self.form.quantized(n)]
        replace_modules(model, names, lambda _, linear: CheckpointLinear(
            self.form, linear.in_features, linear.out_features, linear.bias is not None, self.dtypes))


def checkpoint_arguments(path: Path, quantization) -> dict:
    """``from_pretrained`` arguments that load the checkpoint in ``path`` as it is quantized: the
    config without its ``quantization_config`` (so transformers' own AWQ/GPTQ/compressed-tensors
    support, and its libraries, stay out) and a ``CheckpointConfig``; none for a checkpoint that
    is not quantized. ``ValueError`` for an unsupported format, or when ``quantization`` asks to
    quantize it again."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(path)
    holders = [c for c in {id(c): c for c in (config, config.get_text_config())}.values()
               if getattr(c, "quantization_config", None) is not None]
    if not holders:
        return {}
    settings = holders[0].quantization_config
    form = CheckpointFormat.of(settings if isinstance(settings, dict) else settings.to_dict())
    if quantization is not None:
        raise ValueError(f"{Path(path).name} is quantized already ({form.describe()}); "
                         f"load it without quantization")
    for holder in holders:
        del holder.quantization_config
    return {"config": config, "quantization_config": CheckpointConfig(form, checkpoint_dtypes(path, form))}


def repack_loaded(model: torch.nn.Module) -> int:
    """Turn every ``CheckpointLinear`` of a loaded model into a ``QuantizedLinearModule``, one at a
    time (its packed tensors released as it goes). Returns how many."""
    names = [n for n, m in model.named_modules() if isinstance(m, CheckpointLinear)]
    replace_modules(model, names, lambda _, layer: layer.repacked())
    return len(names)


# transformers' registry of quantization methods (set, not ``register_*``, as mmkv.quantization.loading)
AUTO_QUANTIZATION_CONFIG_MAPPING["mmkv_checkpoint"] = CheckpointConfig
AUTO_QUANTIZER_MAPPING["mmkv_checkpoint"] = CheckpointQuantizer
