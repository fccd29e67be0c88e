"""Quantize-and-write kernel against its reference, on fresh random inputs every run.

The pool is poisoned before the call (random bytes, random scales near -7, NaN zero points,
float pages near 1e4): listed pages must equal the reference exactly and every other page
(bar the null page 0) must be bit-identical to what it was. Exactness holds in interpret mode,
where the kernel and `kv_quant` evaluate one float formula; compiled on a GPU a division may
round differently by an ulp, so there a code may differ by one on a tiny fraction of entries
and a scale by a relative 1e-6.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from covering import rotated_cover

from jkv.kv.format import KV_FORMATS, SCALE_DTYPE, KVFormat
from jkv.kv.pages import KVPages
from jkv.kv.quant import as_stored, pack, unpack
from jkv.pallas_kernels.quantize_write import quantize_write, quantize_write_reference

INTERPRET = jax.default_backend() == "cpu"
FORMATS = [(16, 16), (8, 8), (4, 4), (8, 4), (4, 2), (8, 16)]


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_packed_codes_read_back_exactly(bits):
    """pack's layout (byte j holds channels j, j + Dp, ... from its lowest bits up), written
    from random codes and read back by unpack."""
    rng = np.random.default_rng()
    k, d = 8 // bits, 64
    codes = rng.integers(0, 1 << bits, size=(5, d), dtype=np.uint8)
    packed = np.asarray(pack(jnp.asarray(codes), bits))
    dp = d // k
    want = np.zeros((5, dp), np.uint8)
    for i in range(k):
        want |= codes[:, i * dp:(i + 1) * dp] << (bits * i)
    np.testing.assert_array_equal(packed, want)
    np.testing.assert_array_equal(unpack(jnp.asarray(packed), bits), codes)


def test_as_stored_rounds_as_a_float16_conversion_does():
    """Scales and zero points are rounded by `as_stored`, jitted or not, exactly as a float16
    conversion rounds: random magnitudes from float16's subnormals to past its range, and
    exact ties between two float16 values (normal and subnormal)."""
    rng = np.random.default_rng()
    x = np.concatenate([rng.normal(size=20_000) * 10.0 ** rng.uniform(-9, 5, 20_000),
                        rng.integers(0, 4096, 2_000) * 2.0 ** -25,  # subnormal ties
                        [np.inf, -np.inf, np.nan, 0.0, 65504.0, 65519.0, 65520.0, 2.0 ** -14]])
    halves = rng.normal(size=2_000).astype(np.float16).astype(np.float32)
    tie = (halves.view(np.int32) + (1 << 12)).view(np.float32)  # half a float16 ulp above
    x = np.concatenate([x.astype(np.float32), tie])
    with np.errstate(over="ignore"):
        want = x.astype(np.float16).astype(np.float32)
    for f in (as_stored, jax.jit(as_stored)):
        np.testing.assert_array_equal(np.asarray(f(jnp.asarray(x))), want)


@pytest.mark.parametrize("name", ["k8v4t", "k4v2t", "k8v4", "int8", "k2v2"])
def test_value_parts_are_the_dense_values(name):
    """`value_parts` (the xla path's values, one channel block per packed part) put side by
    side are `dense()`'s values bit for bit, whatever the bits and group size."""
    rng = np.random.default_rng()
    x = jnp.asarray(rng.normal(size=(3, 2, 16, 64)) * (1 + 5 * (rng.random(64) < 0.1)),
                    jnp.float32)
    pages = KVPages.from_dense(x, x, KV_FORMATS[name])
    parts = pages.value_parts()
    assert len(parts) == 8 // KV_FORMATS[name].v_bits
    np.testing.assert_array_equal(np.concatenate([np.asarray(p) for p in parts], -1),
                                  np.asarray(pages.dense()[1]))


def poisoned_pool(rng, num_pages, page, d, k_bits, v_bits, group, dtype=jnp.float32,
                  token_keys=False):
    """A pool in the layout `quantize_write` takes, filled with garbage (built by hand, so a
    test can also build one that does not fit its format)."""
    def side(bits):
        if bits == 16:
            return jnp.asarray(1e4 + rng.normal(size=(num_pages, page, d)), dtype)
        return jnp.asarray(rng.integers(0, 256, (num_pages, page, d * bits // 8)), jnp.uint8)

    g = min(group, d)
    scale = lambda *shape: jnp.asarray(rng.normal(size=shape) - 7.0, SCALE_DTYPE)  # noqa: E731
    zero = lambda *shape: jnp.full(shape, jnp.nan, SCALE_DTYPE)  # noqa: E731
    k_stat = (num_pages, page, d // g) if token_keys else (num_pages, d)
    return KVPages(side(k_bits), side(v_bits),
                   scale(*k_stat) if k_bits < 16 else None,
                   zero(*k_stat) if k_bits < 16 else None,
                   scale(num_pages, page, d // g) if v_bits < 16 else None,
                   zero(num_pages, page, d // g) if v_bits < 16 else None,
                   kv_format=KVFormat(k_bits, v_bits, group, token_keys=token_keys))


def sources(rng, n, page, d, dtype=jnp.float32):
    """New pages: keys with outlier channels and a constant channel (scale 0), values with an
    outlier token and a constant group in one token."""
    k = rng.normal(size=(n, page, d)) * (1 + 9 * (rng.random(d) < 0.1))
    k[:, :, 3] = 0.5
    v = rng.normal(size=(n, page, d))
    v[:, 0] *= 20
    v[:, 1, : min(d, 32)] = -1.25
    return jnp.asarray(k, dtype), jnp.asarray(v, dtype)


def codes_of(name, x, k_bits, v_bits):
    bits = k_bits if name.startswith("k") else v_bits
    return np.asarray(unpack(jnp.asarray(x), bits)).astype(np.int64)


def check_written(name, got, want, k_bits, v_bits, ties=None):
    """Written pages: exact in interpret mode. Compiled, Triton's division is not IEEE, so a
    code may differ by 1 where the exact value sits on a rounding tie (`ties`, from the
    reference's scales in float64); everywhere else codes are exact."""
    assert got.dtype == want.dtype and got.shape == want.shape, name
    if INTERPRET or name.endswith("zero") or got.dtype != np.uint8 and name in ("k", "v"):
        np.testing.assert_array_equal(got, want, err_msg=name)
    elif got.dtype == np.uint8:
        diff = np.abs(codes_of(name, got, k_bits, v_bits) - codes_of(name, want, k_bits, v_bits))
        assert diff.max() <= 1, name
        off_tie = (diff > 0) & ~ties
        assert not off_tie.any(), f"{name}: {off_tie.sum()} codes differ away from a tie"
    else:
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=0, err_msg=name)


def rounding_ties(x, scale, zero, group=None):
    """Where (x - zero) / scale, in float64, is within 1e-3 of a half-integer: codes that a
    last-bit difference in the scale's reciprocal may round either way. Keys have scales per
    channel [n, D]; values per token and group of channels [n, page, D // group]."""
    x = np.asarray(x, np.float64)
    scale, zero = np.asarray(scale, np.float64), np.asarray(zero, np.float64)
    if group is None:
        scale, zero = scale[:, None, :], zero[:, None, :]
    else:
        scale, zero = np.repeat(scale, group, axis=-1), np.repeat(zero, group, axis=-1)
    y = (x - zero) / np.where(scale > 0, scale, 1.0)
    return np.abs(y - np.floor(y) - 0.5) < 1e-3


def check_call(rng, *, k_bits, v_bits, d, page, group, ids, num_pages, dtype=jnp.float32,
               pool_dtype=jnp.float32, token_keys=False):
    """One call on a poisoned pool against the reference, then the untouched pages."""
    pool = poisoned_pool(rng, num_pages, page, d, k_bits, v_bits, group, pool_dtype,
                         token_keys)
    before = {name: np.asarray(x) for name, x in pool.arrays().items()}
    k, v = sources(rng, len(ids), page, d, dtype)
    ids = jnp.asarray(ids, jnp.int32)
    ref = quantize_write_reference(k, v, ids, pool)
    out = quantize_write(k, v, ids, pool, interpret=INTERPRET)
    assert out.kv_format == pool.kv_format and sorted(out.arrays()) == sorted(before)
    written = np.unique(np.asarray(ids)[np.asarray(ids) != 0])
    untouched = np.setdiff1d(np.arange(1, num_pages), written)
    ties = {}
    for name, x, scale, zero in (("k", k, ref.k_scale, ref.k_zero),
                                 ("v", v, ref.v_scale, ref.v_zero)):
        if scale is not None and not INTERPRET:
            grp = None if name == "k" and not token_keys else d // scale.shape[-1]
            mask = np.zeros((num_pages, page, d), bool)
            for j, pid in enumerate(np.asarray(ids)):
                if pid:
                    mask[pid] = rounding_ties(x[j:j + 1].astype(jnp.float32),
                                              np.asarray(scale)[pid:pid + 1],
                                              np.asarray(zero)[pid:pid + 1], grp)[0]
            ties[name] = mask[written]
    for name, want in ref.arrays().items():
        want, got, old = np.asarray(want), np.asarray(getattr(out, name)), before[name]
        assert np.isfinite(want[written].astype(np.float32)).all(), name
        check_written(name, got[written], want[written], k_bits, v_bits, ties.get(name))
        np.testing.assert_array_equal(got[untouched], old[untouched], err_msg=f"{name} untouched")
    return k, v, ids, out


WRITE_SHAPES = [(64, 8, 32, 5), (128, 16, 64, 1), (64, 16, 64, 3), (128, 8, 32, 4),
                (64, 8, 128, 2)]  # (d, page, group, pages written)
# a covering design that keeps the suite's time in bounds: each format over three of the
# shapes, rotated so that every shape meets three or four formats
FORMAT_WRITE_SHAPES = rotated_cover(FORMATS, WRITE_SHAPES, 3, stride=2)


@pytest.mark.parametrize("k_bits,v_bits,d,page,group,n", FORMAT_WRITE_SHAPES)
def test_kernel_matches_reference_and_leaves_other_pages_alone(k_bits, v_bits, d, page, group,
                                                               n):
    rng = np.random.default_rng()
    num_pages = 12
    ids = 1 + rng.permutation(num_pages - 1)[:n]
    check_call(rng, k_bits=k_bits, v_bits=v_bits, d=d, page=page, group=group, ids=ids,
               num_pages=num_pages)


@pytest.mark.parametrize("k_bits,v_bits", [(8, 4), (4, 2), (4, 8), (2, 4)])
@pytest.mark.parametrize("d,page,group,n", [(64, 8, 32, 5), (128, 16, 64, 2)])
def test_per_token_key_scales(k_bits, v_bits, d, page, group, n):
    """token_keys formats: keys quantized per (token, group) exactly as kv_quant does it."""
    rng = np.random.default_rng()
    ids = 1 + rng.permutation(11)[:n]
    check_call(rng, k_bits=k_bits, v_bits=v_bits, d=d, page=page, group=group, ids=ids,
               num_pages=12, token_keys=True)


@pytest.mark.parametrize("k_bits,v_bits", [(16, 16), (8, 4), (4, 2)])
def test_null_page_ids_are_padding(k_bits, v_bits):
    """The engine pads page_ids with 0, many times over: only real pages must be written."""
    rng = np.random.default_rng()
    num_pages = 10
    ids = np.zeros(8, np.int32)
    slots = rng.choice(8, 3, replace=False)
    ids[slots] = 1 + rng.permutation(num_pages - 1)[:3]
    check_call(rng, k_bits=k_bits, v_bits=v_bits, d=64, page=8, group=32, ids=ids,
               num_pages=num_pages)


def test_round_trip_error_is_ordered_by_bits():
    """Reported per format, and ordered: more bits never reconstruct worse."""
    rng = np.random.default_rng()
    page, d, n = 16, 128, 8
    k, v = sources(rng, n, page, d)
    ids = jnp.asarray(1 + rng.permutation(n), jnp.int32)
    errs = {}
    for bits in (16, 8, 4, 2):
        pool = poisoned_pool(rng, n + 1, page, d, bits, bits, 32)
        kd, vd = quantize_write(k, v, ids, pool, interpret=INTERPRET).take(ids).dense()
        errs[bits] = tuple(float(jnp.linalg.norm(x - y) / jnp.linalg.norm(y))
                           for x, y in ((kd, k), (vd, v)))
        print(f"k{bits}v{bits}: key relative error {errs[bits][0]:.3e}, "
              f"value relative error {errs[bits][1]:.3e}")
    for side in (0, 1):
        assert errs[16][side] == 0.0
        assert errs[16][side] < errs[8][side] < errs[4][side] < errs[2][side] < 0.5
    assert errs[8][0] < 1e-2 and errs[8][1] < 1e-2


@pytest.mark.parametrize("k_bits,v_bits", [(16, 16), (8, 4), (4, 2)])
def test_bf16_source_pages(k_bits, v_bits):
    """bf16 model dtype: quantized from bf16, or stored as bf16 pages at 16 bits."""
    rng = np.random.default_rng()
    k, v, ids, out = check_call(rng, k_bits=k_bits, v_bits=v_bits, d=64, page=8, group=32,
                                ids=[2, 5, 0], num_pages=6, dtype=jnp.bfloat16,
                                pool_dtype=jnp.bfloat16)
    if k_bits == 16:
        assert out.k.dtype == jnp.bfloat16
        np.testing.assert_array_equal(np.asarray(out.k[ids[:2]]), np.asarray(k[:2]))
        np.testing.assert_array_equal(np.asarray(out.v[ids[:2]]), np.asarray(v[:2]))


def test_f32_source_into_bf16_pool_is_cast():
    rng = np.random.default_rng()
    check_call(rng, k_bits=16, v_bits=16, d=64, page=8, group=32, ids=[3, 1], num_pages=5,
               dtype=jnp.float32, pool_dtype=jnp.bfloat16)


def test_bad_inputs_raise_value_errors():
    rng = np.random.default_rng()
    pool = poisoned_pool(rng, 6, 8, 64, 8, 4, 32)
    k, v = sources(rng, 2, 8, 64)
    ids = jnp.asarray([1, 2], jnp.int32)
    run = functools.partial(quantize_write, interpret=True)
    run(k, v, ids, pool)  # the baseline is accepted
    with pytest.raises(ValueError, match="page_ids"):
        run(k, v, ids[:1], pool)
    with pytest.raises(ValueError, match="page_ids"):
        run(k, v, ids.astype(jnp.float32), pool)
    with pytest.raises(ValueError, match="k_src and v_src"):
        run(k, v[:1], ids, pool)
    with pytest.raises(ValueError, match="v_scale and pages.v_zero are required"):
        run(k, v, ids, pool.replace(v_scale=None, v_zero=None))
    with pytest.raises(ValueError, match="k_scale and pages.k_zero are required"):
        run(k, v, ids, pool.replace(kv_format=KVFormat(16, 4, 32)))
    with pytest.raises(ValueError, match="pages.k is"):
        run(k, v, ids, pool.replace(kv_format=KVFormat(4, 4, 32)))
    with pytest.raises(ValueError, match="k_bits must be"):
        run(k, v, ids, pool.replace(kv_format=KVFormat(3, 4, 32)))
    k96, v96 = sources(rng, 2, 8, 96)
    with pytest.raises(ValueError, match="group 64 does not divide head_dim 96"):
        run(k96, v96, ids, poisoned_pool(rng, 6, 8, 96, 8, 4, 64))
    with pytest.raises(ValueError, match="pages.v_scale is"):
        run(k, v, ids, pool.replace(kv_format=KVFormat(8, 4, 16)))
    with pytest.raises(ValueError, match="pages.k_zero is"):
        run(k, v, ids, pool.replace(k_zero=pool.k_zero[:, :32]))
    with pytest.raises(ValueError, match="pages.k_scale is float32"):
        run(k, v, ids, pool.replace(k_scale=pool.k_scale.astype(jnp.float32)))
    with pytest.raises(ValueError, match="uint8"):
        run(k, v, ids, pool.replace(k=pool.k.astype(jnp.int8)))
    with pytest.raises(ValueError, match="pages hold 16 tokens"):
        run(k, v, ids, poisoned_pool(rng, 6, 16, 64, 8, 4, 32))
    # 34 channels: fine for 8-bit keys, not a multiple of the 4 codes per byte of 2-bit values
    k34, v34 = sources(rng, 2, 8, 34)
    pool34 = poisoned_pool(rng, 6, 8, 34, 8, 2, 64)
    with pytest.raises(ValueError, match="head_dim 34 is not a multiple of 4 codes per byte"):
        run(k34, v34, ids, pool34)


@pytest.mark.parametrize("k_bits,v_bits", FORMATS)
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("d,page,group", [(128, 16, 64), (64, 8, 32)])
def test_lowers_for_cuda_with_triton(k_bits, v_bits, dtype, d, page, group):
    """Runs the Pallas-to-Triton lowering on any machine, so lowering errors fail CI here."""
    rng = np.random.default_rng()
    pool = poisoned_pool(rng, 9, page, d, k_bits, v_bits, group, dtype)
    k, v = sources(rng, 4, page, d, dtype)
    ids = jnp.asarray([1, 3, 0, 7], jnp.int32)
    lowered = jax.jit(quantize_write).trace(k, v, ids, pool).lower(lowering_platforms=("cuda",))
    text = lowered.as_text()
    assert "__gpu$xla.gpu.triton" in text
    assert f"jkv_quantize_write_{pool.kv_format.name}" in text


def test_cuda_lowering_catches_triton_errors():
    """The route above really lowers: a page of 12 tokens (not a power of 2) is refused."""
    rng = np.random.default_rng()
    pool = poisoned_pool(rng, 5, 12, 64, 8, 8, 32)
    k, v = sources(rng, 2, 12, 64)
    with pytest.raises(Exception, match="power of 2"):
        jax.jit(quantize_write).trace(k, v, jnp.asarray([1, 2], jnp.int32), pool).lower(
            lowering_platforms=("cuda",))


def test_two_bit_ranges_reconstruct_no_worse_than_min_max():
    """2-bit groups take the best of min..max and its narrowings: per group never a larger
    squared error than min..max (up to the float16 rounding of scales), and smaller on
    average for rotated, near-Gaussian values."""
    from jkv.kv.quant import dequantize_values, quantize_codes, quantize_values

    rng = np.random.default_rng()
    x = jnp.asarray(rng.normal(size=(64, 16, 64)) * rng.uniform(0.1, 10, (64, 1, 1)),
                    jnp.float32)
    got = dequantize_values(*quantize_values(x, 2, 32), 2)
    g = x.reshape(64, 16, 2, 32)
    codes, scale, zero = quantize_codes(g, g.min(-1, keepdims=True), g.max(-1, keepdims=True), 2)
    plain = (codes * scale.astype(jnp.float32) + zero.astype(jnp.float32)).reshape(x.shape)
    err = ((got - x) ** 2).reshape(64, 16, 2, 32).sum(-1)
    err_plain = ((plain - x) ** 2).reshape(64, 16, 2, 32).sum(-1)
    assert (err <= err_plain * (1 + 1e-2)).all()
    assert float(err.sum()) < 0.85 * float(err_plain.sum())
