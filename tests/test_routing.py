"""The cache-aware ranking (mmkv.distributed.routing), without Ray: rendezvous hashing keeps
every key on one replica and moves only the keys of a removed replica; ranking by prefix picks
what a naive search of every prompt sent says (the longest match when it covers at least half of
the prompt, else the least loaded replica), and keeps each document's rows on one replica, in
batch placement and in the Serve router; the load guard switches to the shortest queue exactly
when SGLang's rule says the load is imbalanced."""

from types import SimpleNamespace

from hypothesis import given, settings, strategies as st

from mmkv.distributed.placement import Placement
from mmkv.distributed.prefix_index import CHUNK, PrefixIndex, prefix_route
from mmkv.distributed.routing import MATCH_RATIO, imbalanced, rank_by_prefix, rank_replicas, rendezvous_order

REPLICAS = [f"replica-{i}" for i in range(4)]


def test_one_key_always_prefers_one_replica_and_keys_spread():
    tops = [rendezvous_order(f"key-{k}", REPLICAS)[0] for k in range(400)]
    assert tops == [rendezvous_order(f"key-{k}", list(reversed(REPLICAS)))[0] for k in range(400)]
    assert all(60 <= tops.count(r) <= 140 for r in REPLICAS), [tops.count(r) for r in REPLICAS]


@given(st.text(min_size=1), st.integers(0, 3))
def test_removing_a_replica_moves_only_its_own_keys(key, removed):
    order = rendezvous_order(key, REPLICAS)
    rest = rendezvous_order(key, [r for r in REPLICAS if r != REPLICAS[removed]])
    assert rest == [r for r in order if r != REPLICAS[removed]]


def test_imbalance_needs_both_the_absolute_and_the_relative_gap():
    assert not imbalanced({"a": 10, "b": 3}, threshold=8)       # gap 7
    assert imbalanced({"a": 12, "b": 3}, threshold=8)           # gap 9, 4x
    assert not imbalanced({"a": 30, "b": 21}, threshold=8)      # gap 9, but 1.43x
    assert imbalanced({"a": 33, "b": 21}, threshold=8)          # gap 12, 1.57x
    assert not imbalanced({"a": 100}, threshold=0)


def test_balanced_load_follows_the_key_imbalanced_load_the_shortest_queue():
    key = "image:salt:abc"
    preferred = rendezvous_order(key, REPLICAS)
    balanced = {preferred[0]: 5, preferred[1]: 0, preferred[2]: 3, preferred[3]: 1}
    assert rank_replicas(key, balanced, threshold=8) == preferred
    skewed = {**balanced, preferred[0]: 20}
    assert rank_replicas(key, skewed, threshold=8) == [preferred[1], preferred[3], preferred[2], preferred[0]]
    assert rank_replicas(None, balanced, threshold=8)[0] == preferred[1]


def naive_matched(sent: list[tuple[str, list[int]]], prompt: list[int], limit: int) -> dict[str, int]:
    """Per replica, the longest common prefix of ``prompt`` with a prompt sent there, in whole
    chunks of what the router reads: the reference for ``PrefixIndex.matched``."""
    best: dict[str, int] = {}
    for replica, other in sent:
        a, b = prompt[:limit], other[:limit]
        common = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        best[replica] = max(best.get(replica, 0), common // CHUNK * CHUNK)
    return best


def chunks(codes: list[int]) -> list[int]:
    """Whole chunks, equal where their codes are."""
    return [CHUNK * code + i for code in codes for i in range(CHUNK)]


whole_chunks = st.lists(st.integers(0, 3), max_size=5).map(chunks)
documents = st.lists(whole_chunks, min_size=1, max_size=3)
# a document, whole chunks after it, then a few more elements
prompts = st.tuples(st.integers(0, 2), whole_chunks, st.lists(st.integers(0, 9), max_size=20))


@settings(max_examples=300, deadline=None)
@given(documents, st.lists(st.tuples(st.sampled_from("abc"), prompts), max_size=8), prompts,
       st.fixed_dictionaries({r: st.integers(0, 12) for r in "abc"}), st.integers(CHUNK, 120))
def test_ranking_by_prefix_agrees_with_a_naive_search_of_every_prompt_sent(docs, history, request_, loads,
                                                                          limit):
    def text(p):
        return docs[p[0] % len(docs)] + p[1] + p[2]

    index = PrefixIndex()
    sent = [(replica, text(p)) for replica, p in history]
    for replica, prompt in sent:
        index.record(replica, prefix_route(prompt, None, limit))
    prompt = text(request_)
    first = rank_by_prefix(prefix_route(prompt, None, limit), index, loads, threshold=8)[0]
    matched = {r: naive_matched(sent, prompt, limit).get(r, 0) for r in "abc"}
    longest = max(matched.values())
    if not imbalanced(loads, 8) and longest > 0 and longest >= MATCH_RATIO * len(prompt[:limit]):
        assert matched[first] == longest
        assert loads[first] == min(loads[r] for r in "abc" if matched[r] == longest)
    else:
        assert loads[first] == min(loads.values())


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from("ab"), whole_chunks), max_size=12), st.integers(1, 12))
def test_a_replica_keeps_at_most_max_keys_and_never_a_prefix_without_its_own_prefixes(sent, max_keys):
    index = PrefixIndex(max_keys=max_keys)
    routes = [(replica, prefix_route(prompt, None, 256)) for replica, prompt in sent]
    for replica, route in routes:
        index.record(replica, route)
    for replica, route in routes:
        kept = [key in index.kept.get(replica, {}) for key in route.keys]
        assert kept == sorted(kept, reverse=True)  # a run from the first chunk
        assert index.size(replica) <= max_keys
        assert index.matched(route, [replica])[replica] == CHUNK * sum(kept)


