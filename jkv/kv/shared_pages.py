"""Shared-layer pages: the coefficient pages of Krul's shared form on the device, one set per
group of layers, aliased in every layer's page table of the group.

A group of adjacent layers keeps, per side, one coefficient vector per token on the group's
basis (`jkv.kv.shared_form`); each layer reads the same coefficient pages through its own
slice of the basis (`LayerBases`), so the pages are held once however many layers read them.
A page is referenced by every (layer, KV head) table entry that holds it and goes back to the
free list once, when the last of them lets go (`jkv.kv.allocator`'s reference counts): a
layer may drop its entries alone (LayerKV's offload of one layer) without freeing what the
others still read.

Pages hold `shared_form.BLOCK` tokens, the tokens one scale and zero point cover, so a
stored group maps onto pages as it is. Codes are packed like KV pages (`quant.pack`: part i of
a byte holds rank columns [i * R / k, (i + 1) * R / k)), the rank padded to a width R that
is a power of two with at least 16 columns per part (zero codes, scales and zero points:
nothing added).
"""

from __future__ import annotations

from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jkv.kv import shared_form
from jkv.kv.allocator import FreeList, PageTables, add_refs, allocate, held_mask, unref
from jkv.kv.pages import NULL_PAGE
from jkv.kv.quant import codes_per_byte, pack

PAGE = shared_form.BLOCK
MIN_PART = 16  # columns of one packed part: a Triton dot needs 16 along each dimension


@struct.dataclass
class CoefficientPages:
    """One side's coefficient pages [P, page, ...]: each token's coefficients on its group's
    basis, shared by the group's layers."""

    codes: jax.Array  # uint8 [P, page, R * bits / 8] (float16 [P, page, R] at 16 bits)
    scale: jax.Array  # float16 [P, R]: per page and rank column (ones at 16 bits)
    zero: jax.Array  # float16 [P, R] (zeros at 16 bits)
    bits: int = struct.field(pytree_node=False)

    @property
    def width(self) -> int:
        """R: the rank columns a page holds (the group's rank padded)."""
        return self.scale.shape[-1]

    @property
    def page_size(self) -> int:
        return self.codes.shape[1]

    def put(self, ids: jax.Array, pages: CoefficientPages) -> CoefficientPages:
        """These pages with pages[i] written at ids[i]."""
        return self.replace(codes=self.codes.at[ids].set(pages.codes),
                            scale=self.scale.at[ids].set(pages.scale),
                            zero=self.zero.at[ids].set(pages.zero))


@struct.dataclass
class LayerBases:
    """One layer's slice of its group's bases, per sequence: what turns the shared
    coefficients into this layer's keys (still without their rotation) and values."""

    k_basis: jax.Array  # [B, R_k, H * D]
    k_mean: jax.Array  # float32 [B, H * D]
    v_basis: jax.Array  # [B, R_v, H * D]
    v_mean: jax.Array  # float32 [B, H * D]


def part_width(width: int, bits: int) -> int:
    """Rank columns of one packed part of a page `width` columns wide."""
    return width // (codes_per_byte(bits) if bits < 16 else 1)


def page_width(rank: int, bits: int) -> int:
    """The width R pages of `bits`-bit codes need for a group of rank `rank`: a power of two
    with at least MIN_PART columns per packed part."""
    per = codes_per_byte(bits) if bits < 16 else 1
    return max(MIN_PART * per, 1 << max(0, (rank - 1).bit_length()))


