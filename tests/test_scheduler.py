"""The scheduler's rule for prompts submitted together (``mmkv.scheduler.PrefillingBlocks``)
against a naive reference: a waiting sequence waits exactly when some sequence still prefilling
in its namespace computes a full block of its prompt that the cache does not hold yet."""

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from cache import make_keys
from mmkv.scheduler import PrefillingBlocks

BLOCK = 4


def naive_waits(mine: np.ndarray, namespace, prefilling) -> bool:
    """Compares ``mine`` with every prefilling sequence's keys, row by row."""
    for theirs, their_namespace, computed in prefilling:
        if their_namespace != namespace:
            continue
        limit = min(len(mine), len(theirs)) - 1
        common = next((i for i in range(limit) if (mine[i] != theirs[i]).any()), limit)
        if common >= (computed // BLOCK + 1) * BLOCK:
            return True
    return False


# Few distinct tokens and short prompts, so prompts often share blocks; the image tag column
# tells apart prompts whose token ids agree.
tokens = st.lists(st.integers(0, 2), min_size=1, max_size=14)
sequences = st.tuples(tokens, st.sampled_from([None, "tenant"]), st.integers(0, 13), st.booleans())


def keys_of(ids: list[int], tagged: bool) -> np.ndarray:
    keys = make_keys(ids)
    if tagged:
        keys[:, 1] = 7
    return keys


@settings(max_examples=200, deadline=None)
@given(st.lists(sequences, min_size=1, max_size=6), sequences)
def test_a_waiting_prompt_waits_exactly_when_the_naive_rule_says(prefilling, waiting):
    """The drawn waiting prompt, and every first part of each prefilling prompt followed by
    nothing or by the drawn prompt's tokens, in that prompt's namespace and the other."""
    index = PrefillingBlocks(BLOCK)
    reference = []
    for ids, namespace, computed, tagged in prefilling:
        keys = keys_of(ids, tagged)
        computed = min(computed, len(ids) - 1)
        index.add(keys, namespace, computed)
        reference.append((keys, namespace, computed))
    own, namespace, _, tagged = waiting
    asked = [(own, namespace, tagged)]
    for ids, namespace, _, tagged in prefilling:
        asked += [(ids[:cut] + tail, space, tagged) for cut in range(len(ids) + 1) for tail in ([], own)
                  for space in (namespace, "other" if namespace is None else None) if ids[:cut] + tail]
    for ids, namespace, tagged in asked:
        mine = keys_of(ids, tagged)
        assert index.computes_more_of(mine, namespace) == naive_waits(mine, namespace, reference), ids
