"""The cache-aware ranking (mmkv.distributed.routing), without Ray: rendezvous hashing keeps
every key on one replica and moves only the keys of a removed replica; the load guard switches
to the shortest queue exactly when SGLang's rule says the load is imbalanced."""

from hypothesis import given, strategies as st

from mmkv.distributed.routing import imbalanced, rank_replicas, rendezvous_order

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
