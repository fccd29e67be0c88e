"""AdaptCache's placement (`jkv.policies.adaptcache`): forms and tiers by marginal utility,
no store; the quality profile it reads (`jkv.store.adapt_profile`)."""

from __future__ import annotations

import copy
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jkv.policies.adaptcache import AdaptPlacement, Form, Tier
from jkv.store.adapt_profile import Profile

MB = 1 << 20


def forms(size: int, qualities=(1.0, 0.97, 0.9, 0.6)) -> list[Form]:
    """A full form and compressed ones at 1/2, 1/4, 1/8 of its bytes."""
    return [Form("full" if i == 0 else f"m{i}", 1 / 2**i, size // 2**i, q)
            for i, q in enumerate(qualities)]


def tiers(host: int, disk: int) -> list[Tier]:
    return [Tier("host", host, 10e9), Tier("disk", disk, 1e9)]


def test_new_entries_go_to_the_fastest_tier_whole_while_it_fits():
    p = AdaptPlacement(tiers(100 * MB, 1000 * MB), alpha=1.0)
    moves = p.put("a", forms(40 * MB), recompute_s=1.0, now=0.0)
    assert [(m.key, m.src, m.dst, m.new.method) for m in moves] == [("a", None, "host", "full")]
    assert p.where("a") == ("host", forms(40 * MB)[0])
    assert p.bytes_used("host") == 40 * MB


def test_quality_heavy_alpha_moves_down_a_tier_and_delay_heavy_alpha_compresses():
    # the host tier holds one full entry; the older one has to give up bytes
    for alpha in (100.0, 0.0):
        p = AdaptPlacement(tiers(64 * MB, 1000 * MB), alpha=alpha)
        p.put("a", forms(40 * MB), recompute_s=1.0, now=0.0)
        p.access("a", now=1.0)  # a has been read: the newcomer is the colder one
        p.put("b", forms(40 * MB), recompute_s=1.0, now=2.0)
        got = sorted((p.where(k)[0], p.where(k)[1].method) for k in "ab")
        if alpha:  # quality first: whole, one of them on the slower disk
            assert got == [("disk", "full"), ("host", "full")]
        else:  # load time only: a smaller form (any: each loads in proportion to its bytes)
            assert [t for t, _ in got] == ["host", "host"]
            assert sorted(m == "full" for _, m in got) == [False, True]
        assert p.bytes_used("host") <= 64 * MB


@pytest.mark.parametrize("slow_decode", [False, True])
def test_a_form_slow_to_decode_is_worth_less_than_its_bytes_say(slow_decode):
    """The load term counts converting a compressed form back: where that is slow, moving
    the whole entry down a tier beats compressing it in the fast one."""
    slow = {f"m{i}": 1e8 for i in (1, 2, 3)}  # 20 MB of m1 in 0.2 s, past 40 MB from disk
    for how in ("profile", "measured"):
        p = AdaptPlacement(tiers(64 * MB, 1000 * MB), alpha=0.0,
                           decode_bps=slow if slow_decode and how == "profile" else None)
        if slow_decode and how == "measured":
            for method, bps in slow.items():
                p.set_decode_rate(method, bps)
        p.put("a", forms(40 * MB), recompute_s=1.0, now=0.0)
        p.access("a", now=1.0)
        p.put("b", forms(40 * MB), recompute_s=1.0, now=2.0)
        got = sorted((p.where(k)[0], p.where(k)[1].method) for k in "ab")
        if slow_decode:
            assert got == [("disk", "full"), ("host", "full")], how
        else:
            assert [t for t, _ in got] == ["host", "host"]


def test_the_hot_entry_keeps_its_place_and_the_cold_one_gives_way():
    p = AdaptPlacement(tiers(64 * MB, 1000 * MB), alpha=100.0)
    p.put("hot", forms(40 * MB), recompute_s=1.0, now=0.0)
    for t in range(5):
        p.access("hot", now=float(t))
    p.put("cold", forms(40 * MB), recompute_s=1.0, now=6.0)
    assert p.where("hot") == ("host", forms(40 * MB)[0])
    assert p.where("cold")[0] == "disk"


@pytest.mark.parametrize("half_life", [600.0, None])
def test_a_learned_half_life_forgets_a_conversation_quiet_for_a_few_of_its_pauses(half_life):
    """Turns 10 s apart: the learned half-life is 20 s, so an entry used five times but quiet
    for 160 s gives way to a new one; with a fixed 600 s its old uses still outweigh it."""
    p = AdaptPlacement(tiers(64 * MB, 1000 * MB), alpha=100.0, half_life=half_life)
    assert p.half_life == 600.0
    p.put("old", forms(40 * MB), recompute_s=1.0, now=0.0)
    for t in (10.0, 20.0, 30.0, 40.0):
        p.access("old", now=t)
    assert p.half_life == (600.0 if half_life else 20.0)
    p.access("old", now=40.5, learn=False)  # read as what another entry continues
    assert p.half_life == (600.0 if half_life else 20.0)
    p.put("new", forms(40 * MB), recompute_s=1.0, now=200.0)
    assert p.where("old")[0] == ("host" if half_life else "disk")
    assert p.where("new")[0] == ("disk" if half_life else "host")
    if half_life is None:  # hits right after their saves: floored, not every use erased
        for t in (201.0, 201.0, 201.0, 201.0, 201.0, 201.0, 201.0):
            p.put("x", forms(MB), recompute_s=1.0, now=t)
            p.access("x", now=t)
        assert p.half_life == 1.0


@pytest.mark.parametrize("queued, leaves", [({"a", "c"}, "b"), ({"b", "c"}, "a")])
def test_an_entry_the_queue_will_read_is_kept_over_an_equal_one(queued, leaves):
    p = AdaptPlacement(tiers(100 * MB, 1000 * MB), alpha=100.0)
    p.hint(queued)
    for key in "abc":
        p.put(key, forms(40 * MB), recompute_s=1.0, now=0.0)
    assert {k for k in "abc" if p.where(k)[0] == "disk"} == {leaves}


def test_forms_below_the_quality_floor_are_never_chosen():
    p = AdaptPlacement(tiers(30 * MB, 0), alpha=0.0, quality_floor=0.95)
    p.put("a", forms(40 * MB), recompute_s=100.0, now=0.0)  # recompute is dear: compress
    tier, form = p.where("a")
    assert tier == "host" and form.method == "m1"  # 20 MB; m2 (10 MB) is below the floor
    p = AdaptPlacement(tiers(15 * MB, 0), alpha=0.0, quality_floor=0.95)
    moves = p.put("a", forms(40 * MB), recompute_s=100.0, now=0.0)
    assert p.where("a") is None and moves[-1].dst is None  # out, not to m2


def test_an_entry_cheaper_to_recompute_than_to_load_goes_out():
    p = AdaptPlacement([Tier("host", 10 * MB, 1e9), Tier("disk", 1000 * MB, 1e6)], alpha=0.0)
    whole = [Form("full", 1.0, 8 * MB, 1.0)]
    p.put("a", whole, recompute_s=0.5, now=0.0)
    moves = p.put("b", whole, recompute_s=0.5, now=0.0)
    # disk would take 8 s to read what recomputes in 0.5 s: the one leaving host is dropped
    assert moves[-1].dst is None and p.bytes_used("disk") == 0
    # with a fast disk it is moved there instead
    p = AdaptPlacement([Tier("host", 10 * MB, 1e9), Tier("disk", 1000 * MB, 1e9)], alpha=0.0)
    p.put("a", whole, recompute_s=0.5, now=0.0)
    assert p.put("b", whole, recompute_s=0.5, now=0.0)[-1].dst == "disk"


def test_kept_entries_move_only_when_nothing_else_can_make_room():
    p = AdaptPlacement(tiers(64 * MB, 1000 * MB), alpha=100.0)
    p.put("a", forms(40 * MB), recompute_s=1.0, now=0.0)
    for t in range(5):
        p.access("a", now=float(t))
    p.put("b", forms(40 * MB), recompute_s=1.0, now=6.0, keep={"b"})
    assert p.where("b") == ("host", forms(40 * MB)[0])  # "a" gave way though hotter
    p.put("c", forms(80 * MB), recompute_s=1.0, now=7.0, keep={"c"})
    assert p.bytes_used("host") <= 64 * MB  # "c" could not stay whole after all


@pytest.mark.parametrize("kw, field", [
    (dict(tiers=[]), "tiers"), (dict(alpha=-1.0), "alpha"),
    (dict(quality_floor=1.5), "quality_floor"), (dict(half_life=0.0), "half_life"),
    (dict(tiers=[Tier("host", -1, 1e9)]), "capacity"),
    (dict(tiers=[Tier("host", 1, 0.0)]), "read_bps"),
    (dict(tiers=[Tier("x", 1, 1.0), Tier("x", 1, 1.0)]), "distinct"),
    (dict(decode_bps={"m1": 0.0}), "decode_bps")])
def test_bad_settings_name_the_field(kw, field):
    args = {"tiers": tiers(1, 1), "alpha": 1.0, **kw}
    with pytest.raises(ValueError, match=field):
        AdaptPlacement(**args)


def test_bad_puts_name_the_field():
    p = AdaptPlacement(tiers(MB, MB), alpha=1.0)
    with pytest.raises(ValueError, match="forms"):
        p.put("a", [], recompute_s=1.0, now=0.0)
    with pytest.raises(ValueError, match="recompute_s"):
        p.put("a", forms(MB), recompute_s=-1.0, now=0.0)
    with pytest.raises(ValueError, match="quality"):
        p.put("a", [Form("full", 1.0, MB, 1.5)], recompute_s=1.0, now=0.0)


_op = st.one_of(
    st.tuples(st.just("put"), st.integers(0, 7), st.integers(0, 60),
              st.lists(st.floats(0.0, 1.0), min_size=1, max_size=4), st.floats(0.0, 5.0),
              st.booleans()),
    st.tuples(st.just("access"), st.integers(0, 7)),
    st.tuples(st.just("drop"), st.integers(0, 7)),
    st.tuples(st.just("hint"), st.sets(st.integers(0, 7), max_size=3)))


@settings(max_examples=150, deadline=None)
@given(host=st.integers(0, 80), disk=st.integers(0, 200), alpha=st.floats(0.0, 50.0),
       floor=st.floats(0.0, 1.0), ops=st.lists(_op, max_size=40))
def test_replaying_the_moves_never_exceeds_a_tier_and_forms_only_shrink(host, disk, alpha,
                                                                         floor, ops):
    p = AdaptPlacement(tiers(host * MB, disk * MB), alpha=alpha, quality_floor=floor,
                       half_life=10.0)
    held: dict[int, tuple[str, Form]] = {}  # the state the moves build
    order = {"host": 0, "disk": 1}
    for now, op in enumerate(ops):
        if op[0] == "put":
            _, key, mb, qualities, recompute_s, keep = op
            fs = forms(mb * MB, (1.0, *sorted(qualities, reverse=True))[:4])
            moves = p.put(key, fs, recompute_s, float(now), keep={key} if keep else ())
            first, *rest = moves
            assert first.key == key and first.dst == "host" and first.new == fs[0]
            assert (first.src, first.old) == ((held[key][0], held[key][1]) if key in held
                                              else (None, None))
            held[key] = ("host", fs[0])
            for m in rest:
                assert (m.src, m.old) == held[m.key]  # each move starts where the last left
                if m.dst is None:
                    del held[m.key]
                    continue
                assert m.new.size <= m.old.size  # never expanded back
                assert order[m.dst] >= order[m.src]  # never moved up
                assert m.new == m.old or m.new.quality >= floor
                held[m.key] = (m.dst, m.new)
            for tier, cap in (("host", host * MB), ("disk", disk * MB)):
                assert sum(f.size for t, f in held.values() if t == tier) <= cap
        elif op[0] == "access":
            assert p.access(op[1], float(now)) == held.get(op[1])
        elif op[0] == "drop":
            p.drop(op[1])
            held.pop(op[1], None)
        else:
            p.hint(op[1])
        assert {k: p.where(k) for k in range(8) if p.where(k)} == held
        for tier in ("host", "disk"):
            assert p.bytes_used(tier) == sum(f.size for t, f in held.values() if t == tier)


def test_another_method_on_a_compressed_entry_counts_both_qualities():
    full = Form("full", 1.0, 40 * MB, 1.0)
    quant = [Form("q", 0.5, 20 * MB, 0.99), Form("q", 0.25, 10 * MB, 0.97)]
    drop = [Form("drop", 0.375, 15 * MB, 0.985), Form("drop", 0.125, 5 * MB, 0.5)]
    p = AdaptPlacement(tiers(25 * MB, 0), alpha=10.0)
    p.put("a", [full, *quant, *drop], recompute_s=100.0, now=0.0)
    assert p.where("a")[1] == quant[0]  # the least quality lost per byte freed
    # a new 10 MB entry that stays: "a" frees 5 MB more. "drop" on top of "q" keeps
    # 0.99 * 0.985 (losing 0.015 for 5 MB), "q" at 10 MB keeps 0.97 (0.02 for 10 MB)
    p.put("b", [Form("full", 1.0, 10 * MB, 1.0)], recompute_s=100.0, now=1.0, keep={"b"})
    assert p.where("a")[1] == quant[1] and p.where("b")[0] == "host"
    # and it is counted so: another 8 MB entry makes "a" take "drop" at 5 MB on top of "q"
    p.put("c", [Form("full", 1.0, 8 * MB, 1.0)], recompute_s=100.0, now=2.0, keep={"c"})
    assert p.where("a")[1] == Form("drop", 0.125, 5 * MB, pytest.approx(0.97 * 0.5))


PROFILE = {"model": "m", "metric": "top1_agreement", "kinds": ["prose", "code"],
           "methods": {"k4": [{"rate": 0.25, "quality": {"prose": 0.9, "code": 0.8},
                               "family": "quantized"},
                              {"rate": 0.5, "quality": {"prose": 0.99, "code": 0.97},
                               "family": "quantized"}],
                       "window": [{"rate": 0.3, "quality": {"prose": 0.7, "code": 0.6}}]}}


def test_a_profile_gives_each_kind_its_forms_largest_of_a_method_first(tmp_path):
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(PROFILE))
    profile = Profile.load(path)
    assert Profile.from_json(profile.to_json()) == profile
    fs = profile.forms(1000, "code")
    assert fs == [Form("full", 1.0, 1000, 1.0), Form("k4", 0.5, 500, 0.97, "quantized"),
                  Form("k4", 0.25, 250, 0.8, "quantized"), Form("window", 0.3, 300, 0.6)]
    assert [f.quality for f in profile.forms(1000, methods=("window",))] == [1.0,
                                                                           pytest.approx(0.65)]
    assert profile.forms(1000, full_bytes=2000)[0].size == 2000
    timed = Profile.from_json({**PROFILE, "decode_bps": {"cpu": {"k4": 3e8}}})
    assert timed.decode_bps == {"cpu": {"k4": 3e8}} and profile.decode_bps == {}
    assert Profile.from_json(timed.to_json()) == timed


