"""The scheduler's serving loop on a tiny random model (continuous batching, prefix reuse,
preemption, aborts, compile counts); its pure policies are tested in test_planning.py."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jkv.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from jkv.engine.engine import Engine
from jkv.engine.sampling import SamplingParams
from jkv.kv.buckets import bucket, decode_bucket
from jkv.models.loaders import random_params
from jkv.sched.planning import plan_step
from jkv.sched.scheduler import Request, Scheduler, generate_all

TINY = ModelConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_layers=2,
                   num_heads=8, num_kv_heads=2, head_dim=64, rope_theta=10000.0)
PAGE_BYTES = 8 * 64 * 4 * 2  # one float32 page of 8 tokens, keys and values


@pytest.fixture(scope="module")
def params():
    return random_params(TINY, seed=5, dtype=jnp.float32)


def engine(params, pages: int = 512, **kw) -> Engine:
    kw = {"max_model_len": 64, "max_num_seqs": 4, "prefill_chunk": 16, **kw}
    shape_step = kw.pop("shape_step", None)
    return Engine(TINY, params, cache=CacheConfig(page_size=8, kv_cache_bytes=pages * PAGE_BYTES),
                  config=EngineConfig(**kw), shape_step=shape_step)


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
    assert eng.cache.free_pages == eng.cache.total_pages and eng.cache.num_free_slots == 4


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
            # only the cache holds any
            assert eng.cache.pages_used == eng.cache.pages_cached
        else:
            assert eng.stats.prefix_hit_tokens == 0 and eng.cache.pages_used == 0
    assert outputs[True] == outputs[False]


def test_device_cache_bytes_bounds_the_cached_blocks(params):
    eng = engine(params, device_cache_bytes=3 * 4 * PAGE_BYTES)  # three blocks
    run(Scheduler(eng), prompts_of((40, 40)))
    assert len(eng.cache.layout.prefix) == 3 and eng.cache.pages_used == 3 * eng.cache.block_pages


@pytest.mark.parametrize("layer_offload", [False, True])
def test_out_of_pages_preempts_or_offloads_layers_with_the_same_tokens(params, layer_offload):
    """Short of pages, running requests are preempted and recomputed, or (LayerKV) keep
    running with some layers on the host, fetched back once pages free up."""
    prompts = prompts_of((20, 22, 24, 26))
    big = run(Scheduler(engine(params, enable_prefix_caching=False)), prompts, n=20)
    # 4 requests growing to 44..46 tokens need 24 blocks; the pool holds 17 (one sequence of
    # max_model_len 64 needs 8)
    eng = engine(params, pages=17 * 4 + 1, enable_prefix_caching=False)
    sched = Scheduler(eng, SchedulerConfig(layer_offload=layer_offload))
    small = run(sched, prompts, n=20)
    if layer_offload:
        snap = sched.snapshot()["layer_offload"]
        assert sched.stats.preemptions == 0 and sched.stats.recomputed_tokens == 0
        assert snap["layers_offloaded"] > 0 and snap["bytes_to_host"] > 0
        assert snap["fetches"] > 0  # brought back as the others finished
        from jkv.metrics import Metrics

        metrics = Metrics()
        metrics.sync(sched.snapshot())
        text = metrics.render().decode()
        assert f"jkv_layer_offload_layers_total {float(snap['layers_offloaded'])}" in text
        assert "jkv_layer_offload_requests 0.0" in text  # none left offloaded
    else:
        assert sched.stats.preemptions > 0 and sched.stats.recomputed_tokens > 0
    assert [r.output for r in small] == [r.output for r in big]
    assert eng.cache.free_pages == eng.cache.total_pages


def test_a_prompt_arriving_at_a_full_pool_starts_at_once_with_its_layers_offloaded(params):
    """LayerKV: two long decodes hold the pool; a third prompt arrives. Without layer
    offload it waits for pages (and the two others outgrow the pool: one is preempted);
    with it, it is admitted at once with its layers on the host, and nothing is preempted;
    every request's tokens are those it gets alone."""
    cfg = TINY.replace(num_layers=8)  # a layer's pages: an eighth of a request's
    deep = random_params(cfg, seed=5, dtype=jnp.float32)

    def make(pages: int) -> Engine:
        return Engine(cfg, deep, cache=CacheConfig(page_size=8, kv_cache_bytes=pages * PAGE_BYTES),
                      config=EngineConfig(max_model_len=64, max_num_seqs=4, prefill_chunk=16,
                                          enable_prefix_caching=False))

    prompts = prompts_of((40, 40, 40), seed=7)
    alone = [run(Scheduler(make(512)), [p], n=20)[0].output for p in prompts]
    for offload in (False, True):
        # 13 blocks: the two running requests hold 6 each when the third arrives, 8 at the end
        eng = make(13 * 16 + 1)
        sched = Scheduler(eng, SchedulerConfig(layer_offload=offload))
        reqs = [Request(p, SamplingParams(max_tokens=20, temperature=0)) for p in prompts]
        for r in reqs[:2]:
            sched.add(r)
        first_token, finished = None, []
        for i in range(300):  # bounded: a stalled loop fails here instead of hanging
            if i == 8:
                sched.add(reqs[2])  # both others decoding by now
            if i > 8 and not sched.num_unfinished:
                break
            finished += [i for r in sched.step() if r is not reqs[2]]
            if reqs[2].output and first_token is None:
                first_token = i
        assert not sched.num_unfinished
        assert [r.output for r in reqs] == alone
        assert eng.cache.free_pages == eng.cache.total_pages
        if offload:  # its prefill ran at once: 40 tokens, 14 a step beside the 2 decodes
            assert first_token == 8 + 2 < finished[0]
            assert sched.stats.preemptions == 0 and sched.stats.admitted_offloaded == 1
            assert sched.stats.layer_major_prefills == 1  # 40 tokens: longer than a chunk
        else:  # it waited for pages; the two others alone outgrow the pool (16 blocks)
            assert first_token > 8 + 2 and sched.stats.preemptions > 0


