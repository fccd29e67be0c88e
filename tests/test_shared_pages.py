"""Page accounting for shared-layer pages: one set of pages per group of layers, aliased in
every layer's (and KV head's) table entry, each entry a reference. Property tests over random
interleavings of reserving groups, dropping some layers of a slot (one layer offloaded) and
emptying slots, and the same properties failing on a planted bug."""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import Phase, given, settings
from hypothesis import strategies as st

import jkv.kv.allocator as alloc
import jkv.kv.shared_form as sf
import jkv.kv.shared_pages as sp
from jkv.kv.quant import unpack

PAGE, SLOTS, LAYERS, HEADS, WIDTH, POOL = 4, 3, 5, 2, 4, 24


def check_invariants(free, tables, groups):
    """Each page is free once or held, its count the table entries holding it; the pool's
    pages in use are the distinct pages held (an aliased page counts once); the layers of a
    live group hold the same pages."""
    pages, counts = np.asarray(tables.pages), np.asarray(tables.num_pages)
    j = np.arange(WIDTH)
    assert (pages[j >= counts[..., None]] == 0).all(), "entries past num_pages must be empty"
    owned = pages[j < counts[..., None]]
    assert (owned > 0).all(), "the null page is never handed out"
    want = np.bincount(owned, minlength=POOL)
    want[0] = 0
    refs = np.asarray(free.refs)
    assert (refs == want).all(), "reference counts differ from the references held"
    free_ids = np.asarray(free.ids)[(int(free.head) + np.arange(int(free.num_free)))
                                    % (POOL - 1)]
    assert len(set(free_ids.tolist())) == len(free_ids), "a page is free twice"
    assert sorted(free_ids.tolist() + np.flatnonzero(refs).tolist()) == list(range(1, POOL)), \
        "a page is neither free nor referenced (leaked)"
    assert sp.pages_held(free) == len(set(owned.tolist())), "aliased pages counted per holder"
    held = 0
    for (slot, tokens, _), live in groups.items():
        live = sorted(live)
        held_counts = counts[slot, live]
        assert (held_counts > 0).all() and (held_counts == held_counts[0]).all()
        rows = pages[slot, live, :, :-(-tokens // PAGE)]
        assert (rows == rows[0]).all(), "a group's layers read different pages"
        held += -(-tokens // PAGE)
    assert sp.pages_held(free) == held, "pages held differ from the live groups' pages"


ops = st.lists(st.tuples(st.sampled_from(["reserve", "reserve", "drop_layers", "release"]),
                         st.integers(0, SLOTS - 1), st.integers(0, LAYERS - 1),
                         st.integers(1, 3), st.integers(1, WIDTH * PAGE)),
               min_size=1, max_size=25)


def run(seq):
    """Apply `seq`, checking the invariants after every operation."""
    free = alloc.init_free(POOL, PAGE)
    tables = alloc.init_tables(SLOTS, LAYERS, HEADS, WIDTH)
    ids = itertools.count()
    # (slot, tokens, id) -> the group's layers still holding its pages, while any does
    groups: dict[tuple[int, int, int], set[int]] = {}
    for op, slot, first, size, tokens in seq:
        size = min(size, LAYERS - first)
        mask = np.zeros(LAYERS, bool)
        mask[first:first + size] = True
        if op == "reserve":
            busy = np.asarray(tables.num_pages)[slot, first:first + size].any()
            need = -(-tokens // PAGE)
            room = need <= int(free.num_free)
            free, tables, ok = sp.reserve_group(free, tables, jnp.int32(slot),
                                                jnp.asarray(mask), jnp.int32(tokens))
            assert bool(ok) == (room and not busy)
            if ok:
                groups[(slot, tokens, next(ids))] = set(range(first, first + size))
        else:
            slots = np.zeros(SLOTS, bool)
            slots[slot] = True
            if op == "release":
                mask[:] = True
            free, tables = sp.release_layers(free, tables, jnp.asarray(slots),
                                             jnp.asarray(mask))
            for key in list(groups):
                if key[0] == slot:  # a layer dropped alone leaves the rest of its group live
                    groups[key] -= set(np.flatnonzero(mask).tolist())
                    if not groups[key]:
                        del groups[key]
        check_invariants(free, tables, groups)
    free, tables = sp.release_layers(free, tables, jnp.ones(SLOTS, bool),
                                     jnp.ones(LAYERS, bool))
    check_invariants(free, tables, {})
    assert int(free.num_free) == POOL - 1


@settings(max_examples=60, deadline=None)
@given(ops)
def test_random_interleavings_of_aliased_groups_keep_invariants(seq):
    run(seq)


def _refs_once_per_page(free, ids, delta):
    """Planted bug: an aliased page counted once, not once per table entry holding it."""
    flat = jnp.unique(ids.reshape(-1), size=ids.size, fill_value=0)
    dest = jnp.where(flat > 0, flat, POOL)
    return free.replace(refs=free.refs.at[dest].add(delta, mode="drop"))


def test_the_properties_catch_a_planted_bug(monkeypatch):
    monkeypatch.setattr(sp, "add_refs", _refs_once_per_page)

    @settings(max_examples=300, deadline=None, database=None, phases=[Phase.generate])
    @given(ops)
    def planted(seq):
        with jax.disable_jit():
            run(seq)

    with pytest.raises(AssertionError, match="reference|free twice|leaked|held"):
        planted()


def test_a_stored_group_maps_onto_pages_as_it_is():
    """pages_from_form keeps a group's codes, scales and zero points (repacked at the padded
    width): reading them back gives the stored coefficients."""
    rng = np.random.default_rng()
    sides = {s: rng.standard_normal((2, 150, 32)).astype(np.float32) for s in sf.SIDES}
    plan = sf.Plan({"k": [(0, 2)], "v": [(0, 1), (1, 1)]}, {"k": [5], "v": [3, 9]}, 4, sinks=2)
    arrays = sf.encode(sides, plan, 2)
    for group, rank in [(0, 5), (2, 9)]:
        width = sp.page_width(rank, 4)
        tokens, pages = sp.pages_from_form(arrays, group, width)
        t, (codes, scale, zero, _, _) = sf.group_operands(arrays, group, rank, 4)
        assert tokens == t == 148
        back = np.asarray(unpack(pages.codes, 4)).reshape(-1, width)
        assert (back[:t, :rank] == codes[:t, :rank]).all() and (back[:, rank:] == 0).all()
        assert (np.asarray(pages.scale)[:, :rank] == scale[:pages.scale.shape[0], :rank]).all()
        with pytest.raises(ValueError, match="width"):
            sp.pages_from_form(arrays, group, 8)