def test_a_store_assumes_its_backends_profiled_decode_rates_until_it_measures_its_own():
    from jkv.store.adapt_store import AdaptStorePlacement

    profile = Profile.from_json({"model": "m", "metric": "top1_agreement", "kinds": ["chat"],
                                 "methods": {"k4v2t": [{"rate": 0.2, "quality": {"chat": 0.9}}],
                                             "window": [{"rate": 0.3, "quality": {"chat": 0.8}}]},
                                 "decode_bps": {"cpu": {"k4v2t": 3e8, "window": 1e9},
                                                "gpu": {"k4v2t": 5e10}}})
    for backend, assumed in (("cpu", {"k4v2t": 3e8}), ("gpu", {"k4v2t": 5e10}), ("tpu", {})):
        p = AdaptStorePlacement(profile, 1.0, 0.0, MB, MB, backend=backend)
        assert p.adapt.decode_bps == assumed  # (only forms the store can hold)
        p.set_decode_rates({"k4v2t": 2e8})
        assert p.adapt.decode_bps == {"k4v2t": 2e8}


@pytest.mark.parametrize("change, field", [
    (lambda d: d.pop("kinds"), "kinds"),
    (lambda d: d["methods"]["k4"][0].update(rate=1.5), r"k4\[0\].rate"),
    (lambda d: d["methods"]["k4"][1]["quality"].pop("code"), r"k4\[1\].quality"),
    (lambda d: d["methods"]["window"][0]["quality"].update(prose=2.0), "quality values"),
    (lambda d: d["methods"].update(full=[]), "full"),
    (lambda d: d.update(decode_bps={"cpu": {"k4": -1}}), r"decode_bps.cpu.k4"),
    (lambda d: d.update(decode_bps={"cpu": {"k8": 1e9}}), r"decode_bps.cpu.k8: not a method"),
    (lambda d: d.update(decode_bps=[1e9]), "decode_bps must map"),
    (lambda d: d["methods"].update(k2=[]), "methods.k2 must be a non-empty list"),
])
def test_a_bad_profile_names_the_field(change, field):
    data = copy.deepcopy(PROFILE)
    change(data)
    with pytest.raises(ValueError, match=field):
        Profile.from_json(data)


