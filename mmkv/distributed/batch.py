"""Batch image and document Q&A over a Ray Dataset, on engine replicas built once, with image and
prefix affinity.

``Replicas``: ``n`` Ray actors, each one ``Engine`` behind an ``AsyncEngine`` (the requests of every
call it is answering run in one continuous batch), built when the object is made; ``ready()``
waits until every engine is up and says how long that took. They outlive any one job, so a
session of jobs pays their start once, and they report their ``Engine.stats()`` to a
``StatsBoard`` (``replicas.stats``) once built and after every call.

``answer(ds, replicas)`` sends the dataset's blocks to the replicas in turn, as they are read,
and returns the dataset of their answers once every block is answered (Ray Data runs small tasks
of its own for this, so the cluster must keep a CPU free of the replicas: ``answer`` checks this
against what the replicas reserve, placed or not, then waits for them to be built and checks
what the cluster has free). The replicas route among themselves, with no shuffle and no
barrier: the replica given a block keys each row (``rows.py`` and ``affinity.py``: the image's
canonical-pixel key; else the row's ``shared_prefix``, whole; else the route of its first
``affinity_prefix_tokens`` token ids), asks the one ``placement.Placement`` of the replicas (a
small actor of no CPU) where each row goes, answers the rows placed on it and sends every other
row to its replica. One key goes to one replica (rendezvous hashing), and a prompt to the replica
holding the longest of its prefixes when that covers at least half of it: so an image is encoded
once and its cross-attention K/V computed once in the whole cluster, and a document prefilled once
(named as the rows' ``shared_prefix``, or a report at least as long as each row's question after
it), in whatever order and block its rows come. With ``affinity=False`` a block's rows go out in
batches of ``batch_size`` to the replicas in turn, as Ray's own LLM processor sends batches to its
engines.

Guarantees: every input row comes out exactly once, in input order, with the input's columns plus
``answer``, ``finish_reason``, ``prompt_tokens``, ``cached_tokens``, ``replica`` and ``error`` (set
instead of ``answer`` for a row that failed; the other rows are unaffected). A replica that dies
is restarted by Ray and the calls it had are sent again (``max_restarts=-1``,
``max_task_retries=-1``; each call returns its rows once), so no row is lost or duplicated. A
restarted placement actor starts empty: rows are still answered once each, but a document whose
rows were placed before may then be prefilled on a second replica.
"""

from __future__ import annotations

import asyncio
import os
import time
import uuid
from pathlib import Path
from typing import Any, Iterable

import pandas as pd
import ray
from ray.data import Dataset
from tqdm import tqdm

from mmkv import Engine, SamplingParams
from mmkv.bundled import BUNDLED_MODEL
from mmkv.distributed.affinity import DEFAULT_PREFIX_TOKENS, batch_line_key
from mmkv.distributed.placement import Placement
from mmkv.distributed.rows import KEY, AffinityKeys, row_error, row_value
from mmkv.distributed.stats_board import StatsBoard
from mmkv.server.async_engine import AsyncEngine, RequestFailed
from mmkv.server.batch_file import UNBOUNDED, answer_lines, check_line

OUTPUT_COLUMNS = ("answer", "finish_reason", "prompt_tokens", "cached_tokens", "replica", "error")
NAMESPACE = "mmkv-batch"


