"""The async front of one ``Engine``: a thread owns it, coroutines submit work and await outputs.

Input work never runs on the engine thread: a submission's prompts are prepared (chat template,
tokenizing, image decoding and preprocessing, every check) on a small pool of input threads, off
the event loop too, and only the prepared requests go to the engine thread. That thread touches
the ``Engine`` alone: it takes commands (submit, abort, stop) from a thread-safe queue between
steps and runs ``step()`` while any request is unfinished, so requests that arrive while others
decode join the running batch (continuous batching across HTTP requests). Outputs go back to each
submission's ``asyncio.Queue`` on the event loop that made it.

Invariants: a submission that ends for any reason (finished, failed, its caller gone, shutdown)
holds no block once the engine thread has handled its abort, which it does before its next step;
``healthy`` is false once the engine thread has died, or has spent more than ``stall_seconds`` in
one turn (handling commands and stepping) while work was waiting.
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

from mmkv.engine import Engine
from mmkv.outputs import RequestOutput
from mmkv.preparer import PreparedRequest
from mmkv.sampling_params import SamplingParams

INPUT_THREADS = 2  # threads preparing requests' input


class EngineOverloaded(Exception):
    """The admission limit is reached: the client should retry later."""


class EngineStopped(Exception):
    """The server is shutting down; requests in flight were aborted."""


class RequestFailed(Exception):
    """A request raised inside the engine (its own failure; the others run on)."""


@dataclass(frozen=True, slots=True)
class Tokenized:
    """A prompt as the engine would run it: ``token_ids``, each image's ``(start, length)`` in
    them, and ``cached_tokens``: how many leading tokens the cache would serve now."""

    token_ids: list[int]
    images: list[tuple[int, int]]
    cached_tokens: int


@dataclass(slots=True)
class ChatPrompt:
    """Chat messages (image parts as ``{"type": "image"}``) and their images' bytes in order,
    rendered by the model's chat template when the request is prepared."""

    messages: list[dict[str, Any]]
    images: list[bytes]
    tools: list[dict[str, Any]] | None = None  # OpenAI function definitions the template renders


@dataclass(slots=True, eq=False)
class _Submission:
    """Prompts sent together (one HTTP request), prepared, each an engine request with the same
    params."""

    prompts: list[PreparedRequest]
    params: SamplingParams
    stream: bool
    loop: asyncio.AbstractEventLoop
    outputs: asyncio.Queue
    request_ids: list[int] = field(default_factory=list)
    started: set[int] = field(default_factory=set)  # requests that produced a token


class Ticket:
    """Places under the admission limit, one per sequence a request runs (its prompts times its
    ``n``), held from before its images are fetched until its response is done; ``release`` is
    idempotent."""

    def __init__(self, admission: "Admission", n: int) -> None:
        self._admission, self._n = admission, n

    def release(self) -> None:
        self._admission.admitted -= self._n
        self._n = 0


class Admission:
    """The admission limit of one HTTP front: at most ``max_pending`` sequences admitted at once
    (running plus waiting); touched only on the event loop."""

    def __init__(self, max_pending: int) -> None:
        self.max_pending = max_pending
        self.admitted = 0

    def admit(self, n: int) -> Ticket:
        """Reserve ``n`` sequences' places, or raise ``EngineOverloaded`` (before any work)."""
        if self.admitted + n > self.max_pending:
            raise EngineOverloaded(f"{self.admitted} sequences in flight and this request adds {n}; "
                                   f"the limit is {self.max_pending}")
        self.admitted += n
        return Ticket(self, n)