def test_a_missing_or_garbled_profile_file_is_a_value_error(tmp_path):
    with pytest.raises(ValueError, match="profile"):
        Profile.load(tmp_path / "absent.json")
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ValueError, match="profile"):
        Profile.load(tmp_path / "bad.json")
    with pytest.raises(ValueError, match="kind"):
        Profile.from_json(PROFILE).forms(10, "poetry")


def test_the_shipped_profile_is_the_embedded_models_and_a_store_uses_it_by_default():
    import numpy as np

    from jkv.config import StoreConfig
    from jkv.kv.format import KV_FORMATS
    from jkv.store.store import KVStore

    profile = Profile.default()
    assert profile.model == "smollm2-135m" and profile.metric == "top1_agreement"
    storable = {m for m in profile.methods if m in KV_FORMATS}
    assert {"k8v4t", "k4v2t"} <= storable
    store = KVStore(StoreConfig(host_cache_bytes=1 << 20, eviction_policy="adaptcache"),
                    model="m", kv_format="auto", page_size=8,
                    convert=lambda arrays, src, dst: {f: np.asarray(x) for f, x in arrays.items()})
    assert store.placement.profile == profile and set(store.placement.methods) == storable
    assert store.placement.adapt.learned and store.snapshot()["adapt_half_life_s"] == 600.0
    store.close()


