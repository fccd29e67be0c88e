"""Attention over a paged prefix and a full-precision window in plain jnp (the `xla` backend).

The CPU path. `chunked_prefill_attention_reference` is the test oracle: it dequantizes every
page of the table's width and materialises the whole score matrix, so its cost grows with
the table width and with the square of the step. This computes the same function blockwise:
an online softmax of all queries over blocks of the pages the rows hold (the loop stops at
the longest row's held pages, whatever the table width; dequantization is fused into each
block's gather, keys from sub-byte codes are laid out by channel for the score dot and 4-bit
values are dotted one packed part at a time: the shapes a CPU runs fastest), then, a block
of queries at a time, over the part of the window those queries can see (causal by absolute
position, so a prefill chunk computes a little more than half of its window's scores).
Blocks of padding queries (past every row's `q_lengths`) skip the window. Everything is
float32 at the default matmul precision.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from jkv.kv.pages import KVPages
from jkv.pallas_kernels.significance import key_significance

MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)


def _pad_to(x: jax.Array, axis: int, multiple: int) -> jax.Array:
    pad = -x.shape[axis] % multiple
    if not pad:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, pad)
    return jnp.pad(x, widths)


def _online_update(state: tuple, s: jax.Array, v: jax.Array | list[jax.Array],
                   visible: jax.Array | None = None) -> tuple:
    """Fold one block of keys into (acc [B, H, R, D], max [B, H, R], denominator [B, H, R]):
    scores s [B, H, R, K], values v [B, H, K, D] or their channel blocks [B, H, K, D // n] in
    order, `visible` broadcastable to s (None: all).

    Masked scores become MASK_VALUE rather than -inf, so nothing is ever inf - inf: once a
    row has seen a key, masked ones get probability exactly 0; while it has seen none, its
    max is MASK_VALUE-ish and what it gathers (each probability at most 1) is wiped by the
    first visible key (a factor exp(MASK_VALUE - max) = 0), or discarded at the end
    (`_normalize`).
    """
    acc, m, denom = state
    if visible is not None:
        s = jnp.where(visible, s, MASK_VALUE)
    m_next = jnp.maximum(m, s.max(axis=-1))
    p = jnp.exp(s - m_next[..., None])
    correction = jnp.exp(m - m_next)
    pv = jnp.concatenate([jnp.einsum("bhrk,bhkd->bhrd", p, x, preferred_element_type=jnp.float32)
                          for x in (v if isinstance(v, list) else [v])], axis=-1)
    acc = acc * correction[..., None] + pv
    return acc, m_next, denom * correction + p.sum(axis=-1)


def _scores(q: jax.Array, k: jax.Array, by_channel: bool) -> jax.Array:
    """q [B, H, R, D] . k [B, H, K, D] -> [B, H, R, K]; `by_channel`: with k copied to
    [B, H, D, K] first, behind a barrier that keeps XLA from folding the transpose back into
    the dot. On a CPU that speeds up attention over keys unpacked from sub-byte codes but
    slows it over 8-bit or float keys, so only sub-byte keys take it (chosen by measurement,
    see benchmarks/xla_blocks.py)."""
    if not by_channel:
        return jnp.einsum("bhrd,bhkd->bhrk", q, k, preferred_element_type=jnp.float32)
    kt = lax.optimization_barrier(jnp.swapaxes(k, -1, -2))
    return jnp.einsum("bhrd,bhdk->bhrk", q, kt, preferred_element_type=jnp.float32)


def _normalize(state: tuple, real: jax.Array) -> jax.Array:
    """acc / denominator; 0 for rows that saw no key (max still MASK_VALUE-ish or -inf) and
    for rows not `real` (broadcastable to the max)."""
    acc, m, denom = state
    ok = real & (m > 0.5 * MASK_VALUE)
    return jnp.where(ok[..., None], acc / jnp.where(ok, denom, 1.0)[..., None], 0.0)


@functools.partial(jax.jit, static_argnames=("sm_scale", "block_q", "block_k", "block_w",
                                             "return_significance", "max_tokens"))
def xla_attention(
    q: jax.Array,  # [B, T, Hq, D]
    pages: KVPages,  # the pool [P, page, ...]
    page_table: jax.Array,  # int32 [B, Hkv, W]
    page_lengths: jax.Array,  # int32 [B, Hkv]: tokens [0, page_lengths) held in pages
    k_window: jax.Array,  # [B, Hkv, Tw, D]: token i at position window_start + i
    v_window: jax.Array,  # [B, Hkv, Tw, D]
    window_start: jax.Array,  # int32 [B]
    window_len: jax.Array,  # int32 [B]
    q_positions: jax.Array,  # int32 [B, T]
    q_lengths: jax.Array | None = None,  # int32 [B]: real queries per row (default T)
    *,
    sm_scale: float | None = None,
    block_q: int | None = None,
    block_k: int | None = None,
    block_w: int | None = None,
    low_tier: KVPages | None = None,  # a second tier [P', low page, ...], own format
    low_lengths: jax.Array | None = None,  # int32 [B, Hkv]: tokens in the low tier
    return_significance: bool = False,
    significance_from: jax.Array | None = None,  # int32 [B]: earlier queries add none
    max_tokens: int | None = None,  # most tokens a row holds in one tier (None: the table's)
) -> jax.Array | tuple[jax.Array, tuple[jax.Array, ...]]:
    """`chunked_prefill_attention`'s function in jnp; returns float32 [B, T, Hq, D].

    Query (b, t) sees every page token of its KV head and window token i when
    i < window_len[b] and window_start[b] + i <= q_positions[b, t]; a query that sees
    nothing gets 0, and so does a padding query t >= q_lengths[b]. Blocks: `block_q` queries
    (all their query heads together), `block_k` page tokens, `block_w` window tokens; None
    picks sizes that suit a CPU. With `low_tier`, the row's right side holds a second tier's
    pages (`paged_decode_attention`'s bidirectional table), seen like the high tier's.

    With `return_significance` it also returns LeanKV's significance of every key: the
    attention it receives, max over the query heads of its KV head, averaged over the real
    queries that see it: (pages [B, Hkv, W * page] in slot order, window [B, Hkv, Tw], and
    with a low tier its pages [B, Hkv, W * low page] in slot order), 0 where no query sees
    a token. The scores are kept as they are computed (no second pass
    over the pages) and normalised once every row's softmax state is final, in a buffer as
    wide as a tier can be: `max_tokens` when given (a row's tier must then hold no more;
    LeanKV's low tier could fill twice the table's width in tokens, its rows never do), else
    the table's width.
    """
    hkv = page_table.shape[1]
    sm_scale = 1.0 / math.sqrt(q.shape[3]) if sm_scale is None else sm_scale
    block_q, block_k, block_w = _block_sizes(q.shape, hkv, block_q, block_k, block_w)
    qg, pos, q_lengths = _grouped_queries(q, q_positions, q_lengths, hkv, sm_scale, block_q)
    state, tiers = _attend_tiers(qg, q_lengths, pages, page_table, page_lengths, low_tier,
                                 low_lengths, block_k=block_k, max_tokens=max_tokens,
                                 significance=return_significance)
    window = _Window(k_window, v_window,
                     jnp.minimum(window_len.astype(jnp.int32), k_window.shape[2]),
                     window_start.astype(jnp.int32))
    blocks = _attend_window(qg, state, window, pos, q_lengths, t=q.shape[1], block_q=block_q,
                            block_w=block_w, significance=return_significance)
    out = _output(blocks, q.shape, block_q)
    if not return_significance:
        return out
    return out, _significance(blocks, tiers, q_lengths, significance_from, pos, window)


def _block_sizes(shape: tuple, hkv: int, block_q: int | None, block_k: int | None,
                 block_w: int | None) -> tuple[int, int, int]:
    """The blocks `xla_attention` walks, for q of `shape` [B, T, Hq, D]: None picks sizes
    that suit a CPU, and `block_q` is rounded to a power of two no wider than the step."""
    b, t, hq, d = shape
    g = hq // hkv
    if block_q is None:  # about 384 rows of queries per window block, at most 8 blocks
        block_q = max(1 << max(0, round(math.log2(max(384 // g, 1)))), -(-t // 8))
    block_q = min(1 << (block_q - 1).bit_length(), 1 << (t - 1).bit_length())
    if block_k is None:  # the pages take all queries at once
        if -(-t // block_q) * block_q * g <= 64:
            # few rows (decode): 128 tokens while a block's float32 keys stay within 1 MiB,
            # else 64 (larger blocks were slower on a CPU, most with two tiers, whose last
            # blocks are masked; chosen by measurement, see benchmarks/xla_blocks.py)
            block_k = 128 if b * hkv * 128 * d * 4 <= 1 << 20 else 64
        else:
            block_k = 256
    if block_w is None:  # window tokens past a query block's span (outside the engine)
        block_w = 64
    return block_q, block_k, block_w


def _grouped_queries(q: jax.Array, q_positions: jax.Array, q_lengths: jax.Array | None,
                     hkv: int, sm_scale: float, block_q: int) -> tuple:
    """The queries as every block reads them: [B, Hkv, Tp * G, D] (row t * G + g), scaled,
    in float32, with their positions [B, Tp] (both padded to whole query blocks) and the
    real queries per row (int32 [B], T when not given)."""
    b, t, hq, d = q.shape
    g = hq // hkv
    if q_lengths is None:
        q_lengths = jnp.full((b,), t, jnp.int32)
    qg = _pad_to(q.astype(jnp.float32).reshape(b, t, hkv, g, d) * sm_scale, 1, block_q)
    qg = qg.transpose(0, 2, 1, 3, 4).reshape(b, hkv, -1, d)
    pos = _pad_to(q_positions.astype(jnp.int32), 1, block_q)  # [B, Tp]
    return qg, pos, q_lengths.astype(jnp.int32)


def _attend_tiers(qg: jax.Array, q_lengths: jax.Array, pages: KVPages, page_table: jax.Array,
                  page_lengths: jax.Array, low_tier: KVPages | None,
                  low_lengths: jax.Array | None, *, block_k: int, max_tokens: int | None,
                  significance: bool) -> tuple:
    """(1) every query over the pages of each tier, the high one then the low one: returns
    the softmax state and, per tier, (its kept scores or None, its slots)."""
    b, hkv, rows, d = qg.shape
    w = page_table.shape[2]
    state = (jnp.zeros((b, hkv, rows, d), jnp.float32),
             jnp.full((b, hkv, rows), -jnp.inf, jnp.float32),
             jnp.zeros((b, hkv, rows), jnp.float32))
    attend = functools.partial(_attend_tier, qg=qg, q_lengths=q_lengths,
                               pool_format=pages.kv_format, block_k=block_k,
                               max_tokens=max_tokens, significance=significance)
    state, page_scores = attend(state, pages, page_table, page_lengths)
    tiers = [(page_scores, w * pages.page_size)]
    if low_tier is not None:  # low page i at column W - 1 - i: reversed, the slot order
        if low_lengths is None or low_lengths.shape != (b, hkv):
            raise ValueError(f"low_lengths must be [B={b}, Hkv={hkv}] with low_tier")
        state, low_scores = attend(state, low_tier, page_table[..., ::-1], low_lengths)
        tiers.append((low_scores, w * low_tier.page_size))
    return state, tiers


def _attend_tier(state: tuple, tier: KVPages, table: jax.Array, lengths: jax.Array, *,
                 qg: jax.Array, q_lengths: jax.Array, pool_format, block_k: int,
                 max_tokens: int | None, significance: bool) -> tuple:
    """A tier's held pages (table [B, Hkv, W] in slot order): every query of a row sees
    all of them, so all queries go at once. Blocks every row holds in full need no mask;
    the rest (ragged rows' last blocks) are masked by length. A row without real queries
    holds nothing here. Returns (state, the scores [B, Hkv, Tp * G, W * page] or None)."""
    b, hkv, rows, _ = qg.shape
    w = table.shape[2]
    page = tier.page_size
    source = tier
    if tier.kv_format != pool_format:
        # a view of the high tier's pool (LeanKV's low tier): gather pages in the pool's
        # own shapes and read the gathered ones in the view's format; the view of the
        # whole pool would be copied on CPU (its arrays' layouts change)
        try:
            source = tier.as_format(pool_format)
        except ValueError:
            source = tier
    ppb = max(1, block_k // page)  # whole pages
    table = _pad_to(table.astype(jnp.int32), 2, ppb)  # padding columns: the null page
    plen = jnp.where(q_lengths[:, None] > 0,
                     jnp.minimum(lengths.astype(jnp.int32), w * page), 0)  # [B, Hkv]
    block = ppb * page
    body = functools.partial(_page_block, qg=qg, tier=tier, source=source, table=table,
                             plen=plen, ppb=ppb)

    # kept: whole blocks covering the tokens a row can hold in this tier
    cap = w * page if max_tokens is None else min(w * page, max_tokens)
    scores = (jnp.full((b, hkv, rows, -(-cap // block) * block), MASK_VALUE, jnp.float32)
              if significance else None)
    full = plen.min() // block
    carry = lax.fori_loop(0, full, functools.partial(body, masked=False), (state, scores))
    state, scores = lax.fori_loop(full, -(-plen.max() // block),
                                  functools.partial(body, masked=True), carry)
    return state, None if scores is None else scores[..., :cap]


def _page_block(j, carry: tuple, *, qg: jax.Array, tier: KVPages, source: KVPages,
                table: jax.Array, plen: jax.Array, ppb: int, masked: bool) -> tuple:
    """Fold block j of a tier's pages (`ppb` table columns) into carry (state, the tier's
    kept scores or None), its tokens past a row's `plen` masked when `masked`."""
    state, scores = carry
    b, hkv, _, d = qg.shape
    block = ppb * tier.page_size
    ids = lax.dynamic_slice_in_dim(table, j * ppb, ppb, axis=2)  # [B, Hkv, ppb]
    held = source.take(ids).as_format(tier.kv_format)
    k, v = held.dense()  # [B, Hkv, ppb, page, D]
    k, v = k.reshape(b, hkv, block, d), v.reshape(b, hkv, block, d)
    if tier.kv_format.v_bits == 4:
        # the two channel blocks dotted apart: on a CPU that makes decode over 4-bit
        # values faster than dotting them interleaved (2-bit values' four blocks of 16
        # channels gained nothing, so they stay interleaved)
        v = [x.reshape(b, hkv, block, -1) for x in held.value_parts()]
    s = _scores(qg, k, by_channel=tier.kv_format.k_bits < 8)
    if masked:
        token = j * block + jnp.arange(block)
        visible = (token[None, None, :] < plen[:, :, None])[:, :, None, :]
        s = jnp.where(visible, s, MASK_VALUE)
    if scores is not None:
        scores = lax.dynamic_update_slice_in_dim(scores, s, j * block, axis=3)
    return _online_update(state, s, v), scores


class _Window(NamedTuple):
    """The window as the query blocks read it: keys and values [B, Hkv, Tw, D], the
    tokens it holds (at most Tw) and the position of its token 0, int32 [B] each."""

    k: jax.Array
    v: jax.Array
    length: jax.Array
    start: jax.Array


def _attend_window(qg: jax.Array, state: tuple, window: _Window, pos: jax.Array,
                   q_lengths: jax.Array, *, t: int, block_q: int, block_w: int,
                   significance: bool) -> list:
    """(2) the window, causal by absolute position, a block of queries at a time. Block i's
    queries see window tokens up to their own, so it attends at once to the span that the
    engine's layout lets it see (its queries are the window's last T tokens: window tokens
    [0, Tw - T + (i + 1) * block_q)), masked; a loop takes any window tokens past that span
    that its queries see (none in the engine's layout). A block of padding queries (past
    every row's q_lengths) is skipped. Returns each block's (output, max, denominator,
    window scores or None)."""
    rows = block_q * (qg.shape[2] // pos.shape[1])
    tw = window.k.shape[2]
    query_block = functools.partial(_query_block, window=window, pos=pos, q_lengths=q_lengths,
                                    t=t, block_q=block_q, block_w=min(block_w, tw),
                                    significance=significance)
    padding_block = functools.partial(_padding_block, tw=tw, significance=significance)
    blocks = []
    for i in range(qg.shape[2] // rows):
        rows_i = slice(i * rows, (i + 1) * rows)
        qb, state_i = qg[:, :, rows_i], tuple(x[:, :, rows_i] for x in state)
        if i == 0:  # the first block always holds real queries (or the whole step is padding)
            blocks.append(query_block(i, qb, state_i))
        else:
            blocks.append(lax.cond((q_lengths > i * block_q).any(),
                                   functools.partial(query_block, i), padding_block,
                                   qb, state_i))
    return blocks


def _window_keys(qb: jax.Array, carry: tuple, row_pos: jax.Array, first: jax.Array | int,
                 size: int, window: _Window) -> tuple:
    """Window tokens [first, first + size) (a block that would end past the window is
    moved back to end there, its tokens before `first` masked); carry: (state, the
    block's window scores or None)."""
    state, scores = carry
    at = jnp.minimum(first, window.k.shape[2] - size)
    k = lax.dynamic_slice_in_dim(window.k, at, size, axis=2).astype(jnp.float32)
    v = lax.dynamic_slice_in_dim(window.v, at, size, axis=2).astype(jnp.float32)
    s = jnp.einsum("bhrd,bhkd->bhrk", qb, k, preferred_element_type=jnp.float32)
    idx = at + jnp.arange(size)
    visible = ((idx >= first)[None, None, :]
               & (idx[None, None, :] < window.length[:, None, None])
               & (window.start[:, None, None] + idx[None, None, :] <= row_pos[:, :, None]))
    s = jnp.where(visible[:, None], s, MASK_VALUE)
    if scores is not None:  # a token written twice is masked once: keep the larger
        seen = lax.dynamic_slice_in_dim(scores, at, size, axis=3)
        scores = lax.dynamic_update_slice_in_dim(scores, jnp.maximum(seen, s), at, axis=3)
    return _online_update(state, s, v), scores


def _query_block(i: int, qb: jax.Array, state: tuple, *, window: _Window, pos: jax.Array,
                 q_lengths: jax.Array, t: int, block_q: int, block_w: int,
                 significance: bool) -> tuple:
    """Output [B, Hkv, R, D] of query block i, its rows' final (max, denominator) and
    window scores (None without significance): queries qb [B, Hkv, R, D] and their
    state after the pages."""
    b, hkv, rows, _ = qb.shape
    g = rows // block_q
    tw = window.k.shape[2]
    pb = pos[:, i * block_q:(i + 1) * block_q]  # [B, block_q]
    real_q = i * block_q + jnp.arange(block_q)[None, :] < q_lengths[:, None]
    row_pos = jnp.repeat(pb, g, axis=1)  # [B, R]
    span = max(1, min(tw, tw - t + (i + 1) * block_q))
    scores = jnp.full((b, hkv, rows, tw), MASK_VALUE, jnp.float32) if significance else None
    carry = _window_keys(qb, (state, scores), row_pos, 0, span, window)
    top = jnp.where(real_q, pb, -1).max(axis=1)  # latest real query position
    seen = jnp.clip(top - window.start + 1, 0, window.length)  # [B] (0 without real queries)
    state, scores = lax.fori_loop(
        0, -(-jnp.maximum(seen.max() - span, 0) // block_w),
        lambda j, carry: _window_keys(qb, carry, row_pos, span + j * block_w, block_w, window),
        carry)
    out = _normalize(state, jnp.repeat(real_q, g, axis=1)[:, None, :])
    return out, state[1], state[2], scores


def _padding_block(qb: jax.Array, state: tuple, *, tw: int, significance: bool) -> tuple:
    """`_query_block`'s result for a block of padding queries, which sees nothing."""
    b, hkv, rows, _ = qb.shape
    scores = jnp.full((b, hkv, rows, tw), MASK_VALUE, jnp.float32) if significance else None
    return jnp.zeros_like(qb), state[1], jnp.zeros_like(state[2]), scores


def _output(blocks: list, shape: tuple, block_q: int) -> jax.Array:
    """The query blocks' outputs as [B, T, Hq, D] for q of `shape`, padding queries cut."""
    b, t, hq, d = shape
    nq, hkv = len(blocks), blocks[0][0].shape[1]
    out = jnp.stack([x[0] for x in blocks])  # [nq, B, Hkv, R, D]
    out = out.reshape(nq, b, hkv, block_q, hq // hkv, d).transpose(1, 0, 3, 2, 4, 5)
    return out.reshape(b, nq * block_q, hq, d)[:, :t]


def _significance(blocks: list, tiers: list, q_lengths: jax.Array,
                  significance_from: jax.Array | None, pos: jax.Array,
                  window: _Window) -> tuple[jax.Array, ...]:
    """`xla_attention`'s significance from its query blocks' final softmax states and the
    scores it kept (`tiers`: (scores, slots) of each), over the real queries from
    `significance_from` on: (the first tier's, the window's, the low tier's if any)."""
    real = jnp.arange(pos.shape[1])[None, :] < q_lengths[:, None]  # [B, Tp]
    if significance_from is not None:
        real &= pos >= significance_from[:, None]
    m = jnp.concatenate([x[1] for x in blocks], axis=2)  # [B, Hkv, Tp * G]
    denom = jnp.concatenate([x[2] for x in blocks], axis=2)
    g = m.shape[2] // pos.shape[1]
    row_pos = jnp.where(real, pos, -1)
    win_idx = jnp.arange(blocks[0][3].shape[-1])
    sees = ((win_idx[None, None, :] < window.length[:, None, None])
            & (window.start[:, None, None] + win_idx[None, None, :] <= row_pos[:, :, None]))

    def tier_significance(scores: jax.Array, slots: int) -> jax.Array:
        """A tier's significance [B, Hkv, slots] from its kept scores (0 past them)."""
        sig = key_significance(scores, m, denom, real, g, real.sum(axis=1)[:, None, None])
        return jnp.pad(sig, ((0, 0), (0, 0), (0, slots - sig.shape[-1])))

    (high, high_slots), *low = tiers
    window_sig = key_significance(jnp.concatenate([x[3] for x in blocks], axis=2), m, denom,
                                  real, g, sees.sum(axis=1)[:, None, :])
    return (tier_significance(high, high_slots), window_sig,
            *(tier_significance(x, n) for x, n in low))
