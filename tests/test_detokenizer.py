"""Incremental detokenization against the oracle, the tokenizer's decode of the whole list: every
prefix of random token ids and of encoded text (multi-byte characters split across tokens) reads
the same; the work per token stays constant; the engine's stop strings, ``Engine.stream`` and
the server's streamed outputs decode windows of a few tokens, not the whole answer; a streamed
choice's chunks add up to its text."""

import asyncio
import functools
from typing import Callable

from hypothesis import given, settings, strategies as st
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from mmkv import CompletionOutput, SamplingParams
from mmkv.detokenizer import IncrementalText
from mmkv.bundled import BUNDLED_MODEL
from mmkv.server.async_engine import AsyncEngine
from mmkv.server.responses import ChoiceStream
from server_harness import bundled_engine

TOKENIZER = AutoTokenizer.from_pretrained(BUNDLED_MODEL)  # byte-level BPE
DECODE = functools.partial(TOKENIZER.decode, skip_special_tokens=True)
WINDOW = 16  # the most tokens a decode call may see while text grows a token or a few at a time


def sentencepiece_like() -> PreTrainedTokenizerFast:
    """Words with SentencePiece's word-start mark, whose decoder drops the first word's space (a
    token decoded without the one before it reads differently than after it), and with the clean-up
    that joins " ." and " ," (a token can change the text of the one before it)."""
    words = ["<unk>", "\u2581the", "\u2581report", "\u2581says", "s", ",", ".", "\u2581", "\u2581red", "ing"]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", clean_up_tokenization_spaces=True)


SENTENCEPIECE_DECODE = functools.partial(sentencepiece_like().decode, skip_special_tokens=True)


def follow(decode, ids: list[int], chunks: list[int], start: int = 0) -> None:
    """Grow ``ids[:start]`` to ``ids`` by ``chunks`` tokens at a time: every read equals the
    whole decode, and the committed text only grows and is a prefix of it."""
    text, n, committed = IncrementalText(decode, start), start, ""
    for size in chunks:
        n = min(len(ids), n + size)
        whole = decode(ids[start:n])
        assert text.current(ids[:n]) == whole
        assert text.text.startswith(committed) and whole.startswith(text.text)
        committed = text.text
        if n == len(ids):
            break


@settings(max_examples=150, deadline=None)
@given(st.lists(st.integers(0, TOKENIZER.vocab_size - 1), min_size=1, max_size=60),
       st.lists(st.integers(1, 4), min_size=60, max_size=60), st.integers(0, 5))
def test_random_ids_read_as_the_whole_decode_at_every_length(ids, chunks, start):
    follow(DECODE, ids, chunks, min(start, len(ids) - 1))


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(0, 9), min_size=1, max_size=30),
       st.lists(st.integers(1, 3), min_size=30, max_size=30))
def test_a_decoder_that_drops_the_first_space_reads_as_the_whole_decode(ids, chunks):
    follow(SENTENCEPIECE_DECODE, ids, chunks)


@settings(max_examples=150, deadline=None)
@given(st.text(alphabet=st.sampled_from("ab é中🙂 \n.,'"), min_size=1, max_size=40),
       st.lists(st.integers(1, 3), min_size=80, max_size=80))
def test_encoded_text_with_split_characters_reads_as_the_whole_decode(text, chunks):
    follow(DECODE, TOKENIZER.encode(text), chunks)


def test_an_older_snapshot_reads_as_its_own_decode():
    ids = TOKENIZER.encode("a summary of the report, in short")
    text = IncrementalText(DECODE)
    text.current(ids)
    assert text.current(ids[:3]) == DECODE(ids[:3])


def counting_decode() -> tuple[list[int], Callable[[list[int]], str]]:
    sizes: list[int] = []
    return sizes, lambda ids: sizes.append(len(ids)) or DECODE(ids)


def test_decoding_work_per_token_stays_constant():
    ids = TOKENIZER.encode("the report says that the shapes are red and blue, 中 🙂 é. " * 30)
    sizes, decode = counting_decode()
    text = IncrementalText(decode)
    for n in range(1, len(ids) + 1):
        text.current(ids[:n])
    assert text.current(ids) == DECODE(ids)
    assert max(sizes) <= WINDOW and sum(sizes) <= 8 * len(ids), (max(sizes), sum(sizes), len(ids))


def test_stop_strings_and_engine_streams_decode_a_window_per_step():
    eng = bundled_engine()
    sizes, decode = counting_decode()
    eng.tokenizer.decode = lambda ids, skip_special_tokens: decode(ids)
    params = SamplingParams(max_tokens=48, ignore_eos=True, stop=["never in a scene"])
    outs = list(eng.stream("describe the scene.", params))
    assert len(outs[-1].token_ids) == 48 and outs[-1].finish_reason == "length"
    assert [o.text for o in outs] == [DECODE(o.token_ids) for o in outs]
    assert max(sizes) <= WINDOW, sizes
    cut = eng.generate("describe the scene.", SamplingParams(max_tokens=48, ignore_eos=True,
                                                             stop=[outs[-1].text[20:24]]))[0]
    assert cut.finish_reason == "stop" and cut.text == outs[-1].text[:outs[-1].text.find(outs[-1].text[20:24])]


def test_the_servers_streamed_outputs_decode_a_window_per_step():
    eng = bundled_engine()
    sizes, decode = counting_decode()
    eng.tokenizer.decode = lambda ids, skip_special_tokens: decode(ids)
    front = AsyncEngine(eng, max_pending=4)
    front.start()

    async def stream() -> list[tuple[list[int], str]]:
        return [(out.token_ids, out.text) async for _, out in
                front.generate(["describe the scene."], SamplingParams(max_tokens=48, ignore_eos=True))]

    try:
        seen = asyncio.run(stream())
    finally:
        front.stop()
        front.join(10)
    assert len(seen) >= 48 and all(text == DECODE(ids) for ids, text in seen)
    assert max(sizes) <= WINDOW, sizes
    assert front._texts.texts == {}  # nothing kept for a finished request


def test_a_decoder_that_rewrites_earlier_text_is_read_whole():
    """A decode whose later tokens change text before the window (here token 0 capitalises
    everything) still reads as the whole decode."""
    def decode(ids: list[int]) -> str:
        text = "".join("abcdefghij"[i] for i in ids)
        return text.upper() if ids and ids[-1] == 0 else text

    text, ids = IncrementalText(decode), [1, 2, 3, 0, 4, 5, 0, 6]
    assert [text.current(ids[:n]) for n in range(1, len(ids) + 1)] == [decode(ids[:n]) for n in range(1, len(ids) + 1)]


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(0, 9), min_size=1, max_size=30))
def test_a_streamed_choice_adds_up_to_its_final_text_when_clean_up_takes_a_space_back(ids):
    """The server's chunks of one choice, a token at a time: their deltas add up to the finished
    text although a later "," or "." removes the space before it."""
    stream, sent = ChoiceStream(hold=0), ""
    for n in range(1, len(ids) + 1):
        out = CompletionOutput(0, ids[:n], "length" if n == len(ids) else None, decode=SENTENCEPIECE_DECODE)
        sent += stream.advance(out)[0]
    assert sent == SENTENCEPIECE_DECODE(ids)