def test_a_reopened_stores_entries_keep_the_forms_they_can_still_take_and_get_priced():
    """Adopted entries (a store reopened) can still shrink to the profile's smaller forms
    (not only move down or out), and what a miss of them costs is set once the engine has
    measured its prefill (until then recomputing them looks free)."""
    from jkv.store.adapt_store import FOREIGN, AdaptStorePlacement

    profile = Profile.from_json({"model": "m", "metric": "top1_agreement", "kinds": ["chat"],
                                 "methods": {"k8v4t": [{"rate": 0.44, "quality": {"chat": 0.99}}],
                                             "k4v2t": [{"rate": 0.22, "quality": {"chat": 0.9}}]}})
    p = AdaptStorePlacement(profile, 1.0, 0.0, 0, 10 * MB, bf16_ratio=2.0)
    assert p.adopt("full", 1000, "disk", tokens=64)
    assert p.adopt("k8", 880, "disk", tokens=64, form="k8v4t")
    assert p.adopt("unrated", 500, "disk", tokens=64, form="k2v2")
    assert p.adopt("foreign", 500, "disk", form=FOREIGN)
    held = {k: [(f.method, f.size) for f in p.adapt._entries[k].forms]
            for k in ("full", "k8", "unrated", "foreign")}
    # a compressed entry keeps the full form before it (never chosen: forms only shrink),
    # so another method on top of it would count both qualities
    assert held == {"full": [("full", 1000), ("k8v4t", 880), ("k4v2t", 440)],
                    "k8": [("full", 2000), ("k8v4t", 880), ("k4v2t", 440)],
                    "unrated": [("stored", 500)], "foreign": [("stored", 500)]}
    assert [p.adapt.where(k)[1].method for k in held] == ["full", "k8v4t", "stored", "stored"]
    assert p.bytes_used("disk") == 1000 + 880 + 500 + 500
    del held["foreign"]
    assert {p.adapt._entries[k].recompute_s for k in held} == {0.0}
    p.set_recompute_rate(0.01)
    assert [p.adapt._entries[k].recompute_s for k in held] == [0.64] * 3
    assert p.adopt("late", 300, "disk", tokens=32)  # priced as it comes
    assert p.adapt._entries["late"].recompute_s == pytest.approx(0.32)


