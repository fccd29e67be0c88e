"""The xla backend's attention against `chunked_prefill_attention_reference`, on fresh random
inputs every run (the seed is in every failure message).

Ragged rows: prefixes of different lengths per row and KV head (zero, partial pages, whole
pages), windows of different lengths (empty included), queries past a row's window and below
its start, padding queries past `q_lengths`, pages shuffled across the pool and a table
wider than any row needs. What must not be read (the null page, page tokens past a row's
length, window tokens past its length) is poisoned with large finite values, so a missing
mask shows as a huge error.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from paged_inputs import paged_attention_inputs

from jkv.attention.xla import xla_attention
from jkv.kv.format import KV_FORMATS
from jkv.pallas_kernels.chunked_prefill_attention import chunked_prefill_attention_reference
from jkv.pallas_kernels.paged_decode_attention import dequantized_rows

# (k_bits, v_bits, token_keys) of every named format
FORMATS = sorted({(f.k_bits, f.v_bits, f.token_keys) for f in KV_FORMATS.values()},
                 reverse=True)
PAGE, GROUP, POISON = 4, 16, 1e4
# (T, query heads per KV head, head_dim, blocks): a padded prefill chunk in several query,
# page (masked and unmasked) and window blocks, and a decode step with the engine's blocks
CASES = [(7, 3, 32, dict(block_q=2, block_k=8, block_w=4)), (1, 2, 64, {})]


def fresh_rng() -> tuple[np.random.Generator, int]:
    seed = int(np.random.SeedSequence().entropy) % (1 << 63)
    return np.random.default_rng(seed), seed


def make_case(rng, *, t: int, gqa: int, d: int, k_bits: int, v_bits: int, width: int = 12,
              dtype=jnp.float32, token_keys: bool = False):
    """Five rows x two KV heads with random ragged lengths; returns (args, q_lengths).

    Each row holds a random prefix per head (a zero one for some), a window of a random
    length starting at a page boundary (row 4's is empty: a padding row), queries at random
    positions around the window (some below its start: they see only the pages) and a random
    number of real queries (0 for row 3).
    """
    b, hkv = 5, 2
    max_pages = width - 2  # the table is wider than any row needs
    plen = rng.integers(0, max_pages * PAGE + 1, size=(b, hkv))
    plen[0, 0] = 0
    plen[1] = [max_pages * PAGE, (max_pages // 2) * PAGE]  # whole pages
    tw = PAGE + -(-t // PAGE) * PAGE
    start = (plen.max(axis=1) // PAGE) * PAGE
    wlen = rng.integers(0, tw + 1, size=b)
    wlen[2] = rng.integers(0, PAGE) + t  # the engine's case: a filling page, then the chunk
    wlen[4] = 0
    pos = np.maximum(start[:, None] + rng.integers(-3, tw + 2, size=(b, t)), 0)
    pos[2] = start[2] + wlen[2] - t + np.arange(t)
    q_lengths = rng.integers(1, t + 1, size=b)
    q_lengths[3] = 0
    q_lengths[2] = t

    args = paged_attention_inputs(rng, plen, start, wlen, pos, t=t, gqa=gqa, d=d, k_bits=k_bits,
                                  v_bits=v_bits, width=width, page=PAGE, group=GROUP,
                                  poison=POISON, dtype=dtype, token_keys=token_keys)
    return args, jnp.asarray(q_lengths, jnp.int32)


def rel_err(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


@pytest.mark.parametrize("k_bits,v_bits,token_keys", FORMATS)
def test_matches_the_reference_on_ragged_rows(k_bits, v_bits, token_keys):
    rng, seed = fresh_rng()
    for t, gqa, d, blocks in CASES:
        args, q_lengths = make_case(rng, t=t, gqa=gqa, d=d, k_bits=k_bits, v_bits=v_bits,
                                    token_keys=token_keys)
        want = np.asarray(chunked_prefill_attention_reference(*args, q_lengths=q_lengths))
        assert np.abs(want).max() < POISON / 10, f"seed {seed}: the case reads poison"
        got = np.asarray(xla_attention(*args, q_lengths=q_lengths, **blocks))
        assert got.shape == args[0].shape and got.dtype == np.float32
        err = rel_err(got, want)
        assert err < 1e-5, f"seed {seed} k{k_bits}v{v_bits} t={t} {blocks}: {err:.2e}"
        for i, n in enumerate(np.asarray(q_lengths)):  # padding queries: exactly 0
            assert (got[i, n:] == 0).all(), f"seed {seed}: row {i}'s padding queries not 0"


def test_queries_that_see_nothing_give_zero():
    rng, seed = fresh_rng()
    args, q_lengths = make_case(rng, t=6, gqa=2, d=32, k_bits=8, v_bits=4)
    q, pages, table, plen, kw, vw, start, wlen, pos = args
    plen = plen.at[0].set(0)
    pos = pos.at[0].set(start[0] - 1)  # row 0 sees neither pages nor window
    plen = plen.at[4, 1].set(0)  # row 4 (empty window): head 1 sees nothing
    out = np.asarray(xla_attention(q, pages, table, plen, kw, vw, start, wlen, pos, block_q=2,
                                   block_k=8, block_w=4))
    ref = np.asarray(chunked_prefill_attention_reference(
        q, pages, table, plen, kw, vw, start, wlen, pos))
    assert np.isfinite(out).all(), f"seed {seed}"
    assert (out[0] == 0).all() and (out[4, :, 2:] == 0).all(), f"seed {seed}"
    assert rel_err(out, ref) < 1e-5, f"seed {seed}"


def test_table_width_and_block_sizes_do_not_change_the_result():
    """Null columns appended to the table (a wider bucket) and other blocks: same output."""
    rng, seed = fresh_rng()
    args, q_lengths = make_case(rng, t=5, gqa=3, d=32, k_bits=4, v_bits=2, width=6)
    run = functools.partial(xla_attention, q_lengths=q_lengths)
    narrow = np.asarray(run(*args, block_q=1, block_k=4, block_w=4))
    table = jnp.pad(args[2], ((0, 0), (0, 0), (0, 13)))
    wide = np.asarray(run(*args[:2], table, *args[3:]))  # the engine's blocks
    assert rel_err(wide, narrow) < 1e-6, f"seed {seed}"


def test_bf16_inputs_compute_in_float32():
    rng, seed = fresh_rng()
    args, q_lengths = make_case(rng, t=4, gqa=2, d=32, k_bits=16, v_bits=16,
                                dtype=jnp.bfloat16)
    got = xla_attention(*args, q_lengths=q_lengths, block_q=2, block_k=4, block_w=4)
    want = chunked_prefill_attention_reference(*args, q_lengths=q_lengths)
    assert got.dtype == jnp.float32
    assert rel_err(got, want) < 1e-5, f"seed {seed}"


def test_engine_path_calls_no_reference_and_loops_over_blocks():
    """The xla backend imports no `*_reference` function (they are test oracles), and its
    attention walks key blocks in loops instead of one softmax over the table's width."""
    from jkv.attention import backend as attention
    from jkv.attention import kv_write

    for module in (attention, kv_write):
        names = [n for n in vars(module) if n.endswith("_reference")]
        assert not names, f"{module.__name__} imports {names}"
    args, q_lengths = make_case(np.random.default_rng(), t=2, gqa=2, d=32, k_bits=8, v_bits=4)
    assert str(jax.make_jaxpr(xla_attention)(*args, q_lengths=q_lengths)).count("while") >= 3


def float64_significance(args, q_lengths):
    """Each key's attention, max over its KV head's query heads, averaged over the real
    queries that see it, in float64: (pages in table order, window)."""
    q, pages, table, plen, kw, vw, start, wlen, pos = (np.asarray(x) if i != 1 else x
                                                        for i, x in enumerate(args))
    kp, _ = dequantized_rows(pages, jnp.asarray(table))
    kp, kw = np.asarray(kp, np.float64), kw.astype(np.float64)
    b, t, hq, d = q.shape
    hkv, np_, tw = table.shape[1], kp.shape[2], kw.shape[2]
    g = hq // hkv
    sums, counts = np.zeros((b, hkv, np_ + tw)), np.zeros((b, hkv, np_ + tw))
    for i in range(b):
        for j in range(int(q_lengths[i])):
            for h in range(hkv):
                vis = np.concatenate([np.arange(np_) < plen[i, h], (np.arange(tw) < wlen[i])
                                      & (start[i] + np.arange(tw) <= pos[i, j])])
                if not vis.any():
                    continue
                keys = np.concatenate([kp[i, h], kw[i, h]])
                s = q[i, j, h * g:(h + 1) * g].astype(np.float64) @ keys.T / np.sqrt(d)
                s = np.where(vis, s, -np.inf)  # poison where not visible
                p = np.exp(s - s.max(-1, keepdims=True))
                sums[i, h] += (p / p.sum(-1, keepdims=True)).max(axis=0)
                counts[i, h] += vis
    sig = np.where(counts > 0, sums / np.maximum(counts, 1), 0.0)
    return sig[..., :np_], sig[..., np_:]


@pytest.mark.parametrize("k_bits,v_bits", [(16, 16), (8, 4)])
def test_significance_matches_float64(k_bits, v_bits):
    """The optional significance over pages and window, for a padded prefill chunk in several
    blocks and a decode step; asking for it leaves the output unchanged."""
    rng, seed = fresh_rng()
    for t, gqa, d, blocks in CASES:
        args, q_lengths = make_case(rng, t=t, gqa=gqa, d=d, k_bits=k_bits, v_bits=v_bits)
        want_pages, want_window = float64_significance(args, np.asarray(q_lengths))
        out, (sig_pages, sig_window) = xla_attention(*args, q_lengths=q_lengths, **blocks,
                                                     return_significance=True)
        plain = xla_attention(*args, q_lengths=q_lengths, **blocks)
        np.testing.assert_array_equal(np.asarray(out), np.asarray(plain))
        assert sig_pages.shape == want_pages.shape and sig_window.shape == want_window.shape
        err = max(np.abs(np.asarray(sig_pages) - want_pages).max(),
                  np.abs(np.asarray(sig_window) - want_window).max())
        assert err < 1e-5, f"seed {seed} k{k_bits}v{v_bits} t={t}: {err:.2e}"
        assert want_window.max() > 0.01 and want_pages.max() > 0.01, f"seed {seed}"
