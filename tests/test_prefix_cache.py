"""Prefix cache index: chained block hashes, reference counts, LRU eviction."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jkv.kv.prefix_cache import PrefixCache, block_hashes


def test_block_hashes_are_chained_and_seeded():
    rng = np.random.default_rng()
    ids = rng.integers(0, 50_000, 70).tolist()
    h = block_hashes(ids, 16, b"m")
    assert len(h) == 4 and len(set(h)) == 4  # only full blocks
    assert block_hashes(ids[:64] + [1, 2], 16, b"m") == h  # same prefix, same keys
    assert block_hashes(ids, 16, b"m", num_blocks=2) == h[:2]
    changed = list(ids)
    changed[20] += 1  # a change in block 1 changes every later key, not earlier ones
    h2 = block_hashes(changed, 16, b"m")
    assert h2[0] == h[0] and all(a != b for a, b in zip(h2[1:], h[1:], strict=True))
    # the same block after a different history is a different entry
    assert block_hashes(ids[16:32], 16, b"m")[0] != h[1]
    assert block_hashes(ids, 16, b"other model")[0] != h[0]


def test_lookup_stops_at_first_miss_and_lru_evicts_oldest_deepest_first():
    c = PrefixCache(capacity=8)
    keys = [bytes([i]) for i in range(4)]
    rows = [c.insert(k, depth=i)[0] for i, k in enumerate(keys)]
    assert c.lookup(keys) == rows
    assert c.lookup([keys[0], b"x", keys[2]]) == rows[:1]
    c.acquire(rows[:2])
    assert c.num_evictable == 2
    assert set(c.evict(10)) == set(rows[2:])  # referenced rows stay
    assert c.lookup(keys) == rows[:2]
    c.release(rows[:2])  # released together: same age, the deeper block goes first
    assert c.eviction_order() == [rows[1], rows[0]]
    with pytest.raises(ValueError, match="released"):
        c.release(rows[:1])


def test_insert_respects_max_rows_and_skips_known_keys():
    c = PrefixCache(capacity=8, max_rows=2)
    a, _ = c.insert(b"a", 0)
    b, _ = c.insert(b"b", 1)
    assert c.insert(b"a", 0) == (None, [])
    c.acquire([b])
    row, evicted = c.insert(b"c", 2)  # full: the unreferenced LRU row makes room
    assert evicted == [a] and row is not None and len(c) == 2
    c.acquire([row])
    assert c.insert(b"d", 3) == (None, [])  # nothing evictable: not cached
    assert PrefixCache(capacity=4, max_rows=0).insert(b"a", 0) == (None, [])


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["insert", "acquire", "release", "evict"]),
                          st.integers(0, 11)), max_size=80))
def test_random_operations_keep_invariants(ops):
    c = PrefixCache(capacity=6, max_rows=5)
    refs: dict[int, int] = {}
    for op, x in ops:
        if op == "insert":
            row, evicted = c.insert(bytes([x]), x)
            for r in evicted:
                assert refs.get(r, 0) == 0, "evicted a referenced row"
                refs.pop(r, None)
            if row is not None:
                assert row not in refs
                refs[row] = 0
        elif op == "acquire" and refs:
            r = sorted(refs)[x % len(refs)]
            c.acquire([r])
            refs[r] += 1
        elif op == "release" and any(refs.values()):
            r = sorted(k for k, v in refs.items() if v)[x % sum(1 for v in refs.values() if v)]
            c.release([r])
            refs[r] -= 1
        elif op == "evict":
            expected = c.eviction_order()[: x % 3]  # the sorted LRU order, recomputed
            assert c.evict(x % 3) == expected
            for r in expected:
                assert refs.pop(r) == 0
        assert len(c) == len(refs) <= 5
        assert c.num_evictable == sum(1 for v in refs.values() if v == 0)
        assert all(0 <= r < 6 for r in refs)