def test_adopted_spilled_and_resized_entries_keep_every_tier_within_budget():
    p = AdaptPlacement(tiers(64 * MB, 100 * MB), alpha=1.0)
    stored = Form("stored", 1.0, 40 * MB, 1.0)
    assert p.adopt("a", [stored], "host", recompute_s=1.0, now=0.0)
    assert not p.adopt("b", [stored], "host", recompute_s=1.0, now=0.0)  # no room
    assert not p.adopt("a", [stored], "disk", recompute_s=1.0, now=0.0)  # held already
    m = p.spill("a")
    assert (m.src, m.dst) == ("host", "disk") and p.where("a") == ("disk", stored)
    assert p.spill("a") is None  # no tier below
    p.put("c", forms(40 * MB), recompute_s=1.0, now=1.0)
    assert p.resize("c", 30 * MB, now=2.0) == []  # smaller than estimated: nothing moves
    moves = p.resize("c", 70 * MB, now=2.0)  # larger: the tiers fit again
    assert moves and p.bytes_used("host") <= 64 * MB and p.bytes_used("disk") <= 100 * MB
    p.set_read_rate("disk", 1e6)  # a slow disk: what leaves host now goes out instead
    disk = p.bytes_used("disk")
    moves = p.put("d", [Form("full", 1.0, 60 * MB, 1.0)], recompute_s=0.5, now=3.0)
    assert p.bytes_used("host") <= 64 * MB and p.bytes_used("disk") == disk
    assert all(m.dst != "disk" for m in moves)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(100, 4000), min_size=5, max_size=60),
       st.sampled_from([0.01, 1.0, 100.0]), st.booleans())
