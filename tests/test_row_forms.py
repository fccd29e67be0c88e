"""A stored tiered row's smaller forms (`row_forms`): the tokens each way keeps, bit for bit,
in their tiers; forms only shrink; a store behind a token-tier engine (AdaptCache) keeps rows
in them, and a row restored from one is approximate: kept neither on the device nor under
its exact hashes in a lossless store."""

from __future__ import annotations

import json
import math

import jax.numpy as jnp
import numpy as np
import pytest
from test_engine_formats import TINY
from test_engine_tiers import PAGE, check_nothing_leaked, check_pages, prompts, tiered
from test_tier_entries import request, row_contents

from jkv.config import SchedulerConfig, StoreConfig
from jkv.engine.saved_pages import SavedPages
from jkv.kv.pages import KVPages
from jkv.kv.row_forms import drop_tokens
from jkv.kv.tier_entries import TIER_ARRAYS
from jkv.models.loaders import random_params
from jkv.policies import POLICIES, KVPolicy
from jkv.policies.stored_forms import convert_row, parse_row_form, row_form_ways
from jkv.sched.scheduler import Scheduler, generate_all
from jkv.store import KVStore

SINKS, RECENT = 4, PAGE  # `tiered`'s: kv_sink_tokens default, kv_recent_window = PAGE
HEADS = TINY.num_layers * TINY.num_kv_heads


@pytest.fixture(scope="module")
def tiny_params():
    return random_params(TINY, seed=3, dtype=jnp.float32)


def saved_row(params, policy: str, **kw) -> tuple:
    """An engine, a prompt extending a finished conversation and the tiered row (host
    arrays) its slot holds when it opens with the kept conversation."""
    eng = tiered(params, "xla", 2.0, 1.0, kv_policy=policy, **kw)
    [p] = prompts((45,))
    first = request(p, 30)
    sched = Scheduler(eng)
    generate_all(sched, [first])
    follow = p + first.output + [1, 2, 3]
    slot, _ = eng.open(follow)
    saved = eng.save_pages(slot)
    eng.close(slot, keep=False)
    assert eng.cache.make_room(eng.cache.total_pages)  # the kept conversation given up
    return eng, follow, saved


def tokens(arrays: dict, fmt) -> dict[tuple[int, int], tuple]:
    """Every token a row holds, by (head, position): (its tier, dense key, value, score)."""
    views = {0: KVPages.from_arrays(fmt, {k: jnp.asarray(x) for k, x in arrays.items()
                                          if k not in TIER_ARRAYS})}
    if fmt.halvable:
        views[1] = views[0].as_format(fmt.halved())
    dense = {t: tuple(np.asarray(x) for x in v.dense()) for t, v in views.items()}
    out = {}
    for r, (head, low, count) in enumerate(zip(arrays["tier_head"], arrays["tier_low"],
                                               arrays["tier_tokens"], strict=True)):
        k, v = dense[int(low)]
        for j in range(int(count)):
            key = (int(head), int(arrays["tier_pos"][r, j]))
            assert key not in out  # a position once per head
            out[key] = (int(low), k[r, j], v[r, j], float(arrays["tier_score"][r, j]))
    return out


def expected(held: dict, keep: float, way: str) -> set:
    """The (head, position) pairs a form keeps, worked out head by head: the sinks and the
    recent window, then the newest (streaming), the most mean attention (h2o) or the oldest
    (a research policy's)."""
    out = set()
    for head in {h for h, _ in held}:
        mine = [(pos, held[(head, pos)][3]) for h, pos in held if h == head]
        n = max(pos for pos, _ in mine) + 1
        protected = [pos for pos, _ in mine if pos < SINKS or pos >= n - RECENT]
        rest = [(pos, score) for pos, score in mine if pos not in protected]
        if way == "streaming":
            rest.sort(key=lambda t: -t[0])
        elif way == "oldest":
            rest.sort(key=lambda t: t[0])
        else:
            rest.sort(key=lambda t: (-t[1] / max(n - t[0], 1), t[0]))
        budget = max(math.ceil(keep * len(mine)), len(protected))
        out |= {(head, pos) for pos in protected}
        out |= {(head, pos) for pos, _ in rest[: budget - len(protected)]}
    return out


