"""Affinity keys (mmkv.distributed.affinity) and the placement of batch rows, without Ray: one
picture has one key whatever its file format, a one-pixel change or another cache salt gives
another; a named shared prefix and a chat's earlier turns are keyed whole, the last user turn
never; short reports followed by their questions, with no shared part named, keep each report on
one replica, as rows and as lines of a batch file."""

import io
import json
import random

import pandas as pd
from PIL import Image

from mmkv.distributed.affinity import (DEFAULT_PREFIX_TOKENS, batch_line_key, chat_affinity,
                                       image_affinity, shared_prefix_affinity)
from mmkv.distributed.placement import Placement
from mmkv.distributed.rows import KEY, AffinityKeys
from mmkv.synthetic import document_prompt, random_report, random_scene, report_questions
from tiny_vlms import picture


def encoded(image: Image.Image, fmt: str, **options) -> bytes:
    out = io.BytesIO()
    image.save(out, fmt, **options)
    return out.getvalue()


def test_one_picture_one_key_whatever_its_format():
    image = picture(3)
    png, webp = encoded(image, "PNG"), encoded(image, "WEBP", lossless=True)
    assert png != webp
    assert image_affinity(png) == image_affinity(webp) == image_affinity(image)
    changed = image.copy()
    changed.putpixel((0, 0), tuple(255 - c for c in image.getpixel((0, 0))))
    assert image_affinity(changed) != image_affinity(png)
    assert image_affinity(png, cache_salt="tenant-a") != image_affinity(png)


def test_a_shared_prefix_is_keyed_whole_whatever_its_length():
    doc = "report on vale. " + "the river is wide. " * 500
    assert shared_prefix_affinity(doc) == shared_prefix_affinity(doc)
    assert shared_prefix_affinity(doc + "x") != shared_prefix_affinity(doc)  # the end counts too
    assert shared_prefix_affinity(doc, cache_salt="a") != shared_prefix_affinity(doc)


def test_a_chat_is_keyed_by_every_message_before_its_last_user_turn():
    system = {"role": "system", "content": "report on vale. population 3,000."}
    ask = lambda q: {"role": "user", "content": q}  # noqa: E731
    assert chat_affinity([system, ask("who is the mayor?")]) == chat_affinity([system, ask("when?")])
    other = {"role": "system", "content": "report on dale. population 3,000."}
    assert chat_affinity([other, ask("when?")]) != chat_affinity([system, ask("when?")])
    turns = [system, ask("when?"), {"role": "assistant", "content": "founded 1200."}]
    assert chat_affinity(turns + [ask("who?")]) != chat_affinity([system, ask("who?")])
    assert chat_affinity([system, ask("q")], cache_salt="a") != chat_affinity([system, ask("q")])
    # nothing tells what a single turn, or a request ending in another role, shares
    assert chat_affinity([ask("who is the mayor?")]) is None
    assert chat_affinity(turns) is None


def short_reports(seed: int, n: int, questions: int) -> list[tuple[int, str]]:
    """``n`` reports of about 300 characters, each followed by ``questions`` questions of its own
    (``document_prompt``): (report, prompt) pairs, shuffled."""
    rng = random.Random(seed)
    reports = [random_report(rng, fillers=(4, 5)) for _ in range(n)]
    assert all(220 <= len(r.text) <= 400 for r in reports), [len(r.text) for r in reports]
    asks = [(k, document_prompt(r, qa.question)) for k, r in enumerate(reports)
            for qa in report_questions(r)[:questions]]
    rng.shuffle(asks)
    return asks


def test_short_reports_without_a_named_shared_prefix_stay_on_one_replica():
    """The reported case: 76 rows, 19 reports of about 300 characters each followed by 4
    questions, no ``shared_prefix``, with 3 scenes x 4 questions among them, keyed in blocks of 16
    as the replicas key them and placed over two replicas. A key of the first 256 tokens held each
    row's question and split every report; each report's rows, and each scene's, now go to one
    replica, and both replicas get reports."""
    from transformers import AutoTokenizer

    from mmkv.bundled import BUNDLED_MODEL

    rows = [{"prompt": prompt, "question": None, "image": None, "group": f"report-{k}"}
            for k, prompt in short_reports(0, 19, 4)]
    rng = random.Random(1)
    for k in range(3):
        png = io.BytesIO()
        random_scene(rng).render().save(png, "PNG")
        rows += [{"prompt": None, "question": q, "image": png.getvalue(), "group": f"scene-{k}"}
                 for q in ("how many shapes?", "what is at the centre?", "describe it.", "any red?")]
    rng.shuffle(rows)
    keys = AffinityKeys(AutoTokenizer.from_pretrained(BUNDLED_MODEL), DEFAULT_PREFIX_TOKENS)
    placement = Placement(["replica-0", "replica-1"])
    where: dict[str, set[int]] = {}
    for start in range(0, len(rows), 16):
        block = keys(pd.DataFrame(rows[start:start + 16]))
        assert block["error"].isna().all()
        for group, replica in zip(block["group"], placement.place(list(block[KEY]))):
            where.setdefault(group, set()).add(replica)
    assert len(where) == 22 and all(len(r) == 1 for r in where.values()), where
    assert set().union(*(r for g, r in where.items() if g.startswith("report"))) == {0, 1}


def test_batch_file_lines_of_one_short_report_go_to_one_replica():
    """``mmkv run-batch --ray-replicas``: completion lines and single-turn chat lines of short
    reports with their own questions are placed by their prompts, each report on one replica."""
    def line(i: int, prompt: str, chat: bool) -> str:
        body = ({"messages": [{"role": "user", "content": prompt}]} if chat else {"prompt": prompt})
        return json.dumps({"custom_id": str(i), "method": "POST", "url": "/v1/completions", "body": body})

    asks = short_reports(2, 10, 4)
    for chat in (False, True):
        placed = Placement(["replica-0", "replica-1"]).place(
            [batch_line_key(line(i, prompt, chat)) for i, (_, prompt) in enumerate(asks)])
        where: dict[int, set[int]] = {}
        for (k, _), replica in zip(asks, placed):
            where.setdefault(k, set()).add(replica)
        assert all(len(r) == 1 for r in where.values()) and set(placed) == {0, 1}, (chat, where)