class Replicas:
    """``n`` engine replicas on the Ray cluster, each reserving ``num_cpus`` (fractions allowed).
    Raises ``ValueError`` for bad arguments before any actor starts. Use as a context manager,
    or call ``close()``."""

    def __init__(self, model: str | Path | None = None, n: int = 2,
                 engine_options: dict[str, Any] | None = None, num_cpus: float = 1.0) -> None:
        model = Path(model) if model is not None else BUNDLED_MODEL
        if not (model / "config.json").is_file():
            raise ValueError(f"model must be a model directory with a config.json, got {str(model)!r}")
        _check_counts(n=n)
        if not num_cpus >= 0:
            raise ValueError(f"num_cpus must be >= 0, got {num_cpus!r}")
        self.num_cpus = num_cpus
        self.stats = StatsBoard()
        # names, so that a restarted replica finds its peers again
        self.names = [f"replica-{uuid.uuid4().hex[:8]}-{i}" for i in range(n)]
        self.placement = _PlacementActor.remote(self.names)
        self.actors = [_EngineReplica.options(name=name, namespace=NAMESPACE, num_cpus=num_cpus,
                                              max_restarts=-1, max_task_retries=-1)
                       .remote(str(model), dict(engine_options or {}), self.stats.actor, self.placement,
                               self.names, i)
                       for i, name in enumerate(self.names)]
        self._started = time.perf_counter()

    def ready(self) -> float:
        """Wait until every replica's engine is built; the seconds since their actors were started."""
        ray.get([actor.ready.remote() for actor in self.actors])
        return time.perf_counter() - self._started

    def close(self) -> None:
        for actor in [*self.actors, self.placement]:
            ray.kill(actor, no_restart=True)
        self.actors = []

    def __enter__(self) -> Replicas:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def answer(ds: Dataset, replicas: Replicas, params: SamplingParams | None = None, *,
           affinity: bool = True, affinity_prefix_tokens: int = DEFAULT_PREFIX_TOKENS,
           batch_size: int = 64) -> Dataset:
    """Answer every row of ``ds`` on ``replicas`` (the module docstring); returns once every row
    is answered, the answers a materialized dataset in the object store.

    A row has ``prompt`` (text, with ``<image>`` where the model needs its image) or ``question``
    (asked about its image in the model's question template), optionally ``image`` (bytes, a path
    readable on the workers, or a PIL image), ``cache_salt`` and ``shared_prefix`` (the start of
    ``prompt`` that other rows share, e.g. a document before the row's own question: rows with one
    ``shared_prefix`` go to one replica whatever its length). Raises ``ValueError`` for bad
    arguments before anything runs."""
    params = params if params is not None else SamplingParams()
    if not isinstance(params, SamplingParams):
        raise ValueError(f"params must be a SamplingParams, got {type(params).__name__}")
    if not isinstance(replicas, Replicas) or not replicas.actors:
        raise ValueError(f"replicas must be open Replicas, got {replicas!r}")
    _check_counts(affinity_prefix_tokens=affinity_prefix_tokens, batch_size=batch_size)
    # Ray Data's own tasks would wait forever for a CPU. Replicas not yet placed do not show in
    # the cluster's free CPUs, so what they reserve is counted first, then what is free once built.
    total, reserved = ray.cluster_resources().get("CPU", 0.0), len(replicas.actors) * replicas.num_cpus
    if total - reserved < 1.0:
        raise ValueError(f"Ray Data needs a free CPU for its tasks: the replicas reserve {reserved:g} of "
                         f"the cluster's {total:g} CPUs; give them fewer num_cpus")
    replicas.ready()
    if ray.available_resources().get("CPU", 0.0) < 1.0:
        raise ValueError("Ray Data needs a free CPU for its tasks, and the cluster has none left beside "
                         "the replicas: give them fewer num_cpus")
    actors = replicas.actors
    answered = [actors[k % len(actors)].route.remote(block, params, affinity, affinity_prefix_tokens,
                                                     batch_size, k)
                for k, block in enumerate(ds.to_pandas_refs())]
    return ray.data.from_pandas_refs(answered)


def run_batch_on_replicas(model: str, replicas: int, engine_options: dict[str, Any],
                          lines: Iterable[str], progress: bool = True) -> list[dict[str, Any]]:
    """``mmkv.server.batch_file.run_batch`` on ``replicas`` engine replicas (on the Ray cluster
    ``ray.init`` reaches): every line checked here, each one run on the replica its
    ``batch_line_key`` places it on (``placement.Placement``, here), so lines that share an image
    or a prefix share one replica's cache; the results in input order."""
    seen: set[str] = set()
    lines = [text for text in lines if text.strip()]
    checked = [check_line(text, seen) for text in lines]
    results: list[dict[str, Any] | None] = [line.result for line in checked]
    with Replicas(model, replicas, engine_options) as pool:
        todo = [i for i, line in enumerate(checked) if line.result is None]
        groups: dict[int, list[int]] = {}
        for i, target in zip(todo, Placement(pool.names).place([batch_line_key(lines[i]) for i in todo])):
            groups.setdefault(target, []).append(i)
        calls = {target: pool.actors[target].batch_lines.remote([lines[i] for i in members])
                 for target, members in groups.items()}
        with tqdm(total=len(calls), desc="replicas", unit="replica", disable=not progress) as bar:
            for target, members in groups.items():
                for i, result in zip(members, ray.get(calls[target])):
                    results[i] = result
                bar.update(1)
    return results


def _check_counts(**counts: int) -> None:
    for name, value in counts.items():
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {value!r}")


