"""Every KV policy with the KV store (host, disk), device prefix caching and LayerKV's layer
offload, on a tiny model: two-turn conversations give, per policy, the same outputs wherever
the second turn reuses the same KV (a lossy policy keeps its compression, so reusing and
recomputing differ by design); on a pool too small for a workload, layer offload serves it
instead of preempting, with the tokens a large pool gives; and no page leaks."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest
from test_engine_tiers import check_nothing_leaked

from jkv.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig, StoreConfig
from jkv.engine.engine import Engine
from jkv.engine.sampling import SamplingParams
from jkv.models.loaders import random_params
from jkv.policies import POLICIES
from jkv.sched.scheduler import Request, Scheduler, generate_all

TINY = ModelConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_layers=2,
                   num_heads=8, num_kv_heads=2, head_dim=64, rope_theta=10000.0)
PAGE = 8
# the store cells' pool (the layer-offload cells size theirs in pages of the policy's format)
POOL_BYTES = 1 << 20
KNOBS = dict(kv_recent_window=PAGE, kv_alpha_high=1.0, kv_alpha_low=0.5, kv_heavy_ratio=0.3,
             kv_placement_interval=2)  # small enough that every token policy drops tokens


@pytest.fixture(scope="module")
def params():
    return random_params(TINY, seed=5, dtype=jnp.float32)


@pytest.fixture(scope="module")
def conversations():
    rng = np.random.default_rng(7)
    firsts = [rng.integers(0, 512, int(n)).tolist() for n in (23, 38)]
    extra = [rng.integers(0, 512, 7).tolist() for _ in firsts]
    return firsts, extra


def engine(params, policy: str, prefix: bool) -> Engine:
    cache = CacheConfig(page_size=PAGE, kv_cache_bytes=POOL_BYTES, kv_policy=policy, **KNOBS)
    return Engine(TINY, params, cache=cache, config=EngineConfig(
        max_model_len=96, max_num_seqs=8, prefill_chunk=16, enable_prefix_caching=prefix))


def scheduler(eng: Engine, store: str, path) -> Scheduler:
    kv = None if store == "none" else StoreConfig(
        host_cache_bytes=1 << 24, store_dir=str(path) if store == "disk" else None)
    # every hit restored, read at admission: read ahead, a hit whose read is not done when
    # its request could start is recomputed instead (no request waits on the store)
    return Scheduler(eng, SchedulerConfig(restore_planning=False, store_read_ahead=False),
                     store=kv)


def turn(sched: Scheduler, prompts: list[list[int]], one_by_one: bool = False
         ) -> list[Request]:
    """Every prompt's 6 greedy tokens, all at once or one request after the other."""
    requests = [Request(list(p), SamplingParams(max_tokens=6, temperature=0)) for p in prompts]
    for batch in ([[r] for r in requests] if one_by_one else [requests]):
        generate_all(sched, batch)
    return requests


def run_cell(params, conversations, policy: str, prefix: bool, store: str,
             path) -> tuple[list, dict]:
    """Both turns of the conversations: (each turn's outputs, the prefix hits by source). A
    disk cell runs the second turn in a new engine over the same directory."""
    firsts, extra = conversations
    eng = engine(params, policy, prefix)
    sched = scheduler(eng, store, path)
    first = turn(sched, firsts)
    if store == "disk":
        sched.store.close()
        check_nothing_leaked(eng)
        eng = engine(params, policy, prefix)
        sched = scheduler(eng, store, path)
    elif sched.store is not None:
        sched.store.flush()
    # one by one: under a token policy prompt tokens are placed after each prefill chunk,
    # and where chunks end depends on what shares the step (and on when a store hit is
    # read, on the store's thread)
    second = turn(sched, [r.prompt + r.output + x for r, x in zip(first, extra, strict=True)],
                  one_by_one=True)
    hits = sched.snapshot()["prefix_hit_tokens"]
    if sched.store is not None:
        sched.store.close()
    check_nothing_leaked(eng)
    return [[r.output for r in first], [r.output for r in second]], hits