def test_a_salt_or_a_change_in_the_first_chunk_gives_another_route():
    doc = list(range(100, 200))
    assert prefix_route(doc + [1], None, 256).keys == prefix_route(doc + [2], None, 256).keys
    assert prefix_route(doc, "a", 256).keys[0] != prefix_route(doc, None, 256).keys[0]
    assert prefix_route([7] + doc[1:], None, 256).keys[-1] != prefix_route(doc, None, 256).keys[-1]
    assert prefix_route(doc, None, 40) == (prefix_route(doc, None, 256).keys[:2], 40)
    assert prefix_route("a" * 40, None, 256).length == 40


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 4), st.integers(0, 8)), min_size=1, max_size=6),
       st.lists(st.tuples(st.integers(0, 5), st.integers(0, 1000)), min_size=1, max_size=40),
       st.integers(2, 4))
def test_placement_keeps_each_documents_rows_on_one_replica(sizes, asks, n):
    """Documents of whole chunks, each row one of them plus a question no longer than it (so the
    document covers at least half of the row), in any order: each document's rows on one replica."""
    docs = [[1000 * (k + 1) + i for i in range(CHUNK * chunks)] for k, (chunks, _) in enumerate(sizes)]
    placement = Placement([f"replica-{i}" for i in range(n)])
    where: dict[int, set[int]] = {}
    for doc, seed in asks:
        doc %= len(docs)
        question = [seed + i for i in range(seed % (len(docs[doc]) + 1))]
        [replica] = placement.place([prefix_route(docs[doc] + question, None, 256)])
        where.setdefault(doc, set()).add(replica)
    assert all(len(replicas) == 1 for replicas in where.values()), where


def fake_router(known: dict[str, int], threshold: int):
    """A ``CacheAwareRouter`` over replicas "a" and "b" outside Ray: Serve's queue-length cache
    reads ``known`` (a replica missing from it is probed, and every probe misses its deadline);
    returns the router, the replicas and an affinity key whose own replica is "a"."""
    from types import SimpleNamespace

    from mmkv.distributed.router import CacheAwareRouter

    replicas = [SimpleNamespace(replica_id=SimpleNamespace(unique_id=name)) for name in ("a", "b")]
    key = next(f"key-{k}" for k in range(100) if rendezvous_order(f"key-{k}", ["a", "b"])[0] == "a")
    router = object.__new__(CacheAwareRouter)
    router.initialize_state(threshold=threshold)
    router._replica_queue_len_cache = SimpleNamespace(get=lambda rid: known.get(rid.unique_id))

    async def probe(unknown, backoff):
        return [(r, None) for r in unknown]

    router._probe_queue_lens = probe
    return router, replicas, key


def request(key: str, request_id: str):
    from types import SimpleNamespace

    return SimpleNamespace(kwargs={"affinity": key}, metadata=SimpleNamespace(internal_request_id=request_id))


def first_choice(router, replicas, pending) -> str:
    import asyncio

    return asyncio.run(router.choose_replicas(replicas, pending))[0][0].replica_id.unique_id


def test_router_counts_a_replica_whose_probe_goes_unanswered_as_idle():
    """Serve's router probes replicas it has no fresh queue length for, with a 0.1 s deadline; on
    a busy machine the answer can miss it. That replica still takes part: a burst on one key
    spreads to it instead of piling onto the key's replica."""
    known = {"a": 40}
    router, replicas, key = fake_router(known, threshold=8)
    assert first_choice(router, replicas, request(key, "r0")) == "b"
    known["a"] = 3  # balanced again: the key's own replica first
    assert first_choice(router, replicas, request(key, "r1")) == "a"