def row_prompt(engine: Engine, prompt: Any, question: Any, image: Any) -> Any:
    """What the engine is given for a row: a question in the model's question template, or the
    prompt as it is, with the row's image when it has one."""
    text = engine.question_prompt(question) if question is not None else prompt
    return {"prompt": text, "images": [image]} if image is not None else text


_PlacementActor = ray.remote(num_cpus=0, max_restarts=-1, max_task_retries=-1)(Placement)


@ray.remote
class _EngineReplica:
    """One ``Engine`` behind an ``AsyncEngine``: every call's rows join one continuous batch.
    Routes the blocks it is given (the module docstring) and answers rows; reports its stats to
    the board once built and after each call."""

    def __init__(self, model: str, engine_options: dict[str, Any], board: Any, placement: Any,
                 names: list[str], index: int) -> None:
        self.front = AsyncEngine(Engine(model, **engine_options), max_pending=UNBOUNDED)
        self.front.start()
        self.board, self.placement, self.names, self.index = board, placement, names, index
        self.peers: dict[int, Any] = {}  # replica index -> its handle, looked up by name
        self.name = f"{names[index]}-{os.getpid()}"  # one name per incarnation
        self.board.report.remote(self.name, self.front.engine.stats())

    def ready(self) -> str:
        return self.name

    async def route(self, block: pd.DataFrame, params: SamplingParams, affinity: bool,
                    prefix_tokens: int, batch_size: int, position: int) -> pd.DataFrame:
        """``block`` answered: each row here or on the replica it goes to, in input order."""
        block = block.reset_index(drop=True)
        n = len(self.names)
        if affinity:
            keys = AffinityKeys(self.front.engine.tokenizer, prefix_tokens)
            block = await asyncio.to_thread(keys, block)  # reads every image: off the event loop
            chosen = await self.placement.place.remote(list(block[KEY]))
            block = block.drop(columns=[KEY])
        else:
            chosen = [(position + i // batch_size) % n for i in range(len(block))]
        calls = []
        for target in sorted(set(chosen)):
            rows = block.iloc[[i for i, c in enumerate(chosen) if c == target]]
            calls.append(self.answer(rows, params) if target == self.index
                         else self._peer(target).answer.remote(rows, params))
        out = pd.concat(await asyncio.gather(*calls)).sort_index()
        for column in ("answer", "finish_reason", "error"):  # one kind of missing value: None
            out[column] = out[column].astype(object).where(out[column].notna(), None)
        return out

    async def batch_lines(self, lines: list[str]) -> list[dict[str, Any]]:
        """Lines of an OpenAI batch file answered here (``mmkv run-batch --ray-replicas``)."""
        results = await answer_lines(self.front, lines)
        await self.board.report.remote(self.name, self.front.engine.stats())
        return results

    def _peer(self, index: int) -> Any:
        if index not in self.peers:
            self.peers[index] = ray.get_actor(self.names[index], namespace=NAMESPACE)
        return self.peers[index]

    async def answer(self, rows: pd.DataFrame, params: SamplingParams) -> pd.DataFrame:
        """``rows`` with their output columns, every row's request in flight at once."""
        outs = await asyncio.gather(*(self._row(rows, i, params) for i in range(len(rows))))
        await self.board.report.remote(self.name, self.front.engine.stats())
        return rows.assign(**{c: [out[c] for out in outs] for c in OUTPUT_COLUMNS})

    async def _row(self, rows: pd.DataFrame, i: int, params: SamplingParams) -> dict[str, Any]:
        """One row's output columns: its answer, or its error (the other rows go on)."""
        prompt, question, image, shared, salt = (
            row_value(rows, c, i) for c in ("prompt", "question", "image", "shared_prefix", "cache_salt"))
        out = {"answer": None, "finish_reason": None, "prompt_tokens": 0, "cached_tokens": 0,
               "replica": self.name,
               "error": row_value(rows, "error", i) or row_error(prompt, question, image, shared)}
        if out["error"] is not None:
            return out
        try:
            async for _, result in self.front.generate(
                    [row_prompt(self.front.engine, prompt, question, image)], params, salt, stream=False):
                if result.finished:
                    out.update(answer=result.text, finish_reason=result.finish_reason,
                               prompt_tokens=len(result.prompt_token_ids), cached_tokens=result.cached_tokens)
        except (ValueError, RequestFailed) as err:
            out["error"] = str(err)
        return out
