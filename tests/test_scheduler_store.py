"""The scheduler with a KV store: later turns restore their history from the store and give
the tokens recomputing gives; the host tier stays within its budget under 200 conversations."""

from __future__ import annotations

import dataclasses
import time

import jax.numpy as jnp
import numpy as np
import pytest

from jkv.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig, StoreConfig
from jkv.engine.engine import Engine
from jkv.engine.sampling import SamplingParams
from jkv.models.loaders import random_params
from jkv.sched.scheduler import Request, Scheduler, generate_all
from jkv.store.store import KVStore

TINY = ModelConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_layers=2,
                   num_heads=8, num_kv_heads=2, head_dim=64, rope_theta=10000.0)
PAGE_BYTES = 8 * 64 * 4 * 2  # one float32 page of 8 tokens, keys and values


@pytest.fixture(scope="module")
def params():
    return random_params(TINY, seed=11, dtype=jnp.float32)


# The prompts of the tests restoring k4v2t entries: their verified restores' honest distance on
# this tiny random model can reach the tolerance measured on SmolLM2, and the recompute a
# false alarm causes would take the hits these tests count.
LOSSY_SEED = 0


def engine(params, **kw) -> Engine:
    kw = {"max_model_len": 96, "max_num_seqs": 4, "prefill_chunk": 16,
          "enable_prefix_caching": False, **kw}
    return Engine(TINY, params, cache=CacheConfig(page_size=8, kv_cache_bytes=512 * PAGE_BYTES),
                  config=EngineConfig(**kw))


def kv_store(eng: Engine, **kw) -> KVStore:
    return KVStore(StoreConfig(**kw), model=eng.fingerprint, kv_format=eng.kv_format,
                   page_size=eng.page_size)


def request(prompt, n: int = 6, session=None) -> Request:
    return Request(list(prompt), SamplingParams(max_tokens=n, temperature=0),
                   session_id=session)


