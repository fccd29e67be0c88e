"""LeanKV's token tiers through the whole engine (kv_policy="leankv"): the same tokens as the
high tier's format when nothing is demoted, the same tokens from both attention backends,
and page accounting that stays exact while tiers shrink, sequences end and are preempted."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_engine_formats import TINY, greedy, make_engine

from jkv.config import CacheConfig, EngineConfig, SchedulerConfig
from jkv.engine.engine import Engine
from jkv.engine.sampling import SamplingParams
from jkv.kv.format import KV_FORMATS, KVFormat
from jkv.kv.page_pool import page_bytes
from jkv.models.loaders import random_params
from jkv.sched.scheduler import Request, Scheduler

PAGE = 8


@pytest.fixture(scope="module")
def tiny_params():
    return random_params(TINY, seed=3, dtype=jnp.float32)


def tiered(params, backend: str, alpha_high: float = 0.0, alpha_low: float = 0.0,
           kv_cache_bytes: int = 8 << 20, max_num_seqs: int = 4,
           kv_format: KVFormat | str = "auto", kv_policy: str = "leankv",
           max_model_len: int = 128, kv_placement_interval: int = 4,
           shape_step: int | None = None, **kw) -> Engine:
    cache = CacheConfig(page_size=PAGE, kv_cache_bytes=kv_cache_bytes, kv_policy=kv_policy,
                        kv_alpha_high=alpha_high, kv_alpha_low=alpha_low,
                        kv_recent_window=PAGE, kv_format=kv_format,
                        kv_placement_interval=kv_placement_interval, **kw)
    return Engine(TINY, params, cache=cache, config=EngineConfig(
        max_model_len=max_model_len, max_num_seqs=max_num_seqs, attention_backend=backend,
        prefill_chunk=16), shape_step=shape_step)


def prompts(lengths=(3, 16, 37)) -> list[list[int]]:
    rng = np.random.default_rng()
    return [rng.integers(0, TINY.vocab_size, n).tolist() for n in lengths]


def tier_stats(engine: Engine) -> dict:
    return Scheduler(engine).snapshot()["kv_tiers"]


def test_leankv_keeping_every_token_is_its_high_format(tiny_params):
    """Thresholds 0 keep every token in the high tier: tokens written one at a time into
    tier slots give what whole pages in the same format give."""
    ps = prompts((37,))
    eng = tiered(tiny_params, "xla", 0.0, 0.0)
    assert greedy(eng, ps, 16) == greedy(make_engine(TINY, tiny_params, "k8v4t", "xla"), ps, 16)
    tiers = tier_stats(eng)
    assert tiers["high"] > 0 and tiers["low"] == tiers["pruned"] == 0


def test_leankv_pallas_and_xla_agree_with_every_tier_used(tiny_params):
    ps = prompts((16, 37))
    xla_engine = tiered(tiny_params, "xla", 1.0, 0.5, kv_sink_tokens=0)
    xla = greedy(xla_engine, ps, 16)
    # the kernels over a table width that is no power of two (tiered widths are multiples
    # of 32 pages): the same tokens
    pallas_engine = tiered(tiny_params, "pallas", 1.0, 0.5, kv_sink_tokens=0, max_model_len=600)
    assert pallas_engine.cache.max_pages == 96
    assert greedy(pallas_engine, ps, 16) == xla
    tiers = tier_stats(xla_engine)
    assert tiers["low"] > 0 and tiers["pruned"] > 0  # the test exercises demotion and pruning


@pytest.mark.parametrize("policy,knobs", [("streaming", {"kv_sink_tokens": 3}),
                                          ("h2o", {"kv_heavy_ratio": 0.25})])
def test_pruning_baselines_keep_what_they_promise_and_backends_agree(tiny_params, policy,
                                                                     knobs):
    """StreamingLLM keeps exactly the sinks and the window; H2O the window and its share of
    heavy hitters (the most attended, as many as its ratio of the tokens); the
    pallas and xla paths give the same tokens."""
    from jkv.engine.runner import Row

    ps = prompts((37, 20))
    xla_engine = tiered(tiny_params, "xla", kv_policy=policy, **knobs)
    xla = greedy(xla_engine, ps, 24)
    assert greedy(tiered(tiny_params, "pallas", kv_policy=policy, **knobs), ps, 24) == xla

    eng = tiered(tiny_params, "xla", kv_policy=policy, kv_placement_interval=1, **knobs)
    prompt, key = prompts((45,))[0], eng.request_key(0)
    slot, _ = eng.open(prompt)
    greedy_params = SamplingParams(temperature=0)
    eng.step([Row(slot, prompt[:16], greedy_params, key)], [])
    eng.step([Row(slot, prompt[16:32], greedy_params, key)], [])
    [last], _ = eng.step([Row(slot, prompt[32:], greedy_params, key)], [])
    eng.step([], [Row(slot, [last.token], greedy_params, key, 1)])
    n = 46
    c = eng.cache
    t = c.layout
    meta, pages, high = jax.device_get((t.meta, c.tables.pages[slot], t.counts.high[slot]))
    for layer, head in np.ndindex(high.shape):
        held = [(meta.pos[pages[layer, head, j // PAGE], j % PAGE],
                 meta.score[pages[layer, head, j // PAGE], j % PAGE])
                for j in range(high[layer, head])]
        kept = sorted(p for p, _ in held if p < n - PAGE)  # outside the recent window
        assert sorted(p for p, _ in held if p >= n - PAGE) == list(
            range(n - PAGE, n // PAGE * PAGE))  # the window's tokens in full pages
        if policy == "streaming":
            assert kept == [0, 1, 2]
        else:
            assert len(kept) <= int(np.ceil(0.25 * n))
            assert len(kept) >= int(np.ceil(0.25 * (n - 1)))
    assert tier_stats(xla_engine)["pruned"] > 0


def check_pages(engine: Engine) -> None:
    """The host's page counts equal the device's; every row holds the pages its tiers fill."""
    c = engine.cache
    t = c.layout
    free, tables, high, low = jax.device_get((c.free, c.tables, t.counts.high, t.counts.low))
    assert int(free.num_free) == c.free_pages
    np.testing.assert_array_equal(high, c.layout.high)
    np.testing.assert_array_equal(low, c.layout.low)
    np.testing.assert_array_equal(tables.num_pages, -(-high // PAGE))
    np.testing.assert_array_equal(tables.low_pages, -(-low // (2 * PAGE)))
    held = sum(c.pages_held(s) for s in range(c.max_num_seqs) if c.is_open(s))
    kept = 0
    if c.layout.entries is not None:  # kept sequences: their rows hold the pages their tiers fill
        entries, e_high, e_low = jax.device_get((c.layout.entry_tables, c.layout.entry_counts.high,
                                                 c.layout.entry_counts.low))
        np.testing.assert_array_equal(entries.num_pages, -(-e_high // PAGE))
        np.testing.assert_array_equal(entries.low_pages, -(-e_low // (2 * PAGE)))
        for row in range(c.layout.entries.rows):
            if row in c.layout.entries:
                e = c.layout.entries.get(row)
                np.testing.assert_array_equal(e_high[row], e.high)
                np.testing.assert_array_equal(e_low[row], e.low)
            else:
                assert not e_high[row].any() and not e_low[row].any()
        kept = c.layout.entries.pages
    assert held + kept == c.pages_used


def run_checked(engine: Engine, requests: list[Request]) -> tuple[int, Scheduler]:
    """Run to the end, checking the pages after every step: (the most requests running, the
    scheduler)."""
    sched = Scheduler(engine)
    for r in requests:
        sched.add(r)
    peak = 0
    for _ in range(2000):
        if not sched.num_unfinished:
            break
        sched.step()
        check_pages(engine)
        peak = max(peak, sched.snapshot()["num_requests_running"])
    assert not sched.num_unfinished
    check_nothing_leaked(engine)
    return peak, sched


def check_nothing_leaked(engine: Engine) -> None:
    """With every sequence ended and every kept one evicted, every page is free."""
    c = engine.cache
    assert c.free_pages + c.pages_cached == c.total_pages
    assert c.make_room(c.total_pages)
    assert c.pages_cached == 0
    assert int(jax.device_get(c.free.num_free)) == c.total_pages
    assert not jax.device_get(c.free.refs).any()


def test_leankv_pages_stay_exact_through_preemption_and_admit_more(tiny_params):
    """A pool too small for every sequence at once: tiers that prune admit more sequences
    than the same pool in the high tier's format, and every step's accounting is exact.
    Rows padded to powers of 4: each engine compiles 4 step shapes, not up to 6 (compiling
    is most of the test's time; admission and accounting do not depend on the padding)."""
    one_page = page_bytes(KV_FORMATS["k8v4t"], PAGE, TINY.head_dim, jnp.float32)
    # 70 pages: one sequence of max_model_len (with its tiers' part-filled pages) and 2 more
    pool_bytes = 71 * one_page
    lengths = (40, 60, 50, 30)

    def requests():
        return [Request(p, SamplingParams(max_tokens=60, temperature=0, ignore_eos=True))
                for p in prompts(lengths)]

    cache = CacheConfig(page_size=PAGE, kv_cache_bytes=pool_bytes, kv_format="k8v4t")
    plain = Engine(TINY, tiny_params, cache=cache, config=EngineConfig(
        max_model_len=128, max_num_seqs=4, attention_backend="xla", prefill_chunk=16),
        shape_step=4)
    # (without layer offload, which admits more by holding layers on the host instead)
    plain_sched = Scheduler(plain, SchedulerConfig(layer_offload=False))
    for r in requests():
        plain_sched.add(r)
    plain_peak = 0
    while plain_sched.num_unfinished:
        plain_sched.step()
        plain_peak = max(plain_peak, plain_sched.snapshot()["num_requests_running"])

    eng = tiered(tiny_params, "xla", 2.0, 1.0, kv_cache_bytes=pool_bytes, shape_step=4)
    peak, sched = run_checked(eng, requests())
    stats = sched.snapshot()
    assert peak > plain_peak
    assert stats["preemptions"] > 0  # the accounting was checked through them
    assert 0 < stats["kv_bytes_per_token"] < plain_sched.snapshot()["kv_bytes_per_token"]


def dense_significance(params, cfg, tokens: list[int], observe_from: int = 0) -> np.ndarray:
    """Every key's attention summed over the queries at or after it (and at or after
    `observe_from`), max over its KV head's query heads, from a dense float32 forward:
    [L, Hkv, n]."""
    from jkv.models.llama import layer_weights, mlp, positional_tables, rms_norm, rotate

    n, g = len(tokens), cfg.num_heads // cfg.num_kv_heads
    x = params["embed"][jnp.asarray(tokens)][None]
    rope = positional_tables(cfg, jnp.arange(n)[None])
    causal = jnp.tril(jnp.ones((n, n), bool))
    out = []
    for i in range(cfg.num_layers):
        w = layer_weights(params, i)
        q, k, v = jnp.split(rms_norm(x, w["attn_norm"], cfg.rms_norm_eps) @ w["wqkv"],
                            [cfg.num_heads * cfg.head_dim,
                             (cfg.num_heads + cfg.num_kv_heads) * cfg.head_dim], axis=-1)
        q = rotate(q.reshape(1, n, cfg.num_heads, cfg.head_dim), rope)[0]
        k = rotate(k.reshape(1, n, cfg.num_kv_heads, cfg.head_dim), rope)[0]
        v = v.reshape(n, cfg.num_kv_heads, cfg.head_dim)
        k, v = jnp.repeat(k, g, axis=1), jnp.repeat(v, g, axis=1)
        s = jnp.einsum("qhd,khd->hqk", q, k, precision="highest") / np.sqrt(cfg.head_dim)
        p = jax.nn.softmax(jnp.where(causal, s, -jnp.inf), axis=-1)  # [Hq, n, n]
        out.append(p.reshape(cfg.num_kv_heads, g, n, n).max(axis=1)[:, observe_from:].sum(
            axis=1))
        attn = jnp.einsum("hqk,khd->qhd", p, v, precision="highest").reshape(1, n, -1)
        x = x + attn @ w["wo"]
        x = x + mlp(rms_norm(x, w["mlp_norm"], cfg.rms_norm_eps), w["w_gate_up"],
                    w["w_down"])
    return np.stack([np.asarray(o) for o in out])


def engine_significance(engine: Engine, slot: int, n: int) -> np.ndarray:
    """The summed attention the engine holds for each of the slot's n tokens (tier slots
    through TokenMeta, the filling page beside it): [L, Hkv, n]."""
    c = engine.cache
    t = c.layout
    meta, pages, high, score = jax.device_get((t.meta, c.tables.pages[slot], t.counts.high[slot],
                                               c.filling.score[slot]))
    out = np.full(high.shape + (n,), np.nan)
    for layer, head in np.ndindex(high.shape):
        for j in range(high[layer, head]):
            page = pages[layer, head, j // PAGE]
            out[layer, head, meta.pos[page, j % PAGE]] = meta.score[page, j % PAGE]
        start = n // PAGE * PAGE
        out[layer, head, start:] = score[layer, head, : n - start]
    return out


@pytest.mark.parametrize("backend", ["xla", "pallas"])
def test_significance_is_the_attention_each_key_received(tiny_params, backend):
    """After each of two prefill chunks and a decode step, each token's score is the
    attention it got from every query so far (max over its query heads), whether it sits in
    a tier or in the filling page: against a dense forward (exact while every key is in the
    step's full-precision window, close once pages quantized to 8 bits are read: a query
    missed or counted twice would be off by several percent)."""
    from jkv.engine.runner import Row

    eng = tiered(tiny_params, backend, 0.0, 0.0, kv_format=KVFormat(8, 8, 32, token_keys=True))
    prompt = prompts((21,))[0]
    greedy_params, key = SamplingParams(temperature=0), eng.request_key(0)
    slot, _ = eng.open(prompt)
    eng.step([Row(slot, prompt[:13], greedy_params, key)], [])
    np.testing.assert_allclose(engine_significance(eng, slot, 13),
                               dense_significance(tiny_params, TINY, prompt[:13]), rtol=1e-4,
                               atol=1e-6)
    [first], _ = eng.step([Row(slot, prompt[13:], greedy_params, key)], [])
    np.testing.assert_allclose(engine_significance(eng, slot, 21),
                               dense_significance(tiny_params, TINY, prompt), rtol=1e-2,
                               atol=2e-4)
    eng.step([], [Row(slot, [first.token], greedy_params, key, 1)])
    np.testing.assert_allclose(engine_significance(eng, slot, 22),
                               dense_significance(tiny_params, TINY, prompt + [first.token]),
                               rtol=1e-2, atol=2e-4)


@pytest.mark.parametrize("backend", ["xla", "pallas"])
def test_a_policy_observing_the_prompts_end_sums_only_its_last_queries(
        tiny_params, backend, monkeypatch):
    """A policy that `decides_at_prompt_end` (SnapKV's observation window) gets each token's
    attention summed over the prompt's last `kv_recent_window` queries and later ones only:
    a prompt of 21 with a window of 8 counts queries 13 on, from the middle of the second
    chunk (10 + 11 tokens), against the dense forward."""
    from jkv.engine.runner import Row
    from jkv.policies import POLICIES, KVPolicy

    lean = POLICIES["leankv"]
    monkeypatch.setitem(POLICIES, "observing", KVPolicy(
        "observing", "leankv's fates, significance from the prompt's end", fates=lean.fates,
        knobs=lean.knobs, decides_at_prompt_end=True))
    eng = tiered(tiny_params, backend, 0.0, 0.0, kv_format=KVFormat(8, 8, 32, token_keys=True),
                 kv_policy="observing")
    prompt = prompts((21,))[0]
    greedy_params, key = SamplingParams(temperature=0), eng.request_key(0)
    slot, _ = eng.open(prompt)
    eng.step([Row(slot, prompt[:10], greedy_params, key)], [])
    assert not engine_significance(eng, slot, 10).any()
    [first], _ = eng.step([Row(slot, prompt[10:], greedy_params, key)], [])
    np.testing.assert_allclose(engine_significance(eng, slot, 21),
                               dense_significance(tiny_params, TINY, prompt, 13), rtol=1e-2,
                               atol=2e-4)
    eng.step([], [Row(slot, [first.token], greedy_params, key, 1)])
    np.testing.assert_allclose(engine_significance(eng, slot, 22),
                               dense_significance(tiny_params, TINY, prompt + [first.token], 13),
                               rtol=1e-2, atol=2e-4)


def run_beside(params, prompt: list[int], neighbour: list[int] | None, steps: int,
               lead: int = 3) -> tuple[list[int], np.ndarray]:
    """`prompt` decoded `steps` greedy tokens on a leankv engine that demotes and prunes,
    alone or beside `neighbour`, which started decoding `lead` steps before it: (its tokens,
    its high and low tier counts [2, L, Hkv] after them)."""
    from jkv.engine.runner import Row

    eng = tiered(params, "xla", 2.0, 0.5)
    g = SamplingParams(temperature=0)
    rows = []
    for i, p in enumerate([x for x in (neighbour, prompt) if x is not None]):
        slot, _ = eng.open(p)
        for start in range(0, len(p), 16):
            [out], _ = eng.step([Row(slot, p[start:start + 16], g, eng.request_key(i))], [])
        rows.append([slot, out.token, eng.request_key(i), 0])
        for _ in range(lead if i == 0 and neighbour is not None else 0):
            _, [out] = eng.step([], [Row(rows[0][0], [rows[0][1]], g, rows[0][2], 1)])
            rows[0][1] = out.token
    tokens = []
    for _ in range(steps):
        _, outs = eng.step([], [Row(s, [t], g, k, n + 1) for s, t, k, n in rows])
        for r, o in zip(rows, outs, strict=True):
            r[1], r[3] = o.token, r[3] + 1
        tokens.append(rows[-1][1])
    slot = rows[-1][0]
    return tokens, np.stack([eng.cache.layout.high[slot], eng.cache.layout.low[slot]])


def test_a_sequences_compression_does_not_depend_on_its_neighbours(tiny_params):
    """Decode placements run on each sequence's own count of unplaced tokens: beside a
    neighbour out of phase with it, a sequence keeps the same tiers and tokens as alone."""
    prompt, neighbour = prompts((29, 21))
    alone = run_beside(tiny_params, prompt, None, 13)
    beside = run_beside(tiny_params, prompt, neighbour, 13)
    assert alone[0] == beside[0]
    np.testing.assert_array_equal(alone[1], beside[1])
    assert alone[1][1].sum() > 0, "nothing was demoted: the check would not see a placement"
