"""Page free and page tables: property tests over random allocate/append/release sequences."""

import jax.numpy as jnp
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from jkv.cache.page_pool import init_pool, init_tables, release, reserve

PAGE, SLOTS, LAYERS, HEADS, WIDTH, POOL = 4, 4, 2, 2, 4, 24


def check_invariants(free, tables):
    pages = np.asarray(tables.pages)
    counts = np.asarray(tables.num_pages)
    lengths = np.asarray(tables.lengths)
    # tables agree with lengths: every (layer, head) of a slot holds ceil(len / page) pages
    want = -(-lengths // PAGE)
    assert (counts == want[:, None, None]).all()
    j = np.arange(WIDTH)
    assert (pages[j >= counts[..., None]] == 0).all(), "entries past num_pages must be empty"
    owned = pages[j < counts[..., None]]
    assert (owned > 0).all(), "the null page is never handed out"
    n_ids = POOL - 1
    head, num_free = int(free.head), int(free.num_free)
    free_ids = np.asarray(free.ids)[(head + np.arange(num_free)) % n_ids]
    everything = np.concatenate([owned, free_ids])
    assert len(set(everything.tolist())) == len(everything), "a page is owned twice"
    assert sorted(everything.tolist()) == list(range(1, POOL)), "pages lost or invented"


ops = st.lists(
    st.tuples(st.sampled_from(["grow", "release"]), st.integers(0, SLOTS - 1),
              st.integers(1, WIDTH * PAGE)),
    min_size=1, max_size=25)


@settings(max_examples=60, deadline=None)
@given(ops)
def test_random_interleavings_keep_invariants(seq):
    _, free = init_pool(POOL, PAGE, 8, jnp.float32)
    tables = init_tables(SLOTS, LAYERS, HEADS, WIDTH)
    lengths = np.zeros(SLOTS, np.int64)
    for op, slot, n in seq:
        if op == "grow":  # allocate a new sequence or append to one
            target = lengths.copy()
            target[slot] = min(lengths[slot] + n, WIDTH * PAGE)
            pages_needed = sum(
                (-(-int(t) // PAGE) - (-(-int(c) // PAGE))) * LAYERS * HEADS
                for t, c in zip(target, lengths, strict=True))
            before = (np.asarray(tables.pages).copy(), int(free.num_free))
            free, tables, ok = reserve(free, tables, jnp.asarray(target, jnp.int32))
            if pages_needed <= before[1]:
                assert bool(ok)
                lengths = target
                old_pages, _ = before
                kept = old_pages != 0
                assert (np.asarray(tables.pages)[kept] == old_pages[kept]).all(), \
                    "growing moved existing pages"
            else:
                assert not bool(ok)
                assert (np.asarray(tables.pages) == before[0]).all()
                assert int(free.num_free) == before[1]
        else:
            mask = np.zeros(SLOTS, bool)
            mask[slot] = True
            free, tables = release(free, tables, jnp.asarray(mask))
            lengths[slot] = 0
        assert (np.asarray(tables.lengths) == lengths).all()
        check_invariants(free, tables)
    # releasing everything gives every page back
    free, tables = release(free, tables, jnp.ones(SLOTS, bool))
    assert int(free.num_free) == POOL - 1
    check_invariants(free, tables)


def test_reserve_past_table_width_fails_cleanly():
    _, free = init_pool(POOL, PAGE, 8, jnp.float32)
    tables = init_tables(SLOTS, LAYERS, HEADS, WIDTH)
    free, tables, ok = reserve(free, tables, jnp.asarray([WIDTH * PAGE + 1, 0, 0, 0], jnp.int32))
    assert not bool(ok)
    assert int(free.num_free) == POOL - 1
    check_invariants(free, tables)


def test_init_pool_rejects_bad_sizes():
    import pytest

    with pytest.raises(ValueError, match="num_pages"):
        init_pool(1, PAGE, 8)