def test_later_turns_restore_from_the_store_and_match_recomputing(params, tmp_path):
    rng = np.random.default_rng()
    firsts = [rng.integers(0, 512, int(n)).tolist() for n in rng.integers(20, 40, 3)]
    eng = engine(params)
    store = kv_store(eng, host_cache_bytes=1 << 24, store_dir=str(tmp_path))
    sched = Scheduler(eng, SchedulerConfig(restore_planning=False), store=store)
    turn1 = [request(p) for p in firsts]
    generate_all(sched, turn1)
    store.flush()
    fed = eng.stats.prefill_tokens + eng.stats.decode_tokens
    follow = [r.prompt + r.output + rng.integers(0, 512, 7).tolist() for r in turn1]
    turn2 = [request(p) for p in follow]
    generate_all(sched, turn2)
    restored = sched.snapshot()["prefix_hit_tokens"]["host"]
    # each history's full blocks (prompt and all but the last output token) came back
    assert restored == sum((len(r.prompt) + len(r.output) - 1) // 8 * 8 for r in turn1)
    reference = Scheduler(engine(params))
    alone = [request(p) for p in follow]
    generate_all(reference, alone)
    assert [r.output for r in turn2] == [r.output for r in alone]
    # (a prompt's last token can go in as a decode row: count every token fed)
    ref = reference.engine.stats
    assert eng.stats.prefill_tokens + eng.stats.decode_tokens - fed == (
        ref.prefill_tokens + ref.decode_tokens - restored)

    # a new process: the same conversations from the disk tier
    store.close()
    eng2 = engine(params)
    sched2 = Scheduler(eng2, SchedulerConfig(restore_planning=False),
                       store=kv_store(eng2, store_dir=str(tmp_path)))
    again = [request(p) for p in follow]
    generate_all(sched2, again)
    # turn 2's saves replaced turn 1's: all of each prompt's full blocks but the last token's
    assert sched2.snapshot()["prefix_hit_tokens"]["disk"] == sum((len(p) - 1) // 8 * 8
                                                                 for p in follow)
    assert [r.output for r in again] == [r.output for r in alone]
    sched2.store.close()


def test_a_decoding_request_saves_its_blocks_as_they_fill(params):
    """Every 2 blocks (16 tokens) a decoding request queues only the blocks since its last
    save, and at its finish only the rest: a chain of entries holding each block once. The
    next turn restores the whole history from it and says what recomputing says."""
    rng = np.random.default_rng()
    eng = engine(params)
    store = kv_store(eng, host_cache_bytes=1 << 24, save_interval_blocks=2)
    sched = Scheduler(eng, SchedulerConfig(restore_planning=False), store=store)
    first = request(rng.integers(0, 512, 20).tolist(), n=40)
    saves_before_finish = 0
    sched.add(first)
    while sched.num_unfinished:
        sched.step()
        if not first.finished:
            store.flush()
            saves_before_finish = store.stats.saves
    store.flush()
    # 59 tokens' KV at the finish: 7 full blocks, saved as [0, 2) [2, 4) [4, 6) and [6, 7)
    snap = store.snapshot()
    assert saves_before_finish == 3 and snap["saves"] == 4 and snap["entries"]["host"] == 4
    assert snap["superseded"] == 0
    assert snap["bytes"]["host"] < 1.5 * 7 * entry_block_bytes(eng)
    follow = first.prompt + first.output + rng.integers(0, 512, 5).tolist()
    second = request(follow)
    generate_all(sched, [second])
    assert sched.snapshot()["prefix_hit_tokens"]["host"] == 7 * 8
    alone = request(follow)
    generate_all(Scheduler(engine(params)), [alone])
    assert second.output == alone.output
    store.close()


def entry_block_bytes(eng: Engine) -> int:
    """Bytes of one block of every layer and KV head (float32 keys and values)."""
    return TINY.num_layers * TINY.num_kv_heads * PAGE_BYTES


def test_host_tier_stays_within_budget_over_200_conversations(params):
    rng = np.random.default_rng()
    eng = engine(params)
    budget = 12 * 4 * eng.cache.block_pages * PAGE_BYTES  # about twelve 4-block histories
    store = kv_store(eng, host_cache_bytes=budget, eviction_policy="lru")
    sched = Scheduler(eng, SchedulerConfig(restore_planning=False), store=store)
    convs = [rng.integers(0, 512, int(n)).tolist() for n in rng.integers(9, 33, 200)]
    finished: list[Request] = []  # first turns done, their follow-ups not yet sent
    outputs: list[Request] = []  # follow-up turns
    peak = 0
    for start in range(0, len(convs), 5):  # five new conversations a round...
        new = [request(p, n=3) for p in convs[start: start + 5]]
        # ...and the next turn of four recent ones (some still stored, some evicted)
        picks = sorted(rng.choice(min(len(finished), 10), min(len(finished), 4),
                                  replace=False), reverse=True)
        follow = [finished.pop(len(finished) - 1 - int(k)) for k in picks]
        follow = [request(r.prompt + r.output + rng.integers(0, 512, 5).tolist(), n=3)
                  for r in follow]
        for r in new + follow:
            sched.add(r)
        while sched.num_unfinished:
            sched.step()
            peak = max(peak, store.host.bytes_used)
        store.flush()
        peak = max(peak, store.host.bytes_used)
        finished += new
        outputs += follow
    snap = sched.snapshot()
    assert peak <= budget and snap["store"]["bytes"]["host"] <= budget
    assert snap["store"]["evictions"] > 100  # the budget was under pressure all along
    assert snap["prefix_hit_tokens"]["host"] > 0
    assert snap["store"]["corrupt_entries"] == 0
    # restored or not, every follow-up turn says what recomputing it says
    sample = [outputs[int(i)] for i in rng.choice(len(outputs), 8, replace=False)]
    reference = Scheduler(engine(params))
    alone = [request(r.prompt, n=3) for r in sample]
    generate_all(reference, alone)
    assert [r.output for r in sample] == [r.output for r in alone]
    store.close()


def test_restore_planning_recomputes_when_that_is_faster(params):
    # (the decision itself is tested in test_planning.py; here the loop applies it)
    rng = np.random.default_rng()
    eng = engine(params)
    store = kv_store(eng, host_cache_bytes=1 << 24)
    sched = Scheduler(eng, store=store)
    first = [request(rng.integers(0, 512, 40).tolist())]
    generate_all(sched, first)
    store.flush()
    # loading: hopelessly slow
    store.read_bytes_per_s["host"] = eng.connector.load_bytes_per_s = 1.0
    follow = [request(first[0].prompt + first[0].output + [1, 2, 3])]
    generate_all(sched, follow)
    snap = sched.snapshot()
    assert snap["prefix_hit_tokens"]["host"] == 0 and snap["store"]["restores_declined"] == 1
    reference = [request(follow[0].prompt)]
    generate_all(Scheduler(engine(params)), reference)
    assert follow[0].output == reference[0].output
    store.close()


def test_restore_planning_splits_a_hit_where_copies_overlap_compute(params):
    rng = np.random.default_rng()
    eng = engine(params)
    store = kv_store(eng, host_cache_bytes=1 << 24)
    sched = Scheduler(eng, store=store)
    first = [request(rng.integers(0, 512, 45).tolist())]
    generate_all(sched, first)
    store.flush()
    follow = [request(first[0].prompt + first[0].output + [1, 2, 3])]
    blocks = (len(first[0].prompt) + len(first[0].output) - 1) // 8
    # a device that overlaps them (a GPU's), reads free, writing half as long as recomputing
    eng.split_overlap = 1.0
    store.read_bytes_per_s["host"] = 1e15
    entry = store.snapshot()["bytes"]["host"]
    token_s = sched.costs.chunked_token_s(eng.prefill_chunk)
    eng.connector.load_bytes_per_s = 2 * entry / (blocks * 8 * token_s)
    generate_all(sched, follow)
    restore = sched.snapshot()["restore"]
    assert sched.snapshot()["prefix_hit_tokens"]["host"] == blocks * 8
    assert 0 < restore["tokens_recomputed"] < blocks * 8  # split, not all-or-nothing
    assert restore["tokens_loaded"] + restore["tokens_recomputed"] == blocks * 8
    reference = [request(follow[0].prompt)]
    generate_all(Scheduler(engine(params)), reference)
    assert follow[0].output == reference[0].output
    store.close()


@pytest.mark.parametrize("tier", ["slow", "failing", "slow, read on the loop"])
def test_a_slow_or_failing_tier_never_stalls_the_running_requests(params, tier):
    rng = np.random.default_rng()
    eng = engine(params)
    store = kv_store(eng, host_cache_bytes=1 << 24)
    loop = tier.endswith("loop")  # the control: store_read_ahead off
    sched = Scheduler(eng, SchedulerConfig(restore_planning=False, store_read_ahead=not loop),
                      store=store)
    first = request(rng.integers(0, 512, 40).tolist())
    generate_all(sched, [first])
    store.flush()
    delay = 1.0
    get = store.host.get

    def slow_or_failing(key):
        time.sleep(delay)  # the tier hangs this long on every read
        if tier == "failing":
            raise OSError("the tier is gone")
        return get(key)

    store.host.get = slow_or_failing
    running = request(rng.integers(0, 512, 30).tolist(), n=40)
    sched.add(running)
    while not running.output:  # decoding
        sched.step()
    follow = request(first.prompt + first.output + [1, 2, 3])
    sched.add(follow)
    slowest = 0.0
    while sched.num_unfinished:
        t0 = time.perf_counter()
        sched.step()
        if not running.finished:
            slowest = max(slowest, time.perf_counter() - t0)
    # a step that waited for the read would take the whole delay: the control's does
    assert slowest >= delay if loop else slowest < delay / 2
    snap = sched.snapshot()
    if tier.startswith("slow"):  # restored once its read was done
        assert snap["prefix_hit_tokens"]["host"] == (len(first.prompt) + 5) // 8 * 8
    else:  # a miss, counted; recomputed
        assert snap["prefix_hit_tokens"]["host"] == 0
        assert snap["store"]["read_failures"] == 1 and snap["store"]["misses"] == 1
    reference = [request(follow.prompt)]
    generate_all(Scheduler(engine(params)), reference)
    assert follow.output == reference[0].output
    store.close()


def test_a_preempted_request_saves_what_it_holds_and_resumes_from_the_store(params,
                                                                            monkeypatch):
    rng = np.random.default_rng()
    prompts = [rng.integers(0, 512, n).tolist() for n in (20, 22, 24, 26)]

    def small() -> Engine:  # 4 requests growing to 44..46 tokens need 24 blocks; 17 fit
        return Engine(TINY, params, cache=CacheConfig(page_size=8, kv_cache_bytes=(
            17 * 4 + 1) * PAGE_BYTES), config=EngineConfig(
            max_model_len=64, max_num_seqs=4, prefill_chunk=16, enable_prefix_caching=False))

    without = Scheduler(small(), SchedulerConfig(layer_offload=False))
    alone = [request(p, n=20) for p in prompts]
    generate_all(without, alone)
    eng = small()
    store = kv_store(eng, host_cache_bytes=1 << 24)
    write = store.writer._write

    def slow_write(*args, **kw):  # a busy writer: readmitted before its save is written
        time.sleep(0.3)
        return write(*args, **kw)

    monkeypatch.setattr(store.writer, "_write", slow_write)
    sched = Scheduler(eng, SchedulerConfig(restore_planning=False, layer_offload=False),
                      store=store)
    reqs = [request(p, n=20) for p in prompts]
    generate_all(sched, reqs)
    snap = sched.snapshot()
    assert snap["preemptions"] > 0 and without.stats.preemptions > 0
    # the preempted requests found their blocks in the store (no device cache here) and
    # recomputed less than they do without one
    assert snap["prefix_hit_tokens"]["host"] > 0
    assert snap["recomputed_tokens"] < without.stats.recomputed_tokens
    assert [r.output for r in reqs] == [r.output for r in alone]
    assert eng.cache.free_pages == eng.cache.total_pages
    store.close()


def test_a_recompressed_entry_restores_its_form_and_is_never_shared_exactly(params):
    rng = np.random.default_rng()
    first = rng.integers(0, 512, int(rng.integers(30, 45))).tolist()

    def serving(**kw) -> tuple[Engine, KVStore, Scheduler]:
        eng = engine(params, **kw)
        store = KVStore(StoreConfig(host_cache_bytes=1 << 24), model=eng.fingerprint,
                        kv_format=eng.kv_format, page_size=eng.page_size,
                        convert=eng.convert_stored)
        return eng, store, Scheduler(eng, SchedulerConfig(restore_planning=False), store=store)

    eng, store, sched = serving()
    turn1 = request(first, n=12)
    generate_all(sched, [turn1])
    store.flush()
    follow = turn1.prompt + turn1.output + rng.integers(0, 512, 7).tolist()
    hashes = eng.cache.prompt_hashes(follow)
    hit = store.lookup(hashes)
    exact = store.load(hit)
    assert hit.blocks >= 4 and exact.exact_blocks is None
    used = store.snapshot()["bytes"]["host"]
    assert store.recompress(hit.key, "k4v2t")
    assert store.snapshot()["bytes"]["host"] < used / 3  # (float32 pages to 2-4 bits)
    assert not store.recompress(hit.key, "k4v2t")  # already in that form
    # read back: the pages that form implies, in the pool's format, all of them approximate
    implied = eng.convert_stored(eng.convert_stored(exact.arrays, eng.kv_format, "k4v2t"),
                                 "k4v2t", eng.kv_format)
    got = store.load(hit)
    assert got.exact_blocks == 0 and got.hashes == exact.hashes
    for name, x in implied.items():
        np.testing.assert_array_equal(np.asarray(got.arrays[name]), x)
        assert not np.array_equal(x, exact.arrays[name])  # (lossy: the check can fail)

    # the follow-up turn restores that form: the tokens of the same pages restored as if
    # they were exact, on an engine with a device prefix cache
    results = []
    for approximate in (True, False):
        eng2, store2, sched2 = serving(enable_prefix_caching=True)
        if approximate:
            sched2.store = store  # (the same fingerprint: the recompressed entry)
        else:
            store2.save(hit.blocks, implied, hashes[: hit.blocks])
            store2.flush()
        turn2 = request(follow, n=8)
        generate_all(sched2, [turn2])
        assert sched2.snapshot()["prefix_hit_tokens"]["host"] == hit.blocks * 8
        # approximate blocks (and those computed after them) are never shared by hash
        cached, _ = eng2.cache.lookup(eng2.cache.prompt_hashes(follow))
        results.append((turn2.output, cached))
        store2.close()
    (out_approx, cached_approx), (out_exact, cached_exact) = results
    assert out_approx == out_exact
    assert cached_approx == 0 < cached_exact
    assert store.snapshot()["converted_loads"] == 2
    store.close()


def test_adaptcache_and_a_fixed_small_form_keep_more_histories_in_host_memory(params,
                                                                            tmp_path):
    import json

    profile = tmp_path / "profile.json"
    profile.write_text(json.dumps({
        "model": "tiny", "metric": "top1_agreement", "kinds": ["chat"],
        "methods": {"k8v4t": [{"rate": 0.44, "quality": {"chat": 0.99}, "family": "q"}],
                    "k4v2t": [{"rate": 0.22, "quality": {"chat": 0.94}, "family": "q"}],
                    "streaming": [{"rate": 0.5, "quality": {"chat": 0.9}}]}}))
    rng = np.random.default_rng(LOSSY_SEED)
    firsts = [rng.integers(0, 512, int(n)).tolist() for n in rng.integers(36, 44, 4)]
    budget = 200_000  # float32 KV of one history is ~100 KB: two fit whole, four do not
    outcome = {}
    for policy in ("lru", "adaptcache", "k4v2t-lru"):
        eng = engine(params)
        fixed = policy.endswith("-lru")
        cfg = StoreConfig(host_cache_bytes=budget, adapt_alpha=0.0,
                          eviction_policy="lru" if fixed else policy,
                          store_kv_format=policy[:-4] if fixed else None,
                          adapt_profile=str(profile) if policy == "adaptcache" else None)
        sched = Scheduler(eng, SchedulerConfig(restore_planning=False), store=cfg)
        turn1 = [request(p, n=10) for p in firsts]
        generate_all(sched, turn1)
        sched.store.flush()
        snap = sched.store.snapshot()
        assert snap["bytes"]["host"] <= budget and sched.store.host.bytes_used <= budget
        turn2 = [request(r.prompt + r.output + rng.integers(0, 512, 5).tolist(), n=4)
                 for r in turn1]
        generate_all(sched, turn2)
        assert all(r.finish_reason == "length" for r in turn2)
        outcome[policy] = (snap["entries"]["host"], sched.snapshot()["prefix_hit_tokens"]["host"],
                           sched.store.snapshot()["converted_loads"])
        if fixed:  # histories of one padded size: the conversions after the first timed
            assert set(sched.store.snapshot()["convert_bytes_per_s"]) == {"k4v2t"}
        sched.store.close()
    (lru_entries, lru_hits, lru_converted), (ac_entries, ac_hits, ac_converted) = \
        outcome["lru"], outcome["adaptcache"]
    assert lru_entries <= 2 < ac_entries == 4  # compressed to fit: every history kept
    assert ac_hits > lru_hits and ac_converted > 0 == lru_converted
    # a fixed smaller form (store_kv_format): every entry written so, every restore converted
    fixed_entries, fixed_hits, fixed_converted = outcome["k4v2t-lru"]
    assert fixed_entries == 4 and fixed_hits > lru_hits and fixed_converted == 4


def test_a_conversation_restored_from_a_smaller_form_goes_on_in_it(params):
    """Turn 2 restores turn 1's history from a k4v2t store (approximate KV): its own save adds
    the blocks it computed over it, marked approximate, so turn 3 restores both turns'
    history, not turn 1's alone (a lossy store would otherwise lose a conversation's depth)."""
    rng = np.random.default_rng(LOSSY_SEED)
    eng = engine(params)
    sched = Scheduler(eng, SchedulerConfig(restore_planning=False),
                      store=StoreConfig(host_cache_bytes=1 << 24, store_kv_format="k4v2t"))
    turn1 = request(rng.integers(0, 512, 30).tolist(), n=10)
    generate_all(sched, [turn1])
    sched.store.flush()
    turn2 = request(turn1.prompt + turn1.output + rng.integers(0, 512, 6).tolist(), n=10)
    generate_all(sched, [turn2])
    sched.store.flush()
    before = sched.snapshot()["prefix_hit_tokens"]["host"]
    assert before == (len(turn1.prompt) + 10 - 1) // 8 * 8
    follow = turn2.prompt + turn2.output + rng.integers(0, 512, 6).tolist()
    hit = sched.store.lookup(eng.cache.prompt_hashes(follow))
    assert hit.blocks == (len(turn2.prompt) + 10 - 1) // 8  # turn 2's every full block
    assert sched.store.load(hit).exact_blocks == 0
    turn3 = request(follow)
    generate_all(sched, [turn3])
    assert sched.snapshot()["prefix_hit_tokens"]["host"] - before == hit.blocks * 8
    assert turn3.finish_reason == "length"
    from jkv.metrics import Metrics

    metrics, snap = Metrics(), sched.snapshot()
    metrics.sync(snap)
    text = metrics.render().decode()
    assert snap["store"]["converted_loads"] >= 2 and snap["store"]["misses"] == 0
    for key in ("converted_loads", "misses", "restores_declined", "restores_abandoned"):
        assert f"jkv_store_{key}_total {float(snap['store'][key])}" in text
    # turn 1's entry converted twice (turns 2 and 3): the second timed; the host tier read
    exported = dict(line.rsplit(" ", 1) for line in text.splitlines()
                    if line.startswith("jkv_store_") and "_per_second" in line)
    rates = snap["store"]["convert_bytes_per_s"]
    assert set(rates) == {"k4v2t"} and rates["k4v2t"] > 0
    assert float(exported['jkv_store_convert_bytes_per_second{kv_format="k4v2t"}']) == \
        pytest.approx(rates["k4v2t"])
    read = snap["store"]["read_bytes_per_s"]["host"]
    assert read > 0 and float(exported['jkv_store_read_bytes_per_second{tier="host"}']) == \
        pytest.approx(read)
    sched.store.close()


def test_every_store_counter_is_exported_to_metrics(params, tmp_path):
    """Each counter of the store's figures (`LLM.stats()["store"]`: the store's, the
    scheduler's store side's) is a `jkv_store_<name>_total` series of /metrics, so a counter
    added without its export fails here."""
    from jkv.metrics import Metrics

    eng = engine(params)
    sched = Scheduler(eng, SchedulerConfig(), store=kv_store(
        eng, host_cache_bytes=1 << 20, store_dir=str(tmp_path)))
    for i, field in enumerate(dataclasses.fields(sched.store.stats)):  # each its own value
        setattr(sched.store.stats, field.name, i + 1)
    snap = sched.snapshot()
    counters = {k for k, v in snap["store"].items() if isinstance(v, int)}
    assert {"saves", "save_failures", "saves_dropped", "read_failures", "disk_full",
            "save_retries", "compactions", "disk_resets", "misses"} <= counters
    metrics = Metrics()
    metrics.sync(snap)
    text = metrics.render().decode()
    missing = [k for k in sorted(counters) if f"jkv_store_{k}_total {float(snap['store'][k])}"
               not in text]
    assert not missing, f"store counters not exported to /metrics: {missing}"
    sched.store.close()
