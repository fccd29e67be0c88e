"""Saved pages moved to new positions (truncation by re-rotation): layer 0's keys and values
depend only on the token and its position, so after the move they must be what computing
the truncated prompt from scratch writes; a zero move is the identity."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from jkv.config import CacheConfig, EngineConfig, ModelConfig
from jkv.engine.engine import Engine, Row
from jkv.engine.sampling import SamplingParams
from jkv.kv.format import KVFormat
from jkv.kv.pages import KVPages
from jkv.models.loaders import random_params

TINY = ModelConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_layers=2,
                   num_heads=8, num_kv_heads=2, head_dim=64, rope_theta=10000.0)
GREEDY = SamplingParams(max_tokens=1, temperature=0)


@pytest.fixture(scope="module")
def params():
    return random_params(TINY, seed=3, dtype=jnp.float32)


def engine(params, kv_format: str) -> Engine:
    cache = CacheConfig(page_size=8, kv_cache_bytes=4_000_000,
                        kv_format=KVFormat.parse(kv_format))
    return Engine(TINY, params, cache=cache, config=EngineConfig(
        max_model_len=128, max_num_seqs=2, prefill_chunk=32, enable_prefix_caching=False))


def prefilled(eng: Engine, prompt: list[int]):
    slot, _ = eng.open(prompt)
    for i in range(0, len(prompt), eng.prefill_chunk):
        eng.step([Row(slot, prompt[i: i + eng.prefill_chunk], GREEDY, eng.request_key(0))], [])
    return eng.save_pages(slot)


def dense(arrays: dict, fmt: KVFormat) -> tuple[np.ndarray, np.ndarray]:
    k, v = KVPages.from_arrays(fmt, arrays).dense()
    return np.asarray(k, np.float32), np.asarray(v, np.float32)


# k8v4t: rotated keys leave their stored basis for the RoPE shift and come back to it
@pytest.mark.parametrize("kv_format", ["auto", "k8v4", "k8v4t"])
def test_moved_layer0_kv_is_what_the_truncated_prompt_computes(params, kv_format):
    rng = np.random.default_rng()
    fmt = KVFormat.parse(kv_format)
    history = rng.integers(0, 512, 70).tolist()
    keep, drop = 12, int(rng.integers(1, 30))  # a system prompt, then dropped turns
    prompt = history[:keep] + history[keep + drop:] + rng.integers(0, 512, 5).tolist()
    saved = prefilled(engine(params, kv_format), history)
    eng = engine(params, kv_format)
    moved = eng.rebase(saved, prompt, keep, drop)
    assert moved.num_blocks == min((70 // 8 * 8 - drop) // 8, (len(prompt) - 1) // 8)
    assert moved.hashes == eng.cache.prompt_hashes(prompt)[: moved.num_blocks]
    fresh = prefilled(engine(params, kv_format), prompt)
    n = moved.num_blocks
    k, v = dense({f: x[:n] for f, x in moved.arrays.items()}, fmt)
    k_ref, v_ref = dense({f: x[:n] for f, x in fresh.arrays.items()}, fmt)
    for x, ref in ((k[:, 0], k_ref[:, 0]), (v[:, 0], v_ref[:, 0])):
        if kv_format == "auto":
            np.testing.assert_allclose(x, ref, atol=1e-4)
        else:  # codes of the same dense values, twice rounded: far closer than a neighbour
            neighbour = np.abs(ref - np.roll(ref, 1, axis=-2)).mean()
            assert np.abs(x - ref).mean() < 0.1 * neighbour
    if kv_format == "auto":  # deeper layers saw the dropped turns: their KV differs
        assert np.abs(k[:, 1, :, :, :] - k_ref[:, 1]).max() > 1e-3
    # the moved pages restore into an engine and serve the prompt
    slot, cached = eng.open(prompt, restore=moved)
    assert cached == n * 8
    (s,), _ = eng.step([Row(slot, prompt[cached:], GREEDY, eng.request_key(0))], [])
    assert 0 <= s.token < 512


def test_no_move_is_the_identity(params):
    rng = np.random.default_rng()
    history = rng.integers(0, 512, 40).tolist()
    eng = engine(params, "auto")
    saved = prefilled(eng, history)
    moved = eng.rebase(saved, history + [1], keep=len(history), drop=0)
    assert moved.num_blocks == saved.num_blocks
    for f in saved.arrays:
        np.testing.assert_array_equal(moved.arrays[f][: moved.num_blocks], saved.arrays[f])
    with pytest.raises(ValueError, match="keep and drop"):
        eng.rebase(saved, history, keep=-1, drop=0)


def test_moved_blocks_are_never_shared_under_their_tokens_hashes(params):
    rng = np.random.default_rng()
    history = rng.integers(0, 512, 64).tolist()
    keep, drop = 8, 16
    prompt = history[:keep] + history[keep + drop:] + rng.integers(0, 512, 9).tolist()
    saved = prefilled(engine(params, "auto"), history)
    cache = CacheConfig(page_size=8, kv_cache_bytes=4_000_000)
    eng = Engine(TINY, params, cache=cache, config=EngineConfig(
        max_model_len=128, max_num_seqs=2, prefill_chunk=32))  # prefix caching on
    moved = eng.rebase(saved, prompt, keep, drop)
    assert moved.num_blocks == 6 and moved.exact_blocks == 1
    slot, cached = eng.open(prompt, restore=moved)
    assert cached == 48
    eng.step([Row(slot, prompt[cached:], GREEDY, eng.request_key(0))], [])
    assert eng.gather(slot).num_blocks == 1  # what the store would be handed
    eng.close(slot)
    # only the block before the cut (exact KV) is in the device prefix cache
    assert eng.cache.lookup(eng.cache.prompt_hashes(prompt))[0] == 8


def test_pages_of_another_dtype_are_refused_before_anything_is_taken(params):
    rng = np.random.default_rng()
    history = rng.integers(0, 512, 40).tolist()
    saved = prefilled(engine(params, "auto"), history)
    wrong = type(saved)(saved.num_blocks, {f: x.astype(np.float16)
                                           for f, x in saved.arrays.items()}, saved.hashes)
    eng = engine(params, "auto")
    with pytest.raises(ValueError, match="float16"):
        eng.open(history + [1], restore=wrong)
    assert eng.cache.num_free_slots == 2 and eng.cache.available_pages == eng.cache.total_pages
