"""The public entry point: ``Engine(model_dir).generate(prompts, SamplingParams(...))``."""

from __future__ import annotations

import itertools
import sys
from pathlib import Path
from typing import Iterator, Sequence as Seq

import torch
from tqdm import tqdm
from transformers import AutoTokenizer, GenerationConfig

from cache import KVCache
from mmkv.attention.metadata import plan_batch
from mmkv.model_runner import ModelRunner, resolve_device
from mmkv.outputs import CompletionOutput, RequestOutput
from mmkv.sampler import sample
from mmkv.sampling_params import SamplingParams
from mmkv.scheduler import Scheduler, SchedulerConfig
from mmkv.sequence import Sequence, Status

Prompt = str | list[int]


class Engine:
    """Serves many requests at once over a paged, prefix-sharing KV cache.

    Guarantees: greedy output equals transformers' ``generate`` on the same weights whatever the
    batch, cache hits, chunking or preemption; a request that cannot be served raises
    ``ValueError`` when submitted and never disturbs the others; finished requests hold no blocks.
    """

    def __init__(self, model: str | Path, kv_cache_memory: str | int = "1GiB", block_size: int = 16,
                 device: str = "auto", dtype: str | torch.dtype = "auto",
                 host_kv_memory: str | int = "1GiB", max_model_len: int | None = None,
                 max_num_batched_tokens: int = 2048, max_num_seqs: int = 256,
                 enable_prefix_caching: bool = True, eviction_policy: str = "lru",
                 preemption: str = "auto", cascade: bool = True, debug: bool = False) -> None:
        self.device = resolve_device(device)
        self.runner = ModelRunner(model, self.device, dtype)
        layout = self.runner.kv_layout(block_size)
        self.kv = KVCache.from_memory(layout, kv_cache_memory, host_kv_memory, self.device,
                                      eviction_policy)
        self.scheduler = Scheduler(
            self.kv, SchedulerConfig(max_num_batched_tokens, max_num_seqs, preemption,
                                     enable_prefix_caching),
            self.runner.num_parameters, self.device.type)
        self.max_model_len = min(max_model_len or self.runner.max_model_len, self.runner.max_model_len)
        self.tokenizer = _load_tokenizer(Path(model))
        self.eos_token_ids = _eos_ids(Path(model), self.runner.config, self.tokenizer)
        self.cascade = cascade
        self.debug = debug
        self._requests: dict[int, list[Sequence]] = {}
        self._ids = itertools.count()
        self._arrivals = itertools.count()
        self._counters = {"prompt_tokens": 0, "computed_prefill_tokens": 0, "decode_tokens": 0}
        self._peak_blocks = 0

    # -- submission -----------------------------------------------------------------------------
    def add_request(self, prompt: Prompt, params: SamplingParams | None = None,
                    cache_salt: str | None = None, chat: bool = False) -> int:
        """Queue one request; returns its id. Raises ``ValueError`` for input it cannot serve."""
        params = params if params is not None else SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be a SamplingParams, got {type(params).__name__}")
        token_ids = self._tokenize(prompt, chat)
        self._check_fits(token_ids, params)
        request_id = next(self._ids)
        generator = (torch.Generator().manual_seed(params.seed) if params.seed is not None else None)
        seq = Sequence(seq_id=request_id, request_id=request_id, index=0, token_ids=token_ids,
                       prompt_len=len(token_ids), params=params, arrival=next(self._arrivals),
                       namespace=(cache_salt or "").encode(), generator=generator)
        self._requests[request_id] = [seq]
        self._counters["prompt_tokens"] += len(token_ids)
        self.scheduler.add(seq)
        return request_id

    def _tokenize(self, prompt: Prompt, chat: bool) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this model directory has no tokenizer: pass token id lists")
            if chat:
                messages = [{"role": "user", "content": prompt}]
                ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                         tokenize=True, return_dict=False)
            else:
                ids = self.tokenizer.encode(prompt)
        elif isinstance(prompt, (list, tuple)):
            vocab = self.runner.config.vocab_size
            for t in prompt:
                if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab:
                    raise ValueError(f"prompt token ids must be integers in [0, {vocab}), got {t!r}")
            ids = list(prompt)
        else:
            raise ValueError(f"prompt must be a string or a list of token ids, got {type(prompt).__name__}")
        if not ids:
            raise ValueError("prompt is empty")
        return list(ids)

    def _check_fits(self, token_ids: list[int], params: SamplingParams) -> None:
        n = len(token_ids)
        if n >= self.max_model_len:
            raise ValueError(f"prompt has {n} tokens; max_model_len is {self.max_model_len} "
                             f"(prompt plus at least one generated token)")
        longest = min(n + params.max_tokens, self.max_model_len)
        need = -(-longest // self.kv.block_size)
        if need > self.kv.pool.num_blocks:
            raise ValueError(f"request needs {need} KV blocks ({longest} tokens) but the pool holds "
                             f"{self.kv.pool.num_blocks}; raise kv_cache_memory or lower max_tokens")

    # -- running --------------------------------------------------------------------------------
    def has_unfinished(self) -> bool:
        return self.scheduler.has_work()

    def step(self) -> list[RequestOutput]:
        """Run one scheduling step; returns the outputs of requests that progressed."""
        batch = self.scheduler.schedule()
        if not batch.seqs:
            if self.scheduler.has_work():
                raise RuntimeError("the scheduler could not schedule any work")
            return []
        self._peak_blocks = max(self._peak_blocks, self.kv.pool.num_in_use)
        seqs, q_lens = batch.seqs, batch.q_lens
        kv_lens = [s.num_computed + q for s, q in zip(seqs, q_lens)]
        meta = plan_batch([s.table.blocks for s in seqs], q_lens, kv_lens, self.kv.block_size,
                          self.device, cascade=self.cascade and self.runner.cascade_allowed(max(kv_lens)))
        input_ids = torch.tensor([t for s, q in zip(seqs, q_lens)
                                  for t in s.token_ids[s.num_computed:s.num_computed + q]],
                                 dtype=torch.long, device=self.device)
        ends = meta.qo_indptr[1:].tolist()
        sampling = [i for i, (s, n) in enumerate(zip(seqs, kv_lens)) if n == len(s.token_ids)]
        rows = torch.tensor([ends[i] - 1 for i in sampling], dtype=torch.long, device=self.device)
        logits = self.runner.forward(input_ids, meta, self.kv.storage.layers, rows)
        for s, q in zip(seqs, q_lens):
            phase = "decode_tokens" if q == 1 and s.num_computed >= s.prompt_len else "computed_prefill_tokens"
            self._counters[phase] += q
            self.scheduler.commit(s, q)
        touched: dict[int, None] = {}
        for row, i in enumerate(sampling):
            self._accept(seqs[i], logits[row])
            touched[seqs[i].request_id] = None
        if self.debug:
            self.kv.check_integrity()
        return [self._output(r) for r in touched]

    def _accept(self, seq: Sequence, logits: torch.Tensor) -> None:
        """Sample the next token of ``seq`` (and fork its siblings on the first token if n > 1)."""
        family = [seq]
        if seq.params.n > 1 and not seq.output_ids and seq.index == 0:
            family += self._fork(seq)
        tokens = sample(logits[None].expand(len(family), -1), [s.params for s in family],
                        [s.generator for s in family])
        for s, token in zip(family, tokens):
            s.token_ids.append(token)
            reason = self._finish_reason(s, token)
            if reason is not None:
                s.finish_reason = reason
                self.scheduler.finish(s)

    def _fork(self, parent: Sequence) -> list[Sequence]:
        children = []
        seed = parent.params.seed
        for i in range(1, parent.params.n):
            child = Sequence(seq_id=next(self._ids), request_id=parent.request_id, index=i,
                             token_ids=list(parent.token_ids), prompt_len=parent.prompt_len,
                             params=parent.params, arrival=parent.arrival, namespace=parent.namespace,
                             generator=torch.Generator().manual_seed(seed + i) if seed is not None else None,
                             status=Status.RUNNING, table=self.kv.fork(parent.table),
                             num_computed=parent.num_computed,
                             num_cached_blocks=parent.num_cached_blocks, admitted=True,
                             cached_tokens=parent.cached_tokens)
            self.scheduler.running.append(child)
            self._requests[parent.request_id].append(child)
            children.append(child)
        return children

    def _finish_reason(self, seq: Sequence, token: int) -> str | None:
        p = seq.params
        if token in p.stop_token_ids or (not p.ignore_eos and token in self.eos_token_ids):
            return "stop"
        if p.stop and self.tokenizer is not None:
            text = self._detokenize(seq.output_ids)
            hits = [i for i in (text.find(s) for s in p.stop) if i >= 0]
            if hits:
                seq.text = text[: min(hits)]
                return "stop"
        if len(seq.output_ids) >= p.max_tokens or len(seq.token_ids) >= self.max_model_len:
            return "length"
        return None

    def _detokenize(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True) if self.tokenizer else ""

    def _output(self, request_id: int) -> RequestOutput:
        seqs = self._requests[request_id]
        outputs = []
        for s in sorted(seqs, key=lambda s: s.index):
            text = s.text if s.finish_reason == "stop" and s.text else self._detokenize(s.output_ids)
            outputs.append(CompletionOutput(s.index, text, list(s.output_ids), s.finish_reason))
        finished = all(s.status is Status.FINISHED for s in seqs) and len(seqs) == seqs[0].params.n
        if finished:
            del self._requests[request_id]
        return RequestOutput(request_id, seqs[0].token_ids[: seqs[0].prompt_len], outputs, finished,
                             seqs[0].cached_tokens)

    # -- convenience ----------------------------------------------------------------------------
    def generate(self, prompts: Prompt | Seq[Prompt], params: SamplingParams | Seq[SamplingParams] | None = None,
                 use_tqdm: bool | None = None, chat: bool = False,
                 cache_salt: str | None = None) -> list[RequestOutput]:
        """Run prompts to completion; results come back in input order.

        Every prompt is validated before any is queued, so a bad one raises without side effects.
        """
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        if isinstance(params, (list, tuple)):
            if len(params) != len(prompts):
                raise ValueError(f"got {len(params)} SamplingParams for {len(prompts)} prompts")
            plist = list(params)
        else:
            plist = [params if params is not None else SamplingParams()] * len(prompts)
        for prompt, p in zip(prompts, plist):  # validate everything first
            if not isinstance(p, SamplingParams):
                raise ValueError(f"params must be SamplingParams, got {type(p).__name__}")
            self._check_fits(self._tokenize(prompt, chat), p)
        ids = [self.add_request(prompt, p, cache_salt, chat) for prompt, p in zip(prompts, plist)]
        wanted = set(ids)
        results: dict[int, RequestOutput] = {}
        show = sys.stderr.isatty() if use_tqdm is None else use_tqdm
        with tqdm(total=len(ids), disable=not show, desc="mmkv") as bar:
            while wanted - results.keys():
                for out in self.step():
                    if out.finished and out.request_id in wanted:
                        results[out.request_id] = out
                        bar.update(1)
        return [results[i] for i in ids]

    def stream(self, prompt: Prompt, params: SamplingParams | None = None,
               cache_salt: str | None = None, chat: bool = False) -> Iterator[RequestOutput]:
        """Yield the request's output after every step that extends it, the last one finished."""
        request_id = self.add_request(prompt, params, cache_salt, chat)
        while True:
            for out in self.step():
                if out.request_id == request_id:
                    yield out
                    if out.finished:
                        return

    def stats(self) -> dict[str, int]:
        pool, pre = self.kv.pool, self.scheduler.preemptions
        return {
            **self._counters,
            "cached_prompt_tokens": self.scheduler.cached_prompt_tokens,
            "blocks_total": pool.num_blocks,
            "blocks_in_use": pool.num_in_use,
            "blocks_evictable": pool.num_evictable,
            "blocks_free": pool.num_free,
            "evictions": self.kv.metrics.evictions,
            "cache_hits": self.kv.metrics.hits,
            "cache_misses": self.kv.metrics.misses,
            "cow_copies": self.kv.metrics.cow_copies,
            "preemptions_recompute": pre.recompute,
            "preemptions_swap": pre.swap,
            "swapped_bytes": pre.swapped_bytes,
            "peak_kv_bytes": self._peak_blocks * self.kv.layout.bytes_per_block,
            "block_size": self.kv.block_size,
        }


def _load_tokenizer(path: Path):
    if not any((path / f).exists() for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        return None
    return AutoTokenizer.from_pretrained(path)


def _eos_ids(path: Path, config, tokenizer) -> set[int]:
    ids: set[int] = set()
    sources = [getattr(config, "eos_token_id", None)]
    if (path / "generation_config.json").exists():
        sources.append(GenerationConfig.from_pretrained(path).eos_token_id)
    if tokenizer is not None:
        sources.append(tokenizer.eos_token_id)
    for s in sources:
        if isinstance(s, int):
            ids.add(s)
        elif isinstance(s, (list, tuple)):
            ids.update(s)
    return ids
