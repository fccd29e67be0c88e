"""Pages gathered from one pool and scattered into another are bit-exact; nothing else moves."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from jkv.cache.page_pool import init_pool
from jkv.cache.transfer import FIELDS, gather_pages, scatter_pages
from jkv.config import KV_FORMATS


def random_pool(rng, fmt, num_pages=40, page=8, d=64, dtype=jnp.float32):
    pool, _ = init_pool(num_pages, page, d, dtype, fmt)
    changes = {}
    for f in FIELDS:
        x = getattr(pool, f)
        if x is None:
            continue
        if x.dtype == jnp.uint8:
            changes[f] = jnp.asarray(rng.integers(0, 256, x.shape, dtype=np.uint8))
        else:
            changes[f] = jnp.asarray(rng.standard_normal(x.shape), x.dtype)
    return pool.replace(**changes)


@pytest.mark.parametrize("name", ["auto", "int8", "k8v4", "k4v2"])
def test_gather_then_scatter_is_exact_and_touches_only_its_pages(name):
    rng = np.random.default_rng()
    fmt = KV_FORMATS[name]
    src, dst = random_pool(rng, fmt), random_pool(rng, fmt)
    ids = jnp.asarray(1 + rng.permutation(39)[:24].reshape(3, 2, 4), jnp.int32)
    pages = gather_pages(src, ids)
    assert sorted(pages) == sorted(f for f in FIELDS if getattr(src, f) is not None)
    to = np.asarray(1 + rng.permutation(39)[:24].reshape(3, 2, 4), np.int32)
    to[0, 0, 0] = 0  # a null id is skipped
    before = {f: np.asarray(getattr(dst, f)) for f in pages}
    out = scatter_pages(dst, jnp.asarray(to), pages)  # donates dst
    written = to.reshape(-1)[to.reshape(-1) > 0]
    untouched = np.setdiff1d(np.arange(40), written)
    for f, x in pages.items():
        got = np.asarray(getattr(out, f))
        want = np.asarray(x).reshape(24, *got.shape[1:])
        np.testing.assert_array_equal(got[to.reshape(-1)[1:]], want[1:])
        np.testing.assert_array_equal(got[untouched], before[f][untouched])


def test_scatter_checks_format_and_shapes():
    rng = np.random.default_rng()
    pool = random_pool(rng, KV_FORMATS["k8v4"])
    ids = jnp.asarray([[1, 2]], jnp.int32)
    pages = gather_pages(pool, ids)
    with pytest.raises(ValueError, match="format needs"):
        scatter_pages(random_pool(rng, KV_FORMATS["auto"]), ids, pages)
    with pytest.raises(ValueError, match="expected"):
        scatter_pages(pool, jnp.asarray([1, 2], jnp.int32), pages)
