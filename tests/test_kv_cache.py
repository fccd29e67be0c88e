"""The KV cache manager: random sequences opened from the prefix cache, grown and closed,
with a device cache small enough to evict inside a close; the host page count, the device
free list and the reference counts must agree after every operation."""

import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jkv.kv.format import KVFormat
from jkv.kv.manager import KVCacheManager
from jkv.kv.page_pool import page_bytes

LAYERS, HEADS, DIM, PAGE, MAX_LEN, SEQS = 2, 2, 8, 4, 32, 3
ONE_PAGE = page_bytes(KVFormat(), PAGE, DIM, jnp.float32)


def manager(pages: int = 40, cached_blocks: int | None = 3,
            prefix: bool = True) -> KVCacheManager:
    return KVCacheManager(
        num_layers=LAYERS, num_kv_heads=HEADS, head_dim=DIM, dtype=jnp.float32,
        kv_format=KVFormat(), page_size=PAGE, kv_cache_bytes=pages * ONE_PAGE,
        max_model_len=MAX_LEN, max_num_seqs=SEQS, enable_prefix_caching=prefix,
        device_cache_bytes=None if cached_blocks is None
        else cached_blocks * LAYERS * HEADS * ONE_PAGE, hash_seed=b"test")


def check(m: KVCacheManager) -> None:
    free, tables = m.free, m.tables
    assert int(free.num_free) == m.free_pages, "the host count differs from the device's"
    pages, counts = np.asarray(tables.pages), np.asarray(tables.num_pages)
    owned = pages[np.arange(pages.shape[-1]) < counts[..., None]]
    rows = [r for r in range(m.layout.prefix.capacity) if m.layout.prefix.holds(r)]
    cached = np.asarray(m.layout.blocks)[rows].reshape(-1)
    n = m.total_pages + 1
    want = np.bincount(np.concatenate([owned, cached]), minlength=n)
    want[0] = 0
    refs = np.asarray(free.refs)
    assert (refs == want).all(), "reference counts differ from the references held"
    free_ids = np.asarray(free.ids)[(int(free.head) + np.arange(int(free.num_free)))
                                    % (n - 1)]
    assert len(set(free_ids.tolist())) == len(free_ids) and (refs[free_ids] == 0).all()
    assert sorted(free_ids.tolist() + np.flatnonzero(refs).tolist()) == list(range(1, n))
    for slot in range(SEQS):  # each open slot holds pages for exactly its tokens
        held = -(-len(m.slot_tokens[slot]) // PAGE) if m.is_open(slot) else 0
        assert (counts[slot] == held).all()


# prompts are prefixes of a few token runs, so they share blocks often
BASES = [[(7 * i + 3 * b) % 11 for i in range(MAX_LEN)] for b in range(3)]
ops = st.lists(st.tuples(st.sampled_from(["open", "grow", "close"]), st.integers(0, SEQS - 1),
                         st.integers(0, len(BASES) - 1), st.integers(1, MAX_LEN - 1)),
               min_size=1, max_size=25)


@settings(max_examples=60, deadline=None)
@given(ops, st.sampled_from([1, 3, None]))
def test_random_sequences_keep_the_budget_exact(seq, cached_blocks):
    m = manager(cached_blocks=cached_blocks)
    for op, slot, base, n in seq:
        if op == "open" and m.num_free_slots:  # a prompt, prefilled
            tokens = BASES[base][:n]
            slot, cached = m.open(tokens)
            assert cached % PAGE == 0 and m.slot_tokens[slot] == tokens[:cached]
            if cached < n and m.pages_to_grow(slot, n - cached) <= m.available_pages:
                assert bool(m.grow({slot: n}))
                m.add_tokens(slot, tokens[cached:])
        elif op == "grow" and m.is_open(slot):  # decoded tokens
            held = len(m.slot_tokens[slot])
            n = min(n, MAX_LEN - held)
            if n and m.pages_to_grow(slot, n) <= m.available_pages:
                assert bool(m.grow({slot: held + n}))
                m.add_tokens(slot, [base] * n)
        elif op == "close" and m.is_open(slot):
            before = m.available_pages + m.pages_freed_by_close(slot)
            m.close(slot, len(m.slot_tokens[slot]) // PAGE)
            assert m.available_pages == before
        check(m)
    for slot in range(SEQS):
        if m.is_open(slot):
            m.close(slot, len(m.slot_tokens[slot]) // PAGE)
    check(m)
    assert m.available_pages == m.total_pages


def test_a_shared_prefix_sits_in_two_tables_and_is_freed_once():
    m = manager(cached_blocks=None)
    prompt = list(range(9))  # two full blocks and one token
    a, _ = m.open(prompt)
    m.grow({a: len(prompt)})
    m.add_tokens(a, prompt)
    m.close(a, 2)  # the two blocks go to the prefix cache
    b, cached_b = m.open(prompt)
    c, cached_c = m.open(prompt + [5])
    assert cached_b == cached_c == 8
    shared = np.asarray(m.tables.pages)[b, ..., :2]
    assert (np.asarray(m.tables.pages)[c, ..., :2] == shared).all()
    assert (np.asarray(m.free.refs)[shared.reshape(-1)] == 3).all()  # two tables, one row
    check(m)
    m.close(b, 2)
    m.close(c, 2)
    check(m)
    assert m.available_pages == m.total_pages and m.pages_cached == 2 * LAYERS * HEADS


def test_a_cache_too_small_for_one_sequence_is_refused():
    with pytest.raises(ValueError, match="kv_cache_bytes"):
        manager(pages=8)


def test_a_close_may_evict_the_blocks_its_own_sequence_read():
    """A one-block device cache: closing a sequence that read the cached block and filled
    another evicts the block it read to make room for its deeper one."""
    m = manager(cached_blocks=1)
    prompt = BASES[0][:5]
    a, _ = m.open(prompt)
    m.grow({a: 5})
    m.add_tokens(a, prompt)
    m.close(a, 1)
    longer = BASES[0][:13]
    b, cached = m.open(longer)
    assert cached == PAGE
    m.grow({b: 13})
    m.add_tokens(b, longer[PAGE:])
    m.close(b, 3)
    check(m)
    assert len(m.layout.prefix) == 1 and m.available_pages == m.total_pages
