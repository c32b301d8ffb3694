"""A real mmkv server on a free loopback port, in this process (uvicorn in a thread) or as a
subprocess, and the synthetic prompts the server tests ask it."""

from __future__ import annotations

import base64
import io
import random
import socket
import threading
import time
from dataclasses import dataclass

import httpx

from mmkv import Engine
from mmkv.server import ServerSettings, build_server
from mmkv.synthetic import document_prompt, random_report, random_scene

MODEL_NAME = "tiny-vlm"


def bundled_engine(**options) -> Engine:
    options = {"kv_cache_memory": "32MiB", "host_kv_memory": "4MiB", **options}
    return Engine(**options)


@dataclass
class RunningServer:
    url: str
    engine: Engine
    server: object
    thread: threading.Thread
    headers: dict[str, str] | None = None

    def metrics(self) -> dict[str, float]:
        text = httpx.get(f"{self.url}/metrics", headers=self.headers).text
        return {line.split(" ")[0]: float(line.split(" ")[1]) for line in text.splitlines()
                if line and not line.startswith("#")}

    def wait_idle(self, timeout: float = 10.0) -> dict[str, float]:
        """Metrics once no request runs or waits and no block is in use (or after ``timeout``)."""
        deadline = time.monotonic() + timeout
        while True:
            m = self.metrics()
            idle = (m["mmkv_requests_running"], m["mmkv_requests_waiting"], m["mmkv_kv_blocks_in_use"]) == (0, 0, 0)
            if idle or time.monotonic() > deadline:
                return m
            time.sleep(0.05)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)
        assert not self.thread.is_alive()


def free_socket() -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    return sock


def start_server(engine: Engine, **settings) -> RunningServer:
    settings = ServerSettings(served_model_name=MODEL_NAME, **settings)
    sock = free_socket()
    server = build_server(engine, settings)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "the server did not start"
        time.sleep(0.02)
    host, port = sock.getsockname()
    headers = {"Authorization": f"Bearer {settings.api_key}"} if settings.api_key else None
    return RunningServer(f"http://{host}:{port}", engine, server, thread, headers)


def png_data_url(image) -> str:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def scenes_and_reports(seed: int, scenes: int, reports: int):
    rng = random.Random(seed)
    return [random_scene(rng) for _ in range(scenes)], [random_report(rng) for _ in range(reports)]


SCENE_QUESTIONS = ("how many shapes are there?", "what is at the centre?", "describe the scene.",
                   "is there a red circle?")
REPORT_QUESTIONS = ("summarise the report.", "who is the mayor of {name}?",
                    "what is the population of {name}?", "which river runs through {name}?")


def scene_chat(scene, question: str) -> list[dict]:
    return [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": png_data_url(scene.render())}},
        {"type": "text", "text": question}]}]


def report_chat(report, question: str) -> list[dict]:
    return [{"role": "system", "content": report.text},
            {"role": "user", "content": question.format(name=report.name)}]


def report_prompt(report, question: str) -> str:
    return document_prompt(report, question.format(name=report.name))
