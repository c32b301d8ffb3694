"""mmkv's own forward for Llama-style decoder layers, over transformers' parameters.

Llama, Mistral, Qwen2, Qwen2-VL, Qwen2.5-VL and Mllama's self-attention layers share one
structure: RMSNorm, Q/K/V projections, rotary embedding (per row: M-RoPE's cos/sin are rows like
any other), attention, output projection and residual; RMSNorm, gate and up projections,
``act(gate) * up``, down projection and residual. transformers runs it as a tree of
modules with a batch dimension, transposes to ``[batch, heads, tokens, dim]`` and back, and about
fifteen Python calls per layer. ``FusedDecoderLayer`` runs the same operations on packed rows
``[tokens, hidden]`` with one GEMM for Q, K and V and one for gate and up: their weights are
concatenated once at load and the modules' parameters become views of the concatenation (no
second copy; the modules still work).

Invariant: in float32 with torch's operations (plain linear layers, ``MMKV_NATIVE=0``) the output
equals the transformers module's bit for bit (each operation is the module's, in its order; a
concatenated weight gives each output the same dot product); with the CPU's packed weights and
native kernels, up to float rounding. ``tests/test_fused_layer.py`` (for Qwen-VL
``tests/test_qwen_vl.py``) checks both on every family.
"""

from __future__ import annotations

import ctypes
import functools

import torch
import torch.nn.functional as F

from mmkv import native
from mmkv.models.packed_linear import PackedLinear, PlainLinear, make_linear, release
from mmkv.quantization import QuantizedLinear, QuantizedLinearModule, concatenable, concatenate
from mmkv.step_context import StepContext

SUPPORTED = ("LlamaDecoderLayer", "MistralDecoderLayer", "Qwen2DecoderLayer",
             "MllamaSelfAttentionDecoderLayer", "Qwen2VLDecoderLayer", "Qwen2_5_VLDecoderLayer")


def rms_norm(hidden: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' RMSNorm: statistics in float32, the weight applied in the input's dtype. In
    float32 torch's ``rms_norm`` computes the same operations in the same order in one call (on a
    decode row the eight calls' dispatch is the cost)."""
    if hidden.dtype == torch.float32 and weight.dtype == torch.float32:
        return F.rms_norm(hidden, weight.shape, weight, eps)
    x = hidden.to(torch.float32)
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x.to(hidden.dtype)


_RMS_NORM_ARGS = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64,
                  ctypes.c_float]


class RMSNorm:
    """An RMSNorm module's forward as a plain call over its weight (a module call's hooks and
    attribute lookups cost more than the norm does on a decode row). Float32 rows on the CPU go
    through ``mmkv/native/rms_norm.c`` where it is built (one call in place of torch's six
    kernels; equal up to the sum of squares' rounding), others through ``rms_norm``. The kernel
    is looked up when the norm is made: with ``MMKV_NATIVE=0`` every norm is torch's, bit for bit
    transformers'."""

    __slots__ = ("weight", "eps", "kernel")

    def __init__(self, weight: torch.Tensor, eps: float) -> None:
        self.weight, self.eps = weight, eps
        self.kernel = (native.function("mmkv_rms_norm", _RMS_NORM_ARGS, None)
                       if weight.device.type == "cpu" and weight.dtype == torch.float32
                       and weight.is_contiguous() else None)

    @classmethod
    def of(cls, module: torch.nn.Module) -> RMSNorm:
        """The norm of an RMSNorm module (its ``weight`` and ``variance_epsilon``)."""
        return cls(module.weight, module.variance_epsilon)

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.kernel is None or hidden.dtype != torch.float32 or not hidden.is_contiguous():
            return rms_norm(hidden, self.weight, self.eps)
        out = torch.empty_like(hidden)
        size = hidden.shape[-1]
        self.kernel(hidden.data_ptr(), self.weight.data_ptr(), out.data_ptr(), hidden.numel() // size,
                    size, self.eps)
        return out


_ROPE_WRITE_ARGS = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p,
                    ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
                    ctypes.c_int, ctypes.c_int, ctypes.c_int]


SILU_MODULES = ("SiLUActivation", "SiLU")  # transformers' and torch's SiLU modules

# transformers' RMSNorm classes of the fused families: each computes ``rms_norm`` exactly
RMS_NORMS = ("LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm", "MllamaTextRMSNorm", "Qwen2VLRMSNorm",
             "Qwen2_5_VLRMSNorm")


