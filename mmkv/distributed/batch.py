"""Batch image and document Q&A over a Ray Dataset, with image and prefix affinity.

``answer(ds)`` runs the first two of three stages (the keys and the shuffle, a barrier whose
output it holds in the object store) and returns the third, lazy:

1. **keys**: an actor pool reads each row's image (on the worker, never the driver) and gives the
   row its affinity key (``affinity.py``: the image's canonical-pixel key, or a hash of the
   prompt's first ``affinity_prefix_tokens`` token ids); a row that cannot be read gets its
   ``error`` here and travels on.
2. **partition**: a hash repartition on the key into an explicit number of blocks (Ray's default
   shuffle parallelism of 200 would cost seconds), so every row of one key is in one block.
3. **answer**: an actor pool of engine replicas, each building its ``Engine`` once, answers each
   block in one ``generate`` call: an image is encoded once and its cross-attention K/V computed
   once in the whole cluster, a document prefix prefilled once.

Guarantees: every input row comes out exactly once with the input's columns plus ``answer``,
``finish_reason``, ``prompt_tokens``, ``cached_tokens``, ``replica`` and ``error`` (set instead of
``answer`` for a row that failed; the other rows are unaffected). A replica that dies mid-job is
restarted and its blocks retried (Ray Data's actor pools default to ``max_restarts=-1`` and
``max_task_retries=-1``; a failed task's output is discarded and the task rerun), so no row is
lost or duplicated.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pandas as pd
import ray
from ray.data import ActorPoolStrategy, Dataset
from transformers import AutoTokenizer

from mmkv import Engine, SamplingParams
from mmkv.distributed.affinity import DEFAULT_PREFIX_TOKENS, image_affinity, prefix_affinity
from mmkv.distributed.stats_board import StatsBoard
from mmkv.bundled import BUNDLED_MODEL
from vision import ImageError

KEY = "affinity"
ACTOR_START_TIMEOUT_S = 600  # building an engine may load a large model
OUTPUT_COLUMNS = ("answer", "finish_reason", "prompt_tokens", "cached_tokens", "replica", "error")


def answer(ds: Dataset, model: str | Path | None = None, replicas: int = 2,
           params: SamplingParams | None = None, engine_options: dict[str, Any] | None = None, *,
           affinity: bool = True, affinity_prefix_tokens: int = DEFAULT_PREFIX_TOKENS,
           partitions: int | None = None, batch_size: int = 16, num_cpus: float = 1.0,
           stats: StatsBoard | None = None) -> Dataset:
    """Answer every row of ``ds`` on ``replicas`` engine actors; returns the answered dataset, its
    answering stage lazy (the keying and shuffle run before this returns).

    A row has ``prompt`` (text, with ``<image>`` where the model needs its image) or ``question``
    (asked about its image in the model's question template), optionally ``image`` (bytes, a path
    readable on the workers, or a PIL image) and ``cache_salt``. With ``affinity=False`` rows go to
    replicas in batches of ``batch_size`` as they come (plain ``map_batches``, as Ray's own LLM
    processor does). ``partitions`` (default ``2 * replicas``) is the hash shuffle's block count;
    ``num_cpus`` what each replica reserves (fractions allowed); ``stats`` collects each replica's
    ``Engine.stats()``. Raises ``ValueError`` for bad arguments before anything runs.
    """
    model = Path(model) if model is not None else BUNDLED_MODEL
    params = params if params is not None else SamplingParams()
    _check(model, replicas, params, affinity_prefix_tokens, partitions, batch_size, num_cpus)
    replica = dict(fn_constructor_args=(str(model), dict(engine_options or {}), params, stats),
                   batch_format="pandas", num_cpus=num_cpus,
                   compute=ActorPoolStrategy(size=replicas, max_tasks_in_flight_per_actor=1))
    if not affinity:
        out = ds.map_batches(_EngineReplica, batch_size=batch_size, **replica)
    else:
        keyed = ds.map_batches(_AffinityKeys, fn_constructor_args=(str(model), affinity_prefix_tokens),
                               batch_format="pandas", num_cpus=min(num_cpus, 0.25),
                               compute=ActorPoolStrategy(min_size=1, max_size=replicas))
        # The shuffle is a barrier (no partition is done before every row is keyed): holding its
        # output lets every replica start on a partition at once, instead of the first replica up
        # taking each partition as the shuffle hands it over.
        grouped = keyed.repartition(partitions or 2 * replicas, keys=[KEY]).materialize()
        out = grouped.map_batches(_EngineReplica, batch_size=None, **replica).drop_columns([KEY])
    # every replica is up before the first block is sent, so the first one up does not take all
    out.context.wait_for_min_actors_s = ACTOR_START_TIMEOUT_S
    return out


def _check(model: Path, replicas: int, params: Any, prefix_tokens: int, partitions: int | None,
           batch_size: int, num_cpus: float) -> None:
    if not (model / "config.json").is_file():
        raise ValueError(f"model must be a model directory with a config.json, got {str(model)!r}")
    if not isinstance(params, SamplingParams):
        raise ValueError(f"params must be a SamplingParams, got {type(params).__name__}")
    counts = {"replicas": replicas, "affinity_prefix_tokens": prefix_tokens, "batch_size": batch_size,
              "partitions": 1 if partitions is None else partitions}
    for name, value in counts.items():
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    if not num_cpus >= 0:
        raise ValueError(f"num_cpus must be >= 0, got {num_cpus!r}")


def _value(batch: pd.DataFrame, column: str, i: int) -> Any:
    """The row's value, None where the column is missing or the value is null."""
    if column not in batch.columns:
        return None
    value = batch[column].iloc[i]
    return None if pd.api.types.is_scalar(value) and pd.isna(value) else value


