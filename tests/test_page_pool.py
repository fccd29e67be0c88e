"""Page free and page tables: property tests over random allocate/append/release sequences."""

import jax.numpy as jnp
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from jkv.cache.page_pool import (
    export_blocks,
    free_pages,
    import_blocks,
    init_pool,
    init_tables,
    release,
    reserve,
)

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


def _free_ids(free) -> list[int]:
    n_ids = POOL - 1
    return np.asarray(free.ids)[(int(free.head) + np.arange(int(free.num_free))) % n_ids].tolist()


def test_blocks_move_between_a_slot_the_prefix_cache_and_the_free_list():
    rng = np.random.default_rng()
    pool, free = init_pool(POOL, PAGE, 8)
    tables = init_tables(SLOTS, LAYERS, HEADS, WIDTH)
    blocks = jnp.zeros((5, LAYERS, HEADS), jnp.int32)
    slot = int(rng.integers(SLOTS))
    lengths = np.zeros(SLOTS, np.int32)
    lengths[slot] = 3 * PAGE - 1  # two full blocks and a partial page
    free, tables, ok = reserve(free, tables, jnp.asarray(lengths))
    assert ok
    held = np.asarray(tables.pages[slot])  # [L, H, W]
    rows = np.full(WIDTH, -1, np.int32)
    rows[:2] = [3, 1]
    blocks = export_blocks(tables, blocks, jnp.int32(slot), jnp.asarray(rows))
    np.testing.assert_array_equal(np.asarray(blocks[3]), held[..., 0])
    np.testing.assert_array_equal(np.asarray(blocks[1]), held[..., 1])
    assert (np.asarray(blocks)[[0, 2, 4]] == 0).all()
    keep = np.zeros((SLOTS, WIDTH), bool)
    keep[slot, :2] = True
    mask = np.arange(SLOTS) == slot
    free, tables = release(free, tables, jnp.asarray(mask), jnp.asarray(keep))
    cached = np.asarray(blocks)[[3, 1]].reshape(-1).tolist()
    assert sorted(_free_ids(free) + cached) == list(range(1, POOL)), "pages lost or doubled"
    assert set(held[..., 2].reshape(-1).tolist()) <= set(_free_ids(free))

    other = (slot + 1) % SLOTS
    padded = np.full(WIDTH, -1, np.int32)
    padded[:2] = [3, 1]
    tables = import_blocks(tables, blocks, jnp.int32(other), jnp.asarray(padded), jnp.int32(2),
                           jnp.int32(2 * PAGE))
    np.testing.assert_array_equal(np.asarray(tables.pages[other])[..., :2], held[..., :2])
    assert int(tables.lengths[other]) == 2 * PAGE
    lengths = np.zeros(SLOTS, np.int32)
    lengths[other] = 2 * PAGE + 1  # grows by one page past the cached blocks
    free, tables, ok = reserve(free, tables, jnp.asarray(lengths))
    assert ok and (np.asarray(tables.num_pages[other]) == 3).all()
    mask = np.arange(SLOTS) == other
    keep = np.zeros((SLOTS, WIDTH), bool)
    keep[other, :2] = True
    free, tables = release(free, tables, jnp.asarray(mask), jnp.asarray(keep))
    free = free_pages(free, blocks[jnp.asarray([3, 1, 0])])  # row 0 is empty: skipped
    assert sorted(_free_ids(free)) == list(range(1, POOL))
