"""Quantize-and-write kernel against its reference, on fresh random inputs every run.

The pool is poisoned before the call: listed pages must equal the reference exactly (the
kernel and `kv_quant` share one float formula; on a GPU a division may round differently, so
there a code may differ by one on a tiny fraction of entries) and every other page must be
bit-identical to what it was.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jkv.pallas_kernels.kv_quant import dequantize_keys, dequantize_values
from jkv.pallas_kernels.quantize_write import quantize_write, quantize_write_reference

INTERPRET = jax.default_backend() == "cpu"
FORMATS = [(16, 16), (8, 8), (4, 4), (8, 4), (4, 2), (8, 16)]


def poisoned_pool(rng, num_pages, page, d, k_bits, v_bits, group, dtype=jnp.float32):
    def side(bits):
        if bits == 16:
            return jnp.asarray(rng.normal(size=(num_pages, page, d)) * 1e4, dtype)
        return jnp.asarray(rng.integers(0, 256, (num_pages, page, d * bits // 8)), jnp.uint8)

    g = min(group, d)
    noise = lambda *shape: jnp.asarray(rng.normal(size=shape) - 7.0, jnp.float32)  # noqa: E731
    return (side(k_bits), side(v_bits),
            noise(num_pages, d) if k_bits < 16 else None,
            noise(num_pages, d) if k_bits < 16 else None,
            noise(num_pages, page, d // g) if v_bits < 16 else None,
            noise(num_pages, page, d // g) if v_bits < 16 else None)


def sources(rng, n, page, d, dtype=jnp.float32):
    k = rng.normal(size=(n, page, d)) * (1 + 4 * (rng.random(d) < 0.1))  # outlier channels
    k[:, :, 3] = 0.5  # a constant channel: scale 0
    v = rng.normal(size=(n, page, d))
    return jnp.asarray(k, dtype), jnp.asarray(v, dtype)


@pytest.mark.parametrize("k_bits,v_bits", FORMATS)
@pytest.mark.parametrize("d,page,group,n", [(64, 8, 32, 5), (128, 16, 64, 1), (64, 16, 64, 3)])
def test_kernel_matches_reference_and_leaves_other_pages_alone(k_bits, v_bits, d, page, group,
                                                               n):
    rng = np.random.default_rng()
    num_pages = 12
    pool = poisoned_pool(rng, num_pages, page, d, k_bits, v_bits, group)
    before = [None if x is None else np.asarray(x) for x in pool]
    k, v = sources(rng, n, page, d)
    ids = jnp.asarray(1 + rng.permutation(num_pages - 1)[:n], jnp.int32)
    ref = quantize_write_reference(k, v, ids, *pool, k_bits=k_bits, v_bits=v_bits, group=group)
    out = quantize_write(k, v, ids, *pool, k_bits=k_bits, v_bits=v_bits, group=group,
                         interpret=INTERPRET)
    untouched = np.setdiff1d(np.arange(1, num_pages), np.asarray(ids))
    for name, a, b, old in zip(("k", "v", "k_scale", "k_zero", "v_scale", "v_zero"), ref, out,
                               before, strict=True):
        if a is None:
            assert b is None, name
            continue
        a, b = np.asarray(a), np.asarray(b)
        assert a.dtype == b.dtype and a.shape == b.shape, name
        written = np.asarray(ids)
        if INTERPRET:
            np.testing.assert_array_equal(b[written], a[written], err_msg=name)
        else:
            diff = np.abs(b[written].astype(np.float64) - a[written].astype(np.float64))
            assert (diff > (1 if a.dtype == np.uint8 else 1e-6 * np.abs(a[written]).max())
                    ).mean() < 1e-3, name
        np.testing.assert_array_equal(b[untouched], old[untouched], err_msg=f"{name} untouched")


def test_round_trip_error_is_ordered_by_bits():
    rng = np.random.default_rng()
    page, d, n = 16, 128, 8
    k, v = sources(rng, n, page, d)
    ids = jnp.arange(1, n + 1, dtype=jnp.int32)
    errs = {}
    for bits in (8, 4, 2):
        pool = poisoned_pool(rng, n + 1, page, d, bits, bits, 32)
        kp, vp, ks, kz, vs, vz = quantize_write(k, v, ids, *pool, k_bits=bits, v_bits=bits,
                                                group=32, interpret=INTERPRET)
        kd = dequantize_keys(kp[ids], ks[ids], kz[ids], bits)
        vd = dequantize_values(vp[ids], vs[ids], vz[ids], bits)
        errs[bits] = tuple(float(jnp.linalg.norm(x - y) / jnp.linalg.norm(y))
                           for x, y in ((kd, k), (vd, v)))
        print(f"{bits} bits: key relative error {errs[bits][0]:.3e}, "
              f"value relative error {errs[bits][1]:.3e}")
    for side in (0, 1):
        assert errs[8][side] < errs[4][side] < errs[2][side] < 0.5


def test_bf16_source_pages():
    rng = np.random.default_rng()
    pool = poisoned_pool(rng, 6, 8, 64, 8, 4, 32)
    k, v = sources(rng, 2, 8, 64, jnp.bfloat16)
    ids = jnp.asarray([2, 5], jnp.int32)
    ref = quantize_write_reference(k, v, ids, *pool, k_bits=8, v_bits=4, group=32)
    out = quantize_write(k, v, ids, *pool, k_bits=8, v_bits=4, group=32, interpret=INTERPRET)
    for a, b in zip(ref, out, strict=True):
        diff = np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64))
        assert diff.max() <= (1 if a.dtype == jnp.uint8 else 1e-5)


def test_bad_inputs_raise_value_errors():
    rng = np.random.default_rng()
    pool = poisoned_pool(rng, 6, 8, 64, 8, 4, 32)
    k, v = sources(rng, 2, 8, 64)
    ids = jnp.asarray([1, 2], jnp.int32)
    with pytest.raises(ValueError, match="page_ids"):
        quantize_write(k, v, ids[:1], *pool, k_bits=8, v_bits=4, group=32, interpret=True)
    with pytest.raises(ValueError, match="v_scale"):
        quantize_write(k, v, ids, *pool[:4], k_bits=8, v_bits=4, group=32, interpret=True)
    with pytest.raises(ValueError, match="k_pages"):
        quantize_write(k, v, ids, *pool, k_bits=4, v_bits=4, group=32, interpret=True)
    with pytest.raises(ValueError, match="group"):
        quantize_write(k[..., :48], v[..., :48], ids, *pool, k_bits=8, v_bits=4, group=32,
                       interpret=True)


@pytest.mark.parametrize("k_bits,v_bits", FORMATS)
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_lowers_for_cuda_with_triton(k_bits, v_bits, dtype):
    rng = np.random.default_rng()
    pool = poisoned_pool(rng, 9, 16, 128, k_bits, v_bits, 64, dtype)
    k, v = sources(rng, 4, 16, 128, dtype)
    ids = jnp.asarray([1, 3, 5, 7], jnp.int32)
    run = functools.partial(quantize_write, k_bits=k_bits, v_bits=v_bits, group=64)
    lowered = jax.jit(run).trace(k, v, ids, *pool).lower(lowering_platforms=("cuda",))
    assert "__gpu$xla.gpu.triton" in lowered.as_text()
