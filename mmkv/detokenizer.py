"""A growing answer's text, decoded a few tokens at a time.

Decoding a whole answer at every step (to stream its new text, or to look for a stop string)
makes the tokenizer's work grow with the square of the answer's length. ``IncrementalText``
decodes a window: the tokens since the last committed point, with the tokens before it as context,
so the tokenizer joins bytes and places spaces as it does over the whole list; the new text is
what the window decodes to beyond its context. A window whose text ends in U+FFFD (a character
whose bytes are not all there yet) or in a space is not committed: a later token completes the
character, or may take the space back (the clean-up that turns " ," into ",").

Invariant: ``current(ids)`` equals ``decode(ids[start:])``; ``text`` is the decoding of the ids
committed so far and, for tokenizers that only ever take back a space, a prefix of every later
``current``. Where a window's text does not begin with its context's (a tokenizer that rewrites
text further back, or an older snapshot of the list), ``current`` decodes the whole list instead.
An object follows one token list that only grows, on one thread.
"""

from __future__ import annotations

from typing import Callable

from mmkv.outputs import RequestOutput

UNSETTLED = ("\ufffd", " ")  # endings a later token may still change: a partial character, a space


class IncrementalText:
    """The text of ``ids[start:]`` for one growing list ``ids``, decoded with ``decode``."""

    def __init__(self, decode: Callable[[list[int]], str], start: int = 0) -> None:
        self.decode, self.start = decode, start
        self.text = ""  # the decoding of ids[start:read]
        self.prefix = start  # the window's context starts here ...
        self.read = start  # ... and its new tokens here
        self.context = ""  # the decoding of ids[prefix:read] on its own

    def current(self, ids: list[int]) -> str:
        """The text of ``ids`` (grown or not since the last call), committing what is complete."""
        window = self.decode(ids[self.prefix:])
        if not window.startswith(self.context):  # (an older, shorter snapshot of the list too)
            return self.decode(ids[self.start:])
        tail = window[len(self.context):]
        if not tail or tail.endswith(UNSETTLED):
            return self.text + tail
        self.text += tail
        self.prefix, self.read = self.read, len(ids)
        self.context = self.decode(ids[self.prefix:self.read])
        return self.text


class StreamTexts:
    """Incremental texts for streamed requests' outputs: one ``IncrementalText`` per (request,
    sample), set as each output's ``decode``, so reading ``text`` step after step decodes a few
    tokens each time instead of the whole answer. ``attach`` runs where outputs are made; each
    sample's texts are then read on one thread, in order."""

    def __init__(self, decode: Callable[[list[int]], str] | None) -> None:
        self.decode = decode
        self.texts: dict[int, dict[int, IncrementalText]] = {}  # request -> sample index -> text

    def attach(self, out: RequestOutput) -> RequestOutput:
        if self.decode is not None:
            samples = self.texts.setdefault(out.request_id, {})
            for c in out.outputs:
                if c.decoded is None:  # (a text cut at a stop string is already there)
                    text = samples.get(c.index) or samples.setdefault(c.index, IncrementalText(self.decode))
                    c.decode = text.current
        if out.finished:
            self.forget(out.request_id)
        return out

    def forget(self, request_id: int) -> None:
        self.texts.pop(request_id, None)
