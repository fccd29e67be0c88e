"""Pages out of the pool and back: what the store saves and restores.

`gather_pages` reads the pages `ids` (any shape, e.g. [blocks, layers, KV heads]) with their
scales and zero points as they are stored, so a saved entry is bit-exact and a restore at the
same positions is a copy; `scatter_pages` writes such arrays into other page ids of a pool
of the same format. Both are one jitted gather / scatter each, no per-page Python.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp

from jkv.cache.page_pool import NULL_PAGE, PagePool

FIELDS = ("k", "v", "k_scale", "k_zero", "v_scale", "v_zero")


@jax.jit
def gather_pages(pool: PagePool, ids: jax.Array) -> dict[str, jax.Array]:
    """{field: pool.field[ids]} for the pool's arrays (quantized sides bring their scales)."""
    return {f: getattr(pool, f)[ids] for f in FIELDS if getattr(pool, f) is not None}


@partial(jax.jit, donate_argnums=0)  # the pool is updated in place, never copied
def scatter_pages(pool: PagePool, ids: jax.Array, pages: dict[str, jax.Array]) -> PagePool:
    """Write `pages` (as `gather_pages` returns them, leading shape that of `ids`) into page
    ids `ids`; ids equal to the null page are skipped."""
    needed = [f for f in FIELDS if getattr(pool, f) is not None]
    if sorted(pages) != sorted(needed):
        raise ValueError(f"pages carry {sorted(pages)}, the pool's format needs {needed}")
    dest = jnp.where(ids > NULL_PAGE, ids, pool.k.shape[0]).reshape(-1)
    changes = {}
    for f in needed:
        old, new = getattr(pool, f), pages[f]
        if new.shape != ids.shape + old.shape[1:] or new.dtype != old.dtype:
            raise ValueError(f"pages[{f!r}] is {new.dtype}{list(new.shape)}, expected "
                             f"{old.dtype}{list(ids.shape + old.shape[1:])}")
        changes[f] = old.at[dest].set(new.reshape(-1, *old.shape[1:]), mode="drop")
    return pool.replace(**changes)


@partial(jax.jit, static_argnames="count")
def slot_page_ids(pages: jax.Array, slot: jax.Array, first: jax.Array, stop: jax.Array,
                  count: int) -> jax.Array:
    """Page ids of table columns [first, first + count) of `slot` as [count, L, H] (pages:
    the tables' [S, L, H, W]); columns at or past `stop` (or the table's end) read as the
    null page. `count` is static: callers pad it to a few sizes."""
    cols = first + jnp.arange(count)
    ids = jnp.take(pages[slot], cols, axis=-1, mode="fill", fill_value=NULL_PAGE)
    return jnp.moveaxis(jnp.where(cols < stop, ids, NULL_PAGE), -1, 0)