def test_the_store_can_carry_out_its_moves_one_by_one_within_every_tier(sizes, alpha, slow):
    """The store applies a put's moves in order, each a tier's put or delete: no step may
    need room that a later step makes (the greedy fits the fastest tier first, so its own
    list moves an entry down before the evictions below that make the room)."""
    from jkv.store.adapt_store import AdaptStorePlacement

    caps = {"host": 6000, "disk": 12000}
    p = AdaptStorePlacement(Profile.default(), alpha, 0.0, caps["host"], caps["disk"])
    p.recompute_token_s = 1.0 if slow else 1e-6
    held: dict[int, tuple[str, int]] = {}  # what the store's tiers hold: key -> (tier, bytes)
    for key, size in enumerate(sizes):
        for m in p.put(key, size, tokens=size // 10):
            if m.dst is None:
                held.pop(m.session, None)
                continue
            # an entry's bytes change only when it is (re)written: new, or recompressed
            nbytes = held[m.session][1] if m.src is not None and m.form is None else \
                p.size(m.session)
            held[m.session] = (m.dst, nbytes)
            for tier, cap in caps.items():
                assert sum(b for t, b in held.values() if t == tier) <= cap, (m, tier)
        assert held == {k: (p.where(k), p.size(k)) for k in held}
        assert set(held) == set(p.sessions("host")) | set(p.sessions("disk"))
