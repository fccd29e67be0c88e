"""Saved pages restored into another engine give the tokens that recomputing gives."""

from __future__ import annotations

import functools

import jax.numpy as jnp
import numpy as np
import pytest

from jkv.config import CacheConfig, EngineConfig, ModelConfig
from jkv.engine.engine import Engine, Row
from jkv.engine.sampling import SamplingParams
from jkv.kv.format import KVFormat
from jkv.models.loaders import random_params

TINY = ModelConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_layers=2,
                   num_heads=8, num_kv_heads=2, head_dim=64, rope_theta=10000.0)
GREEDY = SamplingParams(max_tokens=8, temperature=0)


@pytest.fixture(scope="module")
def params():
    return random_params(TINY, seed=7, dtype=jnp.float32)


def engine(params, kv_format="auto", **kw) -> Engine:
    cache = CacheConfig(page_size=8, kv_cache_bytes=4_000_000,
                        kv_format=KVFormat.parse(kv_format))
    return Engine(TINY, params, cache=cache, config=EngineConfig(
        max_model_len=128, max_num_seqs=2, prefill_chunk=16, **kw))


def run(eng: Engine, prompt: list[int], restore=None, new: int = 8, recompute: float = 0.0):
    """Prefill what is not held, then decode greedily; returns (tokens, slot, cached)."""
    slot, cached = eng.open(prompt, restore=restore, recompute=recompute)
    key = eng.request_key(0)
    out = []
    while cached < len(prompt):
        chunk = prompt[cached: cached + eng.prefill_chunk]
        (s,), _ = eng.step([Row(slot, chunk, GREEDY, key, 0)], [])
        cached += len(chunk)
    out.append(s.token)
    while len(out) < new:
        _, (s,) = eng.step([], [Row(slot, [out[-1]], GREEDY, key, len(out))])
        out.append(s.token)
    return out, slot, cached


# (layerwise without join_copies: a layer's strided pages go to the device as they are, as
# on a GPU)
@pytest.mark.parametrize("kv_format,execution,join_copies", [
    ("auto", "scan", True), ("k8v4", "layerwise", True), ("k8v4", "layerwise", False)])
def test_restored_pages_give_the_recomputed_tokens(params, kv_format, execution, join_copies):
    rng = np.random.default_rng()
    history = rng.integers(0, 512, 45).tolist()
    first = engine(params, kv_format)
    reply, slot, _ = run(first, history)
    saved = first.save_pages(slot)  # what a finishing request hands the store
    assert saved.num_blocks == (45 + 7) // 8  # the prompt and the decoded tokens, whole blocks
    follow_up = history + reply[:-1] + rng.integers(0, 512, 5).tolist()

    fresh = engine(params, kv_format, enable_prefix_caching=False, execution=execution)
    # a rate known: layerwise restores go through the buffer,
    fresh.connector.load_bytes_per_s = 1e9
    fresh.connector.read_buffer_layers = lambda *_: 1  # each layer's pages one layer ahead
    fresh.connector.join_copies = join_copies
    restored, _, _ = run(fresh, follow_up, restore=saved)
    assert fresh.stats.restored_tokens == saved.num_blocks * 8
    assert fresh.stats.prefill_tokens == len(follow_up) - saved.num_blocks * 8
    # the same pages held by the engine that wrote them (its prefix cache), the same
    # 9-token chunk on top: the same arithmetic, so the same tokens in any format
    first.close(slot)
    continued, _, _ = run(first, follow_up)
    assert first.stats.prefix_hit_tokens == saved.num_blocks * 8
    assert restored == continued
    if kv_format == "auto":  # float pages: recomputing from scratch agrees too (with
        # quantized pages other chunk boundaries round differently, and a random model's
        # near-ties then flip)
        recomputed, _, _ = run(engine(params, kv_format, enable_prefix_caching=False),
                               follow_up)
        assert restored == recomputed


def test_restore_is_checked_against_the_prompt_and_partial_when_short(params):
    rng = np.random.default_rng()
    prompt = rng.integers(0, 512, 40).tolist()
    first = engine(params)
    _, slot, _ = run(first, prompt, new=1)
    saved = first.save_pages(slot)
    other = engine(params)
    with pytest.raises(ValueError, match="not this prompt"):
        other.open(prompt[:20] + [(prompt[20] + 1) % 512] + prompt[21:], restore=saved)
    assert other.cache.num_free_slots == 2  # nothing taken
    # a prompt of 20 tokens takes 2 of the saved blocks (never its last token)
    slot, cached = other.open(prompt[:20], restore=saved)
    assert cached == 16 and other.stats.restored_tokens == 16
    other.close(slot)
    assert other.cache.available_pages == other.cache.total_pages


