"""LeanKV's token tiers: each (slot, layer, KV head) keeps tokens at high precision and at
low precision, and prunes the others as a token policy's fates say (`jkv.policies`: LeanKV's
Algorithm 1, the pruning baselines); the compaction here makes both tiers dense again and
gives freed pages back (parallel KV compaction).

A page-table row is bidirectional (`PageTables`): high pages from the left hold the high
tier's tokens in slots [0, high) (slot j: column j // page, offset j % page), low pages from
the right hold the low tier's in slots [0, low) (slot j: column W - 1 - j // low_page). A low
page is a high page's bytes read at half the bits with twice the tokens (`low_page = 2 *
page`), so both tiers come out of one pool and one free list. A tier's tokens are in no
particular order (keys are stored rotated, so attention needs none): each slot carries its
token's position and the attention it has received so far (`TokenMeta`, indexed by page id
like the pages). A token enters the high tier when its page fills; the newest `recent`
tokens are never demoted or pruned.

Everything is whole-array jnp over all rows at once (no loop per head): decisions are
elementwise with masked reductions along a row, moves are ranked with prefix sums, pages
are freed and taken through the circular free list. The tokens follow `TierMoves`: their
metadata (`move_tokens`) and their K/V in the pool (`move_pages`).

Pages a row shares with another holder (a prefix-cache block) must not be compacted: the
caller keeps shared prefixes out of the tiers.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import struct
from jax import lax

from jkv.kv.allocator import FreeList, PageTables, allocate, unref
from jkv.kv.pages import NULL_PAGE, KVPages

KEEP, LOW, PRUNE = 0, 1, 2  # a token's fate, as a token policy's `fates` gives it


@struct.dataclass
class TokenMeta:
    """Per token slot of every page: [P, 2 * page] (a high page uses the first `page`)."""

    score: jax.Array  # float32: the attention the token received, summed over its queries
    pos: jax.Array  # int32: the token's position in its sequence


@struct.dataclass
class TierCounts:
    """Tokens each (slot, layer, KV head) holds per tier: int32 [S, L, H] each."""

    high: jax.Array
    low: jax.Array


class TierMoves(NamedTuple):
    """Token moves of one compaction as meta addresses (page * 2 * page_size + offset; -1:
    none), sources read before any destination is written. `high` moves within the high
    tier, `demote` from a high slot to a low one (requantized), `low` within the low tier."""

    high_src: jax.Array  # [..., max_moves] each
    high_dst: jax.Array
    demote_src: jax.Array
    demote_dst: jax.Array
    low_src: jax.Array
    low_dst: jax.Array


def init_meta(num_pages: int, page_size: int) -> TokenMeta:
    return TokenMeta(score=jnp.zeros((num_pages, 2 * page_size), jnp.float32),
                     pos=jnp.zeros((num_pages, 2 * page_size), jnp.int32))


def init_counts(shape: tuple[int, ...]) -> TierCounts:
    return TierCounts(high=jnp.zeros(shape, jnp.int32), low=jnp.zeros(shape, jnp.int32))


def slot_addresses(pages: jax.Array, count: jax.Array, page: int,
                   low: bool) -> tuple[jax.Array, jax.Array]:
    """Meta addresses of a tier's slots [..., W * page] (low: [..., W * 2 * page]) and which
    of them hold a token (slot < count)."""
    w = pages.shape[-1]
    per = 2 * page if low else page
    j = jnp.arange(w * per, dtype=jnp.int32)
    col = (w - 1 - j // per) if low else j // per
    ids = jnp.take(pages, col, axis=-1)
    return ids * (2 * page) + j % per, j < count[..., None]


def grow_high(free: FreeList, tables: PageTables, counts: TierCounts, n_new: jax.Array,
              page: int, max_new: int) -> tuple[FreeList, PageTables, TierCounts, jax.Array,
                                                jax.Array]:
    """Make room for n_new [...] tokens (at most `max_new`) at the end of each row's high
    tier: (free, tables, counts, their meta addresses [..., max_new] (-1 past n_new), ok).
    When the pool is short or a row's sides would meet nothing changes and ok is False."""
    w = tables.pages.shape[-1]
    high = counts.high + n_new
    want = (high + page - 1) // page
    fits = (want + tables.low_pages <= w).all()
    need = jnp.where(fits, jnp.maximum(want - tables.num_pages, 0), 0)
    new_free, ids, ok = allocate(free, need, w)
    ok = ok & fits
    k = jnp.arange(w, dtype=jnp.int32) - tables.num_pages[..., None]
    grown = (k >= 0) & (k < need[..., None]) & ok
    pages = jnp.where(grown, jnp.take_along_axis(ids, jnp.clip(k, 0, w - 1), -1), tables.pages)
    new_tables = tables.replace(pages=pages,
                                num_pages=jnp.where(ok, tables.num_pages + need, tables.num_pages))
    slot = counts.high[..., None] + jnp.arange(max_new, dtype=jnp.int32)
    col = jnp.clip(slot // page, 0, w - 1)
    addr = jnp.take_along_axis(new_tables.pages, col, -1) * (2 * page) + slot % page
    addr = jnp.where((jnp.arange(max_new) < n_new[..., None]) & ok, addr, -1)
    return (new_free, new_tables, counts.replace(high=jnp.where(ok, high, counts.high)), addr,
            ok)


def write_meta(meta: TokenMeta, addr: jax.Array, pos: jax.Array, score: jax.Array) -> TokenMeta:
    """Set the position and score of the tokens at meta addresses `addr` (-1: none)."""
    dest = jnp.where(addr >= 0, addr, meta.score.size).reshape(-1)

    def put(x: jax.Array, new: jax.Array) -> jax.Array:
        new = jnp.broadcast_to(new, addr.shape).reshape(-1).astype(x.dtype)
        return x.reshape(-1).at[dest].set(new, mode="drop").reshape(x.shape)

    return TokenMeta(score=put(meta.score, score), pos=put(meta.pos, pos))


def _tier_slots(by_page: jax.Array, page: int) -> tuple[jax.Array, jax.Array]:
    """Per-page values of a row's columns [..., W, 2 * page] in each tier's slot order:
    (high [..., W * page], low [..., W * 2 * page])."""
    *lead, w, _ = by_page.shape
    return (by_page[..., :page].reshape(*lead, w * page),
            by_page[..., ::-1, :].reshape(*lead, w * 2 * page))


def _row_meta(x: jax.Array, pages: jax.Array, page: int,
              max_tokens: int | None = None) -> tuple[jax.Array, jax.Array]:
    """Metadata array x [P, 2 * page] of every row's slots, one gather of whole pages; with
    `max_tokens` (the most a row's tier holds) only the columns such a tier can reach: the
    first slots [..., max_tokens rounded up to pages] of each tier."""
    w = pages.shape[-1]
    if max_tokens is None:
        return _tier_slots(x[pages], page)
    nh, nl = min(w, -(-max_tokens // page)), min(w, -(-max_tokens // (2 * page)))
    return (_tier_slots(x[pages[..., :nh]], page)[0],
            _tier_slots(x[pages[..., w - nl:]], page)[1])


def add_significance(meta: TokenMeta, pages: jax.Array, counts: TierCounts, page: int,
                     high: jax.Array, low: jax.Array) -> TokenMeta:
    """Add one step's significance (per tier slot: high [..., W * page], low [..., W * 2 *
    page]) to the scores of the tokens held: one scatter of whole pages."""
    *lead, w = pages.shape
    j = jnp.arange(w * page)
    high = jnp.where(j < counts.high[..., None], high, 0.0).reshape(*lead, w, page)
    high = jnp.concatenate([high, jnp.zeros_like(high)], -1)
    low = jnp.where(jnp.arange(2 * w * page) < counts.low[..., None], low, 0.0)
    low = low.reshape(*lead, w, 2 * page)[..., ::-1, :]
    col = jnp.arange(w)
    is_low = col >= w - (counts.low[..., None] + 2 * page - 1) // (2 * page)
    is_high = col < (counts.high[..., None] + page - 1) // page
    by_page = jnp.where(is_low[..., None], low, high).astype(jnp.float32)
    dest = jnp.where(is_low | is_high, pages, meta.score.shape[0])
    return meta.replace(score=meta.score.at[dest].add(by_page, mode="drop"))


def _mean(score: jax.Array, pos: jax.Array, n: jax.Array) -> jax.Array:
    """Average attention a token received: from the n - pos queries at or after it."""
    return score / jnp.maximum(n[..., None] - pos, 1).astype(jnp.float32)


def read_rows(meta: TokenMeta, pages: jax.Array, counts: TierCounts, n_prev: jax.Array,
               n: jax.Array, *, page: int, recent: int, sinks: jax.Array | int = 0,
               max_tokens: int | None = None) -> dict:
    """Every row's tokens as Algorithm 1 sees them: positions, mean attention and which
    slots hold a token, per tier in slot order, and the candidates (high tokens that left
    the recent window, positions in [n_prev - recent, n - recent)). With `max_tokens` (no
    tier of a row holds more) only the slots [..., :max_tokens rounded up to pages] of each
    tier: the fates built from them are that wide too (`compact` takes any width)."""
    hi_pos, lo_pos = _row_meta(meta.pos, pages, page, max_tokens)
    hi_score, lo_score = _row_meta(meta.score, pages, page, max_tokens)
    n = jnp.broadcast_to(n, counts.high.shape)
    n_prev = jnp.broadcast_to(n_prev, counts.high.shape)
    hi_held = jnp.arange(hi_pos.shape[-1]) < counts.high[..., None]
    old = (hi_pos < (n - recent)[..., None]) & (hi_pos >= sinks)  # sinks: never candidates
    return dict(hi_mean=_mean(hi_score, hi_pos, n), hi_score=hi_score, hi_pos=hi_pos,
                hi_held=hi_held,
                lo_mean=_mean(lo_score, lo_pos, n), lo_pos=lo_pos,
                lo_held=jnp.arange(lo_pos.shape[-1]) < counts.low[..., None], n=n,
                old=hi_held & old, cand=hi_held & old & (hi_pos >= (n_prev - recent)[..., None]))


def _first(mask: jax.Array, k: int) -> jax.Array:
    """Indices of the first k set entries of each row of mask [R, C], in order, padded with
    -1: [R, k]. A few: picked one at a time; many: a top-k of the set indices."""
    r, c = mask.shape
    j = jnp.arange(c, dtype=jnp.int32)
    if k > 4:  # the k smallest set indices (float32: XLA's TopK, exact below 2**24)
        first = -lax.top_k(-jnp.where(mask, j.astype(jnp.float32), jnp.inf), min(k, c))[0]
        first = jnp.where(first < c, first, -1).astype(jnp.int32)
        return jnp.pad(first, ((0, 0), (0, k - first.shape[1])), constant_values=-1)
    out = []
    for _ in range(k):
        i = jnp.argmax(mask, -1).astype(jnp.int32)
        out.append(jnp.where(mask.any(-1), i, -1))
        mask = mask & (j > i[:, None])
    return jnp.stack(out, -1)


def _addresses(pages: jax.Array, slots: jax.Array, page: int, low: bool) -> jax.Array:
    """Meta addresses of tier slots [R, K] (-1 stays -1) through page-table rows [R, W]."""
    w = pages.shape[-1]
    per = 2 * page if low else page
    s = jnp.maximum(slots, 0)
    col = (w - 1 - s // per) if low else s // per
    ids = jnp.take_along_axis(pages, jnp.clip(col, 0, w - 1), -1)
    return jnp.where(slots >= 0, ids * (2 * page) + s % per, -1)


def _repage(free: FreeList, tables: PageTables, rows: jax.Array, new_hi: jax.Array,
            new_lo: jax.Array, lost_hi: jax.Array, lost_lo: jax.Array, page: int,
            k: int) -> tuple[FreeList, jax.Array, jax.Array, jax.Array, jax.Array]:
    """`compact`'s page changes, apart from its token moves: the page-table rows [R, W] of
    tiers shrunk to new_hi / new_lo tokens (at most k // page + 1 pages leave each side, as
    many join the low side). Returns (free, rows, high pages, low pages, ok)."""
    w = tables.pages.shape[-1]
    old_hp, old_lp = tables.num_pages.reshape(-1), tables.low_pages.reshape(-1)
    new_hp = (new_hi + page - 1) // page
    new_lp = (new_lo + 2 * page - 1) // (2 * page)
    kp = k // page + 1
    i = jnp.arange(kp, dtype=jnp.int32)
    hi_cols = new_hp[:, None] + i  # columns the high side may give up
    lo_idx = new_lp[:, None] + i  # low pages (from the right) the low side may give up
    hi_gone = hi_cols < old_hp[:, None]
    lo_gone = lo_idx < old_lp[:, None]
    hi_cols, lo_cols = jnp.clip(hi_cols, 0, w - 1), jnp.clip(w - 1 - lo_idx, 0, w - 1)
    gone = jnp.concatenate([jnp.where(hi_gone, jnp.take_along_axis(rows, hi_cols, -1), 0),
                            jnp.where(lo_gone, jnp.take_along_axis(rows, lo_cols, -1), 0)], -1)
    fits = ((new_hp + new_lp <= w) & (lost_hi <= k) & (lost_lo <= k)).all()
    grow = jnp.where(fits, jnp.clip(new_lp - old_lp, 0, kp), 0)
    new_free, ids, ok = allocate(unref(free, gone), grow, kp)
    ok = ok & fits
    new_cols = jnp.clip(w - 1 - (old_lp[:, None] + i), 0, w - 1)
    r = jnp.arange(rows.shape[0])[:, None]
    new_rows = rows.at[r, jnp.where(hi_gone, hi_cols, w)].set(NULL_PAGE, mode="drop")
    new_rows = new_rows.at[r, jnp.where(lo_gone, lo_cols, w)].set(NULL_PAGE, mode="drop")
    new_rows = new_rows.at[r, jnp.where(i < grow[:, None], new_cols, w)].set(ids, mode="drop")
    return new_free, new_rows, new_hp, new_lp, ok


def _moves(rows: jax.Array, new_rows: jax.Array, movers: jax.Array, holes: jax.Array,
           demoted: jax.Array, dem_dst: jax.Array, lo_movers: jax.Array, lo_holes: jax.Array,
           page: int) -> TierMoves:
    """`compact`'s token moves as meta addresses: sources through the rows as they were,
    destinations in the low tier through the rows as they are after its page changes."""
    return TierMoves(
        high_src=_addresses(rows, movers, page, False),
        high_dst=_addresses(rows, holes, page, False),  # holes stay in kept pages
        demote_src=_addresses(rows, demoted, page, False),
        demote_dst=_addresses(new_rows, dem_dst, page, True),
        low_src=_addresses(rows, lo_movers, page, True),
        low_dst=_addresses(new_rows, lo_holes, page, True),
    )


def compact(free: FreeList, tables: PageTables, counts: TierCounts, fate_hi: jax.Array,
            fate_lo: jax.Array, page: int, max_moves: int) -> tuple[
                FreeList, PageTables, TierCounts, TierMoves, jax.Array]:
    """Apply `place`'s or `place_generation`'s fates: demoted tokens join the low tier,
    pruned ones go, both tiers end dense (the tier's last tokens fill the holes), emptied
    pages drop their reference and the low tier takes the pages it grows by. A row may lose
    at most `max_moves` tokens per tier (static: the most tokens the rows grew by since
    their last placement, each of which takes at most one victim along), so moves and page
    changes are [..., max_moves]-sized. Returns (free, tables, counts, moves, ok); when a
    row would lose more, the pool cannot give the low pages or a row's two sides would
    meet, nothing changes and ok is False."""
    lead = counts.high.shape
    k = max_moves
    # the fates once, not fused again into each of their uses (their gathers are the cost)
    fate_hi, fate_lo = lax.optimization_barrier((fate_hi, fate_lo))
    flat = lambda x: x.reshape(-1, x.shape[-1])  # noqa: E731
    rows = flat(tables.pages)
    fate_hi, fate_lo = flat(fate_hi), flat(fate_lo)
    hi, lo = counts.high.reshape(-1), counts.low.reshape(-1)
    jh = jnp.arange(fate_hi.shape[-1], dtype=jnp.int32)
    jl = jnp.arange(fate_lo.shape[-1], dtype=jnp.int32)
    hi_held, lo_held = jh < hi[:, None], jl < lo[:, None]

    # the high tier: its last kept tokens fill the holes below its new length
    keep = hi_held & (fate_hi == KEEP)
    new_hi = keep.sum(-1, dtype=jnp.int32)
    lost_hi = hi - new_hi
    holes = _first(~keep & (jh < new_hi[:, None]), k)
    movers = _first(keep & (jh >= new_hi[:, None]), k)
    demoted = _first(hi_held & (fate_hi == LOW), k)
    n_dem = (demoted >= 0).sum(-1, dtype=jnp.int32)
    # the low tier: the same, then the demoted tokens fill the rest
    keep_lo = lo_held & (fate_lo == KEEP)
    new_lo = keep_lo.sum(-1, dtype=jnp.int32) + n_dem
    lost_lo = lo - keep_lo.sum(-1, dtype=jnp.int32)
    lo_movers = _first(keep_lo & (jl >= new_lo[:, None]), k)
    vacant = _first(~keep_lo & (jl < new_lo[:, None]), 2 * k)
    n_lo_movers = (lo_movers >= 0).sum(-1, keepdims=True, dtype=jnp.int32)
    lo_holes = jnp.where(lo_movers >= 0, vacant[:, :k], -1)
    at = jnp.clip(n_lo_movers + jnp.arange(k), 0, 2 * k - 1)
    dem_dst = jnp.where(demoted >= 0, jnp.take_along_axis(vacant, at, -1), -1)

    new_free, new_rows, new_hp, new_lp, ok = _repage(free, tables, rows, new_hi, new_lo,
                                                     lost_hi, lost_lo, page, k)
    new_tables = tables.replace(pages=new_rows.reshape(tables.pages.shape),
                                num_pages=new_hp.reshape(lead), low_pages=new_lp.reshape(lead))

    moves = _moves(rows, new_rows, movers, holes, demoted, dem_dst, lo_movers, lo_holes, page)
    moves = TierMoves(*(jnp.where(ok, m, -1).reshape(*lead, k) for m in moves))
    new_counts = TierCounts(high=new_hi.reshape(lead), low=new_lo.reshape(lead))
    pick = lambda a, b: jax.tree.map(lambda x, y: jnp.where(ok, x, y), a, b)  # noqa: E731
    return (pick(new_free, free), pick(new_tables, tables), pick(new_counts, counts), moves,
            ok)


def move_tokens(meta: TokenMeta, moves: TierMoves) -> TokenMeta:
    """The metadata of moved tokens at their new slots (every source read first)."""
    src = jnp.concatenate([m.reshape(-1) for m in moves[0::2]])
    dst = jnp.concatenate([m.reshape(-1) for m in moves[1::2]])
    size = meta.score.size
    read = jnp.maximum(src, 0)
    dest = jnp.where((src >= 0) & (dst >= 0), dst, size)

    def move(x: jax.Array) -> jax.Array:
        v = x.reshape(-1)
        return v.at[dest].set(v[read], mode="drop").reshape(x.shape)

    return TokenMeta(score=move(meta.score), pos=move(meta.pos))


def _slot(addr: jax.Array, page: int) -> tuple[jax.Array, jax.Array]:
    """Meta addresses -> (page id, offset) (-1 -> the null page)."""
    addr = jnp.maximum(addr, 0)
    return addr // (2 * page), addr % (2 * page)


def move_pages(pool: KVPages, moves: TierMoves, page: int) -> KVPages:
    """The pool (in a halvable format, `KVFormat.halved`) with one compaction's tokens moved:
    bit for bit within a tier, dequantized and requantized at half the bits when demoted.

    Every write goes through the low tier's view of the pool, where a high token's bytes are
    two consecutive rows, as one scatter per array after every read: a donated pool is
    updated in place (a write through each view in turn makes XLA copy the pool)."""
    if not pool.kv_format.halvable:  # one tier (pruning only): no token is demoted
        ids, off = _slot(moves.high_src, page)
        ok = (moves.high_src >= 0) & (moves.high_dst >= 0)
        return pool.put_tokens(*_slot(moves.high_dst, page), pool.take_tokens(ids, off), ok)
    low_format = pool.kv_format.halved()
    low_view = pool.as_format(low_format)

    def two_rows(addr: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        ids, off = _slot(addr, page)
        return (jnp.stack([ids, ids], -1), jnp.stack([2 * off, 2 * off + 1], -1),
                jnp.stack([addr >= 0] * 2, -1))

    hs_ids, hs_off, hs_ok = two_rows(moves.high_src)
    hd_ids, hd_off, hd_ok = two_rows(moves.high_dst)
    ls_ids, ls_off = _slot(moves.low_src, page)
    ld_ids, ld_off = _slot(moves.low_dst, page)
    dd_ids, dd_off = _slot(moves.demote_dst, page)
    flat = lambda *xs: jnp.concatenate([x.reshape(-1) for x in xs])  # noqa: E731
    copied = low_view.take_tokens(flat(hs_ids, ls_ids), flat(hs_off, ls_off))
    k, v = pool.take_tokens(*_slot(moves.demote_src, page)).dense()
    demoted = KVPages.from_dense(k, v, low_format)
    tokens = jax.tree.map(
        lambda a, b: jnp.concatenate([a, b.reshape(-1, *b.shape[-2:])]), copied, demoted)
    where = flat(hs_ok & hd_ok, (moves.low_src >= 0) & (moves.low_dst >= 0),
                 (moves.demote_src >= 0) & (moves.demote_dst >= 0))
    out = low_view.put_tokens(flat(hd_ids, ld_ids, dd_ids), flat(hd_off, ld_off, dd_off),
                              tokens, where)
    return out.as_format(pool.kv_format)


def write_tokens(pool: KVPages, addr: jax.Array, k: jax.Array, v: jax.Array,
                 page: int) -> KVPages:
    """Keys and values [..., D] quantized one token at a time into the high-tier slots at
    meta addresses `addr` [...] (-1: dropped); the format needs per-token scales."""
    tokens = KVPages.from_dense(k[..., None, :], v[..., None, :], pool.kv_format, pool.dtype)
    return pool.put_tokens(*_slot(addr, page), tokens, addr >= 0)