@pytest.mark.parametrize("policy,fmt", [("leankv", "auto"), ("h2o", "auto")])
@pytest.mark.parametrize("way", ["streaming", "h2o"])
def test_a_dropped_row_keeps_what_its_way_chooses_bit_for_bit_and_restores(
        tiny_params, policy, fmt, way):
    eng, follow, saved = saved_row(tiny_params, policy, kv_format=fmt)
    pool_fmt = eng.cache.pool.kv_format
    before = tokens(saved.arrays, pool_fmt)
    if policy == "leankv":  # both tiers are exercised
        assert {t[0] for t in before.values()} == {0, 1}
    keep = float(np.random.default_rng().uniform(0.3, 0.7))
    dropped = drop_tokens(saved.arrays, pool_fmt, keep, row_form_ways()[way], heads=HEADS,
                          page=PAGE, sinks=SINKS, recent=RECENT)
    after = tokens(dropped, pool_fmt)
    want = expected(before, keep, way)
    assert set(after) == want and len(want) < len(before)
    for key, (tier, k, v, score) in after.items():
        b = before[key]
        assert tier == b[0] and score == b[3]
        np.testing.assert_array_equal(k, b[1])
        np.testing.assert_array_equal(v, b[2])
    assert sum(np.asarray(x).nbytes for k, x in dropped.items() if k not in TIER_ARRAYS) < \
        sum(np.asarray(x).nbytes for k, x in saved.arrays.items() if k not in TIER_ARRAYS)

    # restored like any tiered row: the slot holds exactly the dropped row
    restored = SavedPages(saved.num_blocks, dropped, saved.hashes, exact_blocks=0,
                          form=f"{way}@0.5")
    slot, cached = eng.open(follow, restore=restored)
    assert cached == saved.num_blocks * PAGE
    c = eng.cache
    got = row_contents(eng, c.tables, c.layout.counts, slot)
    assert got["high"].sum() + got["low"].sum() == len(want)
    assert eng.connector.approximate_row(slot)
    again = eng.save_pages(slot)
    assert again.exact_blocks == 0 and again.form == f"{way}@0.5"  # marked, in its form
    assert tokens(again.arrays, pool_fmt).keys() == after.keys()
    eng.close(slot)
    assert not len(c.layout.entries)  # an approximate row is not kept for exact-hash lookups
    check_pages(eng)
    check_nothing_leaked(eng)


def test_row_forms_only_shrink_and_name_what_is_wrong(tiny_params, monkeypatch):
    """Forms only shrink; a bad name is named; and a policy registered with a `form_merit`
    (a research policy's save hook) is offered as a form of its own name."""
    eng, _, saved = saved_row(tiny_params, "h2o")
    fmt = eng.cache.pool.kv_format
    kw = dict(heads=HEADS, page=PAGE, sinks=SINKS, recent=RECENT)
    same = convert_row(saved.arrays, "h2o@0.5", fmt.name, fmt, **kw)  # into the pool: as is
    for k, x in saved.arrays.items():
        np.testing.assert_array_equal(same[k], x)
    half = convert_row(saved.arrays, fmt.name, "h2o@0.5", fmt, **kw)
    quarter = convert_row(half, "h2o@0.5", "h2o@0.25", fmt, **kw)  # half of the half
    direct = drop_tokens(half, fmt, 0.5, row_form_ways()["h2o"], **kw)
    for k, x in direct.items():
        np.testing.assert_array_equal(quarter[k], x)
    with pytest.raises(ValueError, match="only shrink"):
        convert_row(half, "h2o@0.5", "streaming@0.5", fmt, **kw)
    for bad in ("k4v2t", "h2o@1.5", "h2o@x", "prune@0.5"):
        with pytest.raises(ValueError, match="neither"):
            convert_row(saved.arrays, fmt.name, bad, fmt, **kw)
    assert parse_row_form("streaming@0.25") == ("streaming", 0.25)
    assert parse_row_form("h2o@0") is None and parse_row_form("h2o") is None
    assert parse_row_form("oldest@0.5") is None  # no policy offers it
    monkeypatch.setitem(POLICIES, "oldest", KVPolicy(
        name="oldest", summary="a research policy", form_merit=lambda pos, score, n: -pos))
    oldest = convert_row(saved.arrays, fmt.name, "oldest@0.5", fmt, **kw)
    assert set(tokens(oldest, fmt)) == expected(tokens(saved.arrays, fmt), 0.5, "oldest")


def row_profile(tmp_path) -> str:
    path = tmp_path / "rows.json"
    path.write_text(json.dumps({
        "model": "tiny", "metric": "top1_agreement", "kinds": ["chat"],
        "methods": {"h2o@0.5": [{"rate": 0.6, "quality": {"chat": 0.95}, "family": "r-h"}],
                    "streaming@0.25": [{"rate": 0.35, "quality": {"chat": 0.7},
                                        "family": "r-s"}],
                    "k4v2t": [{"rate": 0.22, "quality": {"chat": 0.94}}]}}))
    return str(path)


