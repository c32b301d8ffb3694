"""``mmkv run-batch``: an OpenAI batch file through one engine, one result per line in order."""

from __future__ import annotations

import base64
import io
import json
import random

from mmkv import SamplingParams
from mmkv.server.batch_file import run_batch
from mmkv.cli import main
from mmkv.synthetic import document_prompt, random_report, random_scene, scene_prompt, scene_questions
from server_harness import bundled_engine


def _png_url(image) -> str:
    buffer = io.BytesIO()
    image.save(buffer, "PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def _lines(seed: int = 0) -> tuple[list[str], list]:
    """Two scenes x three questions as chats, a report as a completion, and lines that cannot
    run (an unknown url, a duplicate custom_id, a bad parameter, not JSON, no custom_id); with the
    offline prompts of the good ones."""
    rng = random.Random(seed)
    lines, offline = [], []
    for s in range(2):
        scene = random_scene(rng)
        for q, qa in enumerate(scene_questions(scene, rng)[:3]):
            lines.append({"custom_id": f"scene{s}-{q}", "method": "POST", "url": "/v1/chat/completions",
                          "body": {"model": "tiny-vlm", "max_tokens": 12, "temperature": 0, "messages": [
                              {"role": "user", "content": [{"type": "image_url", "image_url": {"url": _png_url(scene.render())}},
                                                           {"type": "text", "text": qa.question}]}]}})
            offline.append({"prompt": scene_prompt(qa.question), "images": [scene.render()]})
    report = document_prompt(random_report(rng), "who is the mayor?")
    lines.append({"custom_id": "report", "method": "POST", "url": "/v1/completions",
                  "body": {"model": "tiny-vlm", "prompt": report, "max_tokens": 8}})
    offline.append(report)
    lines += [{"custom_id": "nowhere", "method": "POST", "url": "/v1/embeddings", "body": {}},
              {"custom_id": "report", "method": "POST", "url": "/v1/completions", "body": {"model": "x", "prompt": "y"}},
              {"custom_id": "hot", "method": "POST", "url": "/v1/completions",
               "body": {"model": "tiny-vlm", "prompt": "y", "temperature": 9}}]
    return [json.dumps(line) for line in lines] + ["{not json", json.dumps({"method": "POST"})], offline


def test_every_line_gets_one_result_in_order_and_shared_images_are_encoded_once():
    lines, offline = _lines()
    engine = bundled_engine()
    results = run_batch(engine, lines, progress=False)
    assert len(results) == len(lines)
    ids = [json.loads(line).get("custom_id") if line.startswith("{\"") else None for line in lines]
    assert [r["custom_id"] for r in results] == ids
    answers = [r["response"]["body"]["choices"][0] for r in results[:7]]
    texts = [a["message"]["content"] for a in answers[:6]] + [answers[6]["text"]]
    want = [o.text for o in bundled_engine().generate(offline, [SamplingParams(max_tokens=12)] * 6
                                                      + [SamplingParams(max_tokens=8)])]
    assert texts == want
    assert all(r["response"]["status_code"] == 200 and r["error"] is None for r in results[:7])
    assert engine.stats()["encoder_calls"] == 2
    refused = {r["custom_id"]: r["response"]["body"]["error"]["message"] for r in results[7:10]}
    assert "url one of /v1/chat/completions, /v1/completions" in refused["nowhere"]
    assert "used by an earlier line" in refused["report"]
    assert "temperature" in refused["hot"]
    assert [r["response"] for r in results[10:]] == [None, None]
    assert [r["error"]["message"] for r in results[10:]] == ["the line is not valid JSON",
                                                            "the line needs a custom_id string"]
    assert len({r["id"] for r in results}) == len(results)
    assert engine.stats()["blocks_in_use"] == 0


def test_the_command_reads_and_writes_files_and_standard_streams(tmp_path, monkeypatch, capsys):
    lines, _ = _lines(seed=1)
    source = tmp_path / "in.jsonl"
    source.write_text("\n".join(lines[6:9]) + "\n")
    target = tmp_path / "out.jsonl"
    main(["run-batch", "-i", str(source), "-o", str(target), "--no-progress", "--kv-cache-memory", "32MiB"])
    written = [json.loads(line) for line in target.read_text().splitlines()]
    assert [r["custom_id"] for r in written] == ["report", "nowhere", "report"]
    monkeypatch.setattr("sys.stdin", io.StringIO(lines[6] + "\n"))
    main(["run-batch", "-i", "-", "-o", "-", "--no-progress", "--kv-cache-memory", "32MiB"])
    [printed] = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert printed["custom_id"] == "report" and printed["response"]["body"]["choices"][0]["text"] == \
        written[0]["response"]["body"]["choices"][0]["text"]
