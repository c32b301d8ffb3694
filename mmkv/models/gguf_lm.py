"""Language models from a GGUF file, llama.cpp's format: Llama, Mistral and Qwen2.

``Engine("model.gguf")`` (or a directory holding one ``.gguf`` and no ``config.json``) reads the
configuration and the tokenizer from the file's metadata as transformers does
(``from_pretrained(..., gguf_file=...)``), builds the model on the meta device, and then reads the
file, memory-mapped by the ``gguf`` package, one tensor at a time:

- a quantized weight of a linear layer (attention, MLP, LM head) is repacked into mmkv's layout
  (``mmkv.quantization.gguf``) and runs on its native kernels; so is a quantized token embedding
  (``QuantizedEmbedding``: a lookup dequantizes only the rows it reads), which a file without an
  ``output.weight`` shares with its head;
- every other tensor (norms, biases, F16/BF16/F32 weights) is read as it is into the model's dtype;
- llama.cpp stores a Llama's Q and K projections with each head's rotary halves interleaved;
  their rows are put back in transformers' order (a reordering of whole rows, exact on codes).

After each tensor its pages of the mapping are released (``madvise``), so the file's bytes never
stay resident beside the repacked copy, and the reader's parsed metadata is dropped once the
configuration is read: peak memory is the loaded model plus a few MiB of the tensor in flight
(``python -m mmkv.bench weights --peers llama.cpp`` reports ``load_rss_gguf_*``).
Invariant: the model computes with exactly the weights ``gguf.quants.dequantize`` gives for the
file (transformers' GGUF loading dequantizes to the same values: the oracle). Before anything is
loaded, an unsupported architecture, tensor type or split file is a ``ValueError`` naming it.
"""

from __future__ import annotations

import mmap
from pathlib import Path

import numpy as np
import torch
from gguf import GGUFReader, LlamaFileType
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.modeling_gguf_pytorch_utils import TensorProcessor, get_gguf_hf_weights_map

from mmkv.heap import release_free_heap
from mmkv.models.base import ATTENTION_NAME, ModelAdapter, ModelLoadError, resolve_dtype
from mmkv.quantization.formats import select_rows
from mmkv.quantization.gguf import QUANTIZED_TYPES, check_type, read_float, repack
from mmkv.quantization.linear import QuantizedEmbedding, QuantizedLinearModule
from mmkv.quantization.loading import quantizes, replace_modules

ARCHITECTURES = {"llama": "Llama and Mistral", "qwen2": "Qwen2"}
INTERLEAVED_ROTARY = ("llama",)  # architectures whose Q and K rows llama.cpp's converter permutes
IGNORED_TENSORS = ("rope_freqs.weight",)  # llama.cpp's copy of what the config's rope scaling says


def gguf_file(path: str | Path) -> Path | None:
    """The GGUF file ``path`` names: itself if it ends in ``.gguf``, or the one ``.gguf`` in a
    directory without a ``config.json`` (``ModelLoadError`` if it holds several); None for a
    Hugging Face model directory."""
    path = Path(path)
    if path.suffix == ".gguf" and not path.is_dir():
        if not path.is_file():
            raise ModelLoadError(f"GGUF file {str(path)!r} does not exist")
        return path
    if not path.is_dir() or (path / "config.json").exists():
        return None
    files = sorted(path.glob("*.gguf"))
    if len(files) > 1:
        raise ModelLoadError(f"model directory {str(path)!r} holds {len(files)} GGUF files "
                             f"({', '.join(f.name for f in files)}); name one of them")
    return files[0] if files else None


def _field(reader: GGUFReader, key: str):
    field = reader.fields.get(key)
    return None if field is None else field.contents()


def weights_format(reader: GGUFReader) -> str:
    """``gguf`` and what the file says it is quantized to (``general.file_type``: ``Q4_K_M``,
    ``Q8_0``, ...; nothing where it names no type mmkv knows)."""
    try:
        kind = LlamaFileType(_field(reader, "general.file_type")).name
    except ValueError:
        return "gguf"
    return f"gguf {kind.removeprefix('MOSTLY_').removeprefix('ALL_')}"


def check_file(reader: GGUFReader, file: Path) -> str:
    """The file's architecture, or ``ValueError`` naming what mmkv cannot load in it."""
    architecture = _field(reader, "general.architecture")
    if architecture not in ARCHITECTURES:
        raise ValueError(f"GGUF architecture {architecture!r} of {file.name} is not supported; "
                         f"supported: {', '.join(f'{k} ({v})' for k, v in ARCHITECTURES.items())}")
    if (_field(reader, "split.count") or 1) > 1:
        raise ValueError(f"{file.name} is one part of a split GGUF model; merge the parts first "
                         f"(llama.cpp's gguf-split --merge)")
    for tensor in reader.tensors:
        check_type(tensor.tensor_type, tensor.name)
    return architecture