def test_a_burst_spreads_while_serves_queue_lengths_lag_the_sends():
    """Serve ranks a burst's requests before the replicas' replies raise its cached queue
    lengths (seen in CI: 48 requests ranked against lengths 1 and 0, all onto one replica). The
    router counts the requests it ranked itself: the key's replica takes ``threshold + 1`` and
    the rest alternate."""
    threshold = 12
    router, replicas, key = fake_router({"a": 1, "b": 0}, threshold)
    router.clock = lambda: 0.0  # no claim lapses, however slow the machine
    firsts = [first_choice(router, replicas, request(key, f"r{i}")) for i in range(48)]
    assert firsts[:threshold + 1] == ["a"] * (threshold + 1)
    assert firsts.count("b") == (48 - threshold) // 2, firsts


def test_the_routers_own_count_follows_acceptance_completion_and_abandoned_claims():
    from types import SimpleNamespace

    now = [0.0]
    router, replicas, key = fake_router({}, threshold=8)
    router.clock = lambda: now[0]
    pending = [request(key, f"r{i}") for i in range(3)]
    for p in pending:
        first_choice(router, replicas, p)
    assert router.placed() == {"a": 3}
    a = SimpleNamespace(unique_id="a")
    router.on_request_routed(pending[0], a, None)
    router.on_request_routed(pending[1], a, None)
    router.on_request_completed(SimpleNamespace(unique_id="b"), "r0")  # a refused send elsewhere
    assert router.placed() == {"a": 3}
    router.on_request_completed(a, "r0")
    assert router.placed() == {"a": 2}
    now[0] = 5.0  # r2 was ranked but never accepted: its claim lapses; r1 runs on
    assert router.placed() == {"a": 1}


def test_requests_placed_on_a_replica_that_died_stop_counting():
    """Serve never reports completions from a dead replica: without forgetting its requests the
    router would carry them, and every key's request would look at a longer queue than there is."""
    from collections import namedtuple

    router, replicas, key = fake_router({}, threshold=8)
    router._replicas, router._replica_id_set, router._queue_len_gauge_last_update = {}, set(), {}
    a, b = (namedtuple("ReplicaID", "unique_id")(name) for name in "ab")  # hashable, as Serve's are
    pending = [request(key, f"r{i}") for i in range(3)]
    for p in pending:
        first_choice(router, replicas, p)
    router.on_request_routed(pending[0], a, None)
    router.on_request_routed(pending[1], b, None)
    assert router.placed() == {"a": 2, "b": 1}  # r2 still a claim on "a"
    router.on_replica_actor_died(a)
    assert router.placed() == {"b": 1}


def test_router_keeps_each_reports_requests_on_one_replica():
    """Serve: completions of short reports (about 300 characters, no shared part named), each
    followed by its own questions, keyed by the ingress (``ReplicaSetFront.affinity``) and ranked
    by the router one after another: every report's requests go to one replica, and the reports
    to both replicas."""
    import random

    from transformers import AutoTokenizer

    from mmkv.bundled import BUNDLED_MODEL
    from mmkv.distributed.serve_front import ReplicaSetFront
    from mmkv.preparer import longest_token
    from mmkv.synthetic import document_prompt, random_report, report_questions

    front = ReplicaSetFront(None, None, 2, 8, 256)
    front.tokenizer = AutoTokenizer.from_pretrained(BUNDLED_MODEL)
    front.prefix_chars = 256 * longest_token(front.tokenizer)
    rng = random.Random(1)
    reports = [random_report(rng, fillers=(3, 4)) for _ in range(8)]
    asks = [(k, document_prompt(r, qa.question)) for k, r in enumerate(reports)
            for qa in report_questions(r)[:4]]
    rng.shuffle(asks)
    router, replicas, _ = fake_router({}, threshold=8)
    where: dict[int, set[str]] = {}
    for i, (k, prompt) in enumerate(asks):
        pending = request(front.affinity(prompt, None), f"r{i}")
        replica = first_choice(router, replicas, pending)
        router.on_request_routed(pending, SimpleNamespace(unique_id=replica), None)
        router.on_request_completed(SimpleNamespace(unique_id=replica), f"r{i}")
        where.setdefault(k, set()).add(replica)
    assert all(len(r) == 1 for r in where.values()), where
    assert set().union(*where.values()) == {"a", "b"}
