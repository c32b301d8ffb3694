"""Speculative decoding on the bundled model: plain decoding against early exit and the bundled
draft model, each with the draft-length controller on, at batch sizes 1, 4, 8, 16 and 32, with
transformers' assisted generation on the same weights as the peer.

Regimes (``--regimes``): ``greedy``, a batch's requests all at once, is what the controller's
rules were tuned on (at batch sizes 1, 8 and 32); ``t0.7`` and ``t1.0`` sample at that
temperature (each request seeded by its place; outputs compared by distribution:
``token_tv_<config>_<cell>``, the total variation distance between the token frequencies of a
config's runs and its partner's, ``plain_again`` the noise floor); ``arrivals`` serves the
workload greedily as one stream, three requests joining the running batch every two of plain
decoding's steps, in time (``in_turns``' pace; not at batch 1). A cell of a regime other than
greedy is named ``<method>_<workload>_<regime>_b<N>``. Cells of another regime or batch size are
held out (``held_out_cells``): ``min_speedup`` and ``controller_vs_best_fixed_min`` are over every
cell, and each also comes ``_tuned`` and ``_held_out``, so a reader sees whether a rule
generalises.

Workloads: scene descriptions (``describe the scene.``, ~46 answer tokens), report summaries
(``summarise the report.``, ~25 tokens), ``short``: short questions about scenes and reports
alternately (2-8 tokens), and ``mixed``: scene descriptions and report summaries alternately,
arriving together (no controller setting was tuned on it), greedy. Every cell of {scenes,
summaries, short, mixed} x {1, 8, 32} x {early exit, draft model} is a speedup over plain
decoding of the same prompts at the same batch size in the same run; ``min_speedup`` is the
least of them. Each method also runs with fixed rounds (``draft_length="fixed"``: every round
drafts ``--num-tokens``, each sequence stopping where its draft is unsure), taking turns with the
method's controller, not with plain decoding: ``controller_vs_fixed_<cell>`` is the controller's
speed over fixed rounds met head to head, ``fixed_<cell>`` fixed rounds' speedup over plain
decoding through the controller's (its speedup over ``controller_vs_fixed``), and
``controller_vs_best_fixed_<cell>`` the controller's speed over the better of fixed rounds and
plain decoding, the lesser of its two head-to-head ratios (``controller_vs_best_fixed_min``: the
least over cells). Two ratios each measured against plain decoding in other rounds and divided
would carry both rounds' noise. Batch 1 serves the first
``--batch1-requests`` prompts one at a time, batches 8 and 32 serve all ``--requests``.
transformers runs the batch-1 summaries (its Mllama text model takes no image without the
cross-attention plumbing), the only batch size its assisted generation supports. Every greedy
variant must give the same outputs. mmkv runs every variant ``--repeats`` times or more (rounds
are added while a workload's runs at a batch size took under ``--seconds``: ``rounds_b<batch>``,
by workload), each on a fresh engine (so the controller learns afresh) taking turns step by step
with a fresh plain engine (``in_turns``: the machine's drift meets both alike; the two lead
alternate rounds); a speedup is the median over pairs of rounds of the pair's geometric mean ratio
of the plain engine's time to the variant's (``paired``), and plain decoding beside plain decoding
gives the noise floor (``plain_vs_plain_<cell>``). Throughputs (tokens/s)
and transformers' timings are the fastest of the repeats. Every timing is taken with the garbage
collector paused. The chart is the speedup against the batch size, one line per method and
workload.

The speedups are end to end: prompts' prefill, the same work with or without speculation, is in
both times. ``decode_speedup_<cell>`` is the same paired ratio over the seconds of the engine's
decoding steps alone (``Engine.stats()["step_seconds_decode"]``: steps that compute no more than
each sequence's pending token), what speculation does to the time per output token, and
``prefill_share_plain_b<batch>`` the share of plain decoding's step time spent in prompt steps:
with a share ``p`` no decoding speedup takes the end-to-end one past ``1 / p``.

With ``--all-accepted`` each method also runs with every draft replaced by the target's own
greedy token (``Speculator.propose_with``; the outputs of a plain run of the same prompts): its
passes run and are paid for as usual and every draft is accepted, so
``all_accepted_<method>_<cell>`` is what a perfect draft with these pass costs would give, the
controller choosing lengths as usual. With ``--draft-length fixed`` the rounds are the longest,
which at batch 1 is the most any lengths give: one more accepted draft costs a draft pass and a
verified row, less than the round's mean time per token. It tells a draft's shortfall from what
the pass costs allow.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import random
import statistics
import time
from collections import Counter
from pathlib import Path
from typing import Callable

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from mmkv import Engine, SamplingParams
from mmkv.bench import gc_paused, timed
from mmkv.bundled import BUNDLED_DRAFT_MODEL, BUNDLED_MODEL, BUNDLED_SPECULATION
from mmkv.models import MmkvVLM
from mmkv.models.base import read_config_json
from mmkv.synthetic import (document_prompt, random_report, random_scene, report_questions, scene_prompt,
                            scene_questions)
from speculative import SpeculativeConfig
from speculative.proposers import SpeculationStats

REQUESTS, BATCH1_REQUESTS = 32, 8  # prompts drawn of each workload; at batch 1 the first of them
PARAMS = SamplingParams(max_tokens=48)
LOADS = ("scenes", "summaries", "short", "mixed")  # the workloads (``workloads``)
TUNED_BATCHES = (1, 8, 32)  # the batch sizes the controller's rules were tuned at
# How a workload's requests are served: greedy and all at once (what the rules were tuned on),
# sampled at a temperature (seeded), or greedy arriving ARRIVALS[0] at a time into the running
# batch, every ARRIVALS[1] of plain decoding's steps (``in_turns``' ``pace``), from the first on.
REGIMES = ("greedy", "t0.7", "t1.0", "arrivals")
ARRIVALS = (3, 2)
METHODS = ("early_exit", "draft")  # the speculative configs (plain_again: plain beside plain)
MAX_ROUNDS = 4  # a workload's counted rounds at a batch size are at most this x --repeats
ALL_ACCEPTED = "_all_accepted"  # a method's config with the target's own tokens as its drafts
FIXED = "_fixed"  # a method's config drafting its most tokens every round (no controller)
PLAIN = "plain"  # the plain engine every config runs beside


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", type=Path, default=BUNDLED_MODEL)
    p.add_argument("--draft", type=Path, default=BUNDLED_DRAFT_MODEL)
    p.add_argument("--requests", type=int, default=REQUESTS, help="per workload, served at batch 8 and 32")
    p.add_argument("--batch1-requests", type=int, default=BATCH1_REQUESTS,
                   help="per workload, the first of those, served one at a time")
    p.add_argument("--batches", default="1,4,8,16,32", help="batch sizes")
    p.add_argument("--regimes", default=",".join(REGIMES),
                   help="how requests are served, of " + ", ".join(REGIMES) + " (tN: sampled at "
                        "temperature N; arrivals: greedy, joining a running batch; not at batch 1)")
    p.add_argument("--loads", default=",".join(LOADS),
                   help="workloads, of " + ", ".join(LOADS) + " (transformers runs with summaries at batch 1)")
    p.add_argument("--num-tokens", type=int, default=BUNDLED_SPECULATION["num_tokens"],
                   help="most draft tokens per round")
    p.add_argument("--early-exit-layer", type=int, default=None,
                   help="draft depth for early exit (default: the model's early_exit_layer)")
    p.add_argument("--adaptive-threshold", type=float, default=BUNDLED_SPECULATION["adaptive_threshold"],
                   help="stop a round's drafting once the draft's top probability falls below this "
                        "(transformers' assisted generation stops at 0.4 by default); 0: never")
    p.add_argument("--draft-length", choices=("auto", "fixed"), default="auto",
                   help="auto: the controller chooses each sequence's draft length every step")
    p.add_argument("--chart", type=Path, default=Path("spec_speedup.png"))
    p.add_argument("--repeats", type=int, default=5,
                   help="rounds of runs of every variant (speedups: the median round's ratio)")
    p.add_argument("--seconds", type=float, default=15.0,
                   help=f"more rounds (up to {MAX_ROUNDS}x --repeats) while a workload's counted runs "
                        "at a batch size took under this many seconds in all")
    p.add_argument("--seed", type=int, default=11)
    p.add_argument("--all-accepted", action="store_true",
                   help="also run each method with the target's own tokens as its drafts (every "
                        "draft accepted, every pass paid for): what a perfect draft would give")


def workloads(n: int, seed: int) -> dict[str, list]:
    """``n`` prompts of each workload, drawn from ``seed``: scene descriptions, report summaries,
    ``short``, short questions (a count, a colour, a field of a report: 2-8 answer tokens) about
    scenes and reports alternately, and ``mixed``, the scene descriptions and report summaries
    alternately, arriving together (a workload no controller setting was tuned on)."""
    rng = random.Random(seed)
    scenes = [{"prompt": scene_prompt("describe the scene."), "images": [random_scene(rng).render()]}
              for _ in range(n)]
    docs = [document_prompt(random_report(rng), "summarise the report.") for _ in range(n)]
    short: list = []
    for i in range(n):
        if i % 2 == 0:
            scene = random_scene(rng)
            asked = [qa for qa in scene_questions(scene, rng) if qa.kind != "describe"]
            short.append({"prompt": scene_prompt(rng.choice(asked).question), "images": [scene.render()]})
        else:
            report = random_report(rng)
            asked = [qa for qa in report_questions(report) if qa.kind != "summary"]
            short.append(document_prompt(report, rng.choice(asked).question))
    mixed = [scenes[i] if i % 2 == 0 else docs[i] for i in range(n)]
    return {"scenes": scenes, "summaries": docs, "short": short, "mixed": mixed}


def warm_ups(seed: int) -> dict[str, list]:
    """One prompt of each workload that is none of ``workloads(n, seed)``'s (drawn from another
    seed), for an engine's warm-up request: a workload's own prompt would leave its K/V cached (a
    draft model's too) for the run, and its first step would serve that prompt as no later one is
    served."""
    return workloads(1, seed + 1)


def fresh_engine(model: Path, warm_up: list, batch: int, speculative: SpeculativeConfig | None,
                 own: dict[int, list[int]] | None = None, engine_class: type[Engine] = Engine,
                 **options) -> Engine:
    """A fresh engine (so a fresh cache and controller) that serves ``batch`` sequences at a time,
    warmed up on a short request of ``warm_up[0]`` (``warm_ups``); ``options``: more of the
    engine's options. With ``own`` (``own_outputs``), its drafts are the target's own tokens."""
    engine = engine_class(model, kv_cache_memory="256MiB", host_kv_memory="16MiB", speculative=speculative,
                    max_num_seqs=batch, **options)
    engine.generate(warm_up[:1], SamplingParams(max_tokens=4))
    if own is not None:
        engine.speculator.propose_with(lambda seq, depth: own[seq.request_id][seq.num_generated + depth])
    return engine


def serve(engine: Engine, prompts: list, batch: int) -> list:
    """``prompts`` served ``batch`` at a time, in order (so engines warmed up alike number their
    requests alike)."""
    return [o for i in range(0, len(prompts), batch) for o in engine.generate(prompts[i:i + batch], PARAMS)]


def in_turns(engines: dict[str, Engine], prompts: list, batch: int, seed: int = 0,
             params: Callable[[int], SamplingParams] = lambda i: PARAMS,
             arrivals: tuple[int, int] | None = None,
             pace: float | None = None) -> dict[str, tuple[list, float, dict]]:
    """Every engine serves ``prompts`` ``batch`` at a time as ``serve`` does, the engines taking
    turns step by step: one step of each in an order drawn afresh every turn from ``seed``, the
    first turn led by engine ``seed`` (modulo their number), and a turn never starting with the
    engine that ended the one before. Each engine queues a batch in its turn, just before its
    step; prompt ``i`` with ``params(i)``. With ``arrivals`` (``k``, ``n``) the prompts are one
    stream instead, its scheduler running ``batch`` at a time: with ``pace`` (seconds), ``k``
    more arrive every ``n * pace`` seconds of each engine's own clock (the seconds its calls took,
    and those it waited with nothing to run for the next ones to arrive); without, each engine
    queues ``k`` more before every ``n``-th of its steps. Requests arrive in time, not in steps:
    counted in its steps, an engine whose steps are longer (a speculative round makes several
    tokens in one) would receive its stream later, and a run would measure that schedule instead
    of the engine. For each: its outputs' token ids in order, the seconds its own calls took (and
    waited) and its stats (``run_<phase>_seconds``: this run's step seconds, a warm-up before it
    left out; ``run_steps``: its steps).

    This machine's speed drifts over a second or two, and one engine's run after another's
    compares two moments as much as two engines; taking turns every step puts the same moments in
    both. The order is drawn, not rotated: in a rotating order each engine mostly follows the same
    other one, which can favour one of them. Callers pass each round its own ``seed`` (one order
    for every round favoured the same engine in every round) and count rounds in groups in which
    each engine leads once (``paired``): the engine that leads a round ran 3-7 % slower than the
    other in a prefill-heavy run. With two engines no turn may start with the one that ended the
    turn before, so whichever leads a batch's first turn leads its every turn while both are live
    (a later batch's first turn goes to the engine that did not step last). A step right after the
    same engine's own finds its caches warm, hence no engine twice running. What this measured:
    docs/benchmarks.md (spec)."""
    names = list(engines)
    order = random.Random(seed)
    last = None  # the engine that stepped last
    warm = {name: engines[name].stats() for name in names}
    seconds = dict.fromkeys(names, 0.0)
    outputs: dict[str, dict[int, list[int]]] = {name: {} for name in names}
    clock = time.perf_counter
    chunk, (arriving, every) = (len(prompts), arrivals) if arrivals else (batch, (batch, 1))
    paced = bool(arrivals) and pace is not None  # requests arrive in time, not every ``every`` steps
    total_steps = dict.fromkeys(names, 0)

    def queue(name: str, end: int) -> None:
        requests = range(given[name], min(given[name] + arriving, end))
        for i in requests:
            engines[name].add_request(prompts[i], params(i))
        given[name] = requests.stop

    with gc_paused():
        for first in range(0, len(prompts), chunk):
            given = dict.fromkeys(names, first)  # each engine's next prompt to queue
            steps = dict.fromkeys(names, 0)  # each engine's steps in this chunk
            due = dict.fromkeys(names, 0.0)  # with a pace: when its next requests arrive
            end = min(first + chunk, len(prompts))
            while live := [name for name in names if given[name] < end or engines[name].has_unfinished()]:
                turn = order.sample(live, len(live))
                if last is None:  # the round's first turn: engine ``seed`` leads
                    turn.remove(leader := names[seed % len(names)])
                    turn.insert(0, leader)
                elif turn[0] == last and len(turn) > 1:
                    turn[0], turn[-1] = turn[-1], turn[0]
                last = turn[-1]
                for name in turn:
                    if paced:
                        if not engines[name].has_unfinished():  # it waits for the next to arrive
                            seconds[name] = max(seconds[name], due[name])
                        while given[name] < end and seconds[name] >= due[name]:
                            queue(name, end)
                            due[name] += every * pace
                    start = clock()
                    if not paced and steps[name] % every == 0:
                        queue(name, end)
                    steps[name] += 1
                    total_steps[name] += 1
                    finished = [o for o in engines[name].step() if o.finished]
                    seconds[name] += clock() - start
                    outputs[name].update((o.request_id, o.token_ids) for o in finished)
    runs = {}
    for name in names:
        stats = engines[name].stats()
        for phase in ("prefill", "decode"):
            stats[f"run_{phase}_seconds"] = stats[f"step_seconds_{phase}"] - warm[name][f"step_seconds_{phase}"]
        stats["run_steps"] = total_steps[name]
        runs[name] = ([ids for _, ids in sorted(outputs[name].items())], seconds[name], stats)
    return runs


def own_outputs(model: Path, warm_up: list, prompts: list, batch: int) -> dict[int, list[int]]:
    """The target's greedy outputs of ``prompts`` by request id, served as ``in_turns`` serves
    them after the same warm-up: what an all-accepted run's draft proposes (pass ``i`` of a round
    proposes the token at the sequence's generated length plus ``i``)."""
    engine = fresh_engine(model, warm_up, batch, None)
    return {o.request_id: o.token_ids for o in serve(engine, prompts, batch)}


def interleaved(model: Path, prompts: dict[str, list], warm: dict[str, list], batch: int,
                configs: dict[str, SpeculativeConfig | None], repeats: int, seconds: float = 0.0,
                regimes: dict[str, str] | None = None) -> dict:
    """At least ``repeats`` rounds for every (config, workload): in each, a fresh engine of the
    config (so its controller learns afresh) and a fresh engine of its partner take turns over
    the workload (``in_turns``; a config named ``<method>_all_accepted`` proposes the target's own
    tokens). The partner is plain decoding, but a config named ``<method>_fixed`` meets
    ``<method>`` (``partner``). For each (config, workload), the pairs of runs (the config's, its
    partner's) in round order, an even number of them (the two engines lead alternate rounds). More
    rounds, up to ``MAX_ROUNDS`` x ``repeats``, while a workload's counted runs took under
    ``seconds`` in all: each workload its own, so the quick ones (the short answers) get more,
    where one prompt step is much of a run and a round's ratio swings most. A first round of every
    workload is run and not counted: a process's first runs of a batch size are slower than its
    later ones (its allocator and caches settle).

    Two engines at a time, each config with its own plain partner: a plain engine beside one other
    runs as fast as alone, while among many engines taking turns plain decoding slows more than
    speculation does, which would read as a larger speedup. ``regimes``: each workload's way of
    being served (``served``; default greedy, all at once); an all-accepted config runs on greedy
    workloads only. Requests arriving into a running batch arrive at the pace of plain decoding's
    steps in the workload's first round (``pace_of``), the same for every engine after it."""
    regimes = regimes or {}
    runs_on = {load: [name for name in configs if not name.endswith(ALL_ACCEPTED)
                      or regimes.get(load, "greedy") == "greedy"] for load in prompts}
    pairs: dict = {(name, load): [] for load, names in runs_on.items() for name in names}
    own = ({load: own_outputs(model, warm[load], subset, batch) for load, subset in prompts.items()
            if regimes.get(load, "greedy") == "greedy"}
           if any(name.endswith(ALL_ACCEPTED) for name in configs) else {})
    counted, spent = dict.fromkeys(prompts, 0), dict.fromkeys(prompts, 0.0)
    paces: dict[str, float] = {}  # a workload's plain seconds a step in the first round: arrivals' pace

    def wanted(load: str) -> bool:  # counted rounds come in pairs, each engine leading one (``paired``)
        n = counted[load]
        return n < repeats or n % 2 == 1 or (spent[load] < seconds and n < MAX_ROUNDS * repeats)

    round_ = 0
    while round_ == 0 or any(map(wanted, prompts)):
        for load, subset in prompts.items():
            if round_ and not wanted(load):
                continue
            params, arrivals = served(regimes.get(load, "greedy"))
            for name in runs_on[load]:
                other = partner(name, configs)
                engines = {other: fresh_engine(model, warm[load], batch, configs.get(other)),
                           name: fresh_engine(model, warm[load], batch, configs[name],
                                              own[load] if name.endswith(ALL_ACCEPTED) else None)}
                runs = in_turns(engines, subset, batch, seed=round_, params=params, arrivals=arrivals,
                                pace=paces.get(load))
                if arrivals and PLAIN in runs:
                    paces.setdefault(load, pace_of(runs[PLAIN]))
                if round_:
                    pairs[name, load].append((runs[name], runs[other]))
                    spent[load] += runs[name][1] + runs[other][1]
            counted[load] += bool(round_)
        round_ += 1
    return pairs


def pace_of(run: tuple[list, float, dict]) -> float:
    """A run's seconds a step (``in_turns``' pace for arrivals)."""
    return run[1] / max(run[2]["run_steps"], 1)


def partner(name: str, configs: dict) -> str:
    """The config ``name`` takes turns with: a method's fixed rounds meet the method itself (the
    controller), every other config plain decoding."""
    method = name[:-len(FIXED)] if name.endswith(FIXED) else None
    return method if method in configs else PLAIN


def served(regime: str) -> tuple[Callable[[int], SamplingParams], tuple[int, int] | None]:
    """A regime's sampling parameters for prompt ``i`` (a sampled one seeded by ``i``) and its
    arrivals (None: a batch at once)."""
    if regime.startswith("t"):
        sampled = dataclasses.replace(PARAMS, temperature=float(regime[1:]))
        return (lambda i: dataclasses.replace(sampled, seed=i)), None
    return (lambda i: PARAMS), (ARRIVALS if regime == "arrivals" else None)


def variants(speculative: dict[str, SpeculativeConfig], all_accepted: bool
             ) -> dict[str, SpeculativeConfig | None]:
    """Every config a round runs (each beside its ``partner``): the methods, each method's fixed
    rounds (``draft_length="fixed"``: what the controller must match), ``plain_again`` (plain decoding
    against itself, the noise floor) and with ``all_accepted`` each method's all-accepted config."""
    configs: dict[str, SpeculativeConfig | None] = {**speculative, "plain_again": None}
    configs |= {name + FIXED: dataclasses.replace(config, draft_length="fixed")
                for name, config in speculative.items() if config.draft_length != "fixed"}
    if all_accepted:
        configs |= {name + ALL_ACCEPTED: config for name, config in speculative.items()}
    return configs


def paired(base: list[float], seconds: list[float], engines: int = 2) -> float:
    """How many times faster than ``base`` the runs taking ``seconds`` are: each round's ratio,
    the geometric mean of each ``engines`` rounds in turn (in which each engine led once:
    ``in_turns``), and the median of those. This machine's speed drifts over seconds, so the
    fastest run of each variant compares moments, not variants; two runs of the same round met
    about the same machine, and the median leaves out rounds in which they did not."""
    ratios = [b / s for b, s in zip(base, seconds, strict=True)]
    if not ratios or len(ratios) % engines:
        raise ValueError(f"{len(ratios)} rounds: expected a positive multiple of {engines}, one led by each engine")
    return statistics.median(math.prod(ratios[i:i + engines]) ** (1 / engines)
                             for i in range(0, len(ratios), engines))


@torch.inference_mode()
def timed_hf(target, prompts: list[str], tokenizer, repeats: int, **assist):
    """transformers' generate on each prompt in turn: outputs and the best of ``repeats`` timings."""
    eos = tokenizer.eos_token_id
    target.generate(torch.tensor([tokenizer.encode(prompts[0])]), max_new_tokens=2, **assist)

    def generate_all() -> list[list[int]]:
        outs = []
        for p in prompts:
            ids = torch.tensor([tokenizer.encode(p)])
            out = target.generate(ids, max_new_tokens=PARAMS.max_tokens, do_sample=False,
                                  eos_token_id=eos, pad_token_id=tokenizer.pad_token_id, **assist)
            outs.append(out[0, ids.shape[1]:].tolist())
        return outs

    runs = [timed(generate_all) for _ in range(repeats)]
    return runs[0][0], min(seconds for _, seconds in runs)


def tokens(outs: list[list[int]]) -> int:
    return sum(len(o) for o in outs)


def run(args: argparse.Namespace) -> dict:
    if args.repeats < 1:
        raise SystemExit(f"--repeats must be at least 1, got {args.repeats}")
    batches = [int(b) for b in args.batches.split(",")]
    chosen = args.loads.split(",")
    if unknown := [load for load in chosen if load not in LOADS]:
        raise SystemExit(f"--loads: unknown workload {', '.join(unknown)} (choose from {', '.join(LOADS)})")
    regimes = args.regimes.split(",")
    if unknown := [regime for regime in regimes if regime not in REGIMES]:
        raise SystemExit(f"--regimes: unknown regime {', '.join(unknown)} (choose from {', '.join(REGIMES)})")
    by_load = {load: prompts for load, prompts in workloads(args.requests, args.seed).items() if load in chosen}
    warm_by_load = warm_ups(args.seed)
    # a workload served in a regime: its name (the load's alone when greedy) -> (load, regime)
    keyed = {(load if regime == "greedy" else f"{load}_{regime}"): (load, regime)
             for regime in regimes for load in by_load}
    warm = {key: warm_by_load[load] for key, (load, _) in keyed.items()}
    sampled = {key for key, (_, regime) in keyed.items() if regime.startswith("t")}
    held_out: set[str] = set()  # cells of a regime or batch size no rule was tuned on
    speculative = {"early_exit": SpeculativeConfig(
        num_tokens=args.num_tokens, early_exit_layer=args.early_exit_layer,
        adaptive_threshold=args.adaptive_threshold or None, draft_length=args.draft_length)}
    if args.draft.exists():
        speculative["draft"] = SpeculativeConfig(method="draft_model", num_tokens=args.num_tokens,
                                                 draft_model=args.draft, draft_length=args.draft_length,
                                                 adaptive_threshold=args.adaptive_threshold or None)
    methods = [name for name in METHODS if name in speculative]
    configs = variants(speculative, args.all_accepted)
    result: dict = {}
    equal = True
    ours: dict = {}  # batch-1 summaries: what transformers also serves
    for batch in batches:
        loads = {key: (by_load[load][:args.batch1_requests] if batch == 1 else by_load[load])
                 for key, (load, regime) in keyed.items() if batch > 1 or regime != "arrivals"}
        held_out |= {f"_{key}_b{batch}" for key, (_, regime) in keyed.items()
                     if key in loads and (regime != "greedy" or batch not in TUNED_BATCHES)}

        def over_loads(times: dict) -> dict[str, list[float]]:  # each round's seconds, workloads summed
            return {name: [sum(per_load) for per_load in zip(*(times[name, load] for load in loads
                                                               if (name, load) in times))]
                    for name in configs}

        pairs = interleaved(args.model, loads, warm, batch, configs, args.repeats, args.seconds,
                            {key: keyed[key][1] for key in loads})
        result[f"rounds_b{batch}"] = {load: len(pairs[next(iter(configs)), load]) for load in loads}
        runs = {key: [run for run, _ in rs] for key, rs in pairs.items()}
        beside = {key: [other for _, other in rs] for key, rs in pairs.items()}  # each run's partner's
        plain_runs = {load: [r for name in configs if partner(name, configs) == PLAIN
                             for r in beside.get((name, load), [])] for load in loads}
        reference = {load: plain_runs[load][0][0] for load in loads}  # plain decoding's outputs
        outs = {key: rs[0][0] for key, rs in runs.items()}
        seconds = {key: [r[1] for r in rs] for key, rs in runs.items()}
        base = {key: [r[1] for r in rs] for key, rs in beside.items()}
        decoding = {key: [r[2]["run_decode_seconds"] for r in rs] for key, rs in runs.items()}
        base_decoding = {key: [r[2]["run_decode_seconds"] for r in rs] for key, rs in beside.items()}
        for (name, load), rs in runs.items():  # every run and its partner's
            if load in sampled:  # compared by distribution: every round's tokens against its partner's
                result[f"token_tv_{name}_{load}_b{batch}"] = token_distance(
                    [r[0] for r in rs], [r[0] for r in beside[name, load]])
            else:
                equal &= all(r[0] == reference[load] for r in rs + beside[name, load])
            if name == "plain_again":  # the noise floor: plain decoding against itself
                result[f"plain_vs_plain_{load}_b{batch}"] = round(
                    paired(base[name, load], seconds[name, load]), 2)
                continue
            if name.endswith(ALL_ACCEPTED):
                result[f"all_accepted_{name[:-len(ALL_ACCEPTED)]}_{load}_b{batch}"] = round(
                    paired(base[name, load], seconds[name, load]), 2)
                continue
            if name.endswith(FIXED):  # beside the controller: its speed over fixed rounds'
                result[f"controller_vs_fixed_{name[:-len(FIXED)]}_{load}_b{batch}"] = round(
                    paired(seconds[name, load], base[name, load]), 3)
                continue
            cell, stats = f"{name}_{load}_b{batch}", [r[2] for r in rs]  # every round's run
            more = sum(tokens(r[0]) for r in rs) / sum(tokens(r[0]) for r in beside[name, load])
            result[f"speedup_{cell}"] = round(paired(base[name, load], seconds[name, load]) * more, 2)
            result[f"decode_speedup_{cell}"] = round(
                paired(base_decoding[name, load], decoding[name, load]) * more, 2)
            result[f"acceptance_rate_{cell}"] = _merged_stats(stats)["spec_acceptance_rate"]
            result[f"zero_draft_fraction_{cell}"] = round(sum(st["spec_zero_drafts"] for st in stats)
                                                          / max(1, sum(st["spec_decisions"] for st in stats)), 3)
            result[f"mean_draft_length_{cell}"] = round(statistics.mean(
                st["spec_seq_mean_draft_length_mean"] for st in stats), 4)
            if batch == 1 and load == "summaries":
                ours[name] = outs[name, load], min(seconds[name, load])
        both, both_base = over_loads(seconds), over_loads(base)
        both_decoding, both_base_decoding = over_loads(decoding), over_loads(base_decoding)
        prefill = sum(r[2]["run_prefill_seconds"] for load in loads for r in plain_runs[load])
        decode = sum(r[2]["run_decode_seconds"] for load in loads for r in plain_runs[load])
        result[f"prefill_share_plain_b{batch}"] = round(prefill / (prefill + decode), 3)
        result[f"tokens_per_s_plain_b{batch}"] = round(
            sum(tokens(reference[load]) for load in loads)
            / sum(min(r[1] for r in plain_runs[load]) for load in loads), 1)
        result[f"peak_blocks_plain_b{batch}"] = max(r[2]["peak_blocks_in_use"]
                                                    for load in loads for r in plain_runs[load])
        for name in methods:
            result[f"tokens_per_s_{name}_b{batch}"] = round(
                sum(tokens(outs[name, load]) for load in loads)
                / sum(min(seconds[name, load]) for load in loads), 1)
            result[f"peak_blocks_{name}_b{batch}"] = max(r[2]["peak_blocks_in_use"]
                                                         for load in loads for r in runs[name, load])
            more = (sum(tokens(r[0]) for load in loads for r in runs[name, load])
                    / sum(tokens(r[0]) for load in loads for r in beside[name, load]))
            result[f"speedup_{name}_b{batch}"] = round(paired(both_base[name], both[name]) * more, 2)
            # each workload's engine calibrated when it was built: a short batch job pays that too
            calibrations = [[r[2].get("spec_calibration_seconds", 0.0) for r in runs[name, load]]
                            for load in loads]
            paying = [s + sum(c) for s, c in zip(both[name], zip(*calibrations))]
            result[f"calibration_seconds_{name}_b{batch}"] = round(statistics.median(
                c for per_load in calibrations for c in per_load), 3)
            result[f"speedup_{name}_b{batch}_with_calibration"] = round(
                paired(both_base[name], paying) * more, 2)
            result[f"decode_speedup_{name}_b{batch}"] = round(
                paired(both_base_decoding[name], both_decoding[name]) * more, 2)
            stats = _merged_stats([r[2] for load in loads for r in runs[name, load]])
            result[f"mean_tokens_per_round_{name}_b{batch}"] = stats["spec_mean_tokens_per_round"]
            if name + ALL_ACCEPTED in configs:
                result[f"all_accepted_{name}_b{batch}"] = round(
                    paired(both_base[name + ALL_ACCEPTED], both[name + ALL_ACCEPTED]), 2)
    cells = {k[len("speedup_"):]: v for k, v in result.items()
             if k.startswith("speedup_") and any(f"_{key}_b" in k for key in keyed)}
    result["min_speedup"] = min(cells.values())
    result["min_speedup_cell"] = min(cells, key=cells.get)
    result["held_out_cells"] = sorted(cell for cell in cells if any(cell.endswith(h) for h in held_out))
    apart(result, "min_speedup", cells, set(result["held_out_cells"]))
    # the controller against the better of fixed rounds and plain decoding, cell by cell, each
    # ratio met head to head
    against_fixed = {cell: result[f"controller_vs_fixed_{cell}"] for cell in cells
                     if f"controller_vs_fixed_{cell}" in result}
    result |= {f"fixed_{cell}": round(cells[cell] / v, 2) for cell, v in against_fixed.items()}
    versus = {cell: round(min(cells[cell], v), 3) for cell, v in against_fixed.items()}
    result |= {f"controller_vs_best_fixed_{cell}": v for cell, v in versus.items()}
    if versus:
        result["controller_vs_best_fixed_min"] = min(versus.values())
        result["controller_vs_best_fixed_min_cell"] = min(versus, key=versus.get)
        apart(result, "controller_vs_best_fixed_min", versus, set(result["held_out_cells"]))
    floor = [v for k, v in result.items() if k.startswith("plain_vs_plain_")]
    result["plain_vs_plain_range"] = [min(floor), max(floor)]
    if len(batches) > 1:
        # Blocks the early-exit draft holds beyond plain decoding at the peak of the same workload:
        # its K/V is the target's own, so only the slots reserved for a round's drafts count.
        result["draft_extra_blocks_early_exit"] = (result[f"peak_blocks_early_exit_b{batches[1]}"]
                                                   - result[f"peak_blocks_plain_b{batches[1]}"])
    if 1 in batches and "summaries" in keyed:
        equal &= _against_transformers(args, by_load["summaries"][:args.batch1_requests], ours, result)
    result["outputs_equal"] = equal  # greedy outputs; sampled ones: token_tv_*
    if greedy := [key for key, (_, regime) in keyed.items() if regime == "greedy"]:
        _chart(args.chart, batches, result, methods, greedy)
    result["requests_per_workload"] = {"b1": args.batch1_requests, "other": args.requests}
    result["regimes"] = regimes
    result["settings"] = {"num_tokens": args.num_tokens,
                          "early_exit_layer": args.early_exit_layer or _early_exit_layer(args.model),
                          "adaptive_threshold": args.adaptive_threshold or None,
                          "draft_length": args.draft_length}
    return result


def _against_transformers(args: argparse.Namespace, docs: list[str], ours: dict, result: dict) -> bool:
    """transformers on the same weights (the bundled VLM's language model), batch-1 summaries:
    plain and assisted generation. Adds the speed ratios to ``result``; returns whether every
    output agrees with transformers' plain greedy output."""
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    target = MmkvVLM.from_pretrained(args.model).language_model
    hf_plain, hf_plain_s = timed_hf(target, docs, tokenizer, args.repeats)
    hf = {}
    try:
        hf["hf_assisted_early_exit"] = timed_hf(target, docs, tokenizer, args.repeats,
                                                assistant_early_exit=_early_exit_layer(args.model))
    except (AttributeError, ValueError, TypeError) as err:  # not every model class supports it
        result["hf_assisted_early_exit_error"] = f"{type(err).__name__}: {err}"
    if args.draft.exists():
        draft = AutoModelForCausalLM.from_pretrained(args.draft).eval()
        hf["hf_assisted_draft"] = timed_hf(target, docs, tokenizer, args.repeats, assistant_model=draft)
    result["tokens_per_s_hf_plain_b1"] = round(tokens(hf_plain) / hf_plain_s, 1)
    for name, (outs, seconds) in hf.items():
        result[f"tokens_per_s_{name}_b1"] = round(tokens(outs) / seconds, 1)
    best_ours = max(tokens(o) / s for o, s in ours.values())
    result["speedup_vs_hf_plain_b1"] = round(best_ours / (tokens(hf_plain) / hf_plain_s), 2)
    if hf:
        result["speedup_vs_hf_assisted_b1"] = round(best_ours / max(tokens(o) / s for o, s in hf.values()), 2)
    for name, peer in (("early_exit", "hf_assisted_early_exit"), ("draft", "hf_assisted_draft")):
        if name in ours and peer in hf:
            o, s = ours[name]
            result[f"speedup_{name}_vs_{peer}_b1"] = round((tokens(o) / s) / (tokens(hf[peer][0]) / hf[peer][1]), 2)
    eos = tokenizer.eos_token_id
    reference = [_until_eos(o, eos) for o in hf_plain]
    variants = [o for o, _ in ours.values()] + [o for o, _ in hf.values()]
    return all([_until_eos(x, eos) for x in v] == reference for v in variants)


def apart(result: dict, name: str, cells: dict[str, float], held_out: set[str]) -> None:
    """``name``'s least over the tuned cells and over the held-out ones, each with its cell:
    ``<name>_tuned`` and ``<name>_held_out`` (a rule that generalises holds in both)."""
    for part, chosen in (("tuned", {c: v for c, v in cells.items() if c not in held_out}),
                         ("held_out", {c: v for c, v in cells.items() if c in held_out})):
        if chosen:
            result[f"{name}_{part}"] = min(chosen.values())
            result[f"{name}_{part}_cell"] = min(chosen, key=chosen.get)


def token_distance(outputs: list[list[list[int]]], others: list[list[list[int]]]) -> float:
    """Total variation distance between the token frequencies of two sets of runs' outputs (each
    run a list of token lists): how differently two samplers' outputs are distributed, 0 alike."""
    def frequencies(runs: list[list[list[int]]]) -> dict[int, float]:
        counts = Counter(token for run in runs for ids in run for token in ids)
        total = sum(counts.values()) or 1
        return {token: n / total for token, n in counts.items()}

    a, b = frequencies(outputs), frequencies(others)
    return round(sum(abs(a.get(t, 0.0) - b.get(t, 0.0)) for t in a.keys() | b.keys()) / 2, 4)


def _merged_stats(stats: list[dict]) -> dict:
    """Speculation counters of several runs combined into one set of rates."""
    return SpeculationStats(rounds=sum(st.get("spec_rounds", 0) for st in stats),
                            drafted=sum(st.get("spec_drafted_tokens", 0) for st in stats),
                            accepted=sum(st.get("spec_accepted_tokens", 0) for st in stats)).as_dict()


def _until_eos(ids: list[int], eos: int) -> list[int]:
    return ids[: ids.index(eos) + 1] if eos in ids else ids


def _early_exit_layer(model: Path) -> int:
    return read_config_json(model)["early_exit_layer"]


def _chart(path: Path, batches: list[int], result: dict, methods: list[str], loads: list[str]) -> None:
    """Speedup over plain decoding against the batch size, one line per method and greedy workload
    (none drawn without one)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    labels = {"early_exit": "early exit", "draft": "draft model"}
    for name in methods:
        for load in loads:
            ax.plot(batches, [result[f"speedup_{name}_{load}_b{b}"] for b in batches], marker="o",
                    linestyle="-" if name == "early_exit" else "--", label=f"{labels[name]}, {load}")
    ax.axhline(1.0, color="grey", linewidth=0.8)
    ax.set_xscale("log", base=2)
    ax.set_xticks(batches, [str(b) for b in batches])
    ax.set_xlabel("batch size")
    ax.set_ylabel("speedup over plain decoding")
    ax.set_title("speculative decoding, lengths by the controller")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
