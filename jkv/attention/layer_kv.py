"""One layer's KV for a step, and the one call a model layer makes on it (`attend`).

A model layer hands over its new keys and values and its queries; `attend` appends the
keys and values to the cache and returns the attention. Without token tiers the step's full
pages go into the pool at the table's next columns (`kv_write`); with them (LeanKV) the full
pages' tokens join the end of each row's high tier one token at a time, and each key's
significance from this step's queries is added to its score: in `TokenMeta` for tokens in
pages, beside the filling page for the others, carried into `TokenMeta` when its page fills.
Which tier each token ends in is decided after the step (`tier_step`), so the model layer
does not know tiers exist.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct
from jax.sharding import Mesh

from jkv.attention.backend import paged_attention
from jkv.attention.kv_write import append_kv, last_page, step_window
from jkv.attention.tensor_parallel import split_by_heads
from jkv.kv.pages import KVPages
from jkv.kv.rotation import rotate
from jkv.kv.token_tiers import TierCounts, TokenMeta, add_significance, write_meta, write_tokens


@struct.dataclass
class LayerTiers:
    """One layer's token tiers for a step's rows."""

    meta: TokenMeta  # [P, 2 * page]: every page slot's token (shared by all layers)
    score: jax.Array  # float32 [B, Hkv, page]: the filling page's tokens' summed attention
    high: jax.Array  # int32 [B, Hkv]: high-tier tokens, this step's full pages included
    low: jax.Array  # int32 [B, Hkv]
    # int32 [B]: only queries at or after it add significance (None: every query)
    observe_from: jax.Array | None = None
    max_tokens: int | None = struct.field(pytree_node=False, default=None)  # in either tier


@struct.dataclass
class LayerKV:
    """One layer's KV for a step's rows [B]: the pool (shared by all layers), the rows'
    filling pages [B, Hkv, page, D] and page tables [B, Hkv, W], and their tiers if any;
    `mesh`: the tensor-parallel mesh they are split over by KV head (`jkv.kv.sharding`)."""

    pool: KVPages
    fill_k: jax.Array
    fill_v: jax.Array
    pages: jax.Array
    tiers: LayerTiers | None = None
    mesh: Mesh | None = struct.field(pytree_node=False, default=None)


def attend(q: jax.Array, k: jax.Array, v: jax.Array, kv: LayerKV, positions: jax.Array,
           valid: jax.Array, sm_scale: float, backend: str) -> tuple[jax.Array, LayerKV]:
    """Append the step's k, v [B, T, Hkv, D] (valid [B, T]: real tokens first) at
    `positions` [B, T] and attend q [B, T, Hq, D] over the row's cache and the step; returns
    (attention [B, T, Hq, D], the layer's KV after the step). A rotated format's cache holds
    k and v rotated: q is rotated to meet them, and the attention rotated back. Over a mesh,
    each device does this for its own KV heads."""
    if kv.mesh is not None:
        return split_by_heads(attend, q, k, v, kv, positions, valid, sm_scale, backend)
    if not kv.pool.kv_format.rotated:
        return _attend(q, k, v, kv, positions, valid, sm_scale, backend)
    out, kv = _attend(rotate(q), rotate(k), rotate(v), kv, positions, valid, sm_scale, backend)
    return rotate(out), kv


def _attend(q: jax.Array, k: jax.Array, v: jax.Array, kv: LayerKV, positions: jax.Array,
            valid: jax.Array, sm_scale: float, backend: str) -> tuple[jax.Array, LayerKV]:
    start = positions[:, 0]
    count = valid.sum(axis=1).astype(jnp.int32)
    if kv.tiers is None:
        pool, fill_k, fill_v, window = append_kv(kv.pool, kv.fill_k, kv.fill_v, kv.pages, k, v,
                                                 start, count, backend)
        out = paged_attention(q, pool, kv.pages, window, positions, sm_scale, backend=backend)
        return out, kv.replace(pool=pool, fill_k=fill_k, fill_v=fill_v)

    tiers, pool, pages = kv.tiers, kv.pool, kv.pages
    page = pool.page_size
    window, fill_k, fill_v = step_window(kv.fill_k, kv.fill_v, k, v, start, count)
    tw = window.k.shape[2]
    n_new = (window.length // page) * page  # tokens of the pages this step fills [B]
    high = tiers.high - n_new[:, None]  # before them

    # the full pages' tokens join the end of the high tier (written before attention reads
    # the pool, which does not see them: a write after the read would copy the pool)
    w = pages.shape[-1]
    i = jnp.arange(tw, dtype=jnp.int32)
    slot = high[..., None] + i  # [B, Hkv, Tw]
    col = jnp.clip(slot // page, 0, w - 1)
    addr = jnp.take_along_axis(pages, col, -1) * (2 * page) + slot % page
    addr = jnp.where((i < n_new[:, None])[:, None, :], addr, -1)
    pool = write_tokens(pool, addr, window.k, window.v, page)
    out, (sig_high, sig_window, sig_low) = paged_attention(
        q, pool, pages, window, positions, sm_scale, backend=backend, tiers=(high, tiers.low),
        max_tokens=tiers.max_tokens, significance_from=tiers.observe_from)

    # significance as sums over the queries that saw each key (means x their number)
    t = q.shape[1]
    q_len = jnp.clip(window.start + window.length - start, 0, t)  # real queries [B]
    first = start if tiers.observe_from is None else jnp.maximum(start, tiers.observe_from)
    per_row = jnp.clip(start + q_len - first, 0, None).astype(jnp.float32)[:, None, None]
    meta = add_significance(tiers.meta, pages, TierCounts(high=high, low=tiers.low), page,
                            sig_high * per_row, sig_low * per_row)
    pos = window.start[:, None] + i  # [B, Tw]
    seen = jnp.clip(start[:, None] + q_len[:, None] - jnp.maximum(pos, first[:, None]), 0, None)
    r = start % page
    before = jnp.where((i[None, :] < r[:, None])[:, None, :],
                       jnp.pad(tiers.score, ((0, 0), (0, 0), (0, tw - page))), 0.0)
    score = before + sig_window * seen[:, None, :].astype(jnp.float32)  # [B, Hkv, Tw]

    meta = write_meta(meta, addr, jnp.broadcast_to(pos[:, None, :], addr.shape), score)
    new_tiers = tiers.replace(meta=meta, score=last_page(score, window.length, page))
    return out, kv.replace(pool=pool, fill_k=fill_k, fill_v=fill_v, tiers=new_tiers)


def split_shared(kv: LayerKV) -> tuple[tuple, LayerKV]:
    """((pool, token meta, first observed queries): what every layer shares, the rest): the
    layers of a step scan the rest (with a layer axis) and carry the shared part."""
    if kv.tiers is None:
        return (kv.pool, None, None), kv.replace(pool=None)
    tiers = kv.tiers
    return ((kv.pool, tiers.meta, tiers.observe_from),
            kv.replace(pool=None, tiers=tiers.replace(meta=None, observe_from=None)))


def join_shared(shared: tuple, rest: LayerKV) -> LayerKV:
    """`split_shared` undone."""
    pool, meta, observe_from = shared
    if rest.tiers is None:
        return rest.replace(pool=pool)
    return rest.replace(pool=pool, tiers=rest.tiers.replace(meta=meta, observe_from=observe_from))
