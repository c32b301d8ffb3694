"""Request preparation: everything that happens to a request before it enters the scheduler.

A prompt (text, token ids, or text with images) becomes token ids: text through the model's
tokenizer (or its chat template), ``<image>`` placeholders through the model's image markup, each
image decoded, preprocessed, identified by its canonical pixels and placed where its placeholder
was (LLaVA and Qwen-VL: one token per image feature). Then the request is checked against the
engine's limits and its cache namespace and stop tokens are fixed.

Guarantees: ``prepare`` either returns a request the engine can serve or raises ``ValueError``
(``vision.ImageError`` for a bad image) naming the request and what is wrong; it changes no
engine state but the vision pipeline's caches, so a refused request leaves everything else as
it was.
"""

from __future__ import annotations

import functools
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from jinja2 import TemplateError
from transformers import AutoTokenizer, GenerationConfig

from cache import KVCache
from mmkv.models import ModelAdapter, MRopePositions
from mmkv.models.gguf_lm import gguf_file
from mmkv.sampling_params import SamplingParams
from mmkv.sequence import SeqImage
from mmkv.structured import Constraint, GrammarCache
from vision import ImageInput

Prompt = str | list[int] | dict[str, Any]
IMAGE_PLACEHOLDER = "<image>"


@dataclass(slots=True)
class PreparedRequest:
    """A request checked and tokenized, its images identified and placed, before it is queued."""

    token_ids: list[int]
    images: list[SeqImage]
    params: SamplingParams
    namespace: bytes  # the cache's namespace: its salt, and for cross-attention its images
    stop_token_ids: frozenset[int]  # tokens that end it when generated
    rope: MRopePositions | None
    constraint: Constraint | None = None  # its structured output's matcher (``mmkv.structured``)


