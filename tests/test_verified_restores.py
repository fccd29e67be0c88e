"""Verified restores: an entry keeps the fingerprint of the token just past its blocks, a
restore's first step computes that token again over the restored KV, and a restore whose
KV is not what the model computed (here: an entry whose bytes are whole and checksummed but
whose pages are another conversation's) is discarded, recomputed and quarantined, with the
tokens a run without a store gives."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from jkv.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig, StoreConfig
from jkv.engine.engine import Engine
from jkv.engine.fingerprints import SKETCH_DIMS
from jkv.engine.sampling import SamplingParams
from jkv.metrics import Metrics
from jkv.models.loaders import random_params
from jkv.sched.restore_checks import for_save, plan_check, record
from jkv.sched.scheduler import Request, Scheduler, generate_all
from jkv.store.codec import decode, encode
from jkv.store.entry_forms import HASHES
from jkv.store.store import KVStore
from jkv.store.verify import MARK, MARK_AT, Mark, distance, tolerance

TINY = ModelConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_layers=2,
                   num_heads=8, num_kv_heads=2, head_dim=64, rope_theta=10000.0)
PAGE = 8


@pytest.fixture(scope="module")
def params():
    return random_params(TINY, seed=5, dtype=jnp.float32)


def engine(params) -> Engine:
    return Engine(TINY, params, cache=CacheConfig(page_size=PAGE, kv_cache_bytes=1 << 22),
                  config=EngineConfig(max_model_len=96, max_num_seqs=4, prefill_chunk=16,
                                      enable_prefix_caching=False))


def request(prompt: list[int], n: int = 6) -> Request:
    return Request(list(prompt), SamplingParams(max_tokens=n, temperature=0))


def greedy_alone(params, prompts: list[list[int]]) -> list[list[int]]:
    reqs = [request(p) for p in prompts]
    generate_all(Scheduler(engine(params)), reqs)
    return [r.output for r in reqs]


def test_a_restore_of_another_conversations_kv_is_caught_and_recomputed(params):
    """Two conversations of the same length are saved (4 full blocks each, the token after
    them computed); conversation A's entry is then rewritten, whole and checksummed, with
    B's pages. A's next turn restores it, fails its check, is recomputed and answers as a
    run without a store does; the entry's chain is quarantined and the failure counted in
    /metrics. B's next turn restores its own entry and passes."""
    rng = np.random.default_rng()
    eng = engine(params)
    store = KVStore(StoreConfig(host_cache_bytes=1 << 24, save_interval_blocks=0),
                    model=eng.fingerprint, kv_format=eng.kv_format, page_size=PAGE)
    sched = Scheduler(eng, SchedulerConfig(restore_planning=False), store=store)
    first = [request(rng.integers(0, 512, 29).tolist()) for _ in range(2)]
    generate_all(sched, first)  # 34 tokens fed each: blocks 0-3 saved, token 32 decoded
    store.flush()
    follow = [r.prompt + r.output + rng.integers(0, 512, 5).tolist() for r in first]
    hits = [store.lookup(eng.cache.prompt_hashes(p)) for p in follow]
    assert [h.blocks for h in hits] == [4, 4]
    info, a = decode(store.host.get(hits[0].key))
    _, b = decode(store.host.get(hits[1].key))
    assert a[MARK_AT].tolist() == [32, follow[0][32], 1]  # (pooled)
    assert a[MARK].shape == (SKETCH_DIMS,)
    planted = {**{k: v for k, v in b.items() if k not in (HASHES, MARK_AT, MARK)},
               HASHES: a[HASHES], MARK_AT: a[MARK_AT], MARK: a[MARK]}
    store.host.put(hits[0].key, encode(info, planted), store.host.meta(hits[0].key))

    second = [request(p) for p in follow]
    generate_all(sched, second)
    assert [r.output for r in second] == greedy_alone(params, follow)
    snap = sched.snapshot()["store"]
    assert (snap["verify_failures"], snap["restores_verified"], snap["quarantined"]) == (1, 1, 1)
    assert snap["restores_unverified"] == 0
    # only B's restore counts as a hit: A's 32 tokens were computed again
    assert sched.snapshot()["prefix_hit_tokens"]["host"] == 32
    store.flush()
    assert hits[0].key not in store.host and hits[0].key not in store.index
    assert second[0].cached_tokens == 0 and second[1].cached_tokens == 32
    metrics = Metrics()
    metrics.sync(sched.snapshot())
    text = metrics.render().decode()
    assert "jkv_store_verify_failures_total 1.0" in text
    assert "jkv_store_quarantined_total 1.0" in text
    store.close()


