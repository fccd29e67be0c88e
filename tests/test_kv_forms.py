"""Stored pages moved between KV formats (`jkv.kv.kv_forms`): a recompressed entry and a
stored form restored into the pool's format."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from jkv.kv.format import KV_FORMATS
from jkv.kv.kv_forms import convert_pages
from jkv.kv.pages import KVPages
from jkv.kv.rotation import rotate

LEAD, PAGE, D = (3, 2, 2), 16, 64  # (blocks, layers, KV heads), tokens a page, head_dim


def kv(seed: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Keys with a few outlier channels (as real keys have), values plain."""
    rng = np.random.default_rng(seed)
    k = rng.standard_normal((*LEAD, PAGE, D)).astype(np.float32)
    k[..., rng.choice(D, 3, replace=False)] *= 8
    return k, rng.standard_normal((*LEAD, PAGE, D)).astype(np.float32)


def stored(k, v, name: str) -> dict[str, np.ndarray]:
    """What the pool of format `name` would hold (rotated formats rotate before writing)."""
    fmt = KV_FORMATS[name]
    if fmt.rotated:
        k, v = rotate(jnp.asarray(k)), rotate(jnp.asarray(v))
    pages = KVPages.from_dense(jnp.asarray(k), jnp.asarray(v), fmt, jnp.bfloat16)
    return {n: np.asarray(x) for n, x in pages.arrays().items()}


def dense(arrays, name: str) -> tuple[np.ndarray, np.ndarray]:
    """The keys and values pages of format `name` hold, in the model's basis."""
    fmt = KV_FORMATS[name]
    k, v = KVPages.from_arrays(fmt, {n: jnp.asarray(x) for n, x in arrays.items()}).dense()
    if fmt.rotated:
        k, v = rotate(k), rotate(v)
    return np.asarray(k), np.asarray(v)


def error(got, want) -> float:
    return float(np.abs(got - want).mean() / np.abs(want).mean())


FORMATS = ["bf16", "int8", "k8v4", "k4v2", "k8v4t", "k4v2t", "k4v8t"]


@pytest.mark.parametrize("src", FORMATS)
@pytest.mark.parametrize("dst", FORMATS)
def test_a_converted_entry_is_what_the_destination_format_holds_of_the_keys(src, dst):
    k, v = kv()
    got = convert_pages(stored(k, v, src), KV_FORMATS[src], KV_FORMATS[dst], jnp.bfloat16)
    want = stored(k, v, dst)
    assert {n: (x.shape, x.dtype) for n, x in got.items()} == \
        {n: (x.shape, x.dtype) for n, x in want.items()}
    gk, gv = dense(got, dst)
    wk, wv = dense(want, dst)
    sk, sv = dense(stored(k, v, src), src)
    # the converted keys and values are as near the originals as the worse of the two
    # formats keeps them (each format's own error, measured here), with a little more for
    # quantizing twice; in the model's basis whether or not either format is rotated
    for got_x, want_x, src_x, x in ((gk, wk, sk, k), (gv, wv, sv, v)):
        bound = max(error(want_x, x), error(src_x, x))
        assert error(got_x, x) <= 1.5 * bound + 1e-3
    if src == dst:
        assert all(np.array_equal(got[n], x) for n, x in stored(k, v, src).items())


def test_arrays_that_are_not_pages_of_the_format_are_a_value_error():
    k, v = kv(seed=0)
    arrays = stored(k, v, "k8v4t")
    with pytest.raises(ValueError, match="not pages of k4v2"):
        convert_pages(arrays, KV_FORMATS["k4v2"], KV_FORMATS["bf16"], jnp.bfloat16)
    arrays["v"] = arrays["v"][..., :-1]
    with pytest.raises(ValueError, match="not pages of k8v4t"):
        convert_pages(arrays, KV_FORMATS["k8v4t"], KV_FORMATS["bf16"], jnp.bfloat16)
