"""The public entry point: ``Engine(model_dir).generate(prompts, SamplingParams(...))``."""

from __future__ import annotations

import functools
import itertools
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Literal, Sequence as Seq

import torch
from jinja2 import TemplateError
from tqdm import tqdm
from transformers import AutoTokenizer, GenerationConfig

from cache import KVCache, parse_bytes
from mmkv.attention.backend import AttentionBackend, choose_backend
from mmkv.attention.metadata import ONE_CALL, CrossSequence, plan_batch, plan_cross
from mmkv.cpu_threads import DecodeThreads
from mmkv.detokenizer import IncrementalText, StreamTexts
from mmkv.host_arrays import longs
from mmkv.image_kv import CrossAttentionKV
from mmkv.models import MRopePositions, StepContext, load_model, resolve_device
from mmkv.models.mrope import step_positions
from mmkv.outputs import CompletionOutput, RequestOutput
from mmkv.sampler import sample, token_logprob
from mmkv.sampling_params import SamplingParams
from mmkv.scheduler import PreemptionStats, Scheduler, SchedulerConfig
from mmkv.speculation import DraftModelSpeculator, EarlyExitSpeculator
from mmkv.sequence import SeqImage, Sequence, Status
from speculative import SpeculativeConfig
from vision import EmbeddingCache, ImageInput

Prompt = str | list[int] | dict[str, Any]
IMAGE_PLACEHOLDER = "<image>"
BUNDLED_MODEL = Path(__file__).parent / "bundled" / "tiny-vlm"
# Early-exit settings measured fastest on the bundled model (python -m mmkv.bench spec)
BUNDLED_SPECULATION = {"num_tokens": 24, "adaptive_threshold": 0.9}
CALIBRATION_BATCHES = (1, 8, 32)  # batch sizes the engine times its passes at, when it speculates
CALIBRATION_LENGTHS = (0, 1, 0, 3, 0, 8) * 2  # each calibration step's draft length (0: plain)
CALIBRATION_PROMPT = 512  # its made-up prompts run 16 tokens to this many (the contexts' spread)
CALIBRATION_SALT = "mmkv-calibration"  # the calibration's prompts share no cache with requests


@dataclass(slots=True)
class _Prepared:
    """A request checked and tokenized, images identified, before it is queued."""

    token_ids: list[int]
    images: list[SeqImage]
    params: SamplingParams
    namespace: bytes
    rope: MRopePositions | None