def test_an_entry_keeps_its_fingerprint_through_tiers_and_recompression(tmp_path):
    """A saved fingerprint comes back with the entry from the host tier, from a persistent
    tier reopened, and after the entry is recompressed; a hit that ends before the entry's
    last block has none (its first computed token is not the one fingerprinted)."""
    rng = np.random.default_rng()
    arrays = {"k": rng.standard_normal((3, 2, 2, 4, 8)).astype(np.float32),
              "v": rng.standard_normal((3, 2, 2, 4, 8)).astype(np.float32)}
    hashes = [bytes([i]) * 16 for i in range(3)]
    vector = rng.standard_normal(SKETCH_DIMS).astype(np.float32)
    config = StoreConfig(host_cache_bytes=1 << 20, store_dir=str(tmp_path),
                         disk_cache_bytes=1 << 22)
    store = KVStore(config, model="m", kv_format="auto", page_size=4)
    store.save(3, arrays, hashes, mark=Mark(12, 77, vector, True))
    store.flush()
    got = store.load(store.lookup(hashes))
    assert got.mark[:2] == (12, 77) and got.mark.pooled
    np.testing.assert_array_equal(got.mark.vector, vector)
    assert store.load(store.lookup(hashes[:2])).mark is None
    store.close()
    reopened = KVStore(config, model="m", kv_format="auto", page_size=4,
                       convert=lambda a, src, dst: {k: x.astype(np.float16)
                                                     for k, x in a.items()})
    back = reopened.load(reopened.lookup(hashes)).mark
    assert back[:2] == (12, 77) and back.pooled and np.array_equal(back.vector, vector)
    key = hashes[-1].hex()
    assert reopened.recompress(key, "int8")
    again = reopened.load(reopened.lookup(hashes))
    assert again.mark.position == 12 and np.array_equal(again.mark.vector, vector)
    reopened.close()


def test_only_a_restore_that_ends_at_the_fingerprint_of_the_same_token_is_checked():
    kept: dict = {}
    v = np.ones((2, SKETCH_DIMS), np.float32)
    for start in range(0, 48, 16):  # rows of 16 tokens: block starts at start and start + 8
        record(kept, np.array([start, start + 8]), v * start, start)
    record(kept, np.array([-1, -1]), v, 48)  # a row with none
    assert sorted(kept) == [16, 24, 32, 40]  # the latest four
    tokens = list(range(100, 150))
    mark = for_save(kept, 5, 8, tokens)  # computed inside its row: not pooled
    assert mark[:2] == (40, 140) and mark.vector[0] == 32 and not mark.pooled
    assert for_save(kept, 4, 8, tokens).pooled  # its row's first token
    assert for_save(kept, 5, 8, tokens[:40]) is None  # the blocks end what it holds
    assert for_save(kept, 1, 8, tokens) is None  # not among the latest
    tol = tolerance("none", "auto")
    assert plan_check(mark, tokens, 40, tol, "e").position == 40
    assert plan_check(mark, tokens[:40] + [0] + tokens[41:], 40, tol, "e") is None
    assert plan_check(mark, tokens, 32, tol, "e") is None  # ends elsewhere
    assert plan_check(mark, tokens, 40, None, "e") is None  # no tolerance measured
    assert tolerance("none", "auto", ["streaming@0.5"]) is None
    assert tolerance("leankv", "auto") is None
    # a converted form's KV is not the pool's: counted as in a chunk, the coarsest form's
    assert tolerance("none", "auto", ["k4v2"], pooled=True) == tolerance("none", "k4v2") > tol
    assert tolerance("none", "k4v2", pooled=True) < tolerance("none", "k4v2")
    assert distance(mark.vector, mark.vector) == 0.0
    assert distance(mark.vector, -mark.vector) == 2.0