def test_read_buffer_follows_the_papers_formula(params):
    eng = engine(params, execution="layerwise")
    assert eng.read_buffer_layers(10**6, 100) == TINY.num_layers  # nothing measured yet
    eng.connector.load_bytes_per_s = 1e9  # 1 GB/s: a 10 MB history loads in 10 ms
    eng.stats.prefill_tokens, eng.stats.prefill_seconds = 1000, 0.01  # 10 us per token
    assert eng.read_buffer_layers(10**7, 1000) == 1  # prefill (10 ms) hides the load
    # 40 ms of loading against 10 ms of prefill: a 30 MB buffer of 40 MB over 2 layers
    assert eng.read_buffer_layers(4 * 10**7, 1000) == 2
    eng = Engine(TINY.replace(num_layers=8), random_params(TINY.replace(num_layers=8)),
                 cache=CacheConfig(page_size=8, kv_cache_bytes=8_000_000),
                 config=EngineConfig(max_model_len=128, execution="layerwise"))
    eng.connector.load_bytes_per_s = 1e9
    eng.stats.prefill_tokens, eng.stats.prefill_seconds = 1000, 0.01
    # S_buf = B (T_load L_hist - T_pref L_new) = 1e9 * (0.04 - 0.025) = 15 MB = 3 of 8 layers
    assert eng.read_buffer_layers(4 * 10**7, 2500) == 3


@pytest.mark.parametrize("join_copies", [True, False])
def test_after_warmup_saving_and_restoring_compile_nothing(params, join_copies):
    from jkv.kv.transfer import gather_pages, scatter_pages, slot_page_ids

    rng = np.random.default_rng()
    eng = engine(params, execution="layerwise", enable_prefix_caching=False)
    eng.connector.join_copies = join_copies  # (False: a GPU's way)
    eng.connector.warmup()
    fns = (gather_pages, scatter_pages, slot_page_ids)
    before = [f._cache_size() for f in fns]
    history = rng.integers(0, 512, int(rng.integers(9, 100))).tolist()
    reply, slot, _ = run(eng, history, new=2)
    saved = eng.save_pages(slot)  # history + reply[0]: the tokens fed
    eng.close(slot)
    fed = history + reply[:1]
    run(eng, fed + [1, 2], restore=saved, new=1)  # no rate yet: written at once
    eng.connector.load_bytes_per_s = 1e9  # then layer by layer, through the read buffer
    run(eng, fed + [3, 4], restore=saved, new=1)
    assert [f._cache_size() for f in fns] == before


@pytest.mark.parametrize("n", [0, 1, 2, 3, 7, 8, 45, 1000])
def test_restores_are_written_in_power_of_two_runs_covering_every_block(n):
    from jkv.kv.block_runs import power_of_two_runs

    runs = power_of_two_runs(n)
    bounds = [0] + [b for _, b in runs]
    assert runs == list(zip(bounds[:-1], bounds[1:], strict=True))  # contiguous from 0
    assert bounds[-1] == n
    sizes = [b - a for a, b in runs]
    assert all(s & (s - 1) == 0 for s in sizes) and sizes == sorted(sizes, reverse=True)
    assert len(runs) == bin(n).count("1")  # as few compiled shapes per restore as can be
    # a chain of stored entries: no run crosses where two of them meet
    rng = np.random.default_rng()
    offset = int(rng.integers(0, 5))
    cuts = sorted(int(c) for c in rng.integers(0, n + 10, 4))
    runs = power_of_two_runs(n, cuts, offset)
    starts, stops = [a for a, _ in runs], [b for _, b in runs]
    assert starts == [0, *stops][:len(starts)] and (stops[-1] if runs else 0) == n
    assert all((b - a) & (b - a - 1) == 0 for a, b in runs)
    assert not any(a < c - offset < b for a, b in runs for c in cuts)


def test_block_runs_slice_without_copying_inside_a_part():
    from jkv.kv.block_runs import BlockRuns

    rng = np.random.default_rng()
    parts = [rng.standard_normal((n, 3, 2)) for n in (4, 1, 6)]
    whole = np.concatenate(parts)
    x = BlockRuns(parts)
    assert x.shape == whole.shape and x.bounds == [4, 5] and x.nbytes == whole.nbytes
    np.testing.assert_array_equal(np.asarray(x), whole)
    for a, b in ((0, 4), (1, 3), (5, 11), (4, 5), (2, 9), (0, 11), (7, 7)):
        np.testing.assert_array_equal(x[a:b], whole[a:b])
        np.testing.assert_array_equal(x[a:b, 1], whole[a:b, 1])
    assert np.shares_memory(x[5:9], parts[2]) and np.shares_memory(x[1:3, 2], parts[0])
    np.testing.assert_array_equal(np.asarray(x.head(7)), whole[:7])
    assert x.head(7).bounds == [4, 5] and len(x.head(3).parts) == 1