def test_an_adaptcache_store_behind_token_tiers_keeps_rows_in_smaller_forms(tiny_params,
                                                                           tmp_path):
    """Four conversations' rows in a host tier that holds about two whole: AdaptCache keeps
    all four, some with tokens dropped (never in a KV format: a row's forms are row
    forms); their next turns restore them approximate, so those rows are not kept on the
    device, and are saved back to the store marked approximate, in the form they came
    from."""
    rng = np.random.default_rng()
    eng = tiered(tiny_params, "xla", 2.0, 1.0, kv_cache_bytes=16 << 20)
    firsts = [rng.integers(0, TINY.vocab_size, int(n)).tolist()
              for n in rng.integers(40, 48, 4)]
    probe = Scheduler(tiered(tiny_params, "xla", 2.0, 1.0), store=StoreConfig(
        host_cache_bytes=1 << 24))
    generate_all(probe, [request(firsts[0], 10)])
    probe.store.flush()
    whole = probe.store.snapshot()["bytes"]["host"]  # one row's bytes, whole
    probe.close()
    budget = int(2.5 * whole)
    sched = Scheduler(eng, SchedulerConfig(restore_planning=False), store=StoreConfig(
        host_cache_bytes=budget, eviction_policy="adaptcache", adapt_alpha=0.0,
        adapt_profile=row_profile(tmp_path)))
    assert sched.store.placement.methods == ("h2o@0.5", "streaming@0.25")
    turn1 = [request(p, 10) for p in firsts]
    generate_all(sched, turn1)
    sched.store.flush()
    snap = sched.store.snapshot()
    assert snap["entries"]["host"] == 4 and snap["bytes"]["host"] <= budget
    forms = {e.form for e in sched.store.index.entries.values()}
    assert forms - {None} and forms <= {None, "h2o@0.5", "streaming@0.25"}
    assert eng.cache.make_room(eng.cache.total_pages)  # only the store has them now
    turn2 = [request(r.prompt + r.output + [1, 2, 3], 4) for r in turn1]
    saves, save = [], sched.store.save

    def recorded(*args, **kw):
        saves.append((kw.get("exact_blocks"), kw.get("form")))
        return save(*args, **kw)

    sched.store.save = recorded
    generate_all(sched, turn2)
    assert all(r.finish_reason == "length" for r in turn2)
    assert sched.store.snapshot()["converted_loads"] >= 1
    assert sched.snapshot()["prefix_hit_tokens"]["host"] > 0
    sched.store.flush()
    # the rows restored from a smaller form went back marked approximate, in that form (so
    # they only shrink further), and were not kept here; the others were
    converted = sched.store.snapshot()["converted_loads"]
    assert len(eng.cache.layout.entries) == 4 - converted and len(saves) == 4
    approx = [form for exact, form in saves if exact is not None]
    assert len(approx) == converted
    assert all(form in ("h2o@0.5", "streaming@0.25") for form in approx)
    for e in sched.store.index.entries.values():  # what the store kept of them
        assert e.approx_from in (None, 0) and (e.approx_from is None or e.form is not None)
    check_pages(eng)
    sched.close()


def test_a_lossless_store_never_gets_a_row_restored_from_a_smaller_form(tiny_params, caplog):
    eng, follow, saved = saved_row(tiny_params, "h2o")
    fmt = eng.cache.pool.kv_format
    small = drop_tokens(saved.arrays, fmt, 0.5, row_form_ways()["h2o"], heads=HEADS,
                        page=PAGE, sinks=SINKS, recent=RECENT)
    store = KVStore(StoreConfig(host_cache_bytes=1 << 24), model=eng.fingerprint,
                    kv_format=eng.kv_format, page_size=PAGE)
    sched = Scheduler(eng, store=store)
    slot, _ = eng.open(follow, restore=SavedPages(saved.num_blocks, small, saved.hashes,
                                                  exact_blocks=0))
    with pytest.raises(ValueError, match="exact_blocks"):
        store.save(saved.num_blocks, eng.gather(slot).fetch().arrays, saved.hashes,
                   rows=len(small["tier_head"]), exact_blocks=0)
    r = request(follow, 1)
    sched.side.save(r, slot)  # the scheduler's save skips it (no failed save logged)
    store.flush()
    assert store.snapshot()["entries"]["host"] == 0
    assert not [rec for rec in caplog.records if "could not queue" in rec.getMessage()]
    eng.close(slot)
    sched.close()