def _row_error(prompt: Any, question: Any, image: Any) -> str | None:
    if (prompt is None) == (question is None):
        return "a row needs exactly one of 'prompt' and 'question'"
    if question is not None and image is None:
        return "a 'question' row needs an 'image'; send a 'prompt' for text"
    return None


class _AffinityKeys:
    """Adds each row's affinity key, and ``error`` for a row whose image or shape is bad."""

    def __init__(self, model: str, prefix_tokens: int) -> None:
        self.tokenizer = AutoTokenizer.from_pretrained(model)
        self.prefix_tokens = prefix_tokens

    def __call__(self, batch: pd.DataFrame) -> pd.DataFrame:
        keys, errors = [], []
        for i in range(len(batch)):
            prompt, question, image, salt = (_value(batch, c, i) for c in
                                             ("prompt", "question", "image", "cache_salt"))
            error = _row_error(prompt, question, image)
            key = ""
            if error is None and image is not None:
                try:
                    key = image_affinity(image, salt)
                except ImageError as err:
                    error = str(err)
            elif error is None:
                ids = self.tokenizer.encode(prompt)
                key = prefix_affinity(ids, self.prefix_tokens, salt)
            keys.append(key)
            errors.append(error)
        return batch.assign(**{KEY: keys, "error": errors})


def row_prompt(engine: Engine, prompt: Any, question: Any, image: Any) -> Any:
    """What the engine is given for a row: a question in the model's question template, or the
    prompt as it is, with the row's image when it has one."""
    text = engine.question_prompt(question) if question is not None else prompt
    return {"prompt": text, "images": [image]} if image is not None else text


class _EngineReplica:
    """One ``Engine``, built once, answering whole batches; reports its stats after each."""

    def __init__(self, model: str, engine_options: dict[str, Any], params: SamplingParams,
                 stats: StatsBoard | None) -> None:
        self.engine = Engine(model, **engine_options)
        self.params = params
        self.stats = stats
        actor = ray.get_runtime_context().get_actor_id() or "driver"
        self.name = f"{actor[:8]}-{os.getpid()}"  # one name per incarnation

    def __call__(self, batch: pd.DataFrame) -> pd.DataFrame:
        n = len(batch)
        columns: dict[str, list] = {c: [None] * n for c in OUTPUT_COLUMNS}
        columns["prompt_tokens"], columns["cached_tokens"] = [0] * n, [0] * n
        columns["error"] = [_value(batch, "error", i) for i in range(n)]
        by_salt: dict[str | None, list[int]] = {}
        prompts: dict[int, Any] = {}
        for i in range(n):
            prompt, question, image = (_value(batch, c, i) for c in ("prompt", "question", "image"))
            columns["error"][i] = columns["error"][i] or _row_error(prompt, question, image)
            if columns["error"][i] is not None:
                continue
            prompts[i] = row_prompt(self.engine, prompt, question, image)
            by_salt.setdefault(_value(batch, "cache_salt", i), []).append(i)
        for salt, rows in by_salt.items():
            outs = self.engine.generate([prompts[i] for i in rows], self.params, use_tqdm=False,
                                        cache_salt=salt, errors="return")
            for i, out in zip(rows, outs):
                columns["error"][i] = out.error
                if out.error is None:
                    columns["answer"][i] = out.text
                    columns["finish_reason"][i] = out.finish_reason
                columns["prompt_tokens"][i] = len(out.prompt_token_ids)
                columns["cached_tokens"][i] = out.cached_tokens
        columns["replica"] = [self.name] * n
        if self.stats is not None:
            self.stats.report(self.name, self.engine.stats())
        return batch.assign(**columns)