def test_prefills_that_fill_the_pool_do_not_stall(params):
    """Two prompts admitted together prefill until they hold every page, each still short of
    its last chunk, with no decode running to free one: the newer one is preempted."""
    prompts = prompts_of((40, 40), seed=3)
    alone = [run(Scheduler(engine(params, enable_prefix_caching=False)), [p], n=4)[0].output
             for p in prompts]
    eng = engine(params, pages=8 * 4 + 1, enable_prefix_caching=False)  # one 64-token sequence
    sched = Scheduler(eng, SchedulerConfig(max_num_batched_tokens=32))  # both chunks a step
    reqs = [Request(p, SamplingParams(max_tokens=4, temperature=0)) for p in prompts]
    for r in reqs:
        sched.add(r)
    for _ in range(200):  # bounded: a stalled loop fails here instead of hanging
        if not sched.num_unfinished:
            break
        sched.step()
    assert not sched.num_unfinished, "the scheduler stopped making progress"
    assert sched.stats.preemptions > 0
    assert [r.output for r in reqs] == alone
    assert eng.cache.free_pages == eng.cache.total_pages


def test_abort_and_deadline_free_the_slot_and_pages(params):
    eng = engine(params)
    sched = Scheduler(eng)
    a, b = (Request(p, SamplingParams(max_tokens=50, temperature=0))
            for p in prompts_of((30, 30)))
    sched.add(a)
    sched.add(b)
    for _ in range(4):
        sched.step()
    assert eng.cache.num_free_slots == 2
    sched.abort(a)
    b.deadline = 0.0  # long past
    finished = sched.step()
    assert {r.finish_reason for r in finished} == {"abort", "timeout"}
    assert sched.num_unfinished == 0 and eng.cache.num_free_slots == 4
    assert eng.cache.available_pages == eng.cache.total_pages