class Engine:
    """Serves many requests at once over a paged, prefix-sharing KV cache.

    Guarantees: greedy output equals transformers' ``generate`` on the same weights whatever the
    batch, cache hits, chunking or preemption; a request that cannot be served raises
    ``ValueError`` when submitted and never disturbs the others; finished requests hold no blocks.
    """

    def __init__(self, model: str | Path = BUNDLED_MODEL, kv_cache_memory: str | int = "1GiB", block_size: int = 16,
                 device: str = "auto", dtype: str | torch.dtype = "auto",
                 host_kv_memory: str | int = "1GiB", max_model_len: int | None = None,
                 max_num_batched_tokens: int = 2048, max_num_seqs: int = 256,
                 enable_prefix_caching: bool = True, eviction_policy: str = "lru",
                 preemption: str = "auto", cascade: bool = True, one_call_cross: bool = True,
                 speculative: SpeculativeConfig | None = None,
                 attention_backend: str | AttentionBackend = "auto", debug: bool = False) -> None:
        self.device = resolve_device(device)
        self.model = load_model(model, self.device, dtype)
        draft = None
        if speculative is not None and speculative.method == "draft_model":
            draft = load_model(speculative.draft_model, self.device, self.model.dtype)
        layout = self.model.kv_layout(block_size)
        shapes = [(m.dtype, m.kv_layout(block_size).head_dim) for m in (self.model, draft) if m]
        self.attention = choose_backend(attention_backend, self.device, shapes)
        self.kv = KVCache.from_memory(layout, kv_cache_memory, host_kv_memory, self.device,
                                      eviction_policy,
                                      [draft.kv_layout(block_size)] if draft is not None else [])
        self.scheduler = Scheduler(
            self.kv, SchedulerConfig(max_num_batched_tokens, max_num_seqs, preemption,
                                     enable_prefix_caching),
            self.model.text_rebuild_flops, self.device.type)
        if self.model.vision is not None and not enable_prefix_caching:
            self.model.vision.cache = EmbeddingCache(max_bytes=0)  # no reuse of any kind
        self.image_kv = (CrossAttentionKV(self.kv, self.model, self.attention,
                                          shared=enable_prefix_caching)
                         if self.model.cross_layers else None)
        self.scheduler.image_kv = self.image_kv
        self.max_model_len = min(max_model_len or self.model.max_model_len, self.model.max_model_len)
        self.tokenizer = _load_tokenizer(Path(model), self.model.text_config)
        # what an output decodes its text with (the tokenizer's, so outputs never hold the engine)
        self._decode = (functools.partial(self.tokenizer.decode, skip_special_tokens=True)
                        if self.tokenizer else None)
        self.eos_token_ids = _eos_ids(Path(model), self.model.text_config, self.tokenizer)
        # False: no shared-prefix attention / every image's cross-attention apart (what the
        # benchmarks measure those paths against)
        self.cascade = cascade
        self.one_call_cross = ONE_CALL if one_call_cross else None
        self.debug = debug
        self._requests: dict[int, list[Sequence]] = {}
        self._start_counting()
        cores = torch.get_num_threads()
        self.decode_threads = DecodeThreads(cores) if self.device.type == "cpu" and cores > 1 else None
        self.speculator = None
        if draft is not None:
            self.speculator = DraftModelSpeculator(self.model, draft, self.kv,
                                                   speculative, self._context)
        elif speculative is not None:
            self.speculator = EarlyExitSpeculator(self.model, speculative, self._context)
        if (speculative is not None and speculative.draft_length == "auto"
                and speculative.settings.calibrate):
            self._calibrate_speculation()

    def _start_counting(self) -> None:
        """Request ids, arrivals and every counter ``stats`` reports from 0 (at construction,
        and again after the calibration's requests)."""
        self._ids = itertools.count()
        self._arrivals = itertools.count()
        self._counters = {"prompt_tokens": 0, "computed_prefill_tokens": 0, "decode_tokens": 0,
                          "generated_tokens": 0}
        # seconds in steps that compute more than each sequence's pending token (prompt chunks,
        # recomputation; a step mixing them with decoding counts here) and in decoding steps
        self._step_seconds = {"step_seconds_prefill": 0.0, "step_seconds_decode": 0.0}
        self._peak_blocks = 0
        self.kv.metrics.reset()
        self.scheduler.preemptions = PreemptionStats()
        self.scheduler.cached_prompt_tokens = 0

    def _calibrate_speculation(self) -> None:
        """Time plain, draft and verification passes before the first request, so the controller
        prices its first decision from what the passes cost here (and explores only where a draft
        that is always right would pay: ``speculative.controller``); then forget the calibration's
        requests, blocks and counts, keeping the pass costs.

        At each batch size of ``CALIBRATION_BATCHES`` up to ``max_num_seqs`` (and as far as half the
        pool holds) the engine decodes made-up prompts of 16-512 ordinary tokens, every step's
        draft length scripted (``CALIBRATION_LENGTHS``, 0 a plain step) and every draft a fixed
        token, so every pass runs whatever the draft would have proposed; the requests are
        dropped once the script is done."""
        spec, rng = self.speculator, random.Random(0)
        special = self.eos_token_ids | {self.model.image_token_id}
        vocab = min(self.model.text_config.vocab_size, len(self.model.text_model.embed_tokens.weight))
        ordinary = [t for t in range(vocab) if t not in special]  # the draft model's vocabulary too
        tail = len(CALIBRATION_LENGTHS) + max(CALIBRATION_LENGTHS) + 2
        longest = min(CALIBRATION_PROMPT, self.max_model_len - tail)
        blocks = -(-(longest + tail) // self.kv.block_size)
        batches = [b for b in CALIBRATION_BATCHES
                   if b <= self.max_num_seqs and b * blocks <= self.kv.pool.num_blocks // 2]
        if longest < 16 or not batches:
            return
        spec.proposals = lambda seq, depth: ordinary[0]
        # room for every scripted length at every step (a round's limit is the tokens left, less 1)
        params = SamplingParams(max_tokens=tail - 1, ignore_eos=True)
        for batch in batches:
            spec.controller.script.extend(CALIBRATION_LENGTHS)
            ids = [self.add_request([rng.choice(ordinary) for _ in range(rng.randint(16, longest))],
                                    params, cache_salt=CALIBRATION_SALT) for _ in range(batch)]
            while spec.controller.script and self.has_unfinished():
                self.step()
            for request_id in ids:  # done once the script is: the rest would be the controller's
                self.abort(request_id)
        spec.keep_costs_only()
        self.kv.tree.evict(self.kv.pool.num_evictable)
        self._start_counting()
        if self.decode_threads is not None:  # its choice is the requests' batches' to make
            self.decode_threads = DecodeThreads(self.decode_threads.wide)

    # -- submission -----------------------------------------------------------------------------
    def add_request(self, prompt: Prompt, params: SamplingParams | None = None,
                    cache_salt: str | None = None, chat: bool = False) -> int:
        """Queue one request; returns its id. Raises ``ValueError`` for input it cannot serve
        (``vision.ImageError`` for a bad image), leaving everything else untouched."""
        return self._queue(self._prepare(prompt, params, cache_salt, chat, "request"))

    def _queue(self, req: _Prepared) -> int:
        request_id = next(self._ids)
        params = req.params
        generator = torch.Generator().manual_seed(params.seed) if params.seed is not None else None
        seq = Sequence(seq_id=request_id, request_id=request_id, index=0, token_ids=req.token_ids,
                       prompt_len=len(req.token_ids), params=params, arrival=next(self._arrivals),
                       namespace=req.namespace, generator=generator, images=req.images,
                       rope=req.rope, logprobs=None if params.logprobs is None else [])
        self._requests[request_id] = [seq]
        self._counters["prompt_tokens"] += len(req.token_ids)
        self.scheduler.add(seq)
        return request_id

    def _prepare(self, prompt: Prompt, params: SamplingParams | None, cache_salt: str | None,
                 chat: bool, label: str) -> _Prepared:
        params = params if params is not None else SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError(f"{label}: params must be a SamplingParams, got {type(params).__name__}")
        images: list[ImageInput] = []
        if isinstance(prompt, dict):
            unknown = set(prompt) - {"prompt", "images"}
            if unknown or "prompt" not in prompt:
                raise ValueError(f"{label}: a dict prompt has keys 'prompt' and optionally "
                                 f"'images', got {sorted(prompt)}")
            images = list(prompt.get("images") or [])
            prompt = prompt["prompt"]
        token_ids = self._tokenize(prompt, chat, label)
        seq_images: list[SeqImage] = []
        if images or (self.model.image_token_id is not None and self.model.image_token_id in token_ids):
            token_ids, seq_images = self._place_images(token_ids, images, label)
        self._check_fits(token_ids, params, label)
        try:
            rope = self.model.prompt_positions(token_ids, seq_images)
        except ValueError as err:
            raise ValueError(f"{label}: {err}") from err
        namespace = (cache_salt or "").encode()
        if self.model.cross_layers and seq_images:  # text KV depends on the images attended
            namespace += b"|images:" + ",".join(str(i.image.uid) for i in seq_images).encode()
        return _Prepared(token_ids, seq_images, params, namespace, rope)

    def _tokenize(self, prompt: str | list[int], chat: bool, label: str) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError(f"{label}: this model directory has no tokenizer: pass token ids")
            if self.model.image_token_id is not None:
                markup = (self.model.image_markup
                          or self.tokenizer.convert_ids_to_tokens(self.model.image_token_id))
                prompt = prompt.replace(IMAGE_PLACEHOLDER, markup)
            if chat:
                ids = self.render_chat([{"role": "user", "content": prompt}])
            else:
                ids = self.tokenizer.encode(prompt)
        elif isinstance(prompt, (list, tuple)):
            limit = len(self.model.text_model.embed_tokens.weight)
            for t in prompt:
                if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < limit:
                    raise ValueError(f"{label}: prompt token ids must be integers in [0, {limit}), got {t!r}")
            ids = list(prompt)
        else:
            raise ValueError(f"{label}: prompt must be a string or a list of token ids, "
                             f"got {type(prompt).__name__}")
        if not ids:
            raise ValueError(f"{label}: prompt is empty")
        return list(ids)

    def render_chat(self, messages: list[dict[str, Any]]) -> list[int]:
        """Token ids of ``messages`` (``{"role", "content"}``; content a string or a list of
        ``{"type": "text", "text"}`` and ``{"type": "image"}`` parts) rendered by the model's chat
        template with the generation prompt; each image part becomes the model's image token, for
        an image passed with the prompt. ``ValueError`` when the model has no chat template or the
        template refuses the messages."""
        return render_chat(self.tokenizer, messages)

    def _place_images(self, token_ids: list[int], images: list[ImageInput],
                      label: str) -> tuple[list[int], list[SeqImage]]:
        """Check, identify and place the images at their placeholders (LLaVA: one placeholder
        becomes one token per image feature)."""
        if self.model.vision is None:
            raise ValueError(f"{label}: this model does not take images")
        marker = self.model.image_token_id
        spots = [i for i, t in enumerate(token_ids) if t == marker]
        if len(spots) != len(images):
            raise ValueError(f"{label}: prompt has {len(spots)} image placeholders but "
                             f"{len(images)} images were given")
        prepared = self.model.vision.prepare(images, label=f"{label} image")
        out: list[int] = []
        placed: list[SeqImage] = []
        previous = 0
        for spot, image in zip(spots, prepared):
            out.extend(token_ids[previous:spot])
            placement = self.model.placement(image)
            placed.append(SeqImage(image, len(out), placement))
            out.extend([marker] * placement.prompt_tokens)
            previous = spot + 1
        out.extend(token_ids[previous:])
        _set_visibility(placed, len(out))
        return out, placed

    def _check_fits(self, token_ids: list[int], params: SamplingParams, label: str) -> None:
        n = len(token_ids)
        if n >= self.max_model_len:
            raise ValueError(f"{label}: prompt has {n} tokens; max_model_len is {self.max_model_len} "
                             f"(prompt plus at least one generated token)")
        longest = min(n + params.max_tokens, self.max_model_len)
        need = -(-longest // self.kv.block_size)
        if need > self.kv.pool.num_blocks:
            raise ValueError(f"{label}: request needs {need} KV blocks ({longest} tokens) but the "
                             f"pool holds {self.kv.pool.num_blocks}; raise kv_cache_memory or "
                             f"lower max_tokens")

    # -- running --------------------------------------------------------------------------------
    def has_unfinished(self) -> bool:
        return self.scheduler.has_work()

    def step(self) -> list[RequestOutput]:
        """Run one scheduling step; returns the outputs of requests that progressed, and of those
        that failed in it (finished, ``error`` set, their blocks released)."""
        start = time.perf_counter()
        batch = self.scheduler.schedule()
        failed = {seq.request_id: err for seq, err in self.scheduler.take_failures()}
        if not batch.seqs and not failed and self.scheduler.has_work():
            raise RuntimeError("the scheduler could not schedule any work")
        decoding = all(s.num_computed == len(s.token_ids) - 1 for s in batch.seqs)
        plain, spec = self._split_speculative(batch.seqs, batch.q_lens)
        self._peak_blocks = max(self._peak_blocks, self.kv.pool.num_in_use)
        touched: dict[int, None] = {}
        self._run_batch(plain, spec, touched, failed)
        outputs = [self._output(r) for r in touched if r not in failed]
        outputs += [self._fail(r, err) for r, err in failed.items()]
        if self.decode_threads and not self.has_unfinished():
            self.decode_threads.release()
        self._step_seconds["step_seconds_decode" if decoding else "step_seconds_prefill"] += (
            time.perf_counter() - start)
        if self.debug:
            self.kv.check_integrity()
        return outputs

    def _run_batch(self, plain: list[tuple[Sequence, int]], spec: list[tuple[Sequence, int]],
                   touched: dict[int, None], failed: dict[int, BaseException]) -> None:
        """Run a step's plain and speculative parts. On the CPU a step that only decodes runs on
        the intra-op thread count ``decode_threads`` measures fastest (every core otherwise, and
        again once the engine is idle)."""
        threads = self.decode_threads
        decoding = bool(plain) and not spec and all(q == 1 for _, q in plain)
        count = threads.use(decoding, len(plain)) if threads else 0
        start = threads.clock() if threads else 0.0
        if plain:
            self._timed_plain([s for s, _ in plain], [q for _, q in plain], touched, failed)
        if spec:
            self._run_speculative([s for s, _ in spec], [g for _, g in spec], touched, failed)
        if threads and decoding:
            threads.observe(count, len(plain), threads.clock() - start)

    def abort(self, request_id: int) -> bool:
        """Stop a request now: its sequences leave the scheduler and every block they hold
        (running, waiting or swapped) is released before this returns. False when the request is
        unknown or already finished."""
        seqs = self._requests.pop(request_id, None)
        if seqs is None:
            return False
        for seq in seqs:
            seq.finish_reason = "abort"
            self.scheduler.finish(seq)
        return True

    def _fail(self, request_id: int, err: BaseException) -> RequestOutput:
        """End a request that raised inside a step; its output carries the error."""
        first = self._requests[request_id][0]
        self.abort(request_id)
        return RequestOutput(request_id, first.token_ids[: first.prompt_len], [], True,
                             first.cached_tokens, error=f"{type(err).__name__}: {err}")

    def check_integrity(self) -> None:
        """Prove the block accounting (device pool, radix tree, host tier), and that an engine
        with no unfinished request holds no block and no request."""
        self.kv.check_integrity()
        if not self.has_unfinished():
            assert self.kv.pool.num_in_use == 0, f"idle engine holds {self.kv.pool.num_in_use} blocks"
            assert not self._requests, f"idle engine tracks requests {sorted(self._requests)}"

    def _context(self, seqs: list[Sequence], q_lens: list[int], kv_lens: list[int],
                 images: bool = True) -> StepContext:
        """Paged metadata and (unless ``images`` is False) image inputs for computing the last
        ``q_lens[i]`` of the first ``kv_lens[i]`` positions of each sequence (slots reserved)."""
        meta = plan_batch([s.table.blocks for s in seqs], q_lens, kv_lens, self.kv.block_size,
                          self.device, cascade=self.cascade and self.model.cascade_allowed(max(kv_lens)))
        step = StepContext(meta, self.model.layer_views(self.kv.storage.stores[0]), self.attention)
        if seqs[0].rope is not None:
            rope = step_positions([s.rope for s in seqs], q_lens, kv_lens)
            step.rope_positions = torch.from_numpy(rope).to(self.device)
        if images:
            self._add_image_inputs(step, seqs, q_lens, kv_lens, meta.host.qo_indptr[:-1].tolist())
        return step

    def _run_plain(self, seqs: list[Sequence], q_lens: list[int], touched: dict[int, None],
                   failed: dict[int, BaseException]) -> None:
        """Compute the scheduled tokens and sample where a sequence's last token was computed.
        When the batch raises, each request runs alone and one that raises alone has failed."""
        try:
            logits, sampling = self._forward_plain(seqs, q_lens)
        except Exception as err:
            groups: dict[int, list[int]] = {}
            for i, s in enumerate(seqs):
                groups.setdefault(s.request_id, []).append(i)
            if len(groups) == 1:
                failed[seqs[0].request_id] = err
                return
            for rows in groups.values():
                self._run_plain([seqs[i] for i in rows], [q_lens[i] for i in rows], touched, failed)
            return
        for s, q in zip(seqs, q_lens):
            phase = "decode_tokens" if q == 1 and s.num_computed >= s.prompt_len else "computed_prefill_tokens"
            self._counters[phase] += q
            self.scheduler.commit(s, q)
        greedy = self._greedy_tokens([seqs[i] for i in sampling], logits)
        for row, i in enumerate(sampling):
            try:
                if row in greedy:
                    self._append(seqs[i], greedy[row])
                else:
                    self._accept(seqs[i], logits[row])
            except Exception as err:
                failed.setdefault(seqs[i].request_id, err)
                continue
            touched[seqs[i].request_id] = None

    @staticmethod
    def _greedy_tokens(seqs: list[Sequence], logits: torch.Tensor) -> dict[int, int]:
        """The next token of every row whose sequence decodes greedily, one token, without
        logprobs, from one ``sample`` call over those rows (row by row it costs ~12 us a row on
        the CPU, a twentieth of a batch-32 decoding step of the bundled model)."""
        rows = [row for row, s in enumerate(seqs)
                if s.params.greedy and s.params.n == 1 and s.params.logprobs is None]
        if not rows:
            return {}
        chosen = [seqs[row] for row in rows]
        return dict(zip(rows, sample(logits[rows], [s.params for s in chosen],
                                     [s.generator for s in chosen])))

    def _timed_plain(self, seqs: list[Sequence], q_lens: list[int], touched: dict[int, None],
                     failed: dict[int, BaseException]) -> None:
        """``_run_plain``; a pure decoding pass is timed for the speculation controller."""
        if self.speculator is None or any(q != 1 for q in q_lens):
            self._run_plain(seqs, q_lens, touched, failed)
            return
        context = sum(len(s.token_ids) for s in seqs)
        start = self.speculator.started()
        self._run_plain(seqs, q_lens, touched, failed)
        self.speculator.observe("plain", len(seqs), context, start)

    def _forward_plain(self, seqs: list[Sequence], q_lens: list[int]) -> tuple[torch.Tensor, list[int]]:
        """Logits at the last token of every sequence whose last token is computed now (and the
        indices of those sequences). Writes K/V only into the reserved slots, so it can rerun."""
        kv_lens = [s.num_computed + q for s, q in zip(seqs, q_lens)]
        step = self._context(seqs, q_lens, kv_lens)
        input_ids = longs([t for s, q in zip(seqs, q_lens)
                           for t in s.token_ids[s.num_computed:s.num_computed + q]], self.device)
        starts = step.batch.host.qo_indptr[:-1].tolist()
        sampling = [i for i, (s, n) in enumerate(zip(seqs, kv_lens)) if n == len(s.token_ids)]
        rows = longs([starts[i] + q_lens[i] - 1 for i in sampling], self.device)
        logits = self.model.forward(input_ids, step, rows)
        if self.speculator is not None:
            self.speculator.follow(input_ids, step, seqs, q_lens)
        return logits, sampling

    def _split_speculative(self, seqs: list[Sequence], q_lens: list[int]):
        """Decoding sequences that can speculate get the draft length the controller chose, and
        that many more slots reserved (pairs ``(seq, gamma)``, gamma 0 included: it joins the
        verification pass); the rest run a plain step (pairs ``(seq, q_len)``), and so does
        everyone when the controller chose 0 for all."""
        if self.speculator is None:
            return list(zip(seqs, q_lens)), []
        plain, candidates = [], []
        for seq, q in zip(seqs, q_lens):
            if q == 1 and seq.num_pending == 1 and seq.params.n == 1 and seq.params.logprobs is None:
                candidates.append(seq)
            else:
                plain.append((seq, q))
        if not candidates:
            return plain, []
        gammas = self.speculator.plan(candidates, self.max_model_len)
        if not any(gammas):
            return plain + [(seq, 1) for seq in candidates], []
        spec = []
        for seq, gamma in zip(candidates, gammas):
            if gamma and self.kv.blocks_needed(seq.table, gamma) <= self.kv.num_available():
                self.kv.append_slots(seq.table, gamma)
            else:
                gamma = 0
            spec.append((seq, gamma))
        return plain, spec

    def _run_speculative(self, seqs: list[Sequence], gammas: list[int], touched: dict[int, None],
                         failed: dict[int, BaseException]) -> None:
        try:
            verdicts = self.speculator.round(seqs, gammas, [self._stop_tokens(s) for s in seqs])
        except Exception:  # give the drafts' slots back and decode plainly, failing alone
            for seq in seqs:
                self.kv.truncate(seq.table, len(seq.token_ids))
            self._run_plain(seqs, [1] * len(seqs), touched, failed)
            return
        for seq, verdict in zip(seqs, verdicts):
            valid = len(seq.token_ids) + verdict.accepted  # positions whose K/V is the target's
            self.kv.truncate(seq.table, valid)
            self._counters["decode_tokens"] += verdict.accepted + 1
            reason = None
            for token in verdict.tokens:
                seq.token_ids.append(token)
                self._counters["generated_tokens"] += 1
                if (reason := self._finish_reason(seq, token)) is not None:
                    break
            # Committed once the accepted drafts are in token_ids: blocks are cached by their keys.
            self.scheduler.commit(seq, verdict.accepted + 1)
            if reason is not None:
                self._finish(seq, reason)
            touched[seq.request_id] = None
        self.speculator.round_applied()

    def _add_image_inputs(self, step: StepContext, seqs: list[Sequence], q_lens: list[int],
                          kv_lens: list[int], starts: list[int]) -> None:
        """Image embeddings for LLaVA's image tokens, cross-attention metadata for the rest."""
        rows: list[int] = []
        embeds: list[torch.Tensor] = []
        cross: list[CrossSequence] = []
        for seq, q, n, start in zip(seqs, q_lens, kv_lens, starts):
            lo, hi = n - q, n
            for image in seq.images:
                if not image.in_sequence:
                    continue
                a, b = max(lo, image.start), min(hi, image.start + image.placement.prompt_tokens)
                if a < b:
                    rows.extend(range(start + a - lo, start + b - lo))
                    embeds.append(self.model.vision.embeddings(image.image)[a - image.start:b - image.start])
            if self.image_kv is not None:
                cross.append(CrossSequence(
                    rows=list(range(start, start + q)), positions=list(range(lo, hi)),
                    prompt_len=seq.prompt_len,
                    images=[(t.blocks, i.placement.xattn_tokens, i.placement.xattn_valid, i.start,
                             i.visible_until) for i, t in zip(seq.images, seq.image_tables)]))
        if rows:
            step.image_rows = torch.tensor(rows, dtype=torch.long, device=self.device)
            step.image_embeds = torch.cat(embeds).to(self.device)
        if any(c.images for c in cross):
            step.cross = plan_cross(cross, step.batch.num_tokens, self.kv.block_size, self.device,
                                    self.model.dtype, self.one_call_cross)

    def _accept(self, seq: Sequence, logits: torch.Tensor) -> None:
        """Sample the next token of ``seq`` (and fork its siblings on the first token if n > 1)."""
        family = [seq]
        if seq.params.n > 1 and not seq.output_ids and seq.index == 0:
            family += self._fork(seq)
        tokens = sample(logits[None].expand(len(family), -1), [s.params for s in family],
                        [s.generator for s in family])
        logprobs = torch.log_softmax(logits.float(), -1) if seq.params.logprobs is not None else None
        for s, token in zip(family, tokens):
            if logprobs is not None:
                s.logprobs.append(token_logprob(logprobs, token, s.params.logprobs))
            self._append(s, token)

    def _append(self, seq: Sequence, token: int) -> bool:
        """Add a generated token; finish the sequence when it should stop (returns True)."""
        seq.token_ids.append(token)
        self._counters["generated_tokens"] += 1
        reason = self._finish_reason(seq, token)
        if reason is not None:
            self._finish(seq, reason)
        return reason is not None

    def _finish(self, seq: Sequence, reason: str) -> None:
        seq.finish_reason = reason
        if self.speculator is not None and reason == "stop":  # not one cut short at its limit
            self.speculator.finished(seq.num_generated)
        self.scheduler.finish(seq)

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
                             cached_tokens=parent.cached_tokens, images=parent.images,
                             logprobs=None if parent.logprobs is None else list(parent.logprobs),
                             image_tables=[self.kv.fork(t) for t in parent.image_tables],
                             rope=parent.rope)
            self.scheduler.running.append(child)
            self._requests[parent.request_id].append(child)
            children.append(child)
        return children

    def _stop_tokens(self, seq: Sequence) -> set[int]:
        """Tokens that end ``seq`` when generated."""
        p = seq.params
        return set(p.stop_token_ids) | (set() if p.ignore_eos else set(self.eos_token_ids))

    def _finish_reason(self, seq: Sequence, token: int) -> str | None:
        p = seq.params
        if token in self._stop_tokens(seq):
            return "stop"
        if p.stop and self._decode is not None:
            # Only text that this token completed can hold a new match.
            if seq.stop_text is None:
                seq.stop_text = IncrementalText(self._decode, start=seq.prompt_len)
            seen = len(seq.stop_text.text)
            text = seq.stop_text.current(seq.token_ids)
            hits = [i for i in (text.find(s, max(0, seen - len(s) + 1)) for s in p.stop) if i >= 0]
            if hits:
                seq.text = text[: min(hits)]
                return "stop"
        if seq.num_generated >= p.max_tokens or len(seq.token_ids) >= self.max_model_len:
            return "length"
        return None

    def _output(self, request_id: int) -> RequestOutput:
        seqs = self._requests[request_id]
        outputs = []
        for s in sorted(seqs, key=lambda s: s.index):
            stopped = s.text if s.finish_reason == "stop" and s.text else None  # cut at the stop string
            outputs.append(CompletionOutput(s.index, s.output_ids, s.finish_reason,
                                            None if s.logprobs is None else list(s.logprobs),
                                            decode=self._decode, decoded=stopped))
        finished = all(s.status is Status.FINISHED for s in seqs) and len(seqs) == seqs[0].params.n
        if finished:
            del self._requests[request_id]
        return RequestOutput(request_id, seqs[0].token_ids[: seqs[0].prompt_len], outputs, finished,
                             seqs[0].cached_tokens)

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
        seqs = [s for family in self._requests.values() for s in family
                if s.status is not Status.FINISHED]
        for seq in seqs:
            longest = min(seq.prompt_len + seq.params.max_tokens, self.max_model_len)
            need = -(-longest // self.kv.block_size)
            if need > blocks:
                raise ValueError(f"kv_cache_memory {kv_cache_memory!r} holds {blocks} blocks, but "
                                 f"request {seq.request_id} needs {need}")
        mapping = self.kv.resize(blocks)
        for seq in seqs:
            for table in (seq.table, seq.swapped, *seq.image_tables):
                if table is not None:
                    table.remap(mapping)
        return blocks

    # -- convenience ----------------------------------------------------------------------------
    def generate(self, prompts: Prompt | Seq[Prompt], params: SamplingParams | Seq[SamplingParams] | None = None,
                 use_tqdm: bool | None = None, chat: bool = False, cache_salt: str | None = None,
                 errors: Literal["raise", "return"] = "raise") -> list[RequestOutput]:
        """Run prompts to completion; results come back in input order.

        A prompt is a string, a list of token ids, or ``{"prompt": ..., "images": [...]}`` with one
        ``<image>`` placeholder per image. Every request is checked before any is queued: with
        ``errors="raise"`` a bad one raises ``ValueError`` and nothing runs; with ``"return"`` its
        output carries the error and the others run. A request that fails while running (an
        exception inside its step) fails alone: ``"raise"`` raises ``RuntimeError`` naming it,
        ``"return"`` returns it with ``error`` set. However this call ends, none of its requests
        stays in the engine.
        """
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts
                                                and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        if isinstance(params, (list, tuple)):
            if len(params) != len(prompts):
                raise ValueError(f"got {len(params)} SamplingParams for {len(prompts)} prompts")
            plist = list(params)
        else:
            plist = [params] * len(prompts)
        prepared: list[_Prepared | ValueError] = []
        for i, (prompt, p) in enumerate(zip(prompts, plist)):
            try:
                prepared.append(self._prepare(prompt, p, cache_salt, chat, f"request {i}"))
            except ValueError as err:
                if errors == "raise":
                    raise
                prepared.append(err)
        ids = [self._queue(r) if isinstance(r, _Prepared) else None for r in prepared]
        wanted = {i for i in ids if i is not None}
        results: dict[int, RequestOutput] = {}
        show = sys.stderr.isatty() if use_tqdm is None else use_tqdm
        try:
            with tqdm(total=len(wanted), disable=not show, desc="mmkv") as bar:
                while wanted - results.keys():
                    for out in self.step():
                        if out.finished and out.request_id in wanted:
                            results[out.request_id] = out
                            bar.update(1)
                            if out.error is not None and errors == "raise":
                                raise RuntimeError(f"request {ids.index(out.request_id)} failed: "
                                                   f"{out.error}")
        finally:  # leaving by an exception: nothing of this call stays queued
            for request_id in wanted - results.keys():
                self.abort(request_id)
        return [results[i] if i is not None else RequestOutput(-1, [], [], True, 0, error=str(r))
                for i, r in zip(ids, prepared)]

    def ask(self, images: ImageInput | Seq[ImageInput], questions: Seq[str],
            params: SamplingParams | None = None, errors: Literal["raise", "return"] = "raise",
            **options: Any) -> list[RequestOutput] | list[list[RequestOutput]]:
        """Ask every question about every image in one batched call.

        One image gives a list of outputs (one per question); a list of images gives one such list
        per image. Questions are put in the model's chat template after the image (models that
        chat: Qwen-VL) or in its question template around an ``<image>``.
        """
        single = not isinstance(images, (list, tuple))
        image_list = [images] if single else list(images)
        texts = [self.question_prompt(q) for q in questions]
        prompts = [{"prompt": text, "images": [img]} for img in image_list for text in texts]
        outs = self.generate(prompts, params, errors=errors, **options)
        per_image = [outs[i * len(questions):(i + 1) * len(questions)] for i in range(len(image_list))]
        return per_image[0] if single else per_image

    def question_prompt(self, question: str) -> str | list[int]:
        """The prompt ``ask`` sends for ``question`` about one image (with its ``<image>``)."""
        if not self.model.chat_questions:
            return self.model.question_template.format(question=question)
        return self.render_chat([{"role": "user", "content": [{"type": "image"},
                                                              {"type": "text", "text": question}]}])

    def stream(self, prompt: Prompt, params: SamplingParams | None = None,
               cache_salt: str | None = None, chat: bool = False) -> Iterator[RequestOutput]:
        """Yield the request's output after every step that extends it, the last one finished.
        Closing the iterator early (or an exception in the caller's loop) aborts the request; a
        request that fails inside a step raises ``RuntimeError``."""
        request_id = self.add_request(prompt, params, cache_salt, chat)
        texts = self.stream_texts()
        try:
            while True:
                for out in self.step():
                    if out.request_id != request_id:
                        continue
                    if out.error is not None:
                        raise RuntimeError(f"request failed: {out.error}")
                    yield texts.attach(out)
                    if out.finished:
                        return
        finally:
            self.abort(request_id)  # nothing to do when it finished

    def stream_texts(self) -> StreamTexts:
        """Incremental texts for the outputs of requests whose every output is read (streams)."""
        return StreamTexts(self._decode)

    @property
    def max_num_seqs(self) -> int:
        """Sequences one step may run (the scheduler's limit)."""
        return self.scheduler.config.max_num_seqs

    def stats(self) -> dict[str, int | float]:
        pool, pre, sched = self.kv.pool, self.scheduler.preemptions, self.scheduler
        running = {s.request_id for s in sched.running}
        return {
            **self._counters,
            **{name: round(seconds, 6) for name, seconds in self._step_seconds.items()},
            "requests_running": len(running),
            "requests_waiting": len({s.request_id for s in (*sched.waiting, *sched.swapped)} - running),
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
            "peak_blocks_in_use": self._peak_blocks,
            "peak_kv_bytes": self._peak_blocks * self.kv.bytes_per_block,
            "block_size": self.kv.block_size,
            **(self.model.vision.stats() if self.model.vision is not None else {}),
            **({"xattn_blocks_computed": self.image_kv.computed_blocks} if self.image_kv else {}),
            **(self.speculator.summary() if self.speculator else {}),
            **(self.decode_threads.summary() if self.decode_threads else {}),
        }


def render_chat(tokenizer: Any, messages: list[dict[str, Any]]) -> list[int]:
    """``Engine.render_chat`` with a given tokenizer (the Ray ingress keys requests by these ids
    without an engine of its own)."""
    if tokenizer is None or not tokenizer.chat_template:
        raise ValueError("this model directory has no chat template (tokenizer_config.json "
                         "'chat_template' or chat_template.jinja); send a plain prompt instead")
    try:
        return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                  tokenize=True, return_dict=False))
    except TemplateError as err:
        raise ValueError(f"the chat template refused the messages: {err}") from err


def _set_visibility(images: list[SeqImage], prompt_len: int) -> None:
    """Mllama's rule: an image is seen from its placeholder up to the next image's placeholder
    (a run of adjacent placeholders is seen together); the last image to the end."""
    if len(images) < 2:
        return
    ends = [nxt.start for nxt in images[1:]] + [prompt_len]
    last = ends[-1]
    for i in range(len(images) - 1, -1, -1):
        if images[i].start == ends[i] - 1:
            ends[i] = last
        last = ends[i]
    for image, end in zip(images, ends):
        image.visible_until = end


def _load_tokenizer(path: Path, config):
    if not any((path / f).exists() for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        return None
    return AutoTokenizer.from_pretrained(path, config=config)


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
