"""SnapKV as a policy: its fates against a numpy reference on random rows (tokens in shuffled
tier slots), and through the engine on a tiny model: the prompt tokens each (layer, KV head)
keeps are the top of the dense forward's pooled votes from the prompt's last queries, and
nothing generated is pruned. Both checks are run against planted bugs."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_engine_formats import TINY
from test_engine_tiers import PAGE, dense_significance, prompts, tiered

import jkv.policies.snapkv as snapkv
from jkv.engine.runner import Row
from jkv.engine.sampling import SamplingParams
from jkv.kv.tier_step import Placing
from jkv.kv.token_tiers import KEEP, PRUNE, TierCounts, TokenMeta
from jkv.models.loaders import random_params
from jkv.policies import KVPolicy

RECENT, WIDTH, ROWS, HEADS = PAGE, 8, 3, 2  # window (`tiered`'s); table columns; rows; heads


@pytest.fixture(scope="module")
def tiny_params():
    return random_params(TINY, seed=3, dtype=jnp.float32)


def pooled_reference(votes: np.ndarray) -> np.ndarray:
    """Votes [k] in position order averaged over the POOL tokens centred on each."""
    half = snapkv.POOL // 2
    return np.array([votes[max(0, i - half):i + half + 1].mean() for i in range(len(votes))])


def random_rows(seed: int, ratio: float) -> tuple[Placing, np.ndarray]:
    """Three rows of two heads in shuffled tier slots (an ended prompt, a prompt not ended,
    an ended prompt some of whose tokens were pruned before) and SnapKV's fates for them by
    the reference: (placing, fates [ROWS, 1, HEADS, WIDTH * PAGE])."""
    rng = np.random.default_rng(seed)
    slots = WIDTH * PAGE
    pages = 1 + np.arange(ROWS * HEADS * WIDTH).reshape(ROWS, 1, HEADS, WIDTH)
    score = np.zeros((1 + pages.size, 2 * PAGE), np.float32)
    pos = np.zeros_like(score, np.int32)
    n = rng.integers(RECENT + 2, slots + 1, ROWS)
    prompt_end = np.where(np.arange(ROWS) == 1, n + 5, n)
    counts = np.zeros((ROWS, 1, HEADS), np.int32)
    want = np.full((ROWS, 1, HEADS, slots), KEEP)
    for b, h in np.ndindex(ROWS, HEADS):
        held = np.arange(n[b]) if b < 2 else np.sort(rng.choice(n[b], rng.integers(
            RECENT, n[b] + 1), replace=False))
        votes = rng.random(len(held)).astype(np.float32)
        where = rng.permutation(slots)[:len(held)] if b != 1 else np.arange(len(held))
        order = np.argsort(where)  # the tokens in slot order
        counts[b, 0, h] = len(held)
        for j, t in enumerate(order):  # slot j holds token t
            page = pages[b, 0, h, j // PAGE]
            score[page, j % PAGE], pos[page, j % PAGE] = votes[t], held[t]
        if n[b] < prompt_end[b]:
            continue
        old = held < n[b] - RECENT
        pooled = pooled_reference(votes[old])
        budget = int(np.ceil(np.float32(ratio) * np.float32(n[b])))
        ranked = sorted(range(len(pooled)), key=lambda i: (-pooled[i], i))
        pruned = {held[old][i] for i in ranked[budget:]}
        for j, t in enumerate(order):
            if held[t] in pruned:
                want[b, 0, h, j] = PRUNE
    placing = Placing(
        meta=TokenMeta(score=jnp.asarray(score), pos=jnp.asarray(pos)),
        pages=jnp.asarray(pages, jnp.int32),
        counts=TierCounts(high=jnp.asarray(counts), low=jnp.zeros_like(jnp.asarray(counts))),
        n_prev=jnp.asarray(n[:, None, None] - 1, jnp.int32),
        n=jnp.asarray(n[:, None, None], jnp.int32),
        prompt_end=jnp.asarray(prompt_end[:, None, None], jnp.int32), page=PAGE,
        recent=RECENT, max_tokens=None, max_moves=slots, generation=False)
    return placing, want


def check_fates(seed: int, ratio: float) -> None:
    placing, want = random_rows(seed, ratio)
    fate_hi, fate_lo = snapkv.snapkv_fates(placing, jnp.asarray([ratio], jnp.float32))
    held = np.arange(want.shape[-1]) < np.asarray(placing.counts.high)[..., None]
    np.testing.assert_array_equal(np.where(held, np.asarray(fate_hi), KEEP), want)
    assert (np.asarray(fate_lo) == KEEP).all()
    gen_hi, _ = snapkv.snapkv_fates(placing._replace(generation=True),
                                    jnp.asarray([ratio], jnp.float32))
    assert (np.asarray(gen_hi) == KEEP).all(), "a decode step pruned"
    decided, _ = snapkv.snapkv_fates(placing._replace(prompt_end=placing.n_prev),
                                     jnp.asarray([ratio], jnp.float32))
    assert (np.asarray(decided) == KEEP).all(), "a prompt decided before was pruned again"


@pytest.mark.parametrize("seed", range(6))
def test_fates_keep_the_top_pooled_votes_of_an_ended_prompt(seed):
    check_fates(seed, ratio=(0.1, 0.25, 0.5)[seed % 3])


def _pooled_in_slot_order(score, pos, among, width=snapkv.POOL):
    """Planted bug: neighbours taken in tier-slot order, not position order."""
    return _pooled(score, jnp.broadcast_to(jnp.arange(score.shape[-1]), pos.shape), among,
                   width)


def _not_pooled(score, pos, among, width=snapkv.POOL):
    """Planted bug: each token's own vote, unpooled."""
    return jnp.where(among, score, 0.0)