def test_a_snapshot_while_a_request_finishes_does_not_fail(params):
    """`snapshot` is read from other threads (/metrics): a request whose state the loop
    has dropped at its finish but still lists as running is skipped, not a KeyError."""
    eng = engine(params)
    sched = Scheduler(eng)
    r = Request(prompts_of((20,))[0], SamplingParams(max_tokens=50, temperature=0))
    sched.add(r)
    for _ in range(3):
        sched.step()
    assert r in sched.running
    state = sched._state.pop(r)  # the window inside `_finish`
    assert sched.snapshot()["layer_offload"]["requests_offloaded"] == 0
    sched._state[r] = state


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


def test_a_step_that_compiled_teaches_the_cost_model_nothing(params, monkeypatch):
    import itertools

    import jkv.sched.scheduler

    sched = Scheduler(engine(params))
    learned = []
    monkeypatch.setattr(sched.costs, "learn", lambda *a, **k: learned.append(a))
    counter = itertools.count()  # every step compiles
    monkeypatch.setattr(jkv.sched.scheduler, "compilations", lambda: next(counter))
    run(sched, prompts_of((12,), seed=1), n=4)
    assert learned == []
    monkeypatch.setattr(jkv.sched.scheduler, "compilations", lambda: 0)  # none does
    steps = sched.engine.stats.steps
    run(sched, prompts_of((12,), seed=2), n=4)
    assert len(learned) == sched.engine.stats.steps - steps > 0


def test_warmup_compiles_every_shape_a_workload_uses(params):
    eng = engine(params, shape_step=2)  # the CPU default (4 on a GPU: fewer, coarser shapes)
    jax.clear_caches()  # engines share compilations: start from none
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


def test_decode_rows_are_padded_finely_on_a_cpu_and_in_powers_on_a_gpu(params):
    for n in range(1, 200):  # (pure: every count up to 8, then steps of at most 1.5x)
        fine = decode_bucket(n, 2)
        assert fine == n if n <= 8 else n <= fine < 1.5 * n
        assert decode_bucket(n, 4) == bucket(n, 1, 4)
    rows = int(np.random.default_rng().integers(5, 8))  # (not a power of two)
    for shape_step, padded in ((2, rows), (4, 8)):
        eng = engine(params, shape_step=shape_step, max_num_seqs=8)
        sched = Scheduler(eng)
        for _ in range(2):  # the second time without compiling (such steps are not learned)
            run(sched, prompts_of((9,) * rows), n=8)
        assert (padded, 1) in eng.stats.step_shapes and (padded, 1) in eng.shapes()
        assert padded in sched.costs.by_rows  # its steps' cost, learned at that size


def test_prefill_rows_share_a_call_only_where_that_adds_little_padding(params):
    rng = np.random.default_rng()
    for shape_step in (2, 4):
        runner = engine(params, shape_step=shape_step, prefill_chunk=512,
                        max_model_len=512).runner
        # a chunk's 2-token tail beside the next prompt's 508: its own 16-token call, not a
        # second 512-token row of padding (which doubled a CPU step)
        assert runner.prefill_groups([2, 508]) == [[1], [0]]
        for _ in range(300):
            lengths = rng.integers(1, 513, int(rng.integers(1, 9))).tolist()
            groups = runner.prefill_groups(lengths)
            assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
            for g in groups:
                area = runner.rows_bucket(len(g)) * runner.tokens_bucket(
                    max(lengths[i] for i in g))
                alone = sum(runner.tokens_bucket(lengths[i]) for i in g)
                assert area <= runner.prefill_area
                assert area - alone <= (len(g) - 1) * runner.call_tokens


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


