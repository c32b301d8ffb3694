"""The stepping engine: requests in, one ``step`` at a time, outputs out (``mmkv.engine`` adds
the calls that run prompts to completion).

An engine is four parts with one job each, and ``step`` is three calls:

* ``RequestPreparer`` (``mmkv.preparer``): tokenize, chat template, images, checks; everything
  before a request enters the scheduler.
* ``Scheduler`` (``mmkv.scheduler``): which sequences compute how many tokens this step, their
  slots reserved (preempting when the pool is full), and each speculating sequence's draft length.
* ``ModelRunner`` (``mmkv.runner``): step contexts, forward passes, sampling, speculative rounds;
  returns tokens and touches no sequence's bookkeeping.
* ``Postprocessor`` (``mmkv.postprocess``): append, stop, fork, finish; the outputs.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, ClassVar, Sequence as Seq

import numpy as np
import torch

from cache import KVCache, parse_bytes
from mmkv.attention.backend import choose_backend
from mmkv.bundled import BUNDLED_MODEL
from mmkv.calibration import calibrate
from mmkv.detokenizer import StreamTexts
from mmkv.image_kv import CrossAttentionKV
from mmkv.models import load_model, resolve_device
from mmkv.outputs import RequestOutput
from mmkv.postprocess import Postprocessor
from mmkv.preemption import CostWeights
from mmkv.preparer import PreparedRequest, Prompt, RequestPreparer
from mmkv.quantization import Quantization
from mmkv.request_table import RequestTable
from mmkv.restore_speeds import measured_restore_speeds
from mmkv.runner import AttentionPlanning, ModelRunner
from mmkv.sampling_params import SamplingParams
from mmkv.scheduler import Scheduler, SchedulerConfig
from mmkv.sequence import Sequence, prompt_keys
from mmkv.step_context import AttentionBackend
from speculative.config import SpeculativeConfig
from speculative.proposers import Speculator

class EngineCore:
    """Serves many requests at once over a paged, prefix-sharing KV cache, one ``step`` at a time.

    Guarantees: greedy output equals transformers' ``generate`` on the same weights whatever the
    batch, cache hits, chunking or preemption; a request that cannot be served raises
    ``ValueError`` when submitted and never disturbs the others; finished requests hold no blocks.
    With ``kv_cache_dtype`` ``"int8"`` or ``"fp8_e4m3"`` the cache stores K/V compressed
    (``cache.kv_format``; the layers of ``kv_cache_dtype_layers`` stay in the model's dtype):
    ``kv_cache_memory`` then holds about 2x (of bfloat16) to 4x (of float32) the tokens, and the
    output is the model's over the compressed K/V, no longer token for token transformers'.
    With ``quantization`` ``"int8"`` or ``"int4"`` every linear layer of the language model (and
    a vision projector) is quantized while it loads (``mmkv.quantization``; int4 in groups of
    ``quantization_group_size`` inputs; the LM head too, to int8, with ``quantize_lm_head``): the
    output is then that quantized model's, token for token transformers' on the dequantized
    weights.
    """

    attention_planning: ClassVar[AttentionPlanning] = AttentionPlanning()

    def __init__(self, model: str | Path = BUNDLED_MODEL, kv_cache_memory: str | int = "1GiB", block_size: int = 16,
                 device: str = "auto", dtype: str | torch.dtype = "auto",
                 host_kv_memory: str | int = "1GiB", max_model_len: int | None = None,
                 max_num_batched_tokens: int = 2048, max_num_seqs: int = 256,
                 enable_prefix_caching: bool = True, eviction_policy: str = "lru",
                 preemption: str = "auto", preemption_policy: str = "newest",
                 preemption_weights: CostWeights | None = None,
                 speculative: SpeculativeConfig | None = None,
                 attention_backend: str | AttentionBackend = "auto", kv_cache_dtype: str = "auto",
                 kv_cache_dtype_layers: Seq[int] | None = None, quantization: str | None = None,
                 quantization_group_size: int = 32, quantize_lm_head: bool = False,
                 debug: bool = False) -> None:
        device = resolve_device(device)
        weights = (None if quantization is None else
                   Quantization(quantization, quantization_group_size, quantize_lm_head))
        self.model = load_model(model, device, dtype, weights)
        draft = None
        if speculative is not None and speculative.method == "draft_model":
            draft_weights = (None if speculative.draft_quantization is None else
                             Quantization(speculative.draft_quantization, quantization_group_size))
            draft = load_model(speculative.draft_model, device, self.model.dtype, draft_weights)
        self.weight_bytes = self.model.weight_bytes + (0 if draft is None else draft.weight_bytes)
        layouts = [self.model.kv_layout(block_size, kv_cache_dtype, kv_cache_dtype_layers or ())]
        if draft is not None:
            layouts.append(draft.kv_layout(block_size, kv_cache_dtype))
        shapes = [(m.dtype, lay.head_dim) for m, lay in zip((self.model, draft), layouts)]
        stored = {lay.dtype_of(i) for lay in layouts for i in range(lay.num_layers)}
        self.attention = choose_backend(attention_backend, device, shapes, stored)
        self.kv = KVCache.from_memory(layouts[0], kv_cache_memory, host_kv_memory, device,
                                      eviction_policy, layouts[1:])
        if self.model.vision is not None and not enable_prefix_caching:
            self.model.vision.cache.resize(0)  # no reuse of any kind
        self.image_kv = (CrossAttentionKV(self.kv, self.model, self.attention,
                                          shared=enable_prefix_caching)
                         if self.model.cross_layers else None)
        self.max_model_len = min(max_model_len or self.model.max_model_len, self.model.max_model_len)
        self.quantization = self.model.weights_format or (weights and weights.describe())
        self.preparer = RequestPreparer(self.model, Path(model), self.kv, self.max_model_len)
        self.runner = ModelRunner(self.model, self.kv, self.attention, self.image_kv,
                                  self.attention_planning, speculative, draft, check_bounds=debug)
        self.scheduler_config = SchedulerConfig(max_num_batched_tokens, max_num_seqs, preemption,
                                                enable_prefix_caching, preemption_policy,
                                                preemption_weights or CostWeights())
        self.debug = debug
        self._start()
        self.calibration_seconds = 0.0  # what timing the speculative passes took at construction
        if (speculative is not None and speculative.draft_length == "auto"
                and speculative.settings.calibrate):
            started = time.perf_counter()
            calibrate(self)
            self.calibration_seconds = time.perf_counter() - started
            self.speculator.keep_costs_only()
            self.runner.forget_decode_threads()
            self.kv.reset_cache()
            self._start()

    def _start(self) -> None:
        """A fresh scheduler, request table and postprocessor: no request, every count at 0
        (at construction, and again after the calibration's requests)."""
        speculator = self.speculator
        self.requests = RequestTable()
        self.scheduler = Scheduler(
            self.kv, self.scheduler_config, self.model.text_rebuild_flops,
            measured_restore_speeds(self.runner, self.kv),
            self.image_kv,
            (lambda seqs, prompts: speculator.plan(seqs, self.max_model_len, prompts))
            if speculator else None,
            vision=self.model.vision)
        self.postprocessor = Postprocessor(self.scheduler, self.kv, self.requests,
                                           self.preparer.decode, self.max_model_len,
                                           speculator.finished if speculator else None)
        self._prompt_tokens = 0
        # seconds in steps that compute more than each sequence's pending token (prompt chunks,
        # recomputation; a step mixing them with decoding counts here) and in decoding steps
        self._step_seconds = {"step_seconds_prefill": 0.0, "step_seconds_decode": 0.0}

    # -- submission -----------------------------------------------------------------------------
    def add_request(self, prompt: Prompt, params: SamplingParams | None = None,
                    cache_salt: str | None = None, chat: bool = False) -> int:
        """Queue one request; returns its id. Raises ``ValueError`` for input it cannot serve
        (``vision.ImageError`` for a bad image), leaving everything else untouched."""
        return self.add_prepared(self.prepare_request(prompt, params, cache_salt, chat))

    def prepare_request(self, prompt: Prompt, params: SamplingParams | None = None,
                        cache_salt: str | None = None, chat: bool = False,
                        label: str = "request") -> PreparedRequest:
        """Everything ``add_request`` does before queueing (tokenizing, the chat template, the
        images, every check), on any thread: it touches no engine state but the image registry,
        which is locked. Raises ``ValueError`` as ``add_request`` does (``label`` names it)."""
        return self.preparer.prepare(prompt, params, cache_salt, chat, label)

    def add_prepared(self, req: PreparedRequest) -> int:
        """Queue a request ``prepare_request`` made; returns its id. Runs on the thread that
        steps the engine, and costs no input work."""
        request_id = self.requests.new_id()
        params, seed = req.params, req.params.seed
        generators = [torch.Generator().manual_seed(seed + i) if seed is not None else None
                      for i in range(params.n)]
        seq = Sequence(seq_id=request_id, request_id=request_id, index=0, token_ids=req.token_ids,
                       prompt_len=len(req.token_ids), params=params,
                       arrival=self.requests.new_arrival(), namespace=req.namespace,
                       generator=generators[0], stop_token_ids=req.stop_token_ids,
                       fork_generators=generators[1:], images=req.images, rope=req.rope,
                       logprobs=None if params.logprobs is None else [],
                       constraint=req.constraint)
        self.requests.add(seq)
        self._prompt_tokens += len(req.token_ids)
        self.scheduler.add(seq)
        return request_id

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix, image cross-attention K/V and image embedding that no
        request holds (vLLM's ``reset_prefix_cache``): the next request computes them again. The
        cache's hit and eviction counts start again from 0; requests in flight keep their blocks."""
        self.kv.reset_cache()
        if self.model.vision is not None:
            kept = self.model.vision.cache.max_bytes
            self.model.vision.cache.resize(0)
            self.model.vision.cache.resize(kept)

    def cached_prefix_tokens(self, req: PreparedRequest) -> int:
        """How many of ``req``'s prompt tokens a request would be served from the cache now: its
        longest cached prefix (image tokens matching their image), less the last token, which is
        always computed. Reads the tree without counting a use; on the thread that steps the
        engine."""
        if not self.scheduler_config.enable_prefix_caching or not req.token_ids:
            return 0
        keys = prompt_keys(np.asarray(req.token_ids, dtype=np.int64), req.images)
        return min(self.kv.tree.cached_length(keys, req.namespace), len(req.token_ids) - 1)

    def render_chat(self, messages: list[dict[str, Any]], label: str = "request",
                    tools: list[dict[str, Any]] | None = None) -> list[int]:
        """Token ids of ``messages`` (``{"role", "content"}``; content a string or a list of
        ``{"type": "text", "text"}`` and ``{"type": "image"}`` parts) rendered by the model's chat
        template with the generation prompt; each image part becomes the model's image token, for
        an image passed with the prompt. ``ValueError`` when the model has no chat template, the
        template refuses the messages, or their text cannot fit ``max_model_len``; ``tools``: OpenAI
        function definitions the template renders (``ValueError`` when it does not). Any thread."""
        return self.preparer.render_chat(messages, label, tools)

    # -- running --------------------------------------------------------------------------------
    def has_unfinished(self) -> bool:
        return self.scheduler.has_work()

    def step(self) -> list[RequestOutput]:
        """Run one step: schedule → run → postprocess. Returns the outputs of requests that
        progressed, and of those that failed in it (finished, ``error`` set, blocks released);
        none when the only work left waits for images being encoded (the step waited a little
        for them instead)."""
        start = time.perf_counter()
        if self.speculator is not None:
            self.speculator.step_started()
        batch = self.scheduler.schedule()
        if not (batch.seqs or batch.drafting or batch.failed):
            return []  # only images encoding: nothing to compute yet
        decoding = batch.only_decodes()
        result = self.runner.run(batch)
        outputs = self.postprocessor.process(batch, result)
        self.runner.step_done(idle=not self.scheduler.has_work())
        self._step_seconds["step_seconds_decode" if decoding else "step_seconds_prefill"] += (
            time.perf_counter() - start)
        if self.debug:
            self.check_integrity()
        return outputs

    def abort(self, request_id: int) -> bool:
        """Stop a request now: its sequences leave the scheduler and every block they hold
        (running, waiting or swapped) is released before this returns. False when the request is
        unknown or already finished."""
        return self.postprocessor.abort(request_id)

    def check_integrity(self) -> None:
        """Prove the block accounting (device pool, radix tree, host tier), that every sequence
        holds exactly the slots of its computed tokens, and that an engine with no unfinished
        request holds no block and no request."""
        self.kv.check_integrity()
        self.scheduler.check_integrity()
        if not self.has_unfinished():
            assert self.kv.pool.num_in_use == 0, f"idle engine holds {self.kv.pool.num_in_use} blocks"
            assert not self.requests, f"idle engine tracks requests {self.requests.ids()}"

    # -- memory ---------------------------------------------------------------------------------
    def resize_kv_cache(self, kv_cache_memory: str | int) -> int:
        """Grow or shrink the device KV pool to a new byte budget between steps, with requests
        running, swapped out or waiting; returns the new number of blocks.

        Live K/V moves to the low end of the pool (compaction) and every table follows it; cached
        prefixes that no longer fit are evicted in the eviction policy's order, the rest stay.
        Raises ``ValueError``, changing nothing, when the blocks in use do not fit the new size
        or an unfinished request could no longer fit the pool alone.
        """
        blocks = parse_bytes(kv_cache_memory) // self.kv.bytes_per_block
        for seq in self.requests.unfinished():
            need = self.preparer.blocks_needed(seq.prompt_len, seq.params.max_tokens)
            if need > blocks:
                raise ValueError(f"kv_cache_memory {kv_cache_memory!r} holds {blocks} blocks, but "
                                 f"request {seq.request_id} needs {need}")
        self.requests.remap_tables(self.kv.resize(blocks))
        return blocks

    def stream_texts(self) -> StreamTexts:
        """Incremental texts for the outputs of requests whose every output is read (streams)."""
        return StreamTexts(self.preparer.decode)

    # -- what the parts know --------------------------------------------------------------------
    @property
    def tokenizer(self) -> Any:
        return self.preparer.tokenizer

    @property
    def eos_token_ids(self) -> set[int]:
        return self.preparer.eos_token_ids

    @property
    def speculator(self) -> Speculator | None:
        """The speculating engine's proposer and its draft-length controller (None otherwise)."""
        return self.runner.speculator

    @property
    def max_num_seqs(self) -> int:
        """Sequences one step may run (the scheduler's limit)."""
        return self.scheduler_config.max_num_seqs

    def stats(self) -> dict[str, int | float]:
        scheduler, pool, metrics = self.scheduler.stats(), self.kv.pool, self.kv.metrics
        return {
            "prompt_tokens": self._prompt_tokens,
            **self.postprocessor.counters,
            **{name: round(seconds, 6) for name, seconds in self._step_seconds.items()},
            **scheduler,
            "blocks_total": pool.num_blocks,
            "kv_pool_tokens": pool.num_blocks * self.kv.block_size,
            "kv_pool_bytes": self.kv.storage.device_bytes,
            "weight_bytes": self.weight_bytes,
            "kv_bytes_per_token": self.kv.bytes_per_block // self.kv.block_size,
            "blocks_in_use": pool.num_in_use,
            "blocks_evictable": pool.num_evictable,
            "blocks_free": pool.num_free,
            "evictions": metrics.evictions,
            "cache_hits": metrics.hits,
            "cache_misses": metrics.misses,
            "cow_copies": metrics.cow_copies,
            "peak_kv_bytes": scheduler["peak_blocks_in_use"] * self.kv.bytes_per_block,
            "block_size": self.kv.block_size,
            **(self.model.vision.stats() if self.model.vision is not None else {}),
            **({"xattn_blocks_computed": self.image_kv.computed_blocks,
                "xattn_blocks_reused": self.image_kv.reused_blocks} if self.image_kv else {}),
            **({**self.speculator.summary(),
                "spec_calibration_seconds": round(self.calibration_seconds, 4)}
               if self.speculator else {}),
            **(self.runner.decode_threads.summary() if self.runner.decode_threads else {}),
        }