def pages_from_form(arrays: Mapping[str, np.ndarray], group: int,
                    width: int) -> tuple[int, CoefficientPages]:
    """Group `group` of an entry in the shared form as (its tokens T', ceil(T' / PAGE)
    coefficient pages `width` columns wide): the stored codes, scales and zero points as they
    are, only repacked at the padded width."""
    _, _, _, rank, bits = (int(x) for x in np.asarray(arrays["layout"])[group])
    t, (codes, scale, zero, _, _) = shared_form.group_operands(arrays, group, rank, bits)
    if width < rank or width != page_width(width, bits):
        raise ValueError(f"width {width} cannot hold rank {rank} at {bits} bits")
    n = -(-t // PAGE)
    codes = np.pad(codes[:n * PAGE, :rank], ((0, 0), (0, width - rank)))
    scale, zero = (np.pad(x[:n, :rank], ((0, 0), (0, width - rank))) for x in (scale, zero))
    codes = (jnp.asarray(codes, jnp.float16) if bits == 16
             else pack(jnp.asarray(codes, jnp.uint8), bits))
    return t, CoefficientPages(codes=codes.reshape(n, PAGE, -1),
                               scale=jnp.asarray(scale, jnp.float16),
                               zero=jnp.asarray(zero, jnp.float16), bits=bits)


def layer_basis(arrays: Mapping[str, np.ndarray], group: int, index: int,
                width: int) -> tuple[np.ndarray, np.ndarray]:
    """Layer `index` of group `group`'s slice of the basis, padded to `width` rows [width, F]
    (float16), and its mean [F] (float32)."""
    _, _, size, rank, _ = (int(x) for x in np.asarray(arrays["layout"])[group])
    if not 0 <= index < size:
        raise ValueError(f"layer index {index} is outside group {group} of {size} layers")
    basis = np.asarray(arrays[f"g{group}.basis"])  # [r, G * F]
    f = basis.shape[1] // size
    part = np.pad(basis[:, index * f:(index + 1) * f], ((0, width - rank), (0, 0)))
    return part.astype(np.float16), np.asarray(arrays[f"g{group}.mean"], np.float32)[index]


@jax.jit
def reserve_group(free: FreeList, tables: PageTables, slot: jax.Array, layers: jax.Array,
                  tokens: jax.Array) -> tuple[FreeList, PageTables, jax.Array]:
    """Give the empty rows of `slot` for the layers where `layers` [L] is set one set of
    pages for `tokens` tokens, aliased in every one of those layers' (and KV heads') table
    entries, each entry a reference. (free, tables, ok); when the pool is short, the table
    too narrow or a row not empty, nothing changes and ok is False."""
    _, n_layers, n_heads, w = tables.pages.shape
    n = (tokens + free.page_size - 1) // free.page_size
    rows = layers[:, None] & jnp.ones((n_layers, n_heads), bool)  # [L, H]
    fits = (n <= w) & ~jnp.any(rows & (tables.num_pages[slot] > 0)) & jnp.any(layers)
    taken, ids, ok = allocate(free, jnp.where(fits, n, 0)[None], w)
    ok = ok & fits
    row = jnp.where(rows[..., None] & ok, ids[0], tables.pages[slot])  # [L, H, W]
    new_tables = tables.replace(
        pages=tables.pages.at[slot].set(row),
        num_pages=tables.num_pages.at[slot].set(jnp.where(rows & ok, n, tables.num_pages[slot])),
        lengths=tables.lengths.at[slot].set(jnp.where(ok, jnp.maximum(tables.lengths[slot],
                                                                      tokens),
                                                      tables.lengths[slot])))
    # allocate referenced each page once; every aliasing entry holds one reference instead
    aliased = jnp.where(rows[..., None] & ok, row, NULL_PAGE)
    return add_refs(add_refs(taken, ids, -1), aliased, 1), new_tables, ok


@jax.jit
def release_layers(free: FreeList, tables: PageTables, slots: jax.Array,
                   layers: jax.Array) -> tuple[FreeList, PageTables]:
    """Empty the rows of the layers where `layers` [L] is set in the slots where `slots`
    [S] is set: each entry drops its reference, and a page goes back to the free list once,
    when no layer of any slot holds it any more."""
    rows = slots[:, None, None] & layers[None, :, None]  # [S, L, 1]
    held = rows[..., None] & held_mask(tables)
    new_free = unref(free, jnp.where(held, tables.pages, NULL_PAGE))
    num_pages = jnp.where(rows, 0, tables.num_pages)
    return new_free, tables.replace(
        pages=jnp.where(rows[..., None], NULL_PAGE, tables.pages), num_pages=num_pages,
        low_pages=jnp.where(rows, 0, tables.low_pages),
        lengths=jnp.where(jnp.any(num_pages > 0, axis=(1, 2)), tables.lengths, 0))


def pages_held(free: FreeList) -> int:
    """Pages of the pool in use, each counted once however many tables alias it."""
    return int(free.refs.shape[0] - 1 - free.num_free)


__all__ = ["PAGE", "CoefficientPages", "LayerBases", "layer_basis", "page_width",
           "pages_from_form", "pages_held", "part_width", "release_layers", "reserve_group"]
