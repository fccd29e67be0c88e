"""Pages out of the pool and back: what the store saves and restores.

`gather_pages` reads the pages `ids` (any shape, e.g. [blocks, layers, KV heads]) with their
scales and zero points as they are stored, so a saved entry is bit-exact and a restore at the
same positions is a copy; `scatter_pages` writes such pages into other page ids of a pool
of the same format (host runs joined into one leading axis first: `flat_run`). Both are
one jitted gather / scatter each (`KVPages.take`, `put`), no per-page Python.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from jkv.kv.pages import NULL_PAGE, KVPages


@jax.jit
def gather_pages(pool: KVPages, ids: jax.Array) -> KVPages:
    """Pages `ids` of the pool, leading shape ids.shape (quantized sides bring their scales)."""
    return pool.take(ids)


def join_leading(pages: KVPages, lead: int) -> KVPages:
    """Host pages with their `lead` leading axes joined into one (numpy views where
    contiguous: a 64-byte aligned one then reaches a CPU backend uncopied). Pages reach a
    scatter so: on CPU, XLA copies a whole argument it reshapes inside a jit before
    scattering it (a large share of a restore's time)."""
    return jax.tree.map(lambda x: np.reshape(x, (-1, *np.shape(x)[lead:])), pages)


def flat_run(ids: np.ndarray, pages: KVPages, join_copies: bool = True
             ) -> tuple[np.ndarray, KVPages]:
    """A run of host pages (leading shape ids.shape) as `scatter_pages` is given them: ids
    and pages with their leading axes joined (`join_leading`). Without `join_copies`, a run
    whose pages join only by a copy (one layer of a run of every layer's, strided) is left
    as it is: a GPU's host-to-device copy lays a strided array out itself, where a host copy
    first copies the whole entry once more, on the thread that dispatches the layers."""
    lead = np.ndim(ids)
    if not join_copies and not all(_joins_as_view(x, lead) for x in jax.tree.leaves(pages)):
        return np.asarray(ids), pages
    return np.reshape(ids, -1), join_leading(pages, lead)


def _joins_as_view(x: np.ndarray, lead: int) -> bool:
    """Whether host array `x`'s first `lead` axes join into one without a copy (axes of
    size 1 aside, each stride is the next one's times its size)."""
    axes = [(n, s) for n, s in zip(x.shape[:lead], x.strides[:lead], strict=True) if n != 1]
    return all(s == s_next * n_next
               for (_, s), (n_next, s_next) in zip(axes, axes[1:], strict=False))


@partial(jax.jit, donate_argnums=0)  # the pool is updated in place, never copied
def scatter_pages(pool: KVPages, ids: jax.Array, pages: KVPages) -> KVPages:
    """Write `pages` (as `gather_pages` returns them, leading shape that of `ids`) into page
    ids `ids`; ids equal to the null page are skipped."""
    return pool.put(ids, pages)


@partial(jax.jit, static_argnames="count")
def slot_page_ids(pages: jax.Array, slot: jax.Array, first: jax.Array, stop: jax.Array,
                  count: int) -> jax.Array:
    """Page ids of table columns [first, first + count) of `slot` as [count, L, H] (pages:
    the tables' [S, L, H, W]); columns at or past `stop` (or the table's end) read as the
    null page. `count` is static: callers pad it to a few sizes."""
    cols = first + jnp.arange(count)
    ids = jnp.take(pages[slot], cols, axis=-1, mode="fill", fill_value=NULL_PAGE)
    return jnp.moveaxis(jnp.where(cols < stop, ids, NULL_PAGE), -1, 0)
