"""Tiered sequences kept for their conversation's next turn (`tier_entries`): a follow-up
opens with a bit-for-bit copy of the kept tiers (cut to the blocks it shares, when it shares
all but the last few), two follow-ups from one kept sequence start
alike, a pool too short for a copy takes the kept sequence over, a tiered row saved to the
store comes back bit for bit (and a damaged one is refused), and the pages stay exact
throughout."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_engine_formats import TINY
from test_engine_tiers import PAGE, check_nothing_leaked, check_pages, prompts, tiered

from jkv.config import StoreConfig
from jkv.engine.engine import Engine
from jkv.engine.sampling import SamplingParams
from jkv.engine.saved_pages import SavedPages
from jkv.kv.format import KV_FORMATS
from jkv.kv.page_pool import page_bytes
from jkv.kv.prefix_cache import block_hashes
from jkv.kv.tier_entries import CUT_BLOCKS
from jkv.models.loaders import random_params
from jkv.sched.scheduler import Request, Scheduler
from jkv.store import KVStore


@pytest.fixture(scope="module")
def tiny_params():
    return random_params(TINY, seed=3, dtype=jnp.float32)


def run(engine: Engine, requests: list[Request]) -> Scheduler:
    sched = Scheduler(engine)
    for r in requests:
        sched.add(r)
    for _ in range(500):
        if not sched.num_unfinished:
            break
        sched.step()
        check_pages(engine)
    assert not sched.num_unfinished
    return sched


def request(prompt: list[int], n: int) -> Request:
    return Request(prompt, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))


def row_contents(engine: Engine, tables, counts, row: int) -> dict[str, np.ndarray]:
    """Every array of the pages a (slot or entry) row holds, and their token metadata, in
    column order of each (layer, KV head)."""
    c = engine.cache
    pages, high, low = jax.device_get((tables.pages[row], tables.num_pages[row],
                                       tables.low_pages[row]))
    np.testing.assert_array_equal(high, -(-np.asarray(counts.high[row]) // PAGE))
    w = pages.shape[-1]
    ids = np.concatenate([np.concatenate([p[:n], p[w - m:]]) for p, n, m in zip(
        pages.reshape(-1, w), high.reshape(-1), low.reshape(-1), strict=True)])
    out = {name: np.asarray(a)[ids] for name, a in c.pool.arrays().items()}
    meta = c.layout.meta
    out["score"], out["pos"] = np.asarray(meta.score)[ids], np.asarray(meta.pos)[ids]
    out["high"], out["low"] = np.asarray(counts.high[row]), np.asarray(counts.low[row])
    assert len(set(ids.tolist())) == len(ids) and (ids > 0).all()
    return out


def kept_conversation(params) -> tuple[Engine, list[int]]:
    """An engine keeping one finished 37-token conversation (20 tokens generated, 56 tokens
    of full pages kept, with demoted and pruned tokens) and a follow-up prompt extending it."""
    eng = tiered(params, "xla", 2.0, 1.0)
    [p] = prompts((37,))
    first = request(p, 20)
    run(eng, [first])
    return eng, p + first.output + [1, 2, 3, 4, 5]


def test_a_follow_up_opens_with_a_copy_of_the_kept_sequence(tiny_params):
    eng, follow_up = kept_conversation(tiny_params)
    c = eng.cache
    # 37 + 19 tokens fed: the full pages' 56 are kept, with demoted and pruned tokens
    assert len(c.layout.entries) == 1 and c.layout.entries.pages > 0
    row, blocks = c.layout.entries.lookup(c.prompt_hashes(follow_up))
    assert blocks * PAGE == 56
    kept = row_contents(eng, c.layout.entry_tables, c.layout.entry_counts, row)
    assert kept["low"].sum() > 0 and kept["high"].sum() + kept["low"].sum() < 56 * 4
    free = c.free_pages
    slots = []
    for _ in range(2):  # two requests from one kept sequence: the same copy each
        slot, cached = eng.open(follow_up)
        assert cached == 56
        got = row_contents(eng, c.tables, c.layout.counts, slot)
        for name, want in kept.items():
            np.testing.assert_array_equal(got[name], want, err_msg=name)
        check_pages(eng)
        slots.append(slot)
    assert c.free_pages == free - 2 * c.layout.entries.get(row).pages
    assert eng.stats.prefix_hit_tokens == 2 * 56
    # a prompt that does not start with the kept tokens finds nothing (one sharing only
    # their first blocks: `test_a_prompt_sharing_the_first_blocks_opens_with_a_cut_copy`)
    assert c.lookup(c.prompt_hashes([7] * 30 + follow_up)) == (0, 0)
    # a sequence whose KV is suspect (a failed step) is not kept
    slot, _ = eng.open(follow_up)
    eng.close(slot, keep=False)
    assert len(c.layout.entries) == 1 and c.free_pages == free - 2 * c.layout.entries.get(row).pages
    for slot in slots:
        eng.close(slot)
        check_pages(eng)
    assert len(c.layout.entries) == 1  # the same tokens are kept once
    check_nothing_leaked(eng)


def held_tokens(engine: Engine, tables, counts, row: int) -> dict[tuple, tuple]:
    """Each token a (slot or entry) row holds, by (layer, KV head, tier, position): its
    score and the bytes of each of its arrays in its tier's format."""
    c = engine.cache
    pages, high, low = jax.device_get((tables.pages[row], counts.high[row], counts.low[row]))
    score, pos = jax.device_get((c.layout.meta.score, c.layout.meta.pos))
    w, out = pages.shape[-1], {}
    views = {"high": (c.pool, PAGE, high),
             "low": (c.pool.as_format(c.pool.kv_format.halved()), 2 * PAGE, low)}
    for tier, (view, per, count) in views.items():
        at = [(lh, pages[lh][j // per if tier == "high" else w - 1 - j // per], j % per)
              for lh, n in np.ndenumerate(count) for j in range(n)]
        if not at:
            continue
        ids, offs = (jnp.asarray([a[i] for a in at]) for i in (1, 2))
        arrays = jax.device_get(view.take_tokens(ids, offs).arrays())
        for i, ((layer, head), page, off) in enumerate(at):
            out[layer, head, tier, int(pos[page, off])] = (
                float(score[page, off]), *(a[i].tobytes() for a in arrays.values()))
    return out


def test_a_prompt_sharing_the_first_blocks_opens_with_a_cut_copy(tiny_params):
    """A prompt that shares all but the last few blocks of the kept sequence (a client
    resending a reply cut by max_tokens re-tokenized) opens with a copy holding exactly the
    kept tokens before the first block it does not share, bit for bit, and the pages stay
    exact; one that shares fewer finds nothing."""
    eng, follow_up = kept_conversation(tiny_params)
    c = eng.cache
    row, _ = c.layout.entries.lookup(c.prompt_hashes(follow_up))
    kept = held_tokens(eng, c.layout.entry_tables, c.layout.entry_counts, row)
    assert {k[2] for k in kept} == {"high", "low"}
    diverged = follow_up[:45] + [7] * 30  # the kept 56 tokens' first 5 blocks, then others
    pages = c.layout.entries.get(row).pages
    assert c.lookup(c.prompt_hashes(diverged)) == (40, pages)
    # sharing 2 of its 7 blocks, more than CUT_BLOCKS short of its end: computed
    assert 7 - 2 > CUT_BLOCKS and c.lookup(c.prompt_hashes(follow_up[:20] + [7] * 40)) == (0, 0)
    for prompt, max_cached, want in ((diverged, None, 40), (follow_up, 48, 48)):
        free = c.free_pages
        slot, cached = eng.open(prompt, max_cached=max_cached)
        assert cached == want
        got = held_tokens(eng, c.tables, c.layout.counts, slot)
        assert got == {k: v for k, v in kept.items() if k[3] < want}
        check_pages(eng)
        assert 0 < free - c.free_pages < pages  # a copy, less what the cut freed
        eng.close(slot, keep=False)
    # and the cut sequence goes on: the scheduler reports the reused tokens
    second = request(diverged, 6)
    run(eng, [second])
    assert second.cached_tokens == 40 and len(second.output) == 6
    check_nothing_leaked(eng)


def test_two_follow_ups_of_a_kept_sequence_generate_alike(tiny_params):
    eng = tiered(tiny_params, "xla", 2.0, 1.0)
    [p] = prompts((30,))
    first = request(p, 26)
    run(eng, [first])
    follow_up = p + first.output + prompts((9,))[0]
    # one after the other: batched together, when each is placed would depend on the
    # other's schedule (decode steps are placed once any row has `interval` of them)
    twins = [request(follow_up, 12) for _ in range(2)]
    layout = eng.cache.layout
    for twin in twins:
        sched = run(eng, [twin])
        # what the twin kept (its whole prompt) dropped: the next opens from the first's
        fed = block_hashes(follow_up + twin.output[:-1], PAGE, eng.cache.hash_seed)
        layout._drop_entry(layout.entries.row_of(fed[-1]))
    assert twins[0].output == twins[1].output
    assert eng.stats.prefix_hit_tokens == 2 * 48  # 30 + 25 tokens fed: 6 full pages
    assert sched.snapshot()["kv_tiers"]["pruned"] > 0
    check_nothing_leaked(eng)


def test_a_pool_too_short_for_a_copy_takes_the_kept_sequence_over(tiny_params):
    one_page = page_bytes(KV_FORMATS["k8v4t"], PAGE, TINY.head_dim, jnp.float32)
    heads = TINY.num_layers * TINY.num_kv_heads
    # one sequence of max_model_len (16 pages per head, and its tiers' part-filled page)
    # and a spare page: no room for two
    eng = tiered(tiny_params, "xla", kv_cache_bytes=(17 * heads + 2) * one_page)
    c = eng.cache
    [p] = prompts((90,))
    first = request(p, 20)
    run(eng, [first])
    assert c.layout.entries.pages == 13 * heads  # 109 tokens fed, every one kept high
    follow_up = p + first.output + [9] * 4
    second = request(follow_up, 8)
    run(eng, [second])
    assert eng.stats.prefix_hit_tokens == 13 * PAGE
    assert len(second.output) == 8
    assert len(c.layout.entries) == 1  # the follow-up's own pages; the first entry was taken over
    check_nothing_leaked(eng)


def test_a_saved_tiered_row_restores_bit_for_bit_through_the_store(tiny_params):
    eng, follow_up = kept_conversation(tiny_params)
    c = eng.cache
    slot, cached = eng.open(follow_up)  # a copy of the kept row
    want = row_contents(eng, c.tables, c.layout.counts, slot)
    saved = eng.save_pages(slot)
    assert saved.rows == c.pages_held(slot) and saved.num_blocks == 7
    eng.close(slot)
    assert c.make_room(c.total_pages) and not len(c.layout.entries)  # nothing kept on the device

    store = KVStore(StoreConfig(host_cache_bytes=64 << 20), model=eng.fingerprint,
                    kv_format=eng.kv_format, page_size=PAGE)
    assert store.save(saved.num_blocks, saved.arrays, saved.hashes, rows=saved.rows)
    store.flush()
    hashes = c.prompt_hashes(follow_up)
    assert store.lookup(hashes[:5], whole=True) is None  # a tiered row is used whole or not
    hit = store.lookup(hashes, whole=True)
    assert hit is not None and hit.blocks == 7
    arrays, stored_hashes, *_ = store.load(hit)
    restored = SavedPages(hit.blocks, arrays, stored_hashes)

    bad = dict(arrays, tier_tokens=np.asarray(arrays["tier_tokens"]) + 1)
    with pytest.raises(ValueError, match="tier counts|more tokens"):
        eng.open(follow_up, restore=SavedPages(7, bad, stored_hashes))
    with pytest.raises(ValueError, match="not this prompt's"):
        eng.open(prompts((70,))[0], restore=restored)
    assert c.num_free_slots == c.max_num_seqs  # a refused restore took nothing

    # a row is restored whole: a split restore's recompute share (Krul's) changes nothing
    slot, cached = eng.open(follow_up, restore=restored, recompute=0.5)
    assert cached == 56 and eng.stats.restored_tokens == 56
    got = row_contents(eng, c.tables, c.layout.counts, slot)
    for name, value in want.items():
        np.testing.assert_array_equal(got[name], value, err_msg=name)
    check_pages(eng)
    eng.close(slot)
    check_nothing_leaked(eng)
    store.close()


def test_a_conversation_restored_from_the_store_goes_on_as_one_kept_on_the_device(
        tiny_params):
    [p] = prompts((30,))
    tail = prompts((9,))[0]

    def turns(store: StoreConfig | None) -> tuple[list[int], Scheduler]:
        eng = tiered(tiny_params, "xla", 2.0, 1.0)
        sched = Scheduler(eng, store=store)
        first = request(p, 26)
        sched.add(first)
        while sched.num_unfinished:
            sched.step()
        if store is not None:
            sched.store.flush()
            assert eng.cache.make_room(eng.cache.total_pages)  # only the store has it now
        second = request(p + first.output + tail, 12)
        sched.add(second)
        while sched.num_unfinished:
            sched.step()
            check_pages(eng)
        return second.output, sched

    kept, _ = turns(None)
    restored, sched = turns(StoreConfig(host_cache_bytes=64 << 20))
    assert sched.snapshot()["prefix_hit_tokens"] == {"device": 0, "host": 48, "disk": 0}
    assert restored == kept
    sched.close()