@pytest.mark.parametrize("n,first,layers,chunk", [(12, 0, 6, 1), (40, 3, 30, 2), (7, 2, 1, 1),
                                                  (100, 0, 32, 8)])
def test_the_pyramid_recomputes_a_falling_prefix_of_about_its_share(n, first, layers, chunk):
    from jkv.engine.saved_pages import pyramid

    assert (pyramid(first, n, layers, 0.0, chunk) == first).all()  # load everything
    assert (pyramid(first, n, layers, 1.0, chunk) == n).all()  # recompute everything
    for r in np.linspace(0, 1, 11):
        b = pyramid(first, n, layers, r, chunk)
        assert b.shape == (layers,) and ((first <= b) & (b <= n)).all()
        assert (np.diff(b) <= 0).all()  # eq. 4: no layer recomputes past the layer below
        assert (((b - first) % chunk == 0) | (b == n)).all()
        share = (b - first).sum() / ((n - first) * layers)
        assert abs(share - r) <= chunk / (n - first) / 2 + 1e-9  # rounding to chunks only
        if layers > 1 and 0 < r < 1:
            assert b[0] >= b[-1]  # the first layer recomputes the most
    with pytest.raises(ValueError, match="recompute"):
        pyramid(0, 4, 2, 1.5, 1)


DEEP = TINY.replace(num_layers=6)


@pytest.fixture(scope="module")
def deep_params():
    return random_params(DEEP, seed=3, dtype=jnp.float32)


def deep_engine(deep_params, **kw) -> Engine:
    return Engine(DEEP, deep_params, cache=CacheConfig(page_size=8, kv_cache_bytes=8_000_000),
                  config=EngineConfig(max_model_len=160, max_num_seqs=2, prefill_chunk=32,
                                      enable_prefix_caching=False, **kw))


@pytest.mark.parametrize("execution", ["scan", "layerwise"])
def test_split_restore_gives_the_recomputed_tokens_and_never_reads_the_recomputed_pages(
        deep_params, execution):
    from jkv.engine.saved_pages import pyramid

    cfg = DEEP
    rng = np.random.default_rng()
    make = functools.partial(deep_engine, deep_params)
    history = rng.integers(0, 512, 97).tolist()
    first = make()
    reply, slot, _ = run(first, history, new=2)
    saved = first.save_pages(slot)
    n = saved.num_blocks
    follow_up = history + reply[:1] + rng.integers(0, 512, 6).tolist()
    recomputed, _, _ = run(make(), follow_up)
    for r in (0.0, 0.2, 0.5, 0.8, 1.0):
        b = pyramid(0, n, cfg.num_layers, r, 1)  # what the engine will split by (chunk 1)
        poisoned = {f: np.array(x) for f, x in saved.arrays.items()}
        for layer in range(cfg.num_layers):  # the pages it recomputes: never to be read
            poisoned["k"][:b[layer], layer] = np.nan
            poisoned["v"][:b[layer], layer] = np.nan
        eng = make(execution=execution)
        eng.connector.load_bytes_per_s = 1e9  # layerwise: staged through the read buffer
        tokens, _, cached = run(eng, follow_up, restore=type(saved)(
            n, poisoned, saved.hashes), recompute=r)
        assert tokens == recomputed, r
        assert eng.stats.restored_tokens == n * 8
        assert eng.stats.prefill_tokens == len(follow_up) - n * 8  # the rest: fed as usual
        assert eng.stats.recomputed_tokens == pytest.approx(b.sum() * 8 / cfg.num_layers)
    with pytest.raises(ValueError, match="recompute"):
        make().open(follow_up, restore=saved, recompute=-0.1)


def test_after_warmup_a_split_restore_written_at_once_compiles_no_copy(deep_params):
    """Off a CPU (`join_copies` off), a split restore written at once brings one layer's
    pages for the layers it recomputes part of: the warm-up compiled their copies as the
    layer-by-layer staging sends them (6 layers: a layer's run never has a whole run's
    shape)."""
    from jkv.kv.transfer import gather_pages, scatter_pages, slot_page_ids

    rng = np.random.default_rng()
    eng = deep_engine(deep_params)
    eng.connector.join_copies = False
    eng.connector.warmup()
    history = rng.integers(0, 512, 97).tolist()
    reply, slot, _ = run(eng, history, new=2)
    saved = eng.save_pages(slot)
    eng.close(slot)
    fns = (gather_pages, scatter_pages, slot_page_ids)
    before = [f._cache_size() for f in fns]
    run(eng, history + reply[:1] + [1, 2], restore=saved, recompute=0.5, new=1)
    assert eng.stats.recomputed_tokens > 0
    assert [f._cache_size() for f in fns] == before
