"""Chunked prefill attention over a paged prefix (Pallas, Triton lowering).

A chunk of new tokens of a request attends to (1) the tokens its pages hold (quantized or in
model dtype; they all precede the chunk, so only a length mask applies) and (2) a
full-precision window that holds the partly filled page and the chunk itself, causally by
absolute position. So a follow-up turn computes only its new tokens against the paged
history. One program per (sequence, KV head, block of queries): the query heads of the KV head
for `block_q` tokens form the rows of one tile; an online softmax walks blocks of pages
(dequantization fused, shared with the decode kernel) and then the window blocks that the
tile's queries can see.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pl_triton

from jkv.kv.pages import KVPages
from jkv.pallas_kernels.page_blocks import (
    attend_block,
    dot_t,
    half_dtypes,
    online_update,
    query_parts,
)
from jkv.pallas_kernels.paged_decode_attention import MIN_DOT, checked_parts, dequantized_tiers
from jkv.pallas_kernels.significance import chunked_prefill_significance


def _kernel(*refs, formats: tuple, parts: tuple, pages_per_block: int, block_w: int,
            heads: int, sm_scale: float, scores: bool, half: bool):
    refs = list(refs)
    q_ref = refs.pop(0)  # [rows = block_q * heads, D]
    pos_ref = refs.pop(0)  # [block_q]: absolute positions of the tile's queries
    # the pool refs [P, page, ...] of the high tier, then of the low tier if any
    tiers = [KVPages.from_operands(f, refs) for f in formats]
    table_ref = refs.pop(0)  # [W]
    plen_ref = refs.pop(0)  # [2]: tokens held in this row's high pages and low pages
    kw_ref = refs.pop(0)  # [Tw, D] window keys, model dtype
    vw_ref = refs.pop(0)  # [Tw, D] window values
    win_ref = refs.pop(0)  # [3]: window start position, window length, real queries
    o_ref = refs.pop(0)  # [rows, D]
    # with `scores`: logits over the window [rows, Tw], the rows' max and denominator, and
    # over each tier's pages [rows, W * tier page] (blocks never visited are left unwritten;
    # the caller masks them)
    sw_ref, m_ref, l_ref, *sp_refs = refs if scores else (None,) * (3 + len(tiers))

    rows, d = q_ref.shape
    block_q = pos_ref.shape[0]
    tier = tiers[0]
    page = tier.page_size
    ppb = pages_per_block
    nk, nv = parts
    dk, dv = d // nk, d // nv
    compute = q_ref.dtype
    q_parts = query_parts(q_ref, nk, sm_scale, half_dtypes(compute, formats, half))
    carry = (tuple(jnp.zeros((rows, dv), jnp.float32) for _ in range(nv)),
             jnp.full((rows,), -jnp.inf, jnp.float32), jnp.zeros((rows,), jnp.float32))

    # a tile of padding queries only (past the row's real ones) skips all work: outputs 0
    first_query = pl.program_id(2) * block_q
    active = first_query < win_ref[2]

    # (1) the paged prefix: every query sees every held token
    plen = jnp.where(active, plen_ref[0], 0)
    attend = functools.partial(attend_block, q_parts=q_parts, compute=compute, half=half)

    def page_body(j, carry):
        col = j * ppb
        pages = jnp.where(col + jnp.arange(ppb) < pl.cdiv(plen, page),
                          table_ref[pl.ds(col, ppb)], 0)
        token = col * page + jnp.arange(ppb * page)
        carry, logits = attend(carry, tier, pages, (token < plen)[None, :])
        if sp_refs[0] is not None:
            sp_refs[0][:, pl.ds(col * page, ppb * page)] = logits
        return carry

    w = table_ref.shape[0]  # a length past the table never reads past it
    carry = lax.fori_loop(0, jnp.minimum(pl.cdiv(pl.cdiv(plen, page), ppb), w // ppb),
                          page_body, carry)

    if len(tiers) > 1:  # the low tier: its own pages from the right, low page i at w - 1 - i
        low, page_lo = tiers[1], tiers[1].page_size
        len_lo = jnp.where(active, plen_ref[1], 0)
        start_lo = jnp.maximum(w - pl.cdiv(len_lo, page_lo), 0)
        offset = jnp.arange(ppb * page_lo) % page_lo

        def low_body(j, carry):
            col = j * ppb
            pages = jnp.where(col + jnp.arange(ppb) >= start_lo, table_ref[pl.ds(col, ppb)], 0)
            col_tok = col + jnp.arange(ppb * page_lo) // page_lo
            token = jnp.where(col_tok >= start_lo, (w - 1 - col_tok) * page_lo + offset, len_lo)
            carry, logits = attend(carry, low, pages, (token < len_lo)[None, :])
            if sp_refs[1] is not None:
                sp_refs[1][:, pl.ds(col * page_lo, ppb * page_lo)] = logits
            return carry

        carry = lax.fori_loop(jnp.where(len_lo > 0, start_lo // ppb, w // ppb), w // ppb,
                              low_body, carry)

    # (2) the window, causal by absolute position
    start, length = win_ref[0], jnp.minimum(win_ref[1], kw_ref.shape[0])
    pos = pos_ref[...]
    row_pos = jnp.broadcast_to(pos[:, None], (block_q, heads)).reshape(rows)
    visible_len = jnp.where(active, jnp.clip(pos.max() - start + 1, 0, length), 0)

    def window_body(j, carry):
        i = j * block_w + jnp.arange(block_w)
        visible = (i[None, :] < length) & (start + i[None, :] <= row_pos[:, None])
        logits = jnp.zeros((rows, block_w), jnp.float32)
        for p in range(nk):
            k_p = kw_ref[pl.ds(j * block_w, block_w), pl.ds(p * dk, dk)].astype(compute)
            logits += dot_t(q_parts[compute][p], k_p)
        if sw_ref is not None:
            sw_ref[:, pl.ds(j * block_w, block_w)] = logits

        def values(p):
            return vw_ref[pl.ds(j * block_w, block_w), pl.ds(p * dv, dv)].astype(compute)

        return online_update(carry, logits, visible, values)

    carry = lax.fori_loop(0, pl.cdiv(visible_len, block_w), window_body, carry)

    o_parts, m, denom = carry
    if scores:
        m_ref[...] = m
        l_ref[...] = denom
    # a query that sees nothing gives 0, and so does a padding query
    real = first_query + jnp.arange(rows) // heads < win_ref[2]
    denom = jnp.where(real & (denom > 0), denom, jnp.inf)[:, None]
    for i in range(nv):
        o_ref[:, pl.ds(i * dv, dv)] = (o_parts[i] / denom).astype(o_ref.dtype)


@functools.partial(jax.jit, static_argnames=(
    "sm_scale", "block_q", "pages_per_block", "block_w", "num_warps", "num_stages",
    "return_significance", "dequant", "interpret"))
def chunked_prefill_attention(
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
    block_q: int = 16,
    pages_per_block: int = 4,
    block_w: int = 16,
    num_warps: int = 4,
    num_stages: int = 2,
    low_tier: KVPages | None = None,  # a second tier [P', low page, ...], own format
    low_lengths: jax.Array | None = None,  # int32 [B, Hkv]: tokens in the low tier
    return_significance: bool = False,
    significance_from: jax.Array | None = None,  # int32 [B]: earlier queries add none
    dequant: str = "f16",
    interpret: bool = False,
) -> jax.Array | tuple[jax.Array, tuple[jax.Array, ...]]:
    """Attention of T new queries over their pages and window; returns [B, T, Hq, D].

    Query (b, t) sees every page token of its KV head and window token i when
    i < window_len[b] and window_start[b] + i <= q_positions[b, t]. A query that sees
    nothing gets 0, and so does a padding query t >= q_lengths[b] (tiles of them skip all
    work: a padded chunk does not pay for attention over its history). With `low_tier`,
    the row's right side holds a second tier's pages (`paged_decode_attention`'s
    bidirectional table), seen like the high tier's.

    With `return_significance` it also returns each key's significance (`key_significance`)
    over the pages [B, Hkv, W * page] (slot order) and the window [B, Hkv, Tw], and with a
    low tier over its pages [B, Hkv, W * low page] (slot order) third; the kernel writes
    its logits in the same pass and they are normalised once its rows' states are final.
    `dequant`: how quantized pages are dequantized for 16-bit q (`paged_decode_attention`).
    """
    t, d = q.shape[1], q.shape[3]
    block_q = min(block_q, t)
    kw, vw, block_w = _checked_inputs(
        q, pages, page_table, page_lengths, k_window, v_window, window_start, window_len,
        q_positions, block_q=block_q, pages_per_block=pages_per_block, block_w=block_w,
        interpret=interpret)
    tiers, low_lengths, parts, half = checked_parts(pages, low_tier, low_lengths,
                                                    page_lengths, d, dequant, q.dtype)
    out, state, q_lengths = _prefill_pallas_call(
        q, q_positions, q_lengths, tiers, page_table, (page_lengths, low_lengths), (kw, vw),
        (window_start, window_len), parts=parts, half=half,
        sm_scale=1.0 / math.sqrt(d) if sm_scale is None else sm_scale, block_q=block_q,
        pages_per_block=pages_per_block, block_w=block_w, num_warps=num_warps,
        num_stages=num_stages, significance=return_significance, interpret=interpret)
    if not return_significance:
        return out
    return out, chunked_prefill_significance(
        state, (page_lengths, low_lengths)[:len(tiers)], q_lengths, significance_from, window_start,
        window_len, q_positions, w=page_table.shape[2], window_tokens=k_window.shape[2])


def _checked_inputs(q: jax.Array, pages: KVPages, page_table: jax.Array,
                    page_lengths: jax.Array, k_window: jax.Array, v_window: jax.Array,
                    window_start: jax.Array, window_len: jax.Array, q_positions: jax.Array, *,
                    block_q: int, pages_per_block: int, block_w: int,
                    interpret: bool) -> tuple[jax.Array, jax.Array, int]:
    """ValueError for shapes and blocks `chunked_prefill_attention` cannot run on (the
    kernel indexes its operands blindly); returns the window (keys, values) and its block
    as the kernel walks them."""
    b, t, hq, d = q.shape
    bt, hkv, w = page_table.shape
    tw = k_window.shape[2]
    if bt != b or page_lengths.shape != (b, hkv):
        raise ValueError(f"page_table {page_table.shape} and page_lengths {page_lengths.shape} "
                         f"must be [B={b}, Hkv, W] and [B, Hkv]")
    if hq % hkv:
        raise ValueError(f"query heads {hq} are not a multiple of KV heads {hkv}")
    if k_window.shape != (b, hkv, tw, d) or v_window.shape != k_window.shape:
        raise ValueError(f"k_window and v_window must be [B={b}, Hkv={hkv}, Tw, D={d}], got "
                         f"{k_window.shape} and {v_window.shape}")
    if window_start.shape != (b,) or window_len.shape != (b,) or q_positions.shape != (b, t):
        raise ValueError(f"window_start, window_len must be [B={b}] and q_positions [B, T={t}], "
                         f"got {window_start.shape}, {window_len.shape}, {q_positions.shape}")
    page = pages.page_size
    if not interpret:
        # Triton's tensor-core dots give wrong sums (bf16: twice the value) when a contracted
        # dimension is below 16, so the window is walked in blocks of at least 16 tokens
        if block_w < MIN_DOT:
            block_w = MIN_DOT
            pad = ((0, 0), (0, 0), (0, -tw % block_w), (0, 0))
            k_window, v_window = jnp.pad(k_window, pad), jnp.pad(v_window, pad)
            tw = k_window.shape[2]
        if pages_per_block * page < MIN_DOT:
            raise ValueError(f"pages_per_block * page = {pages_per_block} * {page} must be >= "
                             f"{MIN_DOT} on a GPU (Triton dots need 16 along each dimension)")
    for name, n, blk in (("T", t, block_q), ("W", w, pages_per_block), ("Tw", tw, block_w)):
        if blk < 1 or blk & (blk - 1) or n % blk:
            raise ValueError(f"{name}={n} must be a multiple of its block size {blk}, a power "
                             "of two")
    pages.check(d)
    return k_window, v_window, block_w


def _prefill_pallas_call(q: jax.Array, q_positions: jax.Array, q_lengths: jax.Array | None,
                         tiers: list, page_table: jax.Array, lengths: tuple, window: tuple,
                         window_bounds: tuple, *, parts: tuple, half: bool, sm_scale: float,
                         block_q: int, pages_per_block: int, block_w: int, num_warps: int,
                         num_stages: int, significance: bool, interpret: bool) -> tuple:
    """The kernel over a grid of (sequence, KV head, block of queries), each tile's rows
    the query heads of its KV head (padded to `heads`) for `block_q` tokens. Returns the
    output [B, T, Hq, D], the kernel's significance outputs of the real query heads
    ([B, Hkv, T * G, ...], empty without `significance`) and the real queries per row."""
    b, t, hq, d = q.shape
    hkv = page_table.shape[1]
    g = hq // hkv
    heads = max(pl.next_power_of_2(g), 16 // block_q)  # rows per query token, padded
    args, q_lengths = _prefill_operands(q, q_positions, q_lengths, tiers, page_table, lengths,
                                        window, window_bounds, heads=heads)
    kernel = functools.partial(_kernel, formats=tuple(x.kv_format for x in tiers), parts=parts,
                               pages_per_block=pages_per_block, block_w=block_w, heads=heads,
                               sm_scale=sm_scale, scores=significance, half=half)
    out, *state = pl.pallas_call(
        kernel,
        grid=(b, hkv, t // block_q),
        **_prefill_specs(q, tiers, page_table, window[0].shape[2], heads=heads,
                         block_q=block_q, significance=significance),
        compiler_params=pl_triton.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name=f"jkv_chunked_prefill_{'_'.join(x.kv_format.name for x in tiers)}"
             f"{'_f16' if half else ''}{'_sig' if significance else ''}",
    )(*args)
    out = out.reshape(b, hkv, t, heads, d)[:, :, :, :g]
    out = out.transpose(0, 2, 1, 3, 4).reshape(b, t, hq, d)
    state = [x.reshape(b, hkv, t, heads, *x.shape[3:])[:, :, :, :g].reshape(
        b, hkv, t * g, *x.shape[3:]) for x in state]  # [B, Hkv, T * G, ...]: real heads
    return out, state, q_lengths


def _prefill_operands(q: jax.Array, q_positions: jax.Array, q_lengths: jax.Array | None,
                      tiers: list, page_table: jax.Array, lengths: tuple, window: tuple,
                      window_bounds: tuple, *, heads: int) -> tuple[list, jax.Array]:
    """The kernel's operands, in the order it pops them (`_prefill_specs` gives their
    blocks), and the real queries per row (T when not given)."""
    b, t, hq, d = q.shape
    hkv = page_table.shape[1]
    g = hq // hkv
    qg = q.reshape(b, t, hkv, g, d).transpose(0, 2, 1, 3, 4)  # [B, Hkv, T, G, D]
    qg = jnp.pad(qg, ((0, 0), (0, 0), (0, 0), (0, heads - g), (0, 0))).reshape(
        b, hkv, t * heads, d)
    args = [qg, q_positions.astype(jnp.int32)]
    for tier in tiers:  # read back by `KVPages.from_operands`
        args += tier.operands()
    if q_lengths is None:
        q_lengths = jnp.full((b,), t, jnp.int32)
    elif q_lengths.shape != (b,):
        raise ValueError(f"q_lengths must be [B={b}], got {q_lengths.shape}")
    bounds = jnp.stack([*window_bounds, q_lengths], axis=-1).astype(jnp.int32)
    lens = jnp.stack(lengths, axis=-1).astype(jnp.int32)
    return args + [page_table.astype(jnp.int32), lens, *window, bounds], q_lengths


def _prefill_specs(q: jax.Array, tiers: list, page_table: jax.Array, tw: int, *, heads: int,
                   block_q: int, significance: bool) -> dict:
    """`pl.pallas_call`'s in_specs, out_specs and out_shape for `_prefill_operands` on the
    grid (sequence, KV head, block of queries): a tile reads its queries, its row of the
    table and window and the whole pools, and writes its rows (and their logits)."""
    b, t, _, d = q.shape
    hkv, w = page_table.shape[1:]
    rows = block_q * heads
    full = lambda x: pl.BlockSpec(x.shape, lambda *_: (0,) * x.ndim)  # noqa: E731
    specs = [pl.BlockSpec((None, None, rows, d), lambda i, h, s: (i, h, s, 0)),
             pl.BlockSpec((None, block_q), lambda i, h, s: (i, s))]
    for tier in tiers:
        specs += [full(x) for x in tier.operands()]
    specs += [pl.BlockSpec((None, None, w), lambda i, h, s: (i, h, 0)),
              pl.BlockSpec((None, None, 2), lambda i, h, s: (i, h, 0)),
              pl.BlockSpec((None, None, tw, d), lambda i, h, s: (i, h, 0, 0)),
              pl.BlockSpec((None, None, tw, d), lambda i, h, s: (i, h, 0, 0)),
              pl.BlockSpec((None, 3), lambda i, h, s: (i, 0))]
    out_specs = [pl.BlockSpec((None, None, rows, d), lambda i, h, s: (i, h, s, 0))]
    out_shape = [jax.ShapeDtypeStruct((b, hkv, t * heads, d), q.dtype)]
    if significance:
        out_specs.append(pl.BlockSpec((None, None, rows, tw), lambda i, h, s: (i, h, s, 0)))
        out_shape.append(jax.ShapeDtypeStruct((b, hkv, t * heads, tw), jnp.float32))
        for _ in range(2):
            out_specs.append(pl.BlockSpec((None, None, rows), lambda i, h, s: (i, h, s)))
            out_shape.append(jax.ShapeDtypeStruct((b, hkv, t * heads), jnp.float32))
        for tier in tiers:
            n = w * tier.page_size
            out_specs.append(pl.BlockSpec((None, None, rows, n), lambda i, h, s: (i, h, s, 0)))
            out_shape.append(jax.ShapeDtypeStruct((b, hkv, t * heads, n), jnp.float32))
    return dict(in_specs=specs, out_specs=out_specs, out_shape=out_shape)


def chunked_prefill_attention_reference(
    q: jax.Array,
    pages: KVPages,
    page_table: jax.Array,
    page_lengths: jax.Array,
    k_window: jax.Array,
    v_window: jax.Array,
    window_start: jax.Array,
    window_len: jax.Array,
    q_positions: jax.Array,
    q_lengths: jax.Array | None = None,
    *,
    sm_scale: float | None = None,
    dtype=jnp.float32,
    low_tier: KVPages | None = None,
    low_lengths: jax.Array | None = None,
    return_significance: bool = False,
):
    """The same function in plain jnp: dequantize every page (the low tier's read right to
    left), append the window, one masked softmax (and, with `return_significance`, each
    key's probabilities' max over its query heads averaged over the real queries that see
    it)."""
    b, t, hq, d = q.shape
    hkv = page_table.shape[1]
    tw = k_window.shape[2]
    sm_scale = 1.0 / math.sqrt(d) if sm_scale is None else sm_scale
    k, v, in_pages, n_high = dequantized_tiers(pages, page_table, page_lengths, low_tier,
                                               low_lengths)  # [B, Hkv, S, D] x 2, [B, Hkv, S]
    k = jnp.concatenate([k, k_window.astype(jnp.float32)], axis=2).astype(dtype)
    v = jnp.concatenate([v, v_window.astype(jnp.float32)], axis=2).astype(dtype)
    s_pages = k.shape[2] - tw
    in_pages = jnp.broadcast_to(in_pages[:, :, None, :], (b, hkv, t, s_pages))
    i = jnp.arange(tw)[None, None, :]
    in_window = (i < window_len[:, None, None]) & (
        window_start[:, None, None] + i <= q_positions[:, :, None])  # [B, T, Tw]
    in_window = jnp.broadcast_to(in_window[:, None], (b, hkv, t, tw))
    visible = jnp.concatenate([in_pages, in_window], axis=-1)[:, :, None]  # [B, Hkv, 1, T, S]
    qg = q.astype(dtype).reshape(b, t, hkv, hq // hkv, d) * sm_scale
    s = jnp.einsum("bthgd,bhsd->bhgts", qg, k, precision=lax.Precision.HIGHEST)
    s = jnp.where(visible, s, -jnp.inf)
    m = s.max(axis=-1, keepdims=True)
    p = jnp.where(visible, jnp.exp(s - jnp.where(jnp.isfinite(m), m, 0.0)), 0.0)
    denom = p.sum(axis=-1, keepdims=True)
    p = p / jnp.where(denom > 0, denom, 1.0)
    out = jnp.einsum("bhgts,bhsd->bthgd", p, v, precision=lax.Precision.HIGHEST)
    if q_lengths is None:
        q_lengths = jnp.full((b,), t, jnp.int32)
    real = jnp.arange(t)[None, :] < q_lengths[:, None]
    out = jnp.where(real[:, :, None, None, None], out, 0.0).reshape(b, t, hq, d)
    if not return_significance:
        return out
    seen = visible[:, :, 0] & real[:, None, :, None]  # [B, Hkv, T, S]
    total = jnp.where(seen, p.max(axis=2), 0.0).sum(axis=2)
    count = seen.sum(axis=2)
    sig = jnp.where(count > 0, total / jnp.maximum(count, 1), 0.0)
    window_sig = sig[..., s_pages:]
    if low_tier is None:
        return out, (sig[..., :s_pages], window_sig)
    return out, (sig[..., :n_high], window_sig, sig[..., n_high:s_pages])