class RequestPreparer:
    """Turns prompts into ``PreparedRequest``s for one model and its KV cache (a request must fit
    the device pool alone, at its size when the request is prepared)."""

    def __init__(self, model: ModelAdapter, model_dir: Path, kv: KVCache, max_model_len: int) -> None:
        self.model = model
        self.kv = kv
        self.max_model_len = max_model_len
        self.tokenizer = load_tokenizer(model_dir, model.text_config)
        self.eos_token_ids = eos_token_ids(model_dir, model.text_config, self.tokenizer)
        # what outputs decode their text with (the tokenizer's, so outputs never hold the engine)
        self.decode = (functools.partial(decode_text, self.tokenizer)
                       if self.tokenizer is not None else None)
        # No token stands for more characters than its own text has, so a prompt longer than this
        # cannot fit max_model_len tokens: it is refused before it is tokenized.
        self.max_prompt_chars = max_model_len * longest_token(self.tokenizer)
        self._grammars: GrammarCache | None = None  # built with the first structured request
        self._grammars_lock = threading.Lock()

    def prepare(self, prompt: Prompt, params: SamplingParams | None = None,
                cache_salt: str | None = None, chat: bool = False,
                label: str = "request") -> PreparedRequest:
        """Check and tokenize one request (``label`` names it in errors)."""
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
        stop = frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos
                                                    else frozenset(self.eos_token_ids))
        self._check_bias(params, label)
        constraint = None
        if params.structured is not None:  # compiled and its matcher made here, off the engine's thread
            try:
                constraint = self.grammars.constraint(params.structured)
            except ValueError as err:
                raise ValueError(f"{label}: {err}") from None
        return PreparedRequest(token_ids, seq_images, params, namespace, stop, rope, constraint)

    @property
    def grammars(self) -> GrammarCache:
        """The compiled structured outputs of this model's tokenizer (``ValueError`` without one)."""
        with self._grammars_lock:
            if self._grammars is None:
                if self.tokenizer is None:
                    raise ValueError("structured output needs the model's tokenizer, and this model "
                                     "directory has none")
                self._grammars = GrammarCache(self.tokenizer, self.model.text_config.vocab_size,
                                              sorted(self.eos_token_ids))
            return self._grammars

    def _check_bias(self, params: SamplingParams, label: str) -> None:
        vocab = self.model.text_config.vocab_size
        outside = [t for t in params.logit_bias or () if t >= vocab]
        if outside:
            raise ValueError(f"{label}: logit_bias names token {outside[0]}; the vocabulary has "
                             f"tokens 0 to {vocab - 1}")

    def render_chat(self, messages: list[dict[str, Any]], label: str = "request",
                    tools: list[dict[str, Any]] | None = None) -> list[int]:
        """``render_chat`` with this model's tokenizer; messages whose text is longer than
        ``max_prompt_chars`` are refused before they are rendered."""
        self._check_chars(sum(len(text) for text in _message_texts(messages)), label)
        return render_chat(self.tokenizer, messages, tools)

    def _check_chars(self, n: int, label: str) -> None:
        if n > self.max_prompt_chars:
            raise ValueError(f"{label}: prompt has {n} characters; at most {self.max_prompt_chars} "
                             f"can fit in max_model_len ({self.max_model_len} tokens)")

    def _tokenize(self, prompt: str | list[int], chat: bool, label: str) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError(f"{label}: this model directory has no tokenizer: pass token ids")
            self._check_chars(len(prompt), label)
            if self.model.image_token_id is not None:
                markup = (self.model.image_markup
                          or self.tokenizer.convert_ids_to_tokens(self.model.image_token_id))
                prompt = prompt.replace(IMAGE_PLACEHOLDER, markup)
            if chat:
                ids = self.render_chat([{"role": "user", "content": prompt}], label)
            else:
                ids = self.tokenizer.encode(prompt)
        elif isinstance(prompt, (list, tuple)):
            if len(prompt) >= self.max_model_len:
                raise ValueError(f"{label}: prompt has {len(prompt)} tokens; max_model_len is "
                                 f"{self.max_model_len} (prompt plus at least one generated token)")
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
        n, pool_blocks = len(token_ids), self.kv.pool.num_blocks
        if n >= self.max_model_len:
            raise ValueError(f"{label}: prompt has {n} tokens; max_model_len is {self.max_model_len} "
                             f"(prompt plus at least one generated token)")
        need = self.blocks_needed(n, params.max_tokens)
        if need > pool_blocks:
            raise ValueError(f"{label}: request needs {need} KV blocks "
                             f"({min(n + params.max_tokens, self.max_model_len)} tokens) but the "
                             f"pool holds {pool_blocks}; raise kv_cache_memory or lower max_tokens")

    def blocks_needed(self, prompt_len: int, max_tokens: int) -> int:
        """The blocks a request holds at its longest (its prompt and every token it may generate,
        within ``max_model_len``)."""
        return -(-min(prompt_len + max_tokens, self.max_model_len) // self.kv.block_size)

    def question_prompt(self, question: str) -> str | list[int]:
        """The prompt for ``question`` about one image (with its ``<image>``): in the model's chat
        template after the image (models that chat: Qwen-VL), else in its question template."""
        if not self.model.chat_questions:
            return self.model.question_template.format(question=question)
        return self.render_chat([{"role": "user", "content": [{"type": "image"},
                                                              {"type": "text", "text": question}]}])


def render_chat(tokenizer: Any, messages: list[dict[str, Any]],
                tools: list[dict[str, Any]] | None = None) -> list[int]:
    """Token ids of ``messages`` (``{"role", "content"}``; content a string or a list of
    ``{"type": "text", "text"}`` and ``{"type": "image"}`` parts; an assistant's ``tool_calls``
    and ``role: tool`` results as transformers' templates take them) rendered by the tokenizer's
    chat template with the generation prompt, and ``tools`` (OpenAI's function definitions) as
    the template renders them, as ``apply_chat_template(tools=...)`` does; each image part becomes
    the model's image token, for an image passed with the prompt. ``ValueError`` when there is no
    chat template, the template refuses the messages, or ``tools`` are given and the template
    leaves them out."""
    if tokenizer is None or not tokenizer.chat_template:
        raise ValueError("this model directory has no chat template (tokenizer_config.json "
                         "'chat_template' or chat_template.jinja); send a plain prompt instead")
    try:
        if tools:
            text = tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True,
                                                 tokenize=False)
            if not all(tool["function"]["name"] in text for tool in tools):
                raise ValueError("this model's chat template does not render tools")
            return tokenizer.encode(text, add_special_tokens=False)
        return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                  tokenize=True, return_dict=False))
    except TemplateError as err:
        raise ValueError(f"the chat template refused the messages: {err}") from err


def decode_text(tokenizer: Any, token_ids: list[int]) -> str:
    """The text of ``token_ids``, special tokens left out."""
    return tokenizer.decode(token_ids, skip_special_tokens=True)


def longest_token(tokenizer: Any) -> int:
    """The most characters one token of ``tokenizer`` stands for (1 without a tokenizer)."""
    if tokenizer is None:
        return 1
    tokens = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
    return max((len(t) for t in tokens if t), default=1)


def _message_texts(messages: list[dict[str, Any]]) -> list[str]:
    texts = []
    for message in messages:
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, str):
            texts.append(content)
        elif isinstance(content, list):
            texts += [p.get("text") or "" for p in content if isinstance(p, dict)]
    return texts


def load_tokenizer(path: Path, config) -> Any:
    """The model directory's tokenizer (a GGUF file's, from its metadata), or None when it has
    none (prompts are token ids then)."""
    if (file := gguf_file(path)) is not None:
        return AutoTokenizer.from_pretrained(file.parent, gguf_file=file.name)
    if not any((path / f).exists() for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        return None
    return AutoTokenizer.from_pretrained(path, config=config)


def eos_token_ids(path: Path, config, tokenizer) -> set[int]:
    """Every end-of-sequence id the config, generation config and tokenizer name."""
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
