"""LayerKV's layer offload under token policies (LeanKV with LayerKV): a tiered row whose
layers sit on the host, brought in for their turn in a step, placed there and sent out again,
keeps exactly what the same row kept in the pool keeps: the same tokens sampled, the same
tiers, the same stored row (pages, positions, significance), and no page leaks."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_engine_tiers import check_nothing_leaked

from jkv.config import CacheConfig, EngineConfig, ModelConfig
from jkv.engine.engine import Engine, Row
from jkv.engine.sampling import SamplingParams
from jkv.models.loaders import random_params
from jkv.policies import POLICIES

TINY = ModelConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_layers=3,
                   num_heads=8, num_kv_heads=2, head_dim=64, rope_theta=10000.0)
PAGE, CHUNK = 8, 16
TOKEN_POLICIES = [name for name, p in POLICIES.items() if p.token_tiers]
GREEDY = SamplingParams(max_tokens=64, temperature=0)


@pytest.fixture(scope="module")
def params():
    return random_params(TINY, seed=11, dtype=jnp.float32)


def engine(params, policy: str) -> Engine:
    cache = CacheConfig(page_size=PAGE, kv_cache_bytes=512 * PAGE * 64 * 4 * 2,
                        kv_policy=policy, kv_recent_window=PAGE, kv_alpha_high=1.0,
                        kv_alpha_low=0.5, kv_heavy_ratio=0.3, kv_placement_interval=2)
    return Engine(TINY, params, cache=cache, config=EngineConfig(
        max_model_len=128, max_num_seqs=4, prefill_chunk=CHUNK, enable_prefix_caching=False))


def run(eng: Engine, prompt: list[int], moves: dict[int, tuple[str, list[int]]],
        resident: int | None, steps: int = 14) -> tuple[list[int], dict, dict]:
    """Prefill `prompt` in chunks, then `steps` greedy decode steps, doing `moves[i]`
    ("out", layers) or ("in", []) before step i; returns (tokens, tiers, the stored row)."""
    slot, _ = eng.open(prompt, resident=resident)
    token = None
    for i in range(0, len(prompt), CHUNK):
        out, _ = eng.step([Row(slot, prompt[i:i + CHUNK], GREEDY, eng.request_key(0), 0)], [])
        token = out[0].token
    tokens = [int(token)]
    for i in range(steps):
        kind, layers = moves.get(i, ("", []))
        if kind == "out":
            eng.offload_layers(slot, layers)
        elif kind == "in":
            eng.fetch_layers(slot)
        _, dec = eng.step([], [Row(slot, [tokens[-1]], GREEDY, eng.request_key(0), i + 1)])
        tokens.append(int(dec[0].token))
    tiers = eng.cache.layout.tier_tokens(slot, 0)
    saved = jax.device_get(eng.save_pages(slot).arrays)
    eng.close(slot)
    check_nothing_leaked(eng)
    return tokens, tiers, saved


@pytest.mark.parametrize("policy", TOKEN_POLICIES)
def test_layers_on_the_host_keep_what_the_pool_keeps(params, policy):
    """Admitted with 0 or 1 of 3 layers resident (every prefill chunk and decode step
    brings the others in, places them and sends them out), and resident then moved out and
    back between decode steps: every run samples the same tokens and ends with the same
    tiers and the same stored row as the run that never moved a layer."""
    rng = np.random.default_rng(4)
    prompt = rng.integers(0, TINY.vocab_size, 45).tolist()
    eng = engine(params, policy)
    want = run(eng, prompt, {}, None)
    assert want[1]["high"] < 3 * 2 * (45 + 14), "nothing was dropped or demoted"
    for resident, moves in [(0, {}), (1, {5: ("in", [])}),
                            (None, {2: ("out", [0, 2]), 6: ("in", []), 9: ("out", [1])})]:
        got = run(eng, prompt, moves, resident)
        assert got[:2] == want[:2], (resident, moves)
        assert held_tokens(got[2]) == held_tokens(want[2]), (resident, moves)


def held_tokens(row: dict) -> list:
    """A stored row's bytes and metadata where a token is held (past a tier's last token a
    page holds whatever was there before): per page, positions and significance of its
    tokens, and the page's arrays (a part-filled high page's first tokens; a part-filled
    low page packs its tokens at half the bits: its metadata only)."""
    out = []
    for i, n in enumerate(row["tier_tokens"]):
        page = [row[k][i].tolist() for k in ("tier_head", "tier_low", "tier_index")]
        page += [row["tier_pos"][i][:n].tolist(), row["tier_score"][i][:n].tolist()]
        full = n == PAGE * (1 + row["tier_low"][i])
        for name in ("k", "v", "k_scale", "k_zero", "v_scale", "v_zero"):
            x = row.get(name)
            if x is not None and (full or not row["tier_low"][i]):
                per_token = x.ndim > 2 and x.shape[1] == PAGE
                page.append(x[i].tolist() if full or not per_token else x[i][:n].tolist())
        out.append(page)
    return out


def test_a_row_with_layers_on_the_host_is_kept_whole_once_they_come_back(params):
    """With prefix caching, a closing row with layers on the host fetches them (room
    allowing) and is kept: its next turn opens from it."""
    cache = CacheConfig(page_size=PAGE, kv_cache_bytes=512 * PAGE * 64 * 4 * 2,
                        kv_policy="leankv", kv_recent_window=PAGE, kv_alpha_high=1.0,
                        kv_alpha_low=0.5)
    eng = Engine(TINY, params, cache=cache, config=EngineConfig(
        max_model_len=128, max_num_seqs=4, prefill_chunk=CHUNK, enable_prefix_caching=True))
    prompt = np.random.default_rng(5).integers(0, TINY.vocab_size, 40).tolist()
    slot, _ = eng.open(prompt, resident=1)
    for i in range(0, len(prompt), CHUNK):
        eng.step([Row(slot, prompt[i:i + CHUNK], GREEDY, eng.request_key(0), 0)], [])
    assert len(eng.offloaded_layers(slot)) == 2
    eng.close(slot)
    assert eng.cache.pages_cached > 0
    slot, cached = eng.open(prompt + [1, 2, 3])
    assert cached == len(prompt) // PAGE * PAGE
    eng.close(slot, keep=False)
