"""Pages gathered from one pool and scattered into another are bit-exact; nothing else moves.
`KVPages` itself: take / put round trips, null ids dropped, named arrays at the store's
boundary, and a field that does not fit is named."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jkv.kv.format import KV_FORMATS
from jkv.kv.pages import KVPages
from jkv.kv.transfer import flat_run, gather_pages, scatter_pages


def random_like(rng, x):
    if x.dtype == jnp.uint8:
        return jnp.asarray(rng.integers(0, 256, x.shape, dtype=np.uint8))
    return jnp.asarray(rng.standard_normal(x.shape), x.dtype)


def random_pool(rng, fmt, num_pages=40, page=8, d=64, dtype=jnp.float32) -> KVPages:
    pool = KVPages.zeros(num_pages, page, d, dtype, fmt)
    return pool.replace(**{f: random_like(rng, x) for f, x in pool.arrays().items()})


@pytest.mark.parametrize("name", ["auto", "int8", "k8v4", "k4v2"])
def test_gather_then_scatter_is_exact_and_touches_only_its_pages(name):
    rng = np.random.default_rng()
    fmt = KV_FORMATS[name]
    src, dst = random_pool(rng, fmt), random_pool(rng, fmt)
    ids = jnp.asarray(1 + rng.permutation(39)[:24].reshape(3, 2, 4), jnp.int32)
    pages = gather_pages(src, ids)
    assert pages.kv_format == fmt and list(pages.arrays()) == list(src.arrays())
    to = np.asarray(1 + rng.permutation(39)[:24].reshape(3, 2, 4), np.int32)
    to[0, 0, 0] = 0  # a null id is skipped
    before = {f: np.asarray(x) for f, x in dst.arrays().items()}
    out = scatter_pages(dst, jnp.asarray(to), pages)  # donates dst
    written = to.reshape(-1)[to.reshape(-1) > 0]
    untouched = np.setdiff1d(np.arange(40), written)
    for f, x in pages.arrays().items():
        got = np.asarray(getattr(out, f))
        want = np.asarray(x).reshape(24, *got.shape[1:])
        np.testing.assert_array_equal(got[to.reshape(-1)[1:]], want[1:])
        np.testing.assert_array_equal(got[untouched], before[f][untouched])


@pytest.mark.parametrize("name", ["auto", "k8v4"])
def test_a_flat_run_writes_what_its_unjoined_run_writes_and_views_its_host_arrays(name):
    rng = np.random.default_rng()
    fmt = KV_FORMATS[name]
    src = random_pool(rng, fmt)
    pages = jax.device_get(gather_pages(src, jnp.asarray(1 + rng.permutation(39)[:24]
                                                         .reshape(3, 2, 4), jnp.int32)))
    to = np.asarray(1 + rng.permutation(39)[:24].reshape(3, 2, 4), np.int32)
    to[1, 0, 2] = 0
    ids, flat = flat_run(to, pages)
    assert ids.shape == (24,)
    for f, x in flat.arrays().items():
        assert x.shape[0] == 24 and np.shares_memory(x, getattr(pages, f))  # no copy
    want = scatter_pages(random_pool(np.random.default_rng(1), fmt), to, pages)
    got = scatter_pages(random_pool(np.random.default_rng(1), fmt), ids, flat)
    for f, x in want.arrays().items():
        np.testing.assert_array_equal(np.asarray(getattr(got, f)), np.asarray(x))


def test_a_strided_run_is_joined_by_a_copy_or_left_as_it_is():
    """One layer of a run of every layer's pages [blocks, layers, heads] joins only by a
    copy: made by default (a CPU's way), left to the device copy without `join_copies` (a
    GPU's), and either way the same pages are written; a run that joins as a view is joined
    both ways."""
    rng = np.random.default_rng()
    fmt = KV_FORMATS["k8v4"]
    pages = jax.device_get(gather_pages(random_pool(rng, fmt), jnp.asarray(
        1 + rng.permutation(39)[:24].reshape(3, 2, 4), jnp.int32)))
    layer = pages.layer(1)  # [3, 4, ...], strided
    to = np.asarray(1 + rng.permutation(39)[:12].reshape(3, 4), np.int32)
    joined_ids, joined = flat_run(to, layer)
    ids, left = flat_run(to, layer, join_copies=False)
    assert joined_ids.shape == (12,) and ids.shape == (3, 4)
    for f, x in left.arrays().items():
        assert x is getattr(layer, f)
        assert not np.shares_memory(getattr(joined, f), x)
    want, got = (scatter_pages(random_pool(np.random.default_rng(1), fmt), i, p)
                 for i, p in ((joined_ids, joined), (ids, left)))
    for f, x in want.arrays().items():
        np.testing.assert_array_equal(np.asarray(getattr(got, f)), np.asarray(x))
    whole_ids, whole = flat_run(np.zeros((3, 2, 4), np.int32), pages, join_copies=False)
    assert whole_ids.shape == (24,) and all(
        np.shares_memory(x, getattr(pages, f)) for f, x in whole.arrays().items())


def test_scatter_checks_format_and_shapes():
    rng = np.random.default_rng()
    pool = random_pool(rng, KV_FORMATS["k8v4"])
    ids = jnp.asarray([[1, 2]], jnp.int32)
    pages = gather_pages(pool, ids)
    with pytest.raises(ValueError, match="format"):
        scatter_pages(random_pool(rng, KV_FORMATS["auto"]), ids, pages)
    with pytest.raises(ValueError, match="expected"):
        scatter_pages(pool, jnp.asarray([1, 2], jnp.int32), pages)


@pytest.mark.parametrize("name", ["k8v4", "k4v2"])
def test_take_put_round_trip_is_bit_exact_and_drops_null_ids(name):
    rng = np.random.default_rng()
    fmt = KV_FORMATS[name]
    src = random_pool(rng, fmt, dtype=jnp.bfloat16)
    ids = jnp.asarray(1 + rng.permutation(39)[:12].reshape(2, 3, 2), jnp.int32)
    pages = src.take(ids)  # [blocks, layers, heads, page, ...]
    assert pages.num_pages == 12 and pages.page_size == 8 and pages.head_dim == 64
    for f, x in pages.arrays().items():
        assert x.shape == (2, 3, 2, *getattr(src, f).shape[1:]), f

    dst = KVPages.zeros(40, 8, 64, jnp.bfloat16, fmt)
    out = dst.put(ids, pages)
    back = out.take(ids)
    for f, x in pages.arrays().items():
        np.testing.assert_array_equal(np.asarray(getattr(back, f)), np.asarray(x), err_msg=f)
    others = np.setdiff1d(np.arange(40), np.asarray(ids).reshape(-1))
    for f, x in out.arrays().items():
        assert not np.asarray(x)[others].any(), f"{f}: a page not listed was written"

    # null ids are dropped: their pages land nowhere, page 0 included
    some = np.asarray(ids).copy()
    some[0, 1] = 0
    out = dst.put(jnp.asarray(some), pages)
    written = some.reshape(-1)[some.reshape(-1) > 0]
    for f, x in out.arrays().items():
        x = np.asarray(x)
        assert not np.delete(x, written, axis=0).any(), f"{f}: a null id was written"
        np.testing.assert_array_equal(x[written], np.asarray(getattr(pages, f)).reshape(
            12, *x.shape[1:])[some.reshape(-1) > 0], err_msg=f)


def test_named_arrays_round_trip_and_mismatches_are_named():
    rng = np.random.default_rng()
    fmt = KV_FORMATS["k8v4"]
    pool = random_pool(rng, fmt)
    pages = pool.take(jnp.asarray([[3, 5], [7, 0]], jnp.int32))
    again = KVPages.from_arrays(fmt, pages.arrays())
    assert again.kv_format == fmt and again.nbytes == pages.nbytes
    for f, x in pages.arrays().items():
        np.testing.assert_array_equal(np.asarray(getattr(again, f)), np.asarray(x))
    with pytest.raises(ValueError, match="needs"):
        KVPages.from_arrays(fmt, {f: x for f, x in pages.arrays().items() if f != "k_zero"})
    with pytest.raises(ValueError, match="needs"):
        KVPages.from_arrays(KV_FORMATS["auto"], pages.arrays())

    ids = jnp.asarray([1, 2], jnp.int32)
    two = pool.take(ids)
    with pytest.raises(ValueError, match="pages.v_scale is float32"):
        pool.put(ids, two.replace(v_scale=two.v_scale.astype(jnp.float32)))
    with pytest.raises(ValueError, match="pages.k is"):
        pool.put(ids, two.replace(k=two.k[:, :4]))
    saved = {f: np.asarray(x)[:, None] for f, x in two.arrays().items()}  # [rows, 1, ...]
    pool.check_saved(saved, (1,), 2)
    with pytest.raises(ValueError, match="'k_scale'"):
        pool.check_saved({**saved, "k_scale": saved["k_scale"].astype(np.float32)}, (1,), 2)
    with pytest.raises(ValueError, match=">=3"):
        pool.check_saved(saved, (1,), 3)
