"""Shared-layer KV in the store (`kv_sharing="krul"`): the stored form's round trip with rotary
keys at any offset, the Krul policy's choice and refusal, the store's handling of both, the
settings it refuses, and the acceptance targets on a model whose layers share a KV subspace."""

from __future__ import annotations

import sys
from functools import partial
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

from jkv.config import CacheConfig, EngineConfig, ModelConfig, StoreConfig
from jkv.engine.engine import Engine
from jkv.kv import shared_form as sf
from jkv.kv.format import KV_FORMATS
from jkv.kv.pages import KVPages
from jkv.models.loaders import random_params
from jkv.models.rope import apply_rope, inv_frequencies
from jkv.policies import krul
from jkv.store.store import KVStore

L, T, H, D, PAGE = 6, 256, 2, 16, 16
ROTATE = partial(apply_rope, inv_freq=jnp.asarray(inv_frequencies(D, 10000.0)))


def as_pages(x: np.ndarray) -> np.ndarray:
    """[L, T, H, D] as pages [T // PAGE, L, H, PAGE, D]."""
    return np.moveaxis(x.reshape(L, T // PAGE, PAGE, H, D), (1, 2), (0, 3)).astype(np.float32)


def planted_entry(rng, offset: int, groups=(3, 3), rank=4) -> dict[str, np.ndarray]:
    """Pages whose layers share a rank-`rank` token subspace per group (pre-RoPE keys and
    values), keys rotated to positions offset + t."""
    k, v = [], []
    for size in groups:
        c = rng.standard_normal((T, rank))
        for _ in range(size):
            k.append((c @ rng.standard_normal((rank, H * D))).reshape(T, H, D) + 0.5)
            v.append((c @ rng.standard_normal((rank, H * D))).reshape(T, H, D))
    pos = jnp.broadcast_to(offset + jnp.arange(T), (L, T))
    return {"k": as_pages(np.asarray(ROTATE(jnp.asarray(np.stack(k)), pos))),
            "v": as_pages(np.stack(v))}


def test_form_names():
    assert sf.parse_form(sf.form_name(0.3)) == 0.3 == sf.parse_form("krul@0.3")
    for name in ("krul", "krul@0", "krul@1.5", "krul@x", "k8v4", "h2o@0.3", "krul@nan"):
        assert sf.parse_form(name) is None


@pytest.mark.parametrize("offset", [0, 1000])
def test_a_shared_subspace_round_trips_at_any_offset_in_far_fewer_bytes(offset):
    arrays = planted_entry(np.random.default_rng(), offset)
    sides = sf.dense_sides(arrays, KV_FORMATS["auto"], ROTATE)
    plan, err, spectra = krul.choose(sides, 0.2)
    assert plan.groups == {"k": [(0, 3), (3, 3)], "v": [(0, 3), (3, 3)]}
    assert plan.ranks == {"k": [4, 4], "v": [4, 4]} and err < 1e-3
    stored = sf.encode(sides, plan, H, spectra)
    assert sf.shared_groups(stored) == 4
    assert sum(x.nbytes for x in stored.values()) * 10 < sum(x.nbytes for x in arrays.values())
    back = sf.decode(stored, KV_FORMATS["auto"], jnp.float32, ROTATE, PAGE)
    for side in ("k", "v"):
        scale = np.abs(arrays[side]).max()
        assert np.abs(back[side] - arrays[side]).max() < 0.01 * scale
        # the sinks are whole (float16)
        assert np.allclose(back[side][0, :, :, :krul.SINKS], arrays[side][0, :, :, :krul.SINKS],
                           rtol=1e-3, atol=1e-3 * scale)


def test_it_decodes_into_a_quantized_pool():
    arrays = planted_entry(np.random.default_rng(), 5)
    sides = sf.dense_sides(arrays, KV_FORMATS["auto"], ROTATE)
    stored = sf.encode(sides, krul.choose(sides, 0.2)[0], H)
    fmt = KV_FORMATS["k8v4"]
    back = sf.decode(stored, fmt, jnp.float32, ROTATE, PAGE)
    want = KVPages.from_dense(jnp.asarray(arrays["k"]), jnp.asarray(arrays["v"]), fmt)
    assert sorted(back) == sorted(want.arrays())
    k, v = KVPages.from_arrays(fmt, {n: jnp.asarray(x) for n, x in back.items()}).dense()
    assert np.abs(np.asarray(k) - arrays["k"]).max() < 0.05 * np.abs(arrays["k"]).max()


def test_kv_without_low_rank_structure_is_refused_at_a_low_rate():
    rng = np.random.default_rng()
    arrays = {"k": as_pages(rng.standard_normal((L, T, H, D))),
              "v": as_pages(rng.standard_normal((L, T, H, D)))}
    sides = sf.dense_sides(arrays, KV_FORMATS["auto"], ROTATE)
    assert krul.choose(sides, 0.05) is None


def test_arrays_that_are_not_a_shared_entry_are_a_value_error():
    arrays = planted_entry(np.random.default_rng(), 0)
    sides = sf.dense_sides(arrays, KV_FORMATS["auto"], ROTATE)
    stored = sf.encode(sides, krul.choose(sides, 0.2)[0], H)
    for broken in ({n: x for n, x in stored.items() if n != "g1.basis"},
                   {**stored, "layout": stored["layout"][:1]}):
        with pytest.raises(ValueError, match="shared form"):
            sf.reconstruct(broken)


# ---------------------------------------------------------------------------- the store

TINY = ModelConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=L,
                   num_heads=4, num_kv_heads=H, head_dim=D, rope_theta=10000.0)


@pytest.fixture(scope="module")
def engine():
    cache = CacheConfig(page_size=PAGE, kv_cache_bytes=1 << 22)
    return Engine(TINY, random_params(TINY, seed=1, dtype=jnp.float32), cache=cache,
                  config=EngineConfig(max_model_len=512, max_num_seqs=2, prefill_chunk=64))


def store_for(engine, **kw) -> KVStore:
    return KVStore(StoreConfig(host_cache_bytes=1 << 26, **kw), model=engine.fingerprint,
                   kv_format=engine.kv_format, page_size=PAGE, convert=engine.convert_stored)


def test_the_store_writes_the_shared_form_and_restores_its_reconstruction(engine):
    arrays = planted_entry(np.random.default_rng(), 0)
    hashes = [bytes([i]) * 16 for i in range(T // PAGE)]
    plain, shared = store_for(engine), store_for(engine, kv_sharing="krul")
    for store in (plain, shared):
        assert store.save(T // PAGE, arrays, hashes)
        store.flush()
    snap = shared.snapshot()
    assert snap["shared_entries"] == 1 and snap["shared_groups"] == 4
    assert snap["bytes"]["host"] * 10 < plain.snapshot()["bytes"]["host"]
    assert snap["shared_bytes_saved"] > 0
    loaded = shared.load(shared.lookup(hashes))
    assert loaded.exact_blocks == 0  # approximate from its first block
    for side in ("k", "v"):
        assert np.abs(loaded.arrays[side] - arrays[side]).max() < 0.01 * np.abs(
            arrays[side]).max()
    plain.close()
    shared.close()


def test_an_entry_the_form_refuses_is_stored_in_the_pools_format(engine):
    rng = np.random.default_rng()
    arrays = {"k": as_pages(rng.standard_normal((L, T, H, D))),
              "v": as_pages(rng.standard_normal((L, T, H, D)))}
    hashes = [bytes([i]) * 16 for i in range(T // PAGE)]
    store = store_for(engine, kv_sharing="krul", kv_sharing_rate=0.05)
    assert store.save(T // PAGE, arrays, hashes)
    store.flush()
    snap = store.snapshot()
    assert [snap[f"shared_{k}"] for k in ("entries", "groups", "bytes_saved", "refused")] == [
        0, 0, 0, 1]
    loaded = store.load(store.lookup(hashes))
    assert loaded.exact_blocks is None  # stored as it was: an exact restore
    for side in ("k", "v"):
        assert np.array_equal(loaded.arrays[side], arrays[side])
    store.close()


def test_adaptcache_recompresses_entries_into_a_shared_form_its_profile_rates(engine, tmp_path):
    """AdaptCache's profile may name shared-layer forms: with room for two whole entries of
    three, it keeps all three by recompressing (quality weighs nothing here), and a
    recompressed entry restores its reconstruction."""
    import json

    profile = tmp_path / "profile.json"
    profile.write_text(json.dumps({
        "model": "tiny", "metric": "top1_agreement", "kinds": ["chat"],
        "methods": {"krul@0.2": [{"rate": 0.2, "quality": {"chat": 0.93}}]}}))
    rng = np.random.default_rng()
    entries = [(planted_entry(rng, 0), [bytes([i, j]) * 8 for j in range(T // PAGE)])
               for i in range(3)]
    size = sum(x.nbytes for x in entries[0][0].values())
    store = KVStore(StoreConfig(host_cache_bytes=int(2.5 * size), eviction_policy="adaptcache",
                                adapt_profile=str(profile), adapt_alpha=0.0),
                    model=engine.fingerprint, kv_format=engine.kv_format, page_size=PAGE,
                    convert=engine.convert_stored, bf16_ratio=engine.kv_bf16_ratio)
    store.set_recompute_rate(1e-3)  # (the scheduler's measure: a miss costs its recompute)
    for arrays, hashes in entries:
        assert store.save(T // PAGE, arrays, hashes)
        store.flush()
    snap = store.snapshot()
    assert snap["entries"]["host"] == 3 and snap["bytes"]["host"] <= 2.5 * size
    assert snap["shared_entries"] >= 1 and snap["evictions"] == 0
    loads = [store.load(store.lookup(hashes)) for _, hashes in entries]
    assert any(loaded.exact_blocks == 0 for loaded in loads)  # in the shared form
    for (arrays, _), loaded in zip(entries, loads, strict=True):
        for side in ("k", "v"):
            assert np.abs(loaded.arrays[side] - arrays[side]).max() < 0.01 * np.abs(
                arrays[side]).max()
    store.close()


@pytest.mark.parametrize("outcome", ["larger", "fails"])
def test_a_shared_form_that_is_no_smaller_or_fails_leaves_the_entry_as_it_came(outcome):
    """A pool already in few bits can make the shared form larger; a conversion may fail:
    either way the entry is written in its own form and counted refused."""
    from types import SimpleNamespace

    from jkv.store.entry_forms import encode_entry
    from jkv.store.parts import StoreStats

    arrays = {"k": np.zeros((4, 2, 2, 8, 4), np.uint8), "v": np.zeros((4, 2, 2, 8, 4), np.uint8)}

    def convert(a, src, dst):
        if outcome == "fails":
            raise np.linalg.LinAlgError("eigh did not converge")
        return {"layout": np.zeros((1, 5), np.int32), "g0.basis": np.zeros(1000, np.float16)}

    p = SimpleNamespace(convert=convert, stats=StoreStats(), model="m", page_size=8)
    data, fmt, shared = encode_entry(p, arrays, "k4v2", "krul@0.3", 32, "ab",
                                     np.zeros((4, 16), np.uint8))
    assert fmt == "k4v2" and shared is None and p.stats.shared_refused == 1


@pytest.mark.parametrize("kw, names", [
    ({"kv_sharing": "krul", "store_kv_format": "k4v2t"}, ("kv_sharing", "store_kv_format")),
    ({"kv_sharing": "krul", "eviction_policy": "adaptcache"}, ("kv_sharing", "eviction_policy")),
    ({"kv_sharing_rate": 1.0}, ("kv_sharing_rate",)),
    ({"kv_sharing": "xkv"}, ("kv_sharing",)),
])
def test_settings_it_cannot_meet_are_refused_by_name(kw, names):
    with pytest.raises(ValueError) as e:
        StoreConfig(host_cache_bytes=1 << 20, **kw)
    assert all(n in str(e.value) for n in names)


def test_a_token_tier_policys_rows_are_refused():
    with pytest.raises(ValueError, match="kv_sharing.*token-tier kv_policy"):
        KVStore(StoreConfig(host_cache_bytes=1 << 20, kv_sharing="krul"), model="m",
                kv_format="auto", page_size=PAGE, convert=lambda a, s, d: a, whole_rows=True)


# ---------------------------------------------------------------------------- acceptance

@pytest.fixture(scope="module")
def shared_subspace_model(tmp_path_factory):
    sys.path.insert(0, str(Path(__file__).parent))
    import shared_subspace

    return shared_subspace.build(tmp_path_factory.mktemp("shared_subspace"))


@pytest.mark.smollm2
def test_on_a_model_whose_layers_share_a_subspace_chats_meet_the_targets(
        shared_subspace_model):
    """Multi-turn chats (serve.py's workload) through the store with and without sharing,
    as benchmarks/kv_sharing_store.py plays them: at least 1.3x fewer stored bytes, the turns
    after restored histories at least 0.95 top-1 agreement and at most 1% perplexity change,
    and the groups found are the model's."""
    sys.path.insert(0, str(Path(__file__).parents[1] / "benchmarks"))
    import kv_sharing_store as bench

    cfg, params, tokenizer = bench.load_model(str(shared_subspace_model), "")
    convs = bench.chats(tokenizer, 2, 1024, seed=0)
    eng = bench.make_engine(cfg, params, 1024 + 2 * bench.PAGE)
    runs = {}
    for sharing in ("none", "krul"):
        store = KVStore(StoreConfig(host_cache_bytes=1 << 30, kv_sharing=sharing),
                        model=eng.fingerprint, kv_format=eng.kv_format, page_size=bench.PAGE,
                        convert=eng.convert_stored)
        scored = [s for c in convs for s in bench.play(eng, store, c)]
        runs[sharing] = (np.array(scored), store.snapshot())
        store.close()
    (base, plain), (shared, snap) = runs["none"], runs["krul"]
    assert plain["bytes"]["host"] >= 1.3 * snap["bytes"]["host"]
    assert snap["shared_entries"] == snap["saves"] and snap["shared_refused"] == 0
    assert snap["shared_groups"] == 4 * snap["saves"]  # (0-2) and (3-5), both sides
    assert np.mean(base[:, 1] == shared[:, 1]) >= 0.95
    assert abs(np.exp(-shared[:, 0].mean()) / np.exp(-base[:, 0].mean()) - 1) <= 0.01


@pytest.mark.smollm2
def test_the_scheduler_restores_a_chat_from_the_shared_form(shared_subspace_model):
    """Through the serving loop (restores forced: no planning, no read ahead): turn 2 restores
    turn 1's history from the shared form, its own save continues it, turn 3 restores both,
    and the replies are a store-less run's."""
    from jkv.config import SchedulerConfig
    from jkv.engine.sampling import SamplingParams
    from jkv.models import load_params
    from jkv.sched.scheduler import Request, Scheduler, generate_all

    cfg, params = load_params(str(shared_subspace_model), jnp.float32)

    def serve(store):
        eng = Engine(cfg, params, cache=CacheConfig(page_size=PAGE, kv_cache_bytes=1 << 24),
                     config=EngineConfig(max_model_len=1024, max_num_seqs=2,
                                         prefill_chunk=128, enable_prefix_caching=False))
        return Scheduler(eng, SchedulerConfig(restore_planning=False, store_read_ahead=False),
                         store=store)

    greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    rng = np.random.default_rng(3)
    turns = [rng.integers(100, 40000, n).tolist() for n in (300, 40, 40)]
    replies = {}
    for sharing in ("none", "krul"):
        sched = serve(StoreConfig(host_cache_bytes=1 << 28, kv_sharing=sharing))
        history, out = [], []
        for turn in turns:
            r = Request(history + turn, greedy)
            generate_all(sched, [r])
            sched.store.flush()
            history = r.prompt + r.output
            out.append(r.output)
        replies[sharing] = out
        snap = sched.snapshot()
        if sharing == "krul":
            # turn 3's restore converts a chain of two entries
            assert snap["store"]["shared_entries"] == 3 and snap["store"]["converted_loads"] == 3
            restored = snap["prefix_hit_tokens"]["host"]
            assert restored == (len(turns[0]) + 7) // PAGE * PAGE + (
                len(turns[0]) + len(turns[1]) + 15) // PAGE * PAGE
    assert replies["krul"] == replies["none"]


@pytest.mark.smollm2
def test_a_split_restore_of_a_shared_entry_recomputes_its_front_and_loads_the_rest(
        shared_subspace_model):
    """Krul's split (6.2) over a restore from the shared form: layers recompute a front share
    of the history while the rest is loaded from the reconstruction; the next tokens are a
    store-less run's."""
    sys.path.insert(0, str(Path(__file__).parents[1] / "benchmarks"))
    import kv_sharing_store as bench

    from jkv.engine.saved_pages import SavedPages

    cfg, params, _ = bench.load_model(str(shared_subspace_model), "")
    eng = bench.make_engine(cfg, params, 1024)
    rng = np.random.default_rng(5)
    history = rng.integers(100, 40000, 320).tolist()
    prompt = history + rng.integers(100, 40000, 40).tolist()
    store = KVStore(StoreConfig(host_cache_bytes=1 << 28, kv_sharing="krul"),
                    model=eng.fingerprint, kv_format=eng.kv_format, page_size=bench.PAGE,
                    convert=eng.convert_stored)
    slot, _ = eng.open(history)
    bench.prefill(eng, slot, history, 0, targets=False)
    saved = eng.gather(slot)
    store.save(saved.num_blocks, saved.arrays, saved.hashes)
    store.flush()
    eng.close(slot, keep=False)
    assert store.snapshot()["shared_entries"] == 1
    hit = store.lookup(eng.cache.prompt_hashes(prompt))
    loaded = store.load(hit)
    restored = SavedPages(hit.blocks, loaded.arrays, loaded.hashes, exact_blocks=0)
    tops = {}
    for name, restore, recompute in (("none", None, 0.0), ("load", restored, 0.0),
                                     ("split", restored, 0.5)):
        before = eng.stats.recomputed_tokens
        slot, cached = eng.open(prompt, restore=restore, recompute=recompute)
        assert cached == (0 if restore is None else hit.blocks * bench.PAGE)
        assert (eng.stats.recomputed_tokens > before) == (recompute > 0)  # a split indeed
        _, top1, _ = bench.prefill(eng, slot, prompt, cached, targets=True)
        tops[name] = np.array(top1[-40:-1])  # the positions after the history
        eng.close(slot, keep=False)
    # the agreement target, against the recomputed and the fully loaded history
    assert np.mean(tops["split"] == tops["none"]) >= 0.95
    assert np.mean(tops["split"] == tops["load"]) >= 0.95
    store.close()


@pytest.mark.parametrize("bits", [16, 8, 4, 2])
def test_a_hand_made_plan_round_trips_at_every_coefficient_width(bits):
    """Odd ranks (codes packed with padding columns), a rank-0 group, groups of 1 to 3."""
    rng = np.random.default_rng()
    arrays = planted_entry(rng, 7)
    sides = sf.dense_sides(arrays, KV_FORMATS["auto"], ROTATE)
    plan = sf.Plan({"k": [(0, 3), (3, 3)], "v": [(0, 1), (1, 2), (3, 3)]},
                   {"k": [5, 7], "v": [0, 9, 13]}, bits, sinks=3)
    stored = sf.encode(sides, plan, H)
    back = sf.reconstruct(stored)
    for side, groups in plan.groups.items():
        for (first, size), rank in zip(groups, plan.ranks[side], strict=True):
            x = sides[side][first:first + size, plan.sinks:]
            want = krul.sb.reconstruct(krul.sb.fit(x, rank, bits, sf.BLOCK), sf.BLOCK)
            got = back[side][first:first + size, plan.sinks:]
            assert np.allclose(got, want, atol=1e-3 * np.abs(want).max() + 1e-6)
        assert np.allclose(back[side][:, :3], sides[side][:, :3], rtol=1e-3, atol=1e-3)
