"""Appending K/V step by step: whole pages land in the pool in their format exactly once,
the page being filled stays in model dtype, and the window holds what attention must see."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jkv.attention.kv_write import append_kv
from jkv.kv.allocator import init_free, init_tables, reserve
from jkv.kv.format import KV_FORMATS, KVFormat
from jkv.kv.page_pool import page_bytes
from jkv.kv.pages import KVPages
from jkv.kv.quant import unpack

INTERPRET = jax.default_backend() == "cpu"

PAGE, HEADS, D, WIDTH = 8, 2, 64, 8
# every per-channel format, and one with per-token key scales (the kernel's other key path is
# checked format by format in test_quantize_write)
FORMATS = sorted({f for f in KV_FORMATS.values() if not f.token_keys} | {KV_FORMATS["k8v4t"]},
                 key=lambda f: (-f.k_bits, -f.v_bits, f.token_keys))


def same_scale(got, want):
    """Exact on CPU. Compiled on a GPU, two programs computing (max - min) / levels may
    differ in the last bit (XLA fusions, Triton's division); a page scale written from a
    partial page would differ by far more."""
    if INTERPRET:
        np.testing.assert_array_equal(got, want)
    else:
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=0)


def same_page(got, want, bits):
    """Codes: exact on CPU; compiled, a last-bit scale difference may flip a code by 1 at a
    rounding tie, which random normal data hits rarely (at most 1 in 1000 codes)."""
    if INTERPRET or not np.size(want):
        np.testing.assert_array_equal(got, want)
        return
    diff = np.abs(np.asarray(unpack(jnp.asarray(got), bits), np.int64)
                  - np.asarray(unpack(jnp.asarray(want), bits), np.int64))
    assert diff.max() <= 1 and (diff > 0).sum() <= max(1, 1e-3 * diff.size)


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
@pytest.mark.parametrize("backend", ["xla", "pallas"])
def test_chunked_appends_store_each_full_page_once(fmt, backend):
    rng = np.random.default_rng()
    fmt = KVFormat(fmt.k_bits, fmt.v_bits, group=32, token_keys=fmt.token_keys)
    b = 2
    total = np.array([int(rng.integers(1, WIDTH * PAGE)), WIDTH * PAGE])  # ragged, full row
    k_all = rng.normal(size=(b, WIDTH * PAGE, HEADS, D)).astype(np.float32)
    v_all = rng.normal(size=(b, WIDTH * PAGE, HEADS, D)).astype(np.float32)
    pool = KVPages.zeros(b * HEADS * WIDTH + 1, PAGE, D, jnp.float32, fmt)
    free = init_free(b * HEADS * WIDTH + 1, PAGE)
    tables = init_tables(b, 1, HEADS, WIDTH)
    fill_k = jnp.full((b, HEADS, PAGE, D), 7.0, jnp.float32)  # stale content is never kept
    fill_v = jnp.full((b, HEADS, PAGE, D), -7.0, jnp.float32)
    step = jax.jit(append_kv, static_argnames="backend")
    length = np.zeros(b, np.int64)
    while (length < total).any():
        t = int(rng.choice([1, 3, 8, 16]))
        count = np.minimum(total - length, t)
        free, tables, ok = reserve(free, tables, jnp.asarray(length + count, jnp.int32))
        assert bool(ok)
        new_k = np.zeros((b, t, HEADS, D), np.float32)
        new_v = np.zeros((b, t, HEADS, D), np.float32)
        for i in range(b):
            new_k[i, : count[i]] = k_all[i, length[i]: length[i] + count[i]]
            new_v[i, : count[i]] = v_all[i, length[i]: length[i] + count[i]]
        pool, fill_k, fill_v, window = step(
            pool, fill_k, fill_v, tables.pages[:, 0], jnp.asarray(new_k), jnp.asarray(new_v),
            jnp.asarray(length, jnp.int32), jnp.asarray(count, jnp.int32), backend=backend)
        # the window: whole pages before the step are not in it; every later token is
        start = (length // PAGE) * PAGE
        np.testing.assert_array_equal(window.start, start)
        np.testing.assert_array_equal(window.length, length + count - start)
        for i in range(b):
            n = length[i] + count[i] - start[i]
            got = np.asarray(window.k[i, :, :n]).transpose(1, 0, 2)
            np.testing.assert_array_equal(got, k_all[i, start[i]: start[i] + n])
            got = np.asarray(window.v[i, :, :n]).transpose(1, 0, 2)
            np.testing.assert_array_equal(got, v_all[i, start[i]: start[i] + n])
        length = length + count

    pages = np.asarray(tables.pages[:, 0])
    for i in range(b):
        full = total[i] // PAGE
        for h in range(HEADS):
            ids = pages[i, h, :full]
            k = jnp.asarray(k_all[i, : full * PAGE, h].reshape(full, PAGE, D))
            v = jnp.asarray(v_all[i, : full * PAGE, h].reshape(full, PAGE, D))
            want = KVPages.from_dense(k, v, fmt)  # kv_quant's codes and scales
            for side, bits in (("k", fmt.k_bits), ("v", fmt.v_bits)):
                got = getattr(pool, side)[ids]
                if bits == 16:
                    np.testing.assert_array_equal(got, getattr(want, side))
                    continue
                same_page(got, getattr(want, side), bits)
                same_scale(getattr(pool, f"{side}_scale")[ids], getattr(want, f"{side}_scale"))
                np.testing.assert_array_equal(getattr(pool, f"{side}_zero")[ids],
                                              getattr(want, f"{side}_zero"))
            rest = total[i] - full * PAGE  # the page being filled, in model dtype
            np.testing.assert_array_equal(np.asarray(fill_k[i, h, :rest]),
                                          k_all[i, full * PAGE: total[i], h])
            np.testing.assert_array_equal(np.asarray(fill_v[i, h, :rest]),
                                          v_all[i, full * PAGE: total[i], h])


def test_pool_shapes_and_bytes_follow_the_format():
    for name, fmt in KV_FORMATS.items():
        pool = KVPages.zeros(5, 16, 128, jnp.bfloat16, fmt)
        assert pool.num_pages == 5
        assert pool.nbytes / 5 == page_bytes(fmt, 16, 128, jnp.bfloat16), name
        assert pool.head_dim == 128
        if name in ("k8v4t", "k4v8t"):  # LeanKV's low tier: the same bytes, twice the tokens
            low = pool.as_format(fmt.halved())
            assert low.page_size == 32 and low.nbytes == pool.nbytes
            assert page_bytes(fmt.halved(), 32, 128, jnp.bfloat16) == page_bytes(
                fmt, 16, 128, jnp.bfloat16)
            back = low.as_format(fmt)
            assert back.kv_format == fmt and all(
                a.shape == b.shape for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(pool),
                                                   strict=True))
    assert page_bytes(KV_FORMATS["k4v2"], 16, 128, jnp.bfloat16) < page_bytes(
        KV_FORMATS["int8"], 16, 128, jnp.bfloat16) < page_bytes(KV_FORMATS["auto"], 16, 128,
                                                                jnp.bfloat16)


def test_a_pool_rejects_formats_that_do_not_fit():
    with pytest.raises(ValueError, match="head_dim"):
        KVPages.zeros(4, 16, 6, jnp.float32, KVFormat(2, 2, group=2))
    with pytest.raises(ValueError, match="group"):
        KVPages.zeros(4, 16, 96, jnp.float32, KVFormat(8, 4, group=64))
