"""Chunked prefill attention against its references, on fresh random inputs every run.

A chunk of queries attends to a paged prefix (any format) and, causally, to a full-precision
window holding the partly filled page and the chunk itself. Everything the kernel must not
read (the null page, page tokens past a row's length, window tokens past its length) is
poisoned with large finite values, so a missing mask shows as a huge error, not a NaN.
On CPU the kernel runs in interpret mode; on a GPU the same tests compile it with Triton.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from covering import rotated_cover
from paged_inputs import paged_attention_inputs

from jkv.attention.xla import xla_attention
from jkv.kv.format import KV_FORMATS, KVFormat
from jkv.kv.pages import KVPages
from jkv.pallas_kernels.chunked_prefill_attention import (
    chunked_prefill_attention,
    chunked_prefill_attention_reference,
)
from jkv.pallas_kernels.paged_decode_attention import DEQUANT, dequantized_rows

INTERPRET = jax.default_backend() == "cpu"
# (k_bits, v_bits, token_keys) of every named format
FORMATS = sorted({(f.k_bits, f.v_bits, f.token_keys) for f in KV_FORMATS.values()},
                 reverse=True)
PAGE, GROUP, WIDTH, POISON = 8, 32, 8, 1e4
# A covering design that keeps the suite's time in bounds: each per-channel format over two
# of the shapes, rotated so that every shape meets three formats; per-token key scales (the
# values' arithmetic on the key side) over one.
SHAPES = [(1, 64), (3, 128), (4, 64), (8, 128)]
FORMAT_SHAPES = rotated_cover([f for f in FORMATS if not f[2]], SHAPES, 2, stride=2)
FORMAT_SHAPES += [(*f, *SHAPES[1]) for f in FORMATS if f[2]]
FORMAT_DTYPES = [(*f, dt) for f in FORMATS
                 for dt in ([jnp.bfloat16, jnp.float32] if not f[2] else [jnp.bfloat16])]
# float16 dequantization everywhere; float32's only where it differs (16-bit q, quantized)
LOWERING_CASES = [(*f, "f16") for f in FORMAT_DTYPES] + [
    (*f, "f32") for f in FORMAT_DTYPES if f[3] == jnp.bfloat16 and f[:2] != (16, 16)]


def make_case(rng, *, gqa, d, t, k_bits, v_bits, dtype=jnp.float32, token_keys=False):
    """Four rows x two KV heads, pages shuffled across the pool.

    Row 0: its heads hold different prefixes (0 tokens and a random partial page); the
    window starts there and holds just the chunk. Row 1: exact page multiples (4 and 2
    pages), a window of one token; odd queries sit past the window's end, even ones below
    its start (padding that sees only the prefix). Row 2: the engine's case, a whole-page
    prefix and a window holding the partly filled page before the chunk. Row 3: a padding row
    (window_len 0) whose heads hold 1 and 0 tokens, so head 1's queries see nothing at all.
    """
    partial = int(rng.choice([n for n in range(1, 5 * PAGE) if n % PAGE]))
    filled = int(rng.integers(1, PAGE))  # tokens of the partly filled page in row 2's window
    plen = np.array([[0, partial], [4 * PAGE, 2 * PAGE], [PAGE, PAGE], [1, 0]])
    start = np.array([partial, 4 * PAGE, PAGE, 1])
    wlen = np.array([t, 1, filled + t, 0])
    pos = np.stack([start[0] + np.arange(t), start[1] - 1 - np.arange(t),
                    start[2] + filled + np.arange(t), start[3] + np.arange(t)])
    pos[1, 0] = start[1]
    pos[1, 1::2] = start[1] + 1 + np.arange(1, t, 2)  # past the window's end: sees token 0

    return paged_attention_inputs(rng, plen, start, wlen, pos, t=t, gqa=gqa, d=d,
                                  k_bits=k_bits, v_bits=v_bits, width=WIDTH, page=PAGE,
                                  group=GROUP, poison=POISON, dtype=dtype,
                                  token_keys=token_keys)


def float64_reference(args, low=None, low_lens=None):
    """Attention in float64 (numpy, a loop over queries) over the same dequantized pages
    (and a low tier's, read right to left)."""
    q, pages, table, plen, kw, vw, start, wlen, pos = args
    f64 = functools.partial(np.asarray, dtype=np.float64)
    kd, vd = (f64(x) for x in dequantized_rows(pages, table))
    q, plen, start, wlen, pos = (np.asarray(a) for a in (q, plen, start, wlen, pos))
    b, t, hq, d = q.shape
    hkv, tw = table.shape[1], kw.shape[2]
    held = np.arange(kd.shape[2]) < plen[..., None]  # [B, Hkv, S]
    if low is not None:
        kl, vl = (f64(x) for x in dequantized_rows(low, table[..., ::-1]))
        kd, vd = np.concatenate([kd, kl], axis=2), np.concatenate([vd, vl], axis=2)
        held = np.concatenate([held, np.arange(kl.shape[2]) < np.asarray(low_lens)[..., None]],
                              axis=-1)
    kd = np.concatenate([kd, f64(kw.astype(jnp.float32))], axis=2)
    vd = np.concatenate([vd, f64(vw.astype(jnp.float32))], axis=2)
    q = q.astype(np.float64)
    g = hq // hkv
    out = np.zeros((b, t, hq, d))
    for i in range(b):
        for h in range(hkv):
            for j in range(t):
                seen = np.concatenate([held[i, h], (np.arange(tw) < wlen[i])
                                       & (start[i] + np.arange(tw) <= pos[i, j])])
                if not seen.any():
                    continue
                s = q[i, j, h * g:(h + 1) * g] / np.sqrt(d) @ kd[i, h, seen].T
                p = np.exp(s - s.max(-1, keepdims=True))
                out[i, j, h * g:(h + 1) * g] = (p / p.sum(-1, keepdims=True)) @ vd[i, h, seen]
    return out


def with_low_tier(rng, args, low_lens):
    """`args` (a pool with per-token key scales) plus a low tier in the same pool, LeanKV's:
    new pages holding low_lens [B, Hkv] tokens at half the bits, twice the tokens per page,
    from the right of each row (tokens past a row's length poisoned). Returns (args, low
    tier, low lengths)."""
    q, pages, table, *rest = args
    low_format = pages.kv_format.halved()
    page_lo = 2 * PAGE
    b, hkv, w = table.shape
    n_lo = -(-low_lens // page_lo)
    d = q.shape[-1]
    k = rng.normal(size=(n_lo.sum(), page_lo, d)) * (1 + 4 * (rng.random(d) < 0.1))
    v = rng.normal(size=(n_lo.sum(), page_lo, d))
    table = np.array(table)
    ids = iter(pages.num_pages + rng.permutation(n_lo.sum()))
    for i in range(b):
        for h in range(hkv):
            cols = [next(ids) for _ in range(n_lo[i, h])]
            assert (table[i, h, w - len(cols):] == 0).all() or not cols
            table[i, h, w - len(cols):] = cols[::-1]
            for c, pid in enumerate(cols):  # tokens past the row's length
                lo = max(low_lens[i, h] - c * page_lo, 0)
                k[pid - pages.num_pages, lo:], v[pid - pages.num_pages, lo:] = POISON, -POISON
    extra = KVPages.from_dense(jnp.asarray(k, jnp.float32), jnp.asarray(v, jnp.float32),
                               low_format).as_format(pages.kv_format)
    pool = jax.tree.map(lambda a, e: jnp.concatenate([a, e]), pages, extra)
    return ((q, pool, jnp.asarray(table), *rest), pool.as_format(low_format),
            jnp.asarray(low_lens, jnp.int32))


def rel_err(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


# (T, block_q, pages_per_block, block_w): several query blocks, and a single query (block_q
# clamps to 1) with other page and window blocks
TILINGS = ((16, 8, 2, 8), (1, 16, 4, 16))


@pytest.mark.parametrize("k_bits,v_bits,token_keys,gqa,d", FORMAT_SHAPES)
def test_kernel_matches_float64_reference(k_bits, v_bits, token_keys, gqa, d):
    rng = np.random.default_rng()
    for t, block_q, ppb, block_w in TILINGS:
        args = make_case(rng, gqa=gqa, d=d, t=t, k_bits=k_bits, v_bits=v_bits,
                         token_keys=token_keys)
        want = float64_reference(args)
        assert np.abs(want[3, :, gqa:]).max() == 0  # row 3, head 1 sees nothing
        ref = chunked_prefill_attention_reference(*args)
        assert rel_err(ref, want) < 1e-5
        out = chunked_prefill_attention(*args, block_q=block_q, pages_per_block=ppb,
                                        block_w=block_w, interpret=INTERPRET)
        assert out.shape == args[0].shape and out.dtype == args[0].dtype
        assert np.isfinite(np.asarray(out)).all()
        err = rel_err(out, want)
        assert err < 1e-5, f"k{k_bits}v{v_bits} gqa={gqa} d={d} t={t}: {err:.2e}"


def test_float32_queries_over_bf16_pages():
    """kv_format bf16 under a float32 model: bfloat16 pages, float32 queries and window, read
    upcast, as near the float64 attention over the very same pages as float32 pages are."""
    rng = np.random.default_rng()
    args = make_case(rng, gqa=4, d=64, t=16, k_bits=16, v_bits=16)
    pages = KVPages.from_dense(*args[1].dense(), KV_FORMATS["bf16"])
    assert pages.k.dtype == pages.v.dtype == jnp.bfloat16
    args = (args[0], pages, *args[2:])
    want = float64_reference(args)
    for got in (chunked_prefill_attention(*args, block_q=8, pages_per_block=2, block_w=8,
                                          interpret=INTERPRET),
                xla_attention(*args, block_q=8, block_k=16, block_w=8)):
        assert got.dtype == jnp.float32
        assert rel_err(got, want) < 1e-5


def test_query_that_sees_nothing_gives_zero():
    rng = np.random.default_rng()
    args = make_case(rng, gqa=2, d=64, t=8, k_bits=16, v_bits=16)
    q, pages, table, plen, kw, vw, start, wlen, pos = args
    plen = plen.at[1].set(0)
    pos = pos.at[1].set(start[1] - 1)  # row 1 sees neither pages nor window
    out = chunked_prefill_attention(q, pages, table, plen, kw, vw, start, wlen, pos,
                                    block_q=8, pages_per_block=2, block_w=8,
                                    interpret=INTERPRET)
    out = np.asarray(out)
    assert np.isfinite(out).all()
    assert (out[1] == 0).all() and (out[3, :, 2:] == 0).all()
    assert np.abs(out[0]).min() > 0


def test_padding_queries_give_zero_and_leave_real_ones_alone():
    """q_lengths: queries past a row's real ones (whole tiles of them skip all work) give 0;
    the real ones are exactly what the kernel gives without q_lengths."""
    rng = np.random.default_rng()
    args = make_case(rng, gqa=2, d=64, t=32, k_bits=8, v_bits=4)
    q_lengths = jnp.asarray([0, int(rng.integers(1, 8)), int(rng.integers(9, 32)), 32],
                            jnp.int32)
    run = functools.partial(chunked_prefill_attention, *args, block_q=8, pages_per_block=2,
                            block_w=8, interpret=INTERPRET)
    full, padded = np.asarray(run()), np.asarray(run(q_lengths=q_lengths))
    ref = chunked_prefill_attention_reference(*args, q_lengths=q_lengths)
    for i, n in enumerate(np.asarray(q_lengths)):
        np.testing.assert_array_equal(padded[i, :n], full[i, :n])
        assert (padded[i, n:] == 0).all() and (np.asarray(ref)[i, n:] == 0).all()
    assert rel_err(padded, ref) < 1e-5


@pytest.mark.parametrize("k_bits,v_bits,token_keys,dequant",
                         [(16, 16, False, "f16")]
                         + [(*f, dq) for f in ((8, 8, False), (4, 2, False), (8, 4, True))
                            for dq in DEQUANT])
def test_bf16(k_bits, v_bits, token_keys, dequant):
    """bf16 queries, pages (before quantization) and window: 16-bit tensor-core operands,
    quantized pages dequantized either way; within bf16's rounding of float64 (measured
    1.4e-3 to 2.3e-3; a wrong scale group costs far more)."""
    rng = np.random.default_rng()
    args = make_case(rng, gqa=4, d=64, t=16, k_bits=k_bits, v_bits=v_bits, dtype=jnp.bfloat16,
                     token_keys=token_keys)
    out = chunked_prefill_attention(*args, block_q=16, pages_per_block=2, block_w=8,
                                    dequant=dequant, interpret=INTERPRET)
    assert out.dtype == jnp.bfloat16
    assert np.isfinite(np.asarray(out, np.float32)).all()
    assert rel_err(out, float64_reference(args)) < 4e-3


def test_bad_shapes_raise_value_errors():
    rng = np.random.default_rng()
    args = make_case(rng, gqa=2, d=64, t=8, k_bits=8, v_bits=8)
    q, pages, rest = args[0], args[1], args[2:]
    run = functools.partial(chunked_prefill_attention, interpret=True)
    with pytest.raises(ValueError, match="k_scale"):
        run(q, pages.replace(k_scale=None, k_zero=None, v_scale=None, v_zero=None), *rest)
    with pytest.raises(ValueError, match="v_scale"):
        run(q, pages.replace(v_scale=None, v_zero=None), *rest)
    with pytest.raises(ValueError, match="T=8"):
        run(*args, block_q=3, block_w=8)
    with pytest.raises(ValueError, match="Tw=16"):
        run(*args, block_w=32)
    with pytest.raises(ValueError, match="W=8"):
        run(*args, block_w=8, pages_per_block=3)
    with pytest.raises(ValueError, match="head_dim"):
        run(q, pages.replace(kv_format=KVFormat(4, 8, GROUP)), *rest, block_w=8)
    with pytest.raises(ValueError, match="query heads"):
        run(args[0][:, :, :3], *args[1:], block_w=8)
    with pytest.raises(ValueError, match="q_positions"):
        run(*args[:-1], args[-1][:, :4], block_w=8)


@pytest.mark.parametrize("k_bits,v_bits,token_keys,dtype,dequant", LOWERING_CASES)
def test_lowers_for_cuda_with_triton(k_bits, v_bits, token_keys, dtype, dequant):
    """Runs the Pallas-to-Triton lowering on any machine, so lowering errors fail CI here."""
    rng = np.random.default_rng()
    for t, gqa, block_q, ppb, block_w in ((16, 3, 16, 4, 8), (1, 8, 16, 2, 16)):
        args = make_case(rng, gqa=gqa, d=128, t=t, k_bits=k_bits, v_bits=v_bits, dtype=dtype,
                         token_keys=token_keys)
        run = functools.partial(chunked_prefill_attention, block_q=block_q,
                                pages_per_block=ppb, block_w=block_w, dequant=dequant)
        lowered = jax.jit(run).trace(*args).lower(lowering_platforms=("cuda",))
        assert "__gpu$xla.gpu.triton" in lowered.as_text()


@pytest.mark.parametrize("fmt", ["k8v4t"])
def test_two_tiers(fmt):
    """LeanKV's low tier (the same pool's pages at half the bits, from the right of each
    row) is seen like the high tier: kernel, reference and xla path against float64, output
    and significance."""
    rng = np.random.default_rng()
    k_bits, v_bits = KV_FORMATS[fmt].k_bits, KV_FORMATS[fmt].v_bits
    low_lens = np.array([[2 * 2 * PAGE, 1], [2 * PAGE + 3, 0], [5, 2 * PAGE], [0, 3]])
    for t, block_q, ppb, block_w in TILINGS:
        args = make_case(rng, gqa=3, d=64, t=t, k_bits=k_bits, v_bits=v_bits, token_keys=True)
        args, low, low_lens_j = with_low_tier(rng, args, low_lens)
        tiers = dict(low_tier=low, low_lengths=low_lens_j)
        want = float64_reference(args, low, low_lens)
        ref, ref_sig = chunked_prefill_attention_reference(*args, return_significance=True,
                                                           **tiers)
        assert rel_err(ref, want) < 1e-5
        run = functools.partial(chunked_prefill_attention, *args, block_q=block_q,
                                pages_per_block=ppb, block_w=block_w, interpret=INTERPRET,
                                **tiers)
        out, sig = run(return_significance=True)
        assert rel_err(out, want) < 1e-5, f"t={t}"
        np.testing.assert_array_equal(np.asarray(out), np.asarray(run()))
        xla_out, xla_sig = xla_attention(*args, return_significance=True, **tiers)
        assert rel_err(xla_out, want) < 1e-5
        # scores kept only as wide as the longest tier of a row: the same results
        most = int(max(np.asarray(args[3]).max(), low_lens.max()))
        narrow = xla_attention(*args, return_significance=True, max_tokens=most, **tiers)
        for got, full in zip(jax.tree.leaves(narrow), jax.tree.leaves((xla_out, xla_sig)),
                             strict=True):
            np.testing.assert_array_equal(np.asarray(got), np.asarray(full))
        assert len(sig) == len(ref_sig) == len(xla_sig) == 3
        assert (np.asarray(ref_sig[2]) > 0).sum() == low_lens.sum()  # each low token, once
        for got, other, expect in zip(sig, xla_sig, ref_sig, strict=True):
            assert np.abs(np.asarray(got) - np.asarray(expect)).max() < 1e-5
            assert np.abs(np.asarray(other) - np.asarray(expect)).max() < 1e-5


def test_cuda_lowering_catches_triton_errors():
    """The route above really lowers: a head_dim that is not a power of two is refused."""
    rng = np.random.default_rng()
    args = make_case(rng, gqa=2, d=96, t=16, k_bits=16, v_bits=16)
    run = functools.partial(chunked_prefill_attention, block_q=16, pages_per_block=2,
                            block_w=8)
    with pytest.raises(Exception, match="power of 2"):
        jax.jit(run).trace(*args).lower(lowering_platforms=("cuda",))


@pytest.mark.parametrize("k_bits,v_bits", [(16, 16), (8, 4)])
def test_significance_matches_the_reference(k_bits, v_bits):
    """The kernel's significance (logits written in the same pass) against the reference's
    and the xla path's, with padding queries; asking for it leaves the output unchanged."""
    rng = np.random.default_rng()
    for t, block_q, ppb, block_w in TILINGS:
        args = make_case(rng, gqa=3, d=64, t=t, k_bits=k_bits, v_bits=v_bits)
        q_lengths = jnp.asarray([t, max(t - 3, 1), t, 0], jnp.int32)
        _, (ref_pages, ref_window) = chunked_prefill_attention_reference(
            *args, q_lengths=q_lengths, return_significance=True)
        assert np.asarray(ref_pages).max() > 0.01 and np.asarray(ref_window).max() > 0.01
        _, (xla_pages, xla_window) = xla_attention(*args, q_lengths=q_lengths,
                                                   return_significance=True)
        run = functools.partial(chunked_prefill_attention, *args, q_lengths=q_lengths,
                                block_q=block_q, pages_per_block=ppb, block_w=block_w,
                                interpret=INTERPRET)
        out, (sig_pages, sig_window) = run(return_significance=True)
        np.testing.assert_array_equal(np.asarray(out), np.asarray(run()))
        for got, want, other in ((sig_pages, ref_pages, xla_pages),
                                 (sig_window, ref_window, xla_window)):
            assert got.shape == want.shape
            assert np.abs(np.asarray(want) - np.asarray(other)).max() < 1e-5
            err = np.abs(np.asarray(got) - np.asarray(want)).max()
            assert err < 1e-5, f"t={t} block_q={block_q} ppb={ppb} block_w={block_w}: {err:.2e}"


def test_significance_lowers_for_cuda_with_triton():
    rng = np.random.default_rng()
    args = make_case(rng, gqa=3, d=128, t=16, k_bits=8, v_bits=4, dtype=jnp.bfloat16,
                     token_keys=True)
    args, low, low_lens = with_low_tier(rng, args, np.full((4, 2), 5))
    run = functools.partial(chunked_prefill_attention, block_q=16, pages_per_block=4,
                            block_w=8, return_significance=True, low_tier=low,
                            low_lengths=low_lens)
    lowered = jax.jit(run).trace(*args)
    assert lowered.out_info[1][1].shape == args[4].shape[:3]  # the window before its padding
    assert "__gpu$xla.gpu.triton" in lowered.lower(lowering_platforms=("cuda",)).as_text()