def test_slo_misses_and_goodput_are_counted_and_exported(params):
    from jkv.metrics import Metrics

    sched = Scheduler(engine(params))
    rng = np.random.default_rng()
    reqs = [Request(rng.integers(0, TINY.vocab_size, 20).tolist(),
                    SamplingParams(max_tokens=6, temperature=0), **slo)
            for slo in ({"ttft_slo_ms": 1e-6},  # missed: no first token within a nanosecond
                        {"tpot_slo_ms": 1e-6},  # missed
                        {"ttft_slo_ms": 1e-6, "tpot_slo_ms": 1e-6},  # both missed
                        {"ttft_slo_ms": 3.6e6, "tpot_slo_ms": 3.6e6},  # kept (an hour)
                        {})]  # no target: kept
    aborted = Request([1, 2, 3], SamplingParams(max_tokens=50), ttft_slo_ms=1e-6)
    aborted.cancelled = True  # ended early: neither a miss nor goodput
    generate_all(sched, reqs + [aborted])
    stats = sched.snapshot()
    assert stats["slo_violations"] == {"ttft": 2, "tpot": 2}
    assert stats["requests_within_slo"] == 2
    assert all(r.arrival <= r.admit_time <= r.first_token_time for r in reqs)
    metrics = Metrics()
    metrics.sync(stats)
    for r in reqs:
        metrics.observe_finished(r)
    text = metrics.render().decode()
    assert 'jkv_slo_violations_total{kind="ttft"} 2.0' in text
    assert 'jkv_slo_violations_total{kind="tpot"} 2.0' in text
    assert "jkv_goodput_requests_total 2.0" in text
    assert "jkv_request_queue_time_seconds_count 5.0" in text


def test_the_policy_is_given_the_offload_cost_and_each_requests_future(params, monkeypatch):
    """What `admission_keeps_slack` weighs reaches `plan_step`: the measured seconds an
    offloaded layer adds to a step (0 until measured), a step of each number of decodes,
    and each request's expected remaining tokens (decoding ones with their TPOT slack)."""
    import jkv.sched.scheduler as scheduler_module

    seen = []

    def spy(running, waiting, budget):
        seen.append((running, waiting, budget))
        return plan_step(running, waiting, budget)

    monkeypatch.setattr(scheduler_module, "plan_step", spy)
    sched = Scheduler(engine(params), SchedulerConfig(layer_offload=True))
    # before any reply there is no estimate (not "just the next token": waiting for the
    # running requests' pages would look one step long)
    sched.add(Request(list(range(1, 9)), SamplingParams(max_tokens=2, temperature=0)))
    sched.step()
    assert seen[-1][1][0].remaining is None  # (waiting, at its first step)
    while sched.num_unfinished:
        sched.step()
    seen.clear()
    sched.lengths.recent.clear()  # (the reply just finished: 2 tokens)
    for n in (30, 30, 30):
        sched.lengths.add(None, n)
    a = Request(list(range(1, 20)), SamplingParams(max_tokens=50, temperature=0),
                tpot_slo_ms=200)
    sched.add(a)
    while len(a.output) < 5:
        sched.step()
    assert seen[-1][2].offload_layer_seconds == 0.0 and seen[-1][0][0].remaining is not None
    by_rows = seen[-1][2].decode_step_by_rows
    assert len(by_rows) == sched.engine.runner.max_rows + 1 and by_rows[0] == 0.0
    assert by_rows[1] > 0  # its decode steps, measured
    sched.costs.offload_layer_s = 0.003
    sched.add(Request(list(range(3, 40)), SamplingParams(max_tokens=8, temperature=0)))
    sched.step()
    running, waiting, budget = seen[-1]
    assert budget.offload_layer_seconds == 0.003
    (d,), (w,) = running, waiting
    assert d.tpot_slack is not None and d.remaining == 30 - 5
    assert w.remaining == 8  # its max_tokens is below the estimate
    assert not w.whole  # never preempted: it may come in with layers on the host
    back = Request(list(range(5, 30)), SamplingParams(max_tokens=8, temperature=0))
    back.num_preemptions = 1  # (as a preemption leaves it)
    sched.add(back)
    sched.step()
    assert [c.whole for c in seen[-1][1] if c.request_id == back.request_id] == [True]

    held = []

    def holding(running, waiting, budget):  # as if the slack check held each one back
        plan = plan_step(running, [], budget)
        plan.held = [c.request_id for c in waiting]
        held.append(plan.held)
        return plan

    monkeypatch.setattr(scheduler_module, "plan_step", holding)
    sched.add(Request(list(range(5, 30)), SamplingParams(max_tokens=8, temperature=0)))
    for _ in range(3):
        sched.step()
    # each request held in all three steps (one or two: the other may have been admitted)
    assert held[0] and held[0] == held[1] == held[2]
    assert sched.stats.admissions_held == len(held[0])  # counted once, not once a step
    assert sched.snapshot()["layer_offload"]["admissions_held"] == len(held[0])