@pytest.mark.long
@pytest.mark.parametrize("policy", list(POLICIES))
def test_every_policy_composes_with_the_store_and_prefix_caching(params, conversations,
                                                                 policy, tmp_path):
    """Four cells a policy: prefix caching (reuse on the device); it and the host store
    (the device hit comes first); the host store alone (reuse from host memory); prefix
    caching and a disk store, the second turn in a new engine (from disk). Each finds what
    it should and leaks nothing; host and disk hits give the same tokens, and so do device
    hits with and without a store. On block pages every reuse does (a store restores full
    pages and recomputes the last partial one, as the device prefix cache does); a token
    policy's row kept on the device holds that partial page too, so its store hits can
    differ from its device hits."""
    device, hits = run_cell(params, conversations, policy, True, "none", tmp_path)
    assert hits["device"] > 0, "the second turn found nothing on the device"
    both, hits = run_cell(params, conversations, policy, True, "host", tmp_path / "both")
    assert hits["device"] > 0 and both == device
    host, hits = run_cell(params, conversations, policy, False, "host", tmp_path / "host")
    assert hits["host"] > 0 and host[0] == device[0]
    disk, hits = run_cell(params, conversations, policy, True, "disk", tmp_path / "disk")
    assert hits["disk"] > 0 and disk == host
    if not POLICIES[policy].token_tiers:
        assert host == device


def test_the_docs_table_of_what_composes_is_the_codes():
    from pathlib import Path

    from jkv.policies.composition import composition_table

    docs = (Path(__file__).parent.parent / "docs" / "architecture.md").read_text()
    assert composition_table() in docs


def serve(params, policy: str, pool_pages: int, offload: bool,
          alone: bool = False) -> tuple[list, dict, list]:
    """Four requests decoding 40 tokens each at once (`alone`: one after the other, so none
    is ever preempted, with the very programs of a run of them at once), on a pool of
    `pool_pages` pages of the policy's own format: (outputs, the scheduler's snapshot, each
    request's output length when first preempted, None if never). Rows padded to powers of
    4 (a GPU's shapes): the runs compile 4 step shapes, not 8 (compiling is most of the
    test's time; what it checks does not depend on the padding)."""
    cache = CacheConfig(page_size=PAGE, kv_cache_bytes=POOL_BYTES, kv_policy=policy, **KNOBS)
    one = engine(params, policy, False).cache.one_page
    cache = dataclasses.replace(cache, kv_cache_bytes=pool_pages * one + 1)
    eng = Engine(TINY, params, cache=cache, config=EngineConfig(
        max_model_len=96, max_num_seqs=8, prefill_chunk=16, enable_prefix_caching=False),
        shape_step=4)
    sched = Scheduler(eng, SchedulerConfig(layer_offload=offload, restore_planning=False,
                                           store_read_ahead=False))
    rng = np.random.default_rng(3)
    requests = [Request(rng.integers(0, 512, n).tolist(),
                        SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))
                for n in (16, 9, 14, 12)]
    cut: dict[int, int] = {}
    preempt = sched._preempt

    def recorded(r: Request) -> None:
        cut.setdefault(requests.index(r), len(r.output))
        preempt(r)

    sched._preempt = recorded
    for batch in ([[r] for r in requests] if alone else [requests]):
        generate_all(sched, batch)
    snap = sched.snapshot()
    check_nothing_leaked(eng)
    return [r.output for r in requests], snap, [cut.get(i) for i in range(len(requests))]


@pytest.mark.long
@pytest.mark.parametrize("policy", list(POLICIES))
def test_every_policy_composes_with_layer_offload_and_preemption(params, policy):
    """On a pool of 60 pages (a sequence of max_model_len takes 48 or more): where it
    preempts without layer offload (every policy that prunes nothing does), with it the
    running requests' layers go to the host instead, nothing is preempted and every request
    samples what it does alone (prompts of one chunk each: a token policy's placement sees
    the same chunks), and the finished sequences kept as many tokens in each tier.
    Preempted, a request recomputes what it held: where that gives back the same KV
    (`lossy_recompute` False) it samples what it does alone; else what it sampled before the
    preemption stands and the rest is the policy's on its KV placed anew."""
    want, big, _ = serve(params, policy, 60, False, alone=True)
    assert big["preemptions"] == 0  # one at a time
    preempted, without, cut = serve(params, policy, 60, False)
    assert without["preemptions"] or big["kv_tiers"]["pruned"]
    got, snap, _ = serve(params, policy, 60, True)
    assert got == want
    assert snap["kv_tiers"] == big["kv_tiers"]
    assert snap["preemptions"] == 0
    if without["preemptions"]:
        assert snap["layer_offload"]["layers_offloaded"] > 0
    lossy = engine(params, policy, False).cache.lossy_recompute
    for out, full, n in zip(preempted, want, cut, strict=True):
        assert len(out) == len(full)
        assert out == full if n is None or not lossy else out[:n] == full[:n]