def norm_function(module: torch.nn.Module):
    """``module``'s forward as a plain call: an ``RMSNorm`` over its weight where it is one of
    ``RMS_NORMS``, else the module itself."""
    if type(module).__name__ not in RMS_NORMS:
        return module
    return RMSNorm.of(module)


def rotate(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of ``x`` ``[T, heads, dim]`` with ``cos`` ``[T, 1, dim]`` and the sine with
    its first half negated (times ``rotation_signs``): transformers' ``x * cos + rotate_half(x) * sin``, the
    same products in the same order with the negation moved from ``x``'s half to the sine's (so
    bit for bit), in one roll instead of two slices, a negation and a concatenation."""
    return x * cos + x.roll(x.shape[-1] // 2, -1) * signed_sin


def rotation_signs(like: torch.Tensor) -> torch.Tensor:
    """-1 over the first half of the last dimension, 1 over the second, in ``like``'s dtype and on
    its device (made once for each: a step multiplies by them; never written to)."""
    return _signs(like.shape[-1], like.dtype, like.device)


@functools.cache
def _signs(size: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    signs = torch.ones(size, dtype=dtype, device=device)
    signs[:size // 2] = -1
    return signs


def _concatenate(modules: list[torch.nn.Linear]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One weight (and bias) for several linear layers over the same input."""
    biases = [m.bias for m in modules]
    if any(b is None for b in biases) and any(b is not None for b in biases):
        raise ValueError("cannot fuse linear layers of which only some have a bias")
    weight = torch.cat([m.weight.detach() for m in modules])
    bias = None if biases[0] is None else torch.cat([b.detach() for b in biases])
    return weight, bias


def fused_quantized(modules: list[QuantizedLinearModule]) -> QuantizedLinear:
    """One quantized layer for several over the same input (of one layout): the modules' tensors
    become views of its concatenated ones, so they still run and nothing is stored twice."""
    if any(m.bias is not None for m in modules) and any(m.bias is None for m in modules):
        raise ValueError("cannot fuse linear layers of which only some have a bias")
    weight = concatenate([m.quantized for m in modules])
    bias = None if modules[0].bias is None else torch.cat([m.bias.detach() for m in modules])
    start = 0
    for m in modules:
        n = m.out_features
        for name, tensor in QuantizedLinearModule.state_of("", weight.rows(start, start + n)).items():
            m.set_tensor(name.lstrip("."), tensor)
        if bias is not None:
            m.bias.data = bias[start:start + n]
        start += n
    return QuantizedLinear(weight, bias)


class SideBySide:
    """Layers over one input that cannot share one weight (a checkpoint may quantize V to more
    bits than Q and K, or leave one layer unquantized), each run on its own, their outputs side by
    side as one layer's."""

    def __init__(self, linears: list) -> None:
        self.linears = linears

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([linear(x) for linear in self.linears], -1)


def fused_linear(modules: list[torch.nn.Module],
                 pack: bool) -> PackedLinear | PlainLinear | QuantizedLinear | SideBySide:
    """One layer for several linear layers over the same input. Quantized layers of one layout
    fuse into one quantized layer (``fused_quantized``), of several run side by side. Packed, it
    holds the only copy of the weights (the modules' are released); plain, the modules'
    parameters become views of its concatenated weight, so they still run and nothing is stored
    twice."""
    quantized = [isinstance(m, QuantizedLinearModule) for m in modules]
    if all(quantized) and concatenable([m.quantized for m in modules]):
        return fused_quantized(modules)
    if any(quantized):
        return SideBySide([m.linear if q else fused_linear([m], pack) for m, q in zip(modules, quantized)])
    weight, bias = _concatenate(modules)
    linear = make_linear(weight, bias, pack)
    if isinstance(linear, PackedLinear):
        release(*modules)
        return linear
    start = 0
    for m in modules:
        n = m.weight.shape[0]
        m.weight.data = weight[start:start + n]
        if bias is not None:
            m.bias.data = bias[start:start + n]
        start += n
    return linear


class FusedMLP:
    """A decoder layer's normalised gated MLP on packed rows: ``down(act(gate(x)) * up(x))`` with
    ``x`` the RMS-normalised input, gate and up in one GEMM. (Outputs are parted with
    ``split_with_sizes``, without ``Tensor.split``'s Python wrapper, which on a decode row costs
    more than the split.)"""

    def __init__(self, mlp: torch.nn.Module, norm: torch.nn.Module, pack: bool) -> None:
        intermediate = mlp.gate_proj.out_features
        self.halves = [intermediate, intermediate]
        self.gate_up = fused_linear([mlp.gate_proj, mlp.up_proj], pack)
        self.down_proj = fused_linear([mlp.down_proj], pack)
        # SiLU without its module's call (the same function; on a row the call costs more than it)
        self.act = F.silu if type(mlp.act_fn).__name__ in SILU_MODULES else mlp.act_fn
        self.norm = RMSNorm.of(norm)

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        x = self.norm(hidden)
        gate, up = self.gate_up(x).split_with_sizes(self.halves, -1)
        return self.down_proj(self.act(gate) * up)


class FusedDecoderLayer:
    """One decoder layer's forward on packed rows. Guarantees: ``layer(hidden, cos, sin, step)``
    equals the module's output for the same rows, positions and paged context, and writes the
    same K/V: bit for bit in float32 with plain linear layers and torch's operations
    (``MMKV_NATIVE=0``), up to float rounding with weights packed for the CPU (``packed_linear``)
    and the native kernels. On the CPU in float32, with a backend that stores K/V at the step's
    write slots, one native call (``mmkv/native/rope_write.c``) rotates Q and K and stores K and
    V, in place of the split, the rotation's four operations, the concatenation and the copy."""

    def __init__(self, module: torch.nn.Module, pack: bool) -> None:
        attn, mlp = module.self_attn, module.mlp
        self.layer_idx = attn.layer_idx
        self.head_dim = attn.head_dim
        self.num_heads = attn.config.num_attention_heads
        self.num_kv_heads = attn.config.num_key_value_heads
        self.scaling = attn.scaling
        self.sliding_window = (attn.sliding_window if hasattr(attn, "sliding_window")
                               else getattr(attn.config, "sliding_window", None))
        # Q and K side by side, then V: one rotary embedding over Q's and K's heads together
        self.split = [(self.num_heads + self.num_kv_heads) * self.head_dim,
                      self.num_kv_heads * self.head_dim]
        self.heads = [self.num_heads, self.num_kv_heads]
        norm = module.input_layernorm.weight  # in the model's dtype, on its device
        self.rope_write = (native.function("mmkv_rope_write", _ROPE_WRITE_ARGS, None)
                           if norm.device.type == "cpu" and norm.dtype == torch.float32 else None)
        self.qkv = fused_linear([attn.q_proj, attn.k_proj, attn.v_proj], pack)
        self.o_proj = fused_linear([attn.o_proj], pack)
        self.mlp = FusedMLP(mlp, module.post_attention_layernorm, pack)
        self.input_norm = RMSNorm.of(module.input_layernorm)

    @staticmethod
    def supports(module: torch.nn.Module) -> bool:
        return type(module).__name__ in SUPPORTED

    def __call__(self, hidden: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor,
                 step: StepContext) -> torch.Tensor:
        """``hidden`` ``[T, hidden]``; ``cos`` and the signed sine (``rotate``) ``[T, 1, head_dim]``
        at the rows' positions."""
        t = hidden.shape[0]
        qkv = self.qkv(self.input_norm(hidden))
        layer = step.kv_layers[self.layer_idx]
        if (self.rope_write is not None and step.backend.writes_slots_in_place
                and qkv.dtype == cos.dtype == signed_sin.dtype == layer.dtype == torch.float32
                and layer.is_contiguous()
                and qkv.stride(-1) == cos.stride(-1) == signed_sin.stride(-1) == 1):
            if step.check_bounds:  # the kernel writes K/V rows at write_slots unchecked
                native.check_slots(layer, step.batch.write_slots, 2 * t)
            q = torch.empty((t, self.num_heads, self.head_dim), dtype=qkv.dtype)  # K, V: the cache
            self.rope_write(qkv.data_ptr(), qkv.stride(0), cos.data_ptr(), cos.stride(0),
                            signed_sin.data_ptr(), signed_sin.stride(0), q.data_ptr(), layer.data_ptr(),
                            step.batch.write_slots.data_ptr(), t, self.num_heads, self.num_kv_heads,
                            self.head_dim)
        else:
            qk, v = qkv.split_with_sizes(self.split, -1)
            qk = rotate(qk.view(t, self.num_heads + self.num_kv_heads, self.head_dim), cos, signed_sin)
            q, k = qk.split_with_sizes(self.heads, 1)
            step.backend.write_kv(step, layer, k, v.view(t, self.num_kv_heads, self.head_dim))
        out = step.backend.attention(step, q, layer, self.scaling, self.sliding_window)
        hidden = hidden + self.o_proj(out.reshape(t, -1))
        return hidden + self.mlp(hidden)