class AsyncEngine:
    """One engine behind an event loop.

    Guarantees: requests of many coroutines run in one continuous batch; ``generate`` yields a
    submission's outputs and, however it is left (finished, exception, cancellation), leaves none
    of its requests running; ``stop`` aborts everything in flight and ends the thread with the
    engine holding no block.
    """

    def __init__(self, engine: Engine, max_pending: int, stall_seconds: float = 60.0) -> None:
        self.engine = engine
        self.admission = Admission(max_pending)
        self.stall_seconds = stall_seconds
        self.stats: dict[str, int] = engine.stats()  # a snapshot, replaced after every step
        self._inputs = ThreadPoolExecutor(INPUT_THREADS, thread_name_prefix="mmkv-input")
        self._turn_started: float | None = None  # when the engine thread's current turn began
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._owners: dict[int, _Submission] = {}  # engine request id -> its submission
        self._texts = engine.stream_texts()  # streamed outputs' texts, decoded incrementally
        self._lock = threading.Lock()  # orders every submission before the stop command
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="mmkv-engine", daemon=True)

    # -- the event loop's side --------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def admit(self, n: int) -> Ticket:
        """Reserve ``n`` sequences' places, or raise ``EngineOverloaded`` (before any work)."""
        if self._stopping:
            raise EngineStopped("the server is shutting down")
        return self.admission.admit(n)

    # -- what the HTTP app needs of a front (``mmkv.distributed`` has one over many engines) --
    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def quantization(self) -> str | None:
        return self.engine.quantization

    async def open(self) -> None:
        self.start()

    async def close(self) -> None:
        """Abort what runs, end the engine thread and prove the engine holds no block."""
        self.stop()
        self.join()
        self._inputs.shutdown(wait=False, cancel_futures=True)
        self.engine.check_integrity()

    def running(self) -> bool:
        """Whether the engine thread is alive (started and not stopped or crashed)."""
        return self._thread.is_alive()

    def stalled(self) -> bool:
        """Whether the engine thread has been in one turn for more than ``stall_seconds``."""
        started = self._turn_started
        return started is not None and time.monotonic() - started > self.stall_seconds

    async def healthy(self) -> bool:
        return self.running() and not self.stalled()

    async def replica_stats(self) -> dict[str, dict[str, int]]:
        return {"0": self.stats}

    async def generate(self, prompts: list[Any], params: SamplingParams, cache_salt: str | None = None,
                       stream: bool = True, strict_max_tokens: bool = False
                       ) -> AsyncIterator[tuple[int, RequestOutput]]:
        """Yield ``(prompt index, output)`` as the engine produces them (with ``stream=False``
        only each request's first output with a token and its last), until every prompt is
        finished. The prompts are prepared on the input threads first. Raises ``ValueError`` for
        input the engine refuses (nothing of it runs; with ``strict_max_tokens``, also a prompt
        after which ``max_tokens`` does not fit ``max_model_len``), ``RequestFailed`` when a
        request raised inside the engine, ``EngineStopped`` on shutdown."""
        if self._stopping:
            raise EngineStopped("the server is shutting down")
        loop = asyncio.get_running_loop()
        labels = ["request"] if len(prompts) == 1 else [f"prompt {i}" for i in range(len(prompts))]
        prepared = await asyncio.gather(*(
            loop.run_in_executor(self._inputs, self._prepare, prompt, params, cache_salt,
                                 strict_max_tokens, label) for prompt, label in zip(prompts, labels)))
        sub = _Submission(prepared, params, stream, loop, asyncio.Queue())
        with self._lock:
            if self._stopping:
                raise EngineStopped("the server is shutting down")
            self._commands.put(("submit", sub))
        done = 0
        try:
            while done < len(prompts):
                item = await sub.outputs.get()
                if isinstance(item, BaseException):
                    raise item
                done += item[1].finished
                yield item
        finally:
            if done < len(prompts):
                self._commands.put(("abort", sub))

    async def tokenize(self, prompt: Any, cache_salt: str | None = None) -> Tokenized:
        """``prompt`` (text, token ids or a ``ChatPrompt``) as the engine would run it: its token
        ids, each image's span, and how many leading tokens the cache would serve now. The input
        work runs on an input thread, the cache is read on the engine thread. ``ValueError`` for
        input the engine refuses."""
        if self._stopping:
            raise EngineStopped("the server is shutting down")
        loop = asyncio.get_running_loop()
        prepared = await loop.run_in_executor(self._inputs, self._prepare, prompt, SamplingParams(max_tokens=1),
                                              cache_salt, False, "request")
        cached = loop.create_future()
        self._commands.put(("probe", (prepared, cached, loop)))
        spans = [(image.start, image.placement.prompt_tokens) for image in prepared.images]
        return Tokenized(prepared.token_ids, spans, await cached)

    def _prepare(self, prompt: Any, params: SamplingParams, cache_salt: str | None, strict: bool,
                 label: str) -> PreparedRequest:
        """One prompt's input work, on an input thread."""
        if isinstance(prompt, ChatPrompt):
            ids = self.engine.render_chat(prompt.messages, label, prompt.tools)
            prompt = {"prompt": ids, "images": prompt.images} if prompt.images else ids
        request = self.engine.prepare_request(prompt, params, cache_salt, label=label)
        room = self.engine.max_model_len - len(request.token_ids)
        if strict and params.max_tokens > room:
            raise ValueError(f"{label}: max_tokens is {params.max_tokens}, but the prompt has "
                             f"{len(request.token_ids)} tokens and max_model_len is "
                             f"{self.engine.max_model_len}: at most {room} can follow it")
        return request

    def stop(self) -> None:
        """Abort everything in flight and end the engine thread (callable from any thread)."""
        with self._lock:
            self._stopping = True
            self._commands.put(("stop", None))

    def join(self, timeout: float | None = None) -> None:
        self._thread.join(timeout)

    # -- the engine thread ------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            idle = not self.engine.has_unfinished()
            self._turn_started = None if idle else time.monotonic()
            commands = [self._commands.get()] if idle else []
            self._turn_started = self._turn_started or time.monotonic()
            while True:
                try:
                    commands.append(self._commands.get_nowait())
                except queue.Empty:
                    break
            for name, sub in commands:
                if name == "stop":
                    self._abort_all(EngineStopped("the server is shutting down"))
                    self.stats = self.engine.stats()
                    return
                if name == "submit":
                    self._submit(sub)
                elif name == "probe":
                    self._probe(*sub)
                else:
                    self._abort(sub)
            if self.engine.has_unfinished():
                self._step()
            self.stats = self.engine.stats()

    def _submit(self, sub: _Submission) -> None:
        try:
            for prepared in sub.prompts:
                sub.request_ids.append(self.engine.add_prepared(prepared))
                self._owners[sub.request_ids[-1]] = sub
        except Exception as err:  # a bug: nothing of it runs
            self._abort(sub)
            self._deliver(sub, [err])

    def _probe(self, prepared: PreparedRequest, answer: asyncio.Future, loop) -> None:
        try:
            result = self.engine.cached_prefix_tokens(prepared)
        except Exception as err:  # a bug: the caller gets it, the engine goes on
            result = err
        setter = answer.set_exception if isinstance(result, Exception) else answer.set_result
        try:
            loop.call_soon_threadsafe(lambda: answer.done() or setter(result))
        except RuntimeError:  # that event loop is closed: nobody is waiting any more
            pass

    def _abort(self, sub: _Submission) -> None:
        for request_id in sub.request_ids:
            self._texts.forget(request_id)
            if self._owners.pop(request_id, None) is not None:
                self.engine.abort(request_id)

    def _abort_all(self, err: Exception) -> None:
        for sub in {id(s): s for s in self._owners.values()}.values():
            self._abort(sub)
            self._deliver(sub, [err])

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as err:  # the engine itself broke: fail what is in flight, keep serving
            self._abort_all(RequestFailed(f"engine step failed: {type(err).__name__}: {err}"))
            return
        ready: dict[int, tuple[_Submission, list]] = {}
        for out in outputs:
            sub = self._owners.get(out.request_id)
            if sub is None:
                continue
            items = ready.setdefault(id(sub), (sub, []))[1]
            if out.finished:
                del self._owners[out.request_id]
            if out.error is not None:
                self._abort(sub)
                items.append(RequestFailed(out.error))
                continue
            first = out.request_id not in sub.started and any(o.token_ids for o in out.outputs)
            if first:
                sub.started.add(out.request_id)
            if sub.stream:
                items.append((sub.request_ids.index(out.request_id), self._texts.attach(out)))
            elif out.finished or first:
                items.append((sub.request_ids.index(out.request_id), out))
        for sub, items in ready.values():
            self._deliver(sub, items)

    def _deliver(self, sub: _Submission, items: list) -> None:
        try:
            sub.loop.call_soon_threadsafe(_put_all, sub.outputs, items)
        except RuntimeError:  # that event loop is closed: nobody is waiting any more
            pass


def _put_all(outputs: asyncio.Queue, items: list) -> None:
    for item in items:
        outputs.put_nowait(item)
