"""The public entry point: ``Engine(model_dir).generate(prompts, SamplingParams(...))``.

``Engine`` is ``EngineCore`` (``mmkv.engine_core``: submission, ``step``, abort, memory, stats)
plus the calls that drive it to completion: ``generate`` for a batch, ``ask`` for questions about
images, ``stream`` for one request's outputs as they grow.
"""

from __future__ import annotations

import sys
from typing import Any, Iterator, Literal, Sequence as Seq

from tqdm import tqdm

from mmkv.engine_core import EngineCore
from mmkv.outputs import RequestOutput
from mmkv.preparer import PreparedRequest, Prompt
from mmkv.sampling_params import SamplingParams
from vision import ImageInput


class Engine(EngineCore):
    """An ``EngineCore`` that runs prompts to completion; its guarantees are the core's, and every
    request one of these calls queued has left the engine when the call returns or raises."""

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
        prepared: list[PreparedRequest | ValueError] = []
        for i, (prompt, p) in enumerate(zip(prompts, plist)):
            try:
                prepared.append(self.preparer.prepare(prompt, p, cache_salt, chat, f"request {i}"))
            except ValueError as err:
                if errors == "raise":
                    raise
                prepared.append(err)
        ids = [self.add_prepared(r) if isinstance(r, PreparedRequest) else None for r in prepared]
        results = self._run_to_completion(ids, use_tqdm, errors)
        return [results[i] if i is not None else RequestOutput(-1, [], [], True, 0, error=str(r))
                for i, r in zip(ids, prepared)]

    def _run_to_completion(self, ids: list[int | None], use_tqdm: bool | None,
                           errors: Literal["raise", "return"]) -> dict[int, RequestOutput]:
        """Step until every queued request of ``ids`` is finished; leaving by an exception, none
        of them stays queued."""
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
        finally:
            for request_id in wanted - results.keys():
                self.abort(request_id)
        return results

    def ask(self, images: ImageInput | Seq[ImageInput], questions: Seq[str],
            params: SamplingParams | None = None, errors: Literal["raise", "return"] = "raise",
            **options: Any) -> list[RequestOutput] | list[list[RequestOutput]]:
        """Ask every question about every image in one batched call.

        One image gives a list of outputs (one per question); a list of images gives one such list
        per image (each question as ``question_prompt`` puts it).
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
        return self.preparer.question_prompt(question)

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