def rotary_order(rows: int, heads: int) -> torch.Tensor:
    """The rows of a Q or K projection llama.cpp's converter interleaved, in transformers' order:
    within each head, the converter's row ``2i + a`` holds transformers' row ``a * half + i``."""
    half = rows // heads // 2
    return torch.arange(rows).view(heads, half, 2).transpose(1, 2).reshape(-1)


def _release(mapping: mmap.mmap, start: int, length: int) -> None:
    """Drop this process's pages of ``[start, start + length)`` of the file mapping (they stay in
    the page cache; touched again, they are read back)."""
    begin = start - start % mmap.PAGESIZE
    mapping.madvise(mmap.MADV_DONTNEED, begin, start + length - begin)


def load_gguf_lm(file: Path, device: torch.device, dtype: str | torch.dtype) -> ModelAdapter:
    """The model in GGUF ``file`` (the module docstring)."""
    try:
        reader = GGUFReader(file)
    except (OSError, ValueError) as err:
        raise ModelLoadError(f"cannot read GGUF file {str(file)!r}: {err}") from err
    architecture, described = check_file(reader, file), weights_format(reader)
    reader.fields.clear()  # the metadata's per-token views (tens of MiB for a large vocabulary)
    config = AutoConfig.from_pretrained(file.parent, gguf_file=file.name)
    release_free_heap()  # what parsing the metadata again for the config left
    dtype = resolve_dtype(dtype, None, device)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=ATTENTION_NAME)
    names = get_gguf_hf_weights_map(model, TensorProcessor(), model_type=architecture)
    heads = {"attn_q": config.num_attention_heads, "attn_k": config.num_key_value_heads}
    mapping = reader.data.base
    embedding = None
    for tensor in reader.tensors:
        if tensor.name in IGNORED_TENSORS:
            continue
        if tensor.name not in names:
            raise ValueError(f"GGUF tensor {tensor.name!r} has no place in a {config.model_type} model")
        owner_name, _, param = names[tensor.name].rpartition(".")
        owner = model.get_submodule(owner_name)
        kind, shape = tensor.tensor_type, tuple(int(n) for n in reversed(tensor.shape))
        role = tensor.name.split(".")[-2]
        order = (rotary_order(shape[0], heads[role])
                 if architecture in INTERLEAVED_ROTARY and role in heads else None)
        if kind in QUANTIZED_TYPES and param == "weight" and len(shape) == 2:
            weight = repack(kind, tensor.data, *shape)
            weight = weight if order is None else select_rows(weight, order)
            if isinstance(owner, torch.nn.Embedding):
                embedding = QuantizedEmbedding(weight, dtype)
                replace_modules(model, [owner_name], lambda *_: embedding)
            elif isinstance(owner, torch.nn.Linear) and (quantizes(owner_name) or owner is model.lm_head):
                replace_modules(model, [owner_name],
                                lambda _, linear: QuantizedLinearModule.of(weight, linear.bias))
            else:
                raise ValueError(f"GGUF tensor {tensor.name!r} is quantized ({kind.name}) but "
                                 f"{names[tensor.name]} is not a linear layer or embedding")
        else:
            value = read_float(kind, tensor.data, dtype).reshape(shape)
            setattr(owner, param, torch.nn.Parameter(value if order is None else value[order],
                                                     requires_grad=False))
        _release(mapping, int(tensor.data_offset), int(tensor.n_bytes))
    if config.tie_word_embeddings:
        if embedding is not None:
            model.lm_head = embedding.layer
        else:
            model.lm_head.weight = model.model.embed_tokens.weight
    model.model.rotary_emb = type(model.model.rotary_emb)(config=model.config)  # its tables, not meta
    missing = [n for n, t in (*model.named_parameters(), *model.named_buffers()) if t.is_meta]
    if missing:
        raise ModelLoadError(f"GGUF file {file.name} lacks {len(missing)} tensors "
                             f"({', '.join(missing[:3])}, ...)")
    del reader, mapping
    return ModelAdapter(model=model, text_model=model.model, lm_head=model.lm_head,
                        text_config=model.config, device=device, dtype=dtype,
                        weights_format=described)
