"""Attention of a step's queries over the pool (whole pages) and the step's window.

Every query sees all tokens held in whole pages (they precede the window) and, causally by
absolute position, the window's tokens (`kv_write.Window`). Two backends compute the same
function: `xla` (jnp, blockwise over the pages each row holds: `xla_attention`, the CPU
path) and `pallas` (the kernels: paged decode attention with split-K for one token per
sequence, chunked prefill attention for longer steps; `interpret=True` on CPU).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from jkv.attention.kv_write import Window
from jkv.attention.xla import xla_attention
from jkv.config import ATTENTION_BACKENDS
from jkv.kv.pages import KVPages
from jkv.pallas_kernels.chunked_prefill_attention import chunked_prefill_attention
from jkv.pallas_kernels.paged_decode_attention import paged_decode_attention
from jkv.pallas_kernels.softmax_state import merge_softmax_states, normalize_softmax_state

PAGES_PER_BLOCK = 4  # page-table widths are powers of two >= 4, token tiers' multiples of 32


def resolve_backend(name: str) -> str:
    """The attention backend `auto` means here: the Pallas kernels on a GPU, else xla."""
    if name == "auto":
        return "pallas" if jax.default_backend() == "gpu" else "xla"
    return name


def decode_splits(batch: int, kv_heads: int, width: int, programs: int = 264) -> int:
    """Split-K factor: enough programs to fill a GPU (about two per SM), powers of two."""
    splits = 1
    while (2 * splits * PAGES_PER_BLOCK <= width and width % (2 * splits * PAGES_PER_BLOCK) == 0
           and batch * kv_heads * splits * 2 <= programs):
        splits *= 2
    return splits


def window_softmax_state(q: jax.Array, window: Window, q_positions: jax.Array,
                         sm_scale: float) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """Unnormalised attention state of one query per row [B, Hq, D] over its window, and
    the unnormalised probabilities exp(score - row max) [B, Hq, Tw] (0 where not seen)."""
    b, hq, d = q.shape
    hkv, tw = window.k.shape[1], window.k.shape[2]
    qg = q.astype(jnp.float32).reshape(b, hkv, hq // hkv, d) * sm_scale
    s = jnp.einsum("bhgd,bhsd->bhgs", qg, window.k.astype(jnp.float32),
                   precision=lax.Precision.HIGHEST)
    i = jnp.arange(tw)[None, :]
    visible = (i < window.length[:, None]) & (window.start[:, None] + i <= q_positions[:, None])
    visible = visible[:, None, None, :]
    s = jnp.where(visible, s, -jnp.inf)
    m = s.max(axis=-1)
    p = jnp.where(visible, jnp.exp(s - jnp.where(jnp.isfinite(m), m, 0.0)[..., None]), 0.0)
    o = jnp.einsum("bhgs,bhsd->bhgd", p, window.v.astype(jnp.float32),
                   precision=lax.Precision.HIGHEST)
    return o.reshape(b, hq, d), p.sum(axis=-1).reshape(b, hq), m.reshape(b, hq), p.reshape(
        b, hq, tw)


def _decode_significance(p: jax.Array, m_part: jax.Array, m: jax.Array, denom: jax.Array,
                         hkv: int) -> jax.Array:
    """Probabilities of one part of a merged softmax (p [B, Hq, S] unnormalised against the
    part's max m_part [B, Hq]) against the merged max and denominator, max over each KV head's
    query heads: [B, Hkv, S]."""
    b, hq, n = p.shape
    scale = jnp.where(jnp.isfinite(m_part) & (denom > 0),
                      jnp.exp(m_part - m) / jnp.where(denom > 0, denom, 1.0), 0.0)
    return (p * scale[..., None]).reshape(b, hkv, hq // hkv, n).max(axis=2)


def paged_attention(q: jax.Array, pool: KVPages, pages: jax.Array, window: Window,
                    q_positions: jax.Array, sm_scale: float, backend: str = "xla",
                    tiers: tuple[jax.Array, jax.Array] | None = None,
                    max_tokens: int | None = None,
                    significance_from: jax.Array | None = None):
    """q [B, T, Hq, D] at `q_positions` [B, T] over one layer's pages [B, Hkv, W] (tokens
    [0, window.start) of each row) and the window; returns [B, T, Hq, D] in q's dtype.

    With `tiers` = (high, low) [B, Hkv], the pages hold LeanKV's token tiers instead: `high`
    tokens in the left pages, `low` in the right ones read at half the bits
    (`KVFormat.halved`); then it returns (out, significance): each key's attention, max over
    its KV head's query heads, averaged over the real queries that see it, as (high [B, Hkv,
    W * page], window [B, Hkv, Tw], low [B, Hkv, W * 2 * page]), tiers in slot order.
    `max_tokens` bounds the tokens of a row's tier (the xla backend keeps scores only that
    wide; None: the table's width). `significance_from` [B]: only queries at or after it
    count in the significance (an observation window, SnapKV's), None: all."""
    b, t, hq, d = q.shape
    hkv = pages.shape[1]
    if tiers is None:
        prefix = jnp.broadcast_to(window.start[:, None], (b, hkv)).astype(jnp.int32)
        low_tier = low = None
    else:
        prefix, low = tiers
        # a format that does not halve holds one tier (pruning policies): low stays 0
        low_tier = pool.as_format(pool.kv_format.halved()) if pool.kv_format.halvable else None
        low = low if low_tier is not None else None
    significance = tiers is not None
    # the step's real tokens end where the window does; the rest of a row is padding
    q_lengths = jnp.clip(window.start + window.length - q_positions[:, 0], 0, t)
    if backend == "xla":
        out = xla_attention(q, pool, pages, prefix, window.k, window.v, window.start,
                            window.length, q_positions, q_lengths, sm_scale=sm_scale,
                            low_tier=low_tier, low_lengths=low,
                            return_significance=significance, max_tokens=max_tokens,
                            significance_from=significance_from)
        if significance:
            out, sig = out
            return out.astype(q.dtype), _with_low(sig, pages, pool.page_size)
        return out.astype(q.dtype)
    if backend != "pallas":
        raise ValueError(f"attention_backend must be one of {ATTENTION_BACKENDS}, got {backend!r}")
    interpret = jax.default_backend() == "cpu"
    if t == 1:
        real = q_lengths > 0  # padding rows: no query sees anything
        if significance_from is not None:
            real &= q_positions[:, 0] >= significance_from
        return _pallas_decode(q, pool, pages, prefix, low_tier, low, window, q_positions,
                              sm_scale, real, significance, interpret)
    out = chunked_prefill_attention(
        q, pool, pages, prefix, window.k, window.v, window.start, window.length, q_positions,
        q_lengths, sm_scale=sm_scale, pages_per_block=PAGES_PER_BLOCK,
        block_w=min(16, pool.page_size), low_tier=low_tier, low_lengths=low,
        return_significance=significance, significance_from=significance_from,
        interpret=interpret)
    if significance:
        out, sig = out
        return out, _with_low(sig, pages, pool.page_size)
    return out


def _pallas_decode(q, pool, pages, prefix, low_tier, low, window, q_positions, sm_scale,
                   real, significance: bool, interpret: bool):
    """`paged_attention` of one query per row on the Pallas decode kernel, merged with the
    window's; `real` [B]: rows whose query adds significance."""
    b, _, _, _ = q.shape
    hkv, w = pages.shape[1], pages.shape[-1]
    splits = 1 if interpret else decode_splits(b, hkv, w)
    state = paged_decode_attention(
        q[:, 0], pool, pages, prefix, sm_scale=sm_scale, pages_per_block=PAGES_PER_BLOCK,
        k_splits=splits, low_tier=low_tier, low_lengths=low, return_softmax_state=True,
        return_significance=significance, interpret=interpret)
    if significance:
        state, p = state
        p_hi, p_lo = p if low_tier is not None else (p, None)
    *tail, p_win = window_softmax_state(q[:, 0], window, q_positions[:, 0], sm_scale)
    o, denom, m = merge_softmax_states(*(jnp.stack(x) for x in zip(state, tail, strict=True)),
                                       axis=0)
    out = normalize_softmax_state(o, denom)[:, None].astype(q.dtype)
    if not significance:
        return out
    sig = tuple(jnp.where(real[:, None, None], _decode_significance(p, m_part, m, denom, hkv),
                          0.0)
                for p, m_part in ((p_hi, state[2]), (p_win, tail[2]), (p_lo, state[2]))
                if p is not None)
    return out, _with_low(sig, pages, pool.page_size)


def _with_low(sig: tuple, pages: jax.Array, page: int) -> tuple:
    """(high, window, low) significance; zeros for the low tier of a single-tier pool."""
    if len(sig) == 3:
        return sig
    b, hkv, w = pages.shape
    return (*sig, jnp.zeros((b, hkv, w * 2 * page), jnp.float32))
