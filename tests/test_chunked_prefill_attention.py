"""Chunked prefill attention against its references, on fresh random inputs every run.

A chunk of queries attends to a paged prefix (any format) and, causally, to a full-precision
window holding the partly filled page and the chunk itself. Everything the kernel must not
read is poisoned with large finite values.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jkv.config import KV_FORMATS
from jkv.pallas_kernels.chunked_prefill_attention import (
    chunked_prefill_attention,
    chunked_prefill_attention_reference,
)
from jkv.pallas_kernels.kv_quant import quantize_keys, quantize_values
from jkv.pallas_kernels.paged_decode_attention import dequantized_rows

INTERPRET = jax.default_backend() == "cpu"
FORMATS = sorted({(f.k_bits, f.v_bits) for f in KV_FORMATS.values()}, reverse=True)
PAGE, GROUP, WIDTH, POISON = 8, 32, 4, 1e4


def make_case(rng, *, gqa, d, t, k_bits, v_bits, dtype=jnp.float32):
    """Two rows x two KV heads. Row 0: its heads hold different prefixes (0 and a partial
    page) and a window that starts mid-page; row 1: an exact page multiple, a window of one
    token, and padding queries that see only the prefix."""
    b, hkv = 2, 2
    tw = PAGE + -(-t // PAGE) * PAGE
    plen = np.array([[0, 5], [2 * PAGE, 2 * PAGE]])
    start = np.array([5, 2 * PAGE])
    wlen = np.array([t, 1])
    pos = np.stack([start[0] + np.arange(t), start[1] + np.minimum(np.arange(t), 0) - 1])
    pos[1, 0] = start[1]  # the only real query of row 1; the rest see only the prefix
    num_pages = b * hkv * WIDTH + 1
    k = rng.normal(size=(num_pages, PAGE, d)) * (1 + 4 * (rng.random(d) < 0.1))
    v = rng.normal(size=(num_pages, PAGE, d))
    table = (1 + rng.permutation(num_pages - 1)).reshape(b, hkv, WIDTH)
    k[0], v[0] = POISON, -POISON  # the null page
    for i in range(b):
        for h in range(hkv):
            n = plen[i, h]
            for c in range(WIDTH):  # tokens past the prefix in its pages
                lo = max(n - c * PAGE, 0)
                k[table[i, h, c], lo:] = POISON
                v[table[i, h, c], lo:] = -POISON
            if n == 0:
                table[i, h] = 0
    kw = rng.normal(size=(b, hkv, tw, d))
    vw = rng.normal(size=(b, hkv, tw, d))
    for i in range(b):
        kw[i, :, wlen[i]:], vw[i, :, wlen[i]:] = POISON, -POISON
    k, v = jnp.asarray(k, dtype), jnp.asarray(v, dtype)
    extra = {}
    if k_bits < 16:
        k, extra["k_scale"], extra["k_zero"] = quantize_keys(k, k_bits)
    if v_bits < 16:
        v, extra["v_scale"], extra["v_zero"] = quantize_values(v, v_bits, GROUP)
    q = jnp.asarray(rng.normal(size=(b, t, hkv * gqa, d)), dtype)
    i32 = functools.partial(jnp.asarray, dtype=jnp.int32)
    args = (q, k, v, i32(table), i32(plen), jnp.asarray(kw, dtype), jnp.asarray(vw, dtype),
            i32(start), i32(wlen), i32(pos))
    return args, extra


def float64_reference(args, extra, k_bits, v_bits):
    q, k, v, table, plen, kw, vw, start, wlen, pos = (np.asarray(a) if i not in (1, 2) else a
                                                      for i, a in enumerate(args))
    kd, vd = dequantized_rows(k, v, jnp.asarray(table), **extra, k_bits=k_bits, v_bits=v_bits)
    kd = np.concatenate([np.asarray(kd, np.float64), kw.astype(np.float64)], axis=2)
    vd = np.concatenate([np.asarray(vd, np.float64), vw.astype(np.float64)], axis=2)
    b, t, hq, d = q.shape
    hkv, s_pages, tw = table.shape[1], table.shape[2] * PAGE, kw.shape[2]
    out = np.zeros((b, t, hq, d))
    for i in range(b):
        for h in range(hkv):
            for j in range(t):
                seen = np.concatenate([np.arange(s_pages) < plen[i, h],
                                       (np.arange(tw) < wlen[i])
                                       & (start[i] + np.arange(tw) <= pos[i, j])])
                if not seen.any():
                    continue
                g = hq // hkv
                qs = q[i, j, h * g:(h + 1) * g].astype(np.float64) / np.sqrt(d)
                s = qs @ kd[i, h, seen].T
                p = np.exp(s - s.max(-1, keepdims=True))
                out[i, j, h * g:(h + 1) * g] = (p / p.sum(-1, keepdims=True)) @ vd[i, h, seen]
    return out


def rel_err(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


@pytest.mark.parametrize("k_bits,v_bits", FORMATS)
@pytest.mark.parametrize("gqa,d", [(1, 64), (3, 128), (4, 64), (8, 128)])
def test_kernel_matches_float64_reference(k_bits, v_bits, gqa, d):
    rng = np.random.default_rng()
    for t, block_q in ((16, 8), (1, 16)):
        args, extra = make_case(rng, gqa=gqa, d=d, t=t, k_bits=k_bits, v_bits=v_bits)
        want = float64_reference(args, extra, k_bits, v_bits)
        ref = chunked_prefill_attention_reference(*args, **extra, k_bits=k_bits, v_bits=v_bits)
        assert rel_err(ref, want) < 1e-5
        out = chunked_prefill_attention(*args, **extra, k_bits=k_bits, v_bits=v_bits,
                                        group=GROUP, block_q=block_q, pages_per_block=2,
                                        block_w=8, interpret=INTERPRET)
        assert out.shape == args[0].shape and out.dtype == args[0].dtype
        assert np.isfinite(np.asarray(out)).all()
        err = rel_err(out, want)
        assert err < 1e-5, f"k{k_bits}v{v_bits} gqa={gqa} d={d} t={t}: {err:.2e}"


def test_query_that_sees_nothing_gives_zero():
    rng = np.random.default_rng()
    args, extra = make_case(rng, gqa=2, d=64, t=8, k_bits=16, v_bits=16)
    q, k, v, table, plen, kw, vw, start, wlen, pos = args
    plen = jnp.zeros_like(plen)
    pos = pos.at[1].set(start[1] - 1)  # row 1 sees neither pages nor window
    out = chunked_prefill_attention(q, k, v, table, plen, kw, vw, start, wlen, pos,
                                    block_q=8, pages_per_block=2, block_w=8,
                                    interpret=INTERPRET)
    assert np.asarray(out[1]).max() == 0 and np.asarray(out[1]).min() == 0
    assert np.abs(np.asarray(out[0])).max() > 0


def test_bf16():
    rng = np.random.default_rng()
    args, extra = make_case(rng, gqa=4, d=64, t=16, k_bits=16, v_bits=16, dtype=jnp.bfloat16)
    out = chunked_prefill_attention(*args, block_q=16, pages_per_block=2, block_w=8,
                                    interpret=INTERPRET)
    assert out.dtype == jnp.bfloat16
    assert rel_err(out, float64_reference(args, extra, 16, 16)) < 2e-2


def test_bad_shapes_raise_value_errors():
    rng = np.random.default_rng()
    args, extra = make_case(rng, gqa=2, d=64, t=8, k_bits=8, v_bits=8)
    with pytest.raises(ValueError, match="k_scale"):
        chunked_prefill_attention(*args, k_bits=8, v_bits=8, interpret=True)
    with pytest.raises(ValueError, match="T=8"):
        chunked_prefill_attention(*args, **extra, k_bits=8, v_bits=8, block_q=3, block_w=8,
                                  interpret=True)
    with pytest.raises(ValueError, match="Tw=16"):
        chunked_prefill_attention(*args, **extra, k_bits=8, v_bits=8, block_w=32,
                                  interpret=True)


@pytest.mark.parametrize("k_bits,v_bits", FORMATS)
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_lowers_for_cuda_with_triton(k_bits, v_bits, dtype):
    rng = np.random.default_rng()
    args, extra = make_case(rng, gqa=4, d=128, t=16, k_bits=k_bits, v_bits=v_bits, dtype=dtype)
    run = functools.partial(chunked_prefill_attention, k_bits=k_bits, v_bits=v_bits,
                            group=GROUP, block_q=16, pages_per_block=2, block_w=8)
    lowered = jax.jit(run).trace(*args, **extra).lower(lowering_platforms=("cuda",))
    assert "__gpu$xla.gpu.triton" in lowered.as_text()