_pooled = snapkv.pooled_votes


@pytest.mark.parametrize("bug", [_pooled_in_slot_order, _not_pooled])
def test_the_fates_check_catches_planted_bugs(monkeypatch, bug):
    monkeypatch.setattr(snapkv, "pooled_votes", bug)
    with pytest.raises(AssertionError):
        for seed in range(6):
            check_fates(seed, ratio=0.25)


def held_positions(engine, slot: int, n: int) -> list[list[set[int]]]:
    """The positions each (layer, KV head) of `slot` holds: its tier slots' and the filling
    page's (tokens from n // PAGE * PAGE on)."""
    c = engine.cache
    meta, pages, high = jax.device_get((c.layout.meta, c.tables.pages[slot],
                                        c.layout.counts.high[slot]))
    filling = set(range(n // PAGE * PAGE, n))
    return [[{int(meta.pos[pages[layer, head, j // PAGE], j % PAGE])
              for j in range(high[layer, head])} | filling
             for head in range(high.shape[1])] for layer in range(high.shape[0])]


def run_snapkv(params, ratio: float, prompt: list[int], decode: int, scan: bool = False):
    """A prompt in chunks of 16 and `decode` greedy steps on a snapkv engine: (the positions
    held after the prompt, after the decode steps). `scan`: every layer in the one call a
    GPU engine makes (a CPU engine goes layer by layer)."""
    eng = tiered(params, "xla", kv_policy="snapkv", kv_heavy_ratio=ratio)  # window PAGE
    if scan:
        eng.runner.layer_by_layer = False
    greedy_params, key = SamplingParams(temperature=0), eng.request_key(0)
    slot, _ = eng.open(prompt)
    for start in range(0, len(prompt), 16):
        [out], _ = eng.step([Row(slot, prompt[start:start + 16], greedy_params, key)], [])
    after_prompt = held_positions(eng, slot, len(prompt))
    for i in range(decode):
        _, [out] = eng.step([], [Row(slot, [out.token], greedy_params, key, i + 1)])
    return after_prompt, held_positions(eng, slot, len(prompt) + decode)


def check_engine(params, prompt: list[int]) -> None:
    ratio, n = 0.25, len(prompt)
    kept, later = run_snapkv(params, ratio, prompt, decode=6)
    votes = dense_significance(params, TINY, prompt, observe_from=n - RECENT)
    old, budget = n - RECENT, int(np.ceil(ratio * n))
    window = set(range(old, n))
    checked = 0
    for layer, head in np.ndindex(votes.shape[:2]):
        pooled = pooled_reference(votes[layer, head, :old])
        ranked = sorted(range(old), key=lambda i: (-pooled[i], i))
        assert kept[layer][head] >= window, "the observation window was pruned"
        assert len(kept[layer][head]) == budget + len(window)
        gap = pooled[ranked[budget - 1]] - pooled[ranked[budget]]
        if gap > 1e-4 * pooled[ranked[budget - 1]]:  # the engine's sums are f32, the dense's
            assert kept[layer][head] - window == set(ranked[:budget]), (layer, head)
            checked += 1
        assert later[layer][head] == kept[layer][head] | set(range(n, n + 6)), (layer, head)
    assert checked >= votes.shape[0] * votes.shape[1] // 2, "too few heads had a clear cut"


def test_through_the_engine_the_kept_prompt_tokens_are_the_top_pooled_votes(tiny_params):
    check_engine(tiny_params, prompts((45,))[0])


def test_the_one_call_step_keeps_what_the_layer_by_layer_step_keeps(tiny_params):
    """The step a GPU engine runs scans the layers in one call, with the prompt's first
    observed query per row shared by every layer (scanned as per-layer state, it crashed)."""
    prompt = prompts((45,))[0]
    assert (run_snapkv(tiny_params, 0.25, prompt, 3, scan=True)
            == run_snapkv(tiny_params, 0.25, prompt, 3))


def test_the_engine_check_catches_votes_from_every_query(tiny_params, monkeypatch):
    """Planted bug: significance from every query of the prompt, not its last ones."""
    made = KVPolicy.tier_policy
    monkeypatch.setattr(KVPolicy, "tier_policy", lambda self, cache: dataclasses.replace(
        made(self, cache), observation_window=0))
    with pytest.raises(AssertionError):
        check_engine(tiny_params, prompts((45,))[0])


def resume_after_preemption(params, prompt: list[int], decode: int, own_prompt: bool):
    """A snapkv request preempted after `decode` greedy steps (its row kept) and resumed
    with its output so far, the rest fed as a prompt chunk: (the positions each (layer, KV
    head) held before, after). `own_prompt` False: opened as a new prompt would be."""
    eng = tiered(params, "xla", kv_policy="snapkv", kv_heavy_ratio=0.25)
    greedy_params, key = SamplingParams(temperature=0), eng.request_key(0)
    slot, _ = eng.open(prompt)
    for start in range(0, len(prompt), 16):
        [out], _ = eng.step([Row(slot, prompt[start:start + 16], greedy_params, key)], [])
    tokens = prompt + [out.token]
    for i in range(decode):
        _, [out] = eng.step([], [Row(slot, [tokens[-1]], greedy_params, key, i + 1)])
        tokens.append(out.token)
    before = held_positions(eng, slot, len(tokens) - 1)
    eng.close(slot, finished=False)
    with pytest.raises(ValueError, match="prompt_tokens"):
        eng.open(tokens, prompt_tokens=len(tokens) + 1)
    slot, cached = eng.open(tokens, prompt_tokens=len(prompt) if own_prompt else None)
    assert cached == (len(tokens) - 1) // PAGE * PAGE, "the kept row was not found"
    eng.step([Row(slot, tokens[cached:], greedy_params, key)], [])
    return before, held_positions(eng, slot, len(tokens))


def test_a_resumed_request_keeps_what_its_prompt_end_decided(tiny_params):
    """A preempted request resumes from its kept row with its own prompt's end: nothing it
    generated is pruned, and the prompt tokens it held are held again (not voted on again
    as a new prompt's would be, the check's planted bug)."""
    prompt = prompts((29,))[0]
    before, after = resume_after_preemption(tiny_params, prompt, 13, own_prompt=True)
    generated = set(range(len(prompt), len(prompt) + 13))
    for layer, head in np.ndindex(len(before), len(before[0])):
        assert generated <= after[layer][head], (layer, head)
        assert before[layer][head] <= after[layer][head], (layer, head)
    _, again = resume_after_preemption(tiny_params, prompt, 13, own_prompt=False)
    assert any(not generated <= heads for layer in again for heads in layer)
