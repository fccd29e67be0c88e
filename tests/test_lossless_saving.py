"""Krul's lossless saving: an entry keeps only what a split restore of it loads. The front it
leaves out is planned from measured rates (never on a CPU's), the store keeps and reads the
rest, and a restore recomputes at least that front: the next tokens are a recompute's even
where the left-out pages would be poison."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from jkv.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig, StoreConfig
from jkv.engine.engine import Engine, Row
from jkv.engine.sampling import SamplingParams
from jkv.engine.saved_pages import SavedPages, pyramid
from jkv.models.loaders import random_params
from jkv.sched import store_side
from jkv.sched.restore_planning import RestoreRates, saved_front
from jkv.sched.scheduler import Request, Scheduler, generate_all
from jkv.store.fronts import FRONT, drop_front, restore_front
from jkv.store.store import KVStore

CFG = ModelConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_layers=4,
                  num_heads=8, num_kv_heads=2, head_dim=64, rope_theta=10000.0)
GREEDY = SamplingParams(max_tokens=8, temperature=0)


@pytest.fixture(scope="module")
def params():
    return random_params(CFG, seed=5, dtype=jnp.float32)


def engine(params, **kw) -> Engine:
    return Engine(CFG, params, cache=CacheConfig(page_size=8, kv_cache_bytes=8_000_000),
                  config=EngineConfig(**{"max_model_len": 160, "max_num_seqs": 2,
                                         "prefill_chunk": 32, "enable_prefix_caching": False,
                                         **kw}))


def test_a_front_is_left_out_and_put_back_in_place():
    rng = np.random.default_rng()
    arrays = {"k": rng.standard_normal((6, 4, 2, 8, 16)).astype(np.float32),
              "k_scale": rng.standard_normal((6, 4, 2, 16)).astype(np.float16)}
    front = np.array([4, 3, 1, 0])
    kept, dropped = drop_front(arrays, front)
    assert dropped == sum(x.nbytes for x in arrays.values()) * 8 // 24  # 8 of 24 pages
    back = dict(kept)
    assert (restore_front(back, 6) == front).all() and FRONT not in back
    for name, x in arrays.items():
        for layer, b in enumerate(front):
            assert (back[name][b:, layer] == x[b:, layer]).all()
            assert not back[name][:b, layer].any()
    with pytest.raises(ValueError, match="front"):
        restore_front(dict(kept), 3)  # a front past the blocks
    short = dict(kept, k=kept["k"][1:])
    with pytest.raises(ValueError, match="holds"):
        restore_front(short, 6)
    assert restore_front({"k": arrays["k"]}, 6) is None  # an entry that kept every page


def rates(overlap: float, write_s: float, token_s: float = 1e-3, nbytes: int = 1 << 20
          ) -> RestoreRates:
    return RestoreRates({"host": 1e15}, nbytes / write_s, token_s, overlap)


def test_the_front_is_planned_from_the_measured_rates():
    # a GPU: copies overlap compute, writing 40 blocks takes as long as recomputing half
    front = saved_front(40, 8, 1 << 20, rates(1.0, 0.5 * 40 * 8 * 1e-3), 6, 1)
    assert front is not None and front[0] > 0 and (np.diff(front) <= 0).all()
    assert (front == pyramid(0, 40, 6, 1 / 3, 1)).all()  # r = T_W / (T_C + T_W)
    # a CPU: one after the other, a split only interpolates: never
    assert saved_front(40, 8, 1 << 20, rates(0.0, 0.5 * 40 * 8 * 1e-3), 6, 1) is None
    # rates not measured yet: never
    assert saved_front(40, 8, 1 << 20, RestoreRates({}, 0.0, 0.0), 6, 1) is None
    # loading far faster than recomputing: the share rounds to no block
    assert saved_front(4, 8, 1 << 20, rates(1.0, 1e-6), 6, 1) is None


def run(eng: Engine, prompt: list[int], restore=None, new: int = 4):
    slot, cached = eng.open(prompt, restore=restore)
    key, out = eng.request_key(0), []
    while cached < len(prompt):
        chunk = prompt[cached: cached + eng.prefill_chunk]
        (s,), _ = eng.step([Row(slot, chunk, GREEDY, key, 0)], [])
        cached += len(chunk)
    out.append(s.token)
    while len(out) < new:
        _, (s,) = eng.step([], [Row(slot, [out[-1]], GREEDY, key, len(out))])
        out.append(s.token)
    return out, slot


@pytest.mark.parametrize("execution", ["scan", "layerwise"])
def test_a_restore_recomputes_the_front_and_never_reads_it(params, execution):
    rng = np.random.default_rng()
    history = rng.integers(0, 512, 97).tolist()
    first = engine(params)
    reply, slot = run(first, history, new=2)
    saved = first.save_pages(slot)
    follow_up = history + reply[:1] + rng.integers(0, 512, 6).tolist()
    recomputed, _ = run(engine(params), follow_up)
    front = np.array([9, 6, 3, 0])
    poisoned = {f: np.array(x) for f, x in saved.arrays.items()}
    for layer, b in enumerate(front):  # the pages the entry did not keep
        poisoned["k"][:b, layer] = np.nan
        poisoned["v"][:b, layer] = np.nan
    eng = engine(params, execution=execution)
    eng.connector.load_bytes_per_s = 1e9  # layerwise: staged through the read buffer
    tokens, _ = run(eng, follow_up, SavedPages(saved.num_blocks, poisoned, saved.hashes,
                                               front=front))
    assert tokens == recomputed
    assert eng.stats.recomputed_tokens == pytest.approx(front.sum() * 8 / CFG.num_layers)
    with pytest.raises(ValueError, match="front"):
        eng.rebase(SavedPages(saved.num_blocks, poisoned, saved.hashes, front=front),
                   follow_up, 8, 8)


def request(prompt, n: int = 5) -> Request:
    return Request(list(prompt), SamplingParams(max_tokens=n, temperature=0))


def test_chats_saved_without_their_fronts_go_on_as_recomputed(params, tmp_path, monkeypatch):
    """The serving loop, with rates under which a split pays (a GPU's: forced here, as no
    CPU's do): the first turns are stored without the front a split recomputes (counted),
    read back from host memory and from disk in a new process, and the next turns give the
    tokens a store-less run gives."""
    planned = []

    def gpu_like(blocks, page_size, nbytes, rates, layers, chunk):
        planned.append(blocks)
        return pyramid(0, blocks, layers, 0.4, chunk)

    monkeypatch.setattr(store_side, "saved_front", gpu_like)
    rng = np.random.default_rng()
    eng = engine(params)
    store = KVStore(StoreConfig(host_cache_bytes=1 << 24, store_dir=str(tmp_path)),
                    model=eng.fingerprint, kv_format=eng.kv_format, page_size=eng.page_size)
    sched = Scheduler(eng, SchedulerConfig(restore_planning=False), store=store)
    turn1 = [request(rng.integers(0, 512, int(n)).tolist()) for n in (70, 90)]
    generate_all(sched, turn1)
    store.flush()
    stats = store.stats
    assert planned and stats.lossless_entries == 2 and stats.lossless_bytes_saved > 0
    follow = [r.prompt + r.output + rng.integers(0, 512, 5).tolist() for r in turn1]
    alone = [request(p) for p in follow]
    generate_all(Scheduler(engine(params)), alone)
    turn2 = [request(p) for p in follow]
    generate_all(sched, turn2)
    snap = sched.snapshot()
    assert snap["prefix_hit_tokens"]["host"] > 0 and snap["restore"]["tokens_recomputed"] > 0
    assert [r.output for r in turn2] == [r.output for r in alone]
    store.close()
    eng2 = engine(params)
    sched2 = Scheduler(eng2, SchedulerConfig(restore_planning=False), store=KVStore(
        StoreConfig(store_dir=str(tmp_path)), model=eng2.fingerprint,
        kv_format=eng2.kv_format, page_size=eng2.page_size))
    again = [request(p) for p in follow]
    generate_all(sched2, again)
    assert sched2.snapshot()["prefix_hit_tokens"]["disk"] > 0
    assert [r.output for r in again] == [r.output for r in alone]
    sched2.store.close()


def test_the_store_keeps_the_rest_and_a_lossy_store_keeps_every_page(params, tmp_path):
    rng = np.random.default_rng()
    eng = engine(params)
    _, slot = run(eng, rng.integers(0, 512, 81).tolist(), new=1)
    saved = eng.save_pages(slot)
    n, front = saved.num_blocks, np.array([6, 4, 2, 0])
    for config, kept in [(StoreConfig(store_dir=str(tmp_path), host_cache_bytes=0), True),
                         (StoreConfig(store_kv_format="k8v4"), False)]:
        store = KVStore(config, model=eng.fingerprint, kv_format=eng.kv_format,
                        page_size=eng.page_size, convert=eng.convert_stored)
        with pytest.raises(ValueError, match="front"):
            store.save(n, saved.arrays, saved.hashes, start=2, front=front)
        assert store.save(n, saved.arrays, saved.hashes, front=front)
        store.flush()
        loaded = store.load(store.lookup(saved.hashes))
        whole = sum(np.asarray(x).nbytes for x in saved.arrays.values())
        if kept:  # from disk: the rest in place, the front zeros, handed over
            assert (loaded.front == front).all()
            assert store.stats.lossless_entries == 1
            assert store.stats.lossless_bytes_saved == whole * front.sum() // (n * 4)
            for f, x in saved.arrays.items():
                for layer, b in enumerate(front):
                    assert (np.asarray(loaded.arrays[f])[b:n, layer] == x[b:n, layer]).all()
                    assert not np.asarray(loaded.arrays[f])[:b, layer].any()
        else:  # converts what it keeps: kept whole
            assert loaded.front is None and store.stats.lossless_entries == 0
        store.close()
