"""The scheduler: the pure admission policy (`plan_step`) and the serving loop on a tiny
random model (continuous batching, prefix reuse, preemption, aborts, compile counts)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from jkv.config import CacheConfig, ModelConfig, SchedulerConfig
from jkv.engine import Engine
from jkv.models.loaders import random_params
from jkv.sampling import SamplingParams
from jkv.scheduler import Budget, Candidate, Request, Scheduler, generate_all, plan_step

PS, BP = 16, 4  # page size, pages per block


def budget(**kw) -> Budget:
    base = dict(available_pages=1000, free_slots=8, max_tokens=64, chunk=32, page_size=PS,
                block_pages=BP)
    return Budget(**{**base, **kw})


def waiting(rid: str, pending: int, arrival: float = 0.0, **kw) -> Candidate:
    return Candidate(rid, arrival, pending, 0, False, **kw)


def running(rid: str, held: int, arrival: float = 0.0, pending: int = 1, **kw) -> Candidate:
    kw.setdefault("pin_pages", -(-held // PS) * BP)
    return Candidate(rid, arrival, pending, held, True, **kw)


# ---------------------------------------------------------------------------- plan_step


def test_fcfs_chunks_prefill_under_the_token_budget_after_decodes():
    plan = plan_step([running("d1", 40), running("d2", 17)],
                     [waiting("b", 100, arrival=2.0), waiting("a", 100, arrival=1.0)],
                     budget(max_tokens=64, chunk=32))
    assert plan.decode == ["d1", "d2"]
    assert plan.prefill == [("a", 32), ("b", 30)]  # 64 - 2 decodes, first come first
    assert plan.admit == ["a", "b"] and plan.preempt == []


def test_partial_prefills_continue_before_new_admissions_and_slots_bound_admission():
    plan = plan_step([running("p", 32, pending=50)], [waiting("w1", 10), waiting("w2", 10)],
                     budget(max_tokens=100, chunk=64, free_slots=1))
    assert plan.prefill == [("p", 50), ("w1", 10)]
    assert plan.admit == ["w1"]


def test_priority_and_ttft_deadline_order_the_queue():
    plan = plan_step([], [waiting("late", 8, arrival=0.0, priority=1),
                          waiting("slo", 8, arrival=2.0, ttft_deadline=3.0),
                          waiting("fifo", 8, arrival=1.0)], budget())
    assert plan.admit == ["slo", "fifo", "late"]


def test_head_of_line_waits_for_pages_and_is_not_overtaken():
    plan = plan_step([], [waiting("big", 64, arrival=0.0), waiting("small", 4, arrival=1.0)],
                     budget(available_pages=3 * BP, chunk=64))
    assert plan.admit == []
    plan = plan_step([], [waiting("big", 64, arrival=0.0, pin_pages=BP)],
                     budget(available_pages=4 * BP, chunk=64))
    assert plan.admit == [], "pinning the cached blocks counts against the pages"


def test_pages_short_for_decodes_preempt_the_newest_running_request():
    # each decode crosses into a new page: 3 blocks needed, 2 available
    run = [running("old", 32, arrival=0.0), running("mid", 48, arrival=1.0),
           running("new", 64, arrival=2.0)]
    plan = plan_step(run, [], budget(available_pages=2 * BP))
    assert plan.preempt == ["new"]
    assert plan.decode == ["old", "mid"]
    # a low-priority request goes before a newer high-priority one
    run[0] = running("old", 32, arrival=0.0, priority=5)
    plan = plan_step(run, [], budget(available_pages=2 * BP))
    assert plan.preempt == ["old"]


def test_prefill_shrinks_to_the_pages_left():
    plan = plan_step([running("p", 16, pending=100)], [], budget(available_pages=2 * BP,
                                                                  chunk=64, max_tokens=64))
    assert plan.prefill == [("p", 32)]  # two more pages of 16 tokens


def test_tpot_targets_cap_prefill_tokens_unless_a_ttft_deadline_has_passed():
    run = [running("d", 40, tpot_slo=0.05)]
    cost = dict(decode_step_seconds=0.03, prefill_token_seconds=0.001, now=10.0)
    plan = plan_step(run, [waiting("w", 100, arrival=9.0)], budget(max_tokens=256, chunk=256,
                                                                   **cost))
    assert plan.prefill == [("w", 20)]  # (0.05 - 0.03) / 0.001
    plan = plan_step(run, [waiting("w", 100, arrival=9.0, ttft_deadline=9.5)],
                     budget(max_tokens=256, chunk=256, **cost))
    assert plan.prefill == [("w", 100)]
    plan = plan_step([running("d", 40, tpot_slo=0.02)], [waiting("w", 100)],
                     budget(**cost))
    assert plan.prefill == [] and plan.decode == ["d"]


# ---------------------------------------------------------------------------- the loop

TINY = ModelConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_layers=2,
                   num_heads=8, num_kv_heads=2, head_dim=64, rope_theta=10000.0)
PAGE_BYTES = 8 * 64 * 4 * 2  # one float32 page of 8 tokens, keys and values


@pytest.fixture(scope="module")
def params():
    return random_params(TINY, seed=5, dtype=jnp.float32)


def engine(params, pages: int = 512, **kw) -> Engine:
    kw = {"max_model_len": 64, "max_num_seqs": 4, "prefill_chunk": 16, **kw}
    return Engine(TINY, params, cache=CacheConfig(page_size=8, kv_cache_bytes=pages * PAGE_BYTES),
                  **kw)


def run(sched: Scheduler, prompts, n: int = 10, **kw) -> list[Request]:
    reqs = [Request(list(p), SamplingParams(max_tokens=n, temperature=0, **kw))
            for p in prompts]
    generate_all(sched, reqs)
    return reqs


def prompts_of(lengths, seed=None):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, TINY.vocab_size, n).tolist() for n in lengths]


def test_continuous_batching_matches_one_request_at_a_time(params):
    prompts = prompts_of((5, 23, 40, 9, 31, 17))
    alone = [run(Scheduler(engine(params, enable_prefix_caching=False)), [p])[0].output
             for p in prompts[:3]]
    eng = engine(params, enable_prefix_caching=False)
    sched = Scheduler(eng, SchedulerConfig(max_num_batched_tokens=24))
    together = run(sched, prompts)  # 6 requests, 4 slots: some join as others leave
    assert [r.output for r in together[:3]] == alone
    assert all(r.finish_reason == "length" and len(r.output) == 10 for r in together)
    assert eng.free_pages == eng.total_pages and eng.num_free_slots == 4


def test_a_follow_up_turn_reuses_the_history_and_gives_the_same_tokens(params):
    prompts = prompts_of((21, 37))
    outputs = {}
    for cached in (True, False):
        eng = engine(params, enable_prefix_caching=cached)
        sched = Scheduler(eng)
        first = run(sched, prompts)
        follow = [p + r.output + [7, 8, 9] for p, r in zip(prompts, first, strict=True)]
        hits = eng.stats.prefix_hit_tokens
        second = run(sched, follow)
        outputs[cached] = [r.output for r in first + second]
        if cached:
            # every full page of each history whose KV was computed (the prompt and the
            # reply but its last token, which was sampled and never fed) was found
            want = sum((len(p) + len(r.output) - 1) // 8 * 8
                       for p, r in zip(prompts, first, strict=True))
            assert eng.stats.prefix_hit_tokens - hits == want
            assert eng.pages_used == len(eng.prefix) * eng.block_pages  # only cache holds any
        else:
            assert eng.stats.prefix_hit_tokens == 0 and eng.pages_used == 0
    assert outputs[True] == outputs[False]


def test_device_cache_bytes_bounds_the_cached_blocks(params):
    eng = engine(params, device_cache_bytes=3 * 4 * PAGE_BYTES)  # three blocks
    run(Scheduler(eng), prompts_of((40, 40)))
    assert len(eng.prefix) == 3 and eng.pages_used == 3 * eng.block_pages


def test_out_of_pages_preempts_and_recomputes_with_the_same_tokens(params):
    prompts = prompts_of((20, 22, 24, 26))
    big = run(Scheduler(engine(params, enable_prefix_caching=False)), prompts, n=20)
    # 4 requests growing to 44..46 tokens need 24 blocks; the pool holds 17 (one sequence of
    # max_model_len 64 needs 8)
    eng = engine(params, pages=17 * 4 + 1, enable_prefix_caching=False)
    sched = Scheduler(eng)
    small = run(sched, prompts, n=20)
    assert sched.stats.preemptions > 0 and sched.stats.recomputed_tokens > 0
    assert [r.output for r in small] == [r.output for r in big]
    assert eng.free_pages == eng.total_pages


def test_abort_and_deadline_free_the_slot_and_pages(params):
    eng = engine(params)
    sched = Scheduler(eng)
    a, b = (Request(p, SamplingParams(max_tokens=50, temperature=0))
            for p in prompts_of((30, 30)))
    sched.add(a)
    sched.add(b)
    for _ in range(4):
        sched.step()
    assert eng.num_free_slots == 2
    sched.abort(a)
    b.deadline = 0.0  # long past
    finished = sched.step()
    assert {r.finish_reason for r in finished} == {"abort", "timeout"}
    assert sched.num_unfinished == 0 and eng.num_free_slots == 4
    assert eng.available_pages == eng.total_pages


def test_on_token_stop_and_context_limit(params):
    eng = engine(params)
    sched = Scheduler(eng)
    seen = []
    stop = Request(prompts_of((10,))[0], SamplingParams(max_tokens=30, temperature=0),
                   on_token=lambda r, t: seen.append(t) or len(seen) == 3)
    full = Request(prompts_of((60,))[0], SamplingParams(max_tokens=30, temperature=0))
    generate_all(sched, [stop, full])
    assert stop.finish_reason == "stop" and stop.output == seen and len(seen) == 3
    assert full.finish_reason == "length" and len(full.tokens) == 64
    with pytest.raises(ValueError, match="context holds 64"):
        sched.add(Request(list(range(64))))
    with pytest.raises(ValueError, match="empty"):
        sched.add(Request([]))


def test_steady_workload_does_not_recompile(params):
    eng = engine(params)
    sched = Scheduler(eng)
    run(sched, prompts_of((12, 30, 7, 19)), n=8)
    compiles = eng.num_compiles
    run(sched, prompts_of((11, 29, 8, 20)), n=8)
    run(sched, prompts_of((13, 31, 6, 18)), n=8, seed=3)
    assert eng.num_compiles == compiles
    snap = sched.snapshot()
    assert snap["compilations"] == compiles and snap["num_requests_running"] == 0
    assert snap["prefix_hit_tokens"]["device"] == eng.stats.prefix_hit_tokens


@pytest.mark.parametrize("shape_step", [2, 4])
def test_warmup_compiles_every_shape_a_workload_uses(params, shape_step):
    eng = engine(params, shape_step=shape_step)
    assert eng.warmup() == len(eng.shapes())  # each listed shape is its own compilation
    compiles = eng.num_compiles
    rng = np.random.default_rng()
    shared = prompts_of((24,))[0]
    prompts = [shared[: int(rng.integers(1, 24))] + p
               for p in prompts_of(rng.integers(1, 36, 14))]
    reqs = [Request(p, SamplingParams(max_tokens=int(rng.integers(1, 12)), temperature=0))
            for p in prompts]
    generate_all(Scheduler(eng, SchedulerConfig(max_num_batched_tokens=48)), reqs)
    assert all(r.finish_reason == "length" for r in reqs)
    assert eng.stats.step_shapes <= set(eng.shapes())
    assert eng.num_compiles == compiles


def test_layerwise_dispatch_gives_the_scan_outputs(params):
    prompts = prompts_of((5, 23, 40))
    scan = engine(params, execution="scan")
    scan.runner.layer_by_layer = False  # the one-call scan (`_step`), which a CPU engine skips
    outs = {"scan": [r.output for r in run(Scheduler(scan), prompts)],
            "layerwise": [r.output for r in run(Scheduler(engine(params,
                                                                  execution="layerwise")),
                                                prompts)]}
    assert outs["layerwise"] == outs["scan"]
    with pytest.raises(ValueError, match="execution"):
        engine(params, execution="eager")