# (tpot_slo_ms, first_token_time, first in the queue): its next token due at 0.5 s (behind
# its schedule: before the arrival due at 1.5 s), at 3.2 s (ahead: after it), not known
# (its TTFT deadline, 1 s: before)
@pytest.mark.parametrize("tpot_ms,first_token,first", [
    (100, 0.2, "back"), (1000, 0.2, "new"), (100, None, "back")])
def test_a_preempted_request_is_queued_by_its_next_tokens_deadline(params, monkeypatch,
                                                                    tpot_ms, first_token,
                                                                    first):
    """A request preempted part way through its reply is queued by when its next token is
    due on its TPOT schedule: behind it, ahead of a later arrival (behind every arrival with
    a target its stream would stall); ahead of it, behind an arrival whose TTFT deadline
    comes first (its own TTFT deadline, met long ago, would put it before every arrival
    however far ahead it is)."""
    import jkv.sched.scheduler as scheduler_module
    from jkv.sched.plan_records import queue_order

    seen = []

    def spy(running, waiting, budget):
        seen.append(sorted(waiting, key=queue_order))
        return plan_step(running, [], budget)  # (admits no one: the queue stays)

    monkeypatch.setattr(scheduler_module, "plan_step", spy)
    sched = Scheduler(engine(params))
    back = Request(list(range(1, 20)), SamplingParams(max_tokens=8, temperature=0),
                   arrival=0.0, ttft_slo_ms=1000, tpot_slo_ms=tpot_ms)
    back.output, back.num_preemptions = [7, 8, 9], 1  # as a preemption leaves it
    back.first_token_time = first_token
    new = Request(list(range(2, 20)), SamplingParams(max_tokens=8, temperature=0),
                  arrival=0.5, ttft_slo_ms=1000, tpot_slo_ms=100)
    sched.add(new)
    sched.add(back)
    sched.step()
    order = [back.request_id, new.request_id]
    assert [c.request_id for c in seen[-1]] == (order if first == "back" else order[::-1])
    queued = {c.request_id: c for c in seen[-1]}[back.request_id]
    assert queued.ttft_deadline == 1.0 and queued.whole


def test_a_decoding_requests_tpot_slack_follows_layerkv_eq_1(params):
    sched = Scheduler(engine(params))
    r = Request(list(range(1, 20)), SamplingParams(max_tokens=50, temperature=0),
                tpot_slo_ms=200)
    sched.add(r)
    while len(r.output) < 11:
        sched.step()
    for n in (40, 40, 40):
        sched.lengths.add(None, n)
    sched._next_step_s = 0.05  # a step of the requests decoding now
    now = r.first_token_time + 1.0  # a second since its first token
    c = sched._running(r, now)
    m = 40 - 11  # the estimate (40) less what it generated
    assert c.tpot_slack == pytest.approx((10 + m) * 0.2 - 1.0 - m * 0.05)
    r.tpot_slo_ms = None  # no target: no slack
    assert sched._running(r, now).tpot_slack is None