def test_a_token_tier_store_takes_the_shipped_rows_profile_and_no_kv_formats(tmp_path):
    from jkv.store.adapt_profile import Profile

    cfg = StoreConfig(host_cache_bytes=1 << 20, eviction_policy="adaptcache")
    kw = dict(model="m", kv_format="k8v4t", page_size=PAGE, convert=lambda a, s, d: a)
    store = KVStore(cfg, whole_rows=True, **kw)  # a leankv pool's format is no obstacle
    shipped = Profile.default(whole_rows=True)
    assert store.placement.methods == tuple(shipped.methods)
    assert all(parse_row_form(m) for m in shipped.methods) and shipped.model == "smollm2-135m"
    store.close()
    with pytest.raises(ValueError, match="model dtype"):  # block pages: formats need it
        KVStore(cfg, **kw)
    formats = tmp_path / "formats.json"
    formats.write_text(json.dumps({
        "model": "m", "metric": "top1_agreement", "kinds": ["chat"],
        "methods": {"k4v2t": [{"rate": 0.22, "quality": {"chat": 0.9}}]}}))
    with pytest.raises(ValueError, match="no row form"):
        KVStore(StoreConfig(host_cache_bytes=1 << 20, eviction_policy="adaptcache",
                            adapt_profile=str(formats)), whole_rows=True, **kw)
    rows = tmp_path / "rows_only.json"
    rows.write_text(json.dumps({
        "model": "m", "metric": "top1_agreement", "kinds": ["chat"],
        "methods": {"h2o@0.5": [{"rate": 0.6, "quality": {"chat": 0.9}}]}}))
    with pytest.raises(ValueError, match="no KV format"):  # block pages: no row forms
        KVStore(StoreConfig(host_cache_bytes=1 << 20, eviction_policy="adaptcache",
                            adapt_profile=str(rows)), **dict(kw, kv_format="auto"))


def test_a_row_recompressed_in_place_restores_to_the_tokens_its_form_keeps(tiny_params):
    eng, follow, saved = saved_row(tiny_params, "leankv")
    fmt = eng.cache.pool.kv_format
    kw = dict(heads=HEADS, page=PAGE, sinks=SINKS, recent=RECENT)
    store = KVStore(StoreConfig(host_cache_bytes=1 << 24, store_kv_format="k4v2t"),
                    model=eng.fingerprint, kv_format=eng.kv_format, page_size=PAGE,
                    convert=eng.convert_stored, whole_rows=True)
    assert store.save(saved.num_blocks, saved.arrays, saved.hashes, rows=saved.rows)
    store.flush()  # (a row is written whole, in the pool's format, whatever store_kv_format)
    key = saved.hashes[-1].hex()
    hashes = eng.cache.prompt_hashes(follow)
    assert store.load(store.lookup(hashes, whole=True)).exact_blocks is None
    before = store.snapshot()["bytes"]["host"]
    assert store.recompress(key, "h2o@0.5")
    assert not store.recompress(key, "streaming@0.5")  # no smaller than the held form
    assert not store.recompress(key, fmt.name)  # never expanded back
    assert store.snapshot()["bytes"]["host"] < before
    got = store.load(store.lookup(hashes, whole=True))
    assert got.exact_blocks == 0  # read back approximate
    want = drop_tokens(saved.arrays, fmt, 0.5, row_form_ways()["h2o"], **kw)
    for k, x in want.items():
        np.testing.assert_array_equal(got.arrays[k], x, err_msg=k)
    slot, cached = eng.open(follow, restore=SavedPages(saved.num_blocks, got.arrays,
                                                       got.hashes, got.exact_blocks))
    assert cached == saved.num_blocks * PAGE and eng.connector.approximate_row(slot)
    assert tokens(eng.save_pages(slot).arrays, fmt).keys() == tokens(want, fmt).keys()
    eng.close(slot)
    store.close()


def test_a_row_form_is_made_only_from_one_keeping_more_of_the_tokens():
    """h2o@0.5 cannot become streaming@0.5 (both keep half the tokens: the newest half of
    an h2o half is all of it), however much smaller the profile says that form is: the
    policy takes a quarter for the h2o half instead."""
    from jkv.policies.adaptcache import AdaptPlacement, Tier
    from jkv.store.adapt_profile import Profile

    profile = Profile.from_json({
        "model": "m", "metric": "top1_agreement", "kinds": ["chat"],
        "methods": {"h2o@0.5": [{"rate": 0.6, "quality": {"chat": 0.95}, "family": "h"}],
                    "streaming@0.5": [{"rate": 0.3, "quality": {"chat": 0.95}, "family": "s"}],
                    "streaming@0.25": [{"rate": 0.25, "quality": {"chat": 0.5},
                                        "family": "s"}]}})
    forms = profile.forms(1000)
    assert [f.share for f in forms] == [None, 0.5, 0.5, 0.25]
    assert forms[0].reachable(forms[2]) and not forms[1].reachable(forms[2])
    assert forms[1].reachable(forms[3]) and not forms[3].reachable(forms[1])
    # room for a held h2o@0.5 (600) and a new row (1000, kept as it is put) if the first
    # shrinks by 300 (streaming@0.5, were it reachable) or 350 (streaming@0.25)
    p = AdaptPlacement([Tier("host", 1300, 1e9)], alpha=100.0, half_life=600.0)
    assert p.adopt("a", forms, "host", 1000.0, 0.0, held=1)
    p.put("b", forms, 1000.0, 0.0)
    assert p.bytes_used("host") == 1250
    assert p.where("a")[1].method == "streaming@0.25" and p.where("b")[1].method == "full"
