"""LeanKV's token tiers: which tokens each (slot, layer, KV head) keeps at high precision,
which at low precision and which it prunes (Algorithm 1, both phases), and the compaction
that makes both tiers dense again and gives freed pages back (parallel KV compaction).

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

from jkv.cache.allocator import FreeList, PageTables, allocate, unref
from jkv.pallas_kernels.kv_pages import NULL_PAGE, KVPages

KEEP, LOW, PRUNE = 0, 1, 2  # a token's fate in `place`


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

    high_src: jax.Array  # [..., W * page]
    high_dst: jax.Array
    demote_src: jax.Array  # [..., W * page]
    demote_dst: jax.Array
    low_src: jax.Array  # [..., W * 2 * page]
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


def add_significance(meta: TokenMeta, pages: jax.Array, counts: TierCounts, page: int,
                     high: jax.Array, low: jax.Array) -> TokenMeta:
    """Add one step's significance (per tier slot: high [..., W * page], low [..., W * 2 *
    page]) to the scores of the tokens held."""
    score = meta.score.reshape(-1)
    for sig, count, is_low in ((high, counts.high, False), (low, counts.low, True)):
        addr, held = slot_addresses(pages, count, page, is_low)
        score = score.at[jnp.where(held, addr, score.shape[0])].add(
            sig.astype(jnp.float32), mode="drop")
    return meta.replace(score=score.reshape(meta.score.shape))


def _mean(score: jax.Array, pos: jax.Array, n: jax.Array) -> jax.Array:
    """Average attention a token received: from the n - pos queries at or after it."""
    return score / jnp.maximum(n[..., None] - pos, 1).astype(jnp.float32)


def _argmin(mean: jax.Array, pos: jax.Array, among: jax.Array) -> jax.Array:
    """Index of the lowest mean among `among` (ties: the earliest position) per row."""
    big = jnp.float32(jnp.inf)
    m = jnp.where(among, mean, big)
    lowest = m.min(axis=-1, keepdims=True)
    tied = among & (m == lowest)
    return jnp.argmin(jnp.where(tied, pos, jnp.iinfo(jnp.int32).max), axis=-1)


def place(meta: TokenMeta, pages: jax.Array, counts: TierCounts, n_prev: jax.Array,
          n: jax.Array, prompt: jax.Array, *, page: int, recent: int, alpha_high: jax.Array,
          alpha_low: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Algorithm 1: the fate (KEEP, LOW, PRUNE) of each high slot [..., W * page] and each
    low slot (KEEP, PRUNE) [..., W * 2 * page] of rows whose sequences grew from n_prev to n
    tokens ([...], broadcast against the rows).

    The candidates are the high tokens that left the recent window, positions in
    [n_prev - recent, n - recent). Prompt rows (`prompt`) place each candidate i (1-based
    position) by its mean attention: high above alpha_high / i, low above alpha_low / i,
    pruned below. Generation rows have one candidate, thresholds alpha / n, and then demote
    one victim, the least significant token of the tier the candidate joined: high to low
    or pruned, low to pruned.
    """
    hi_addr, hi_held = slot_addresses(pages, counts.high, page, False)
    lo_addr, lo_held = slot_addresses(pages, counts.low, page, True)
    hi_pos, lo_pos = meta.pos.reshape(-1)[hi_addr], meta.pos.reshape(-1)[lo_addr]
    n = jnp.broadcast_to(n, counts.high.shape)
    n_prev = jnp.broadcast_to(n_prev, counts.high.shape)
    prompt = jnp.broadcast_to(prompt, counts.high.shape)[..., None]
    hi_mean = _mean(meta.score.reshape(-1)[hi_addr], hi_pos, n)
    lo_mean = _mean(meta.score.reshape(-1)[lo_addr], lo_pos, n)
    old = hi_pos < (n - recent)[..., None]
    cand = hi_held & old & (hi_pos >= (n_prev - recent)[..., None])

    # prompt phase: every candidate against alpha / i
    i = (hi_pos + 1).astype(jnp.float32)
    prompt_fate = jnp.where(hi_mean >= alpha_high / i, KEEP,
                            jnp.where(hi_mean >= alpha_low / i, LOW, PRUNE))

    # generation phase: one candidate c against alpha / n, then one victim
    nf = n.astype(jnp.float32)[..., None]
    t_high, t_low = alpha_high / nf, alpha_low / nf
    has_c = cand.any(axis=-1, keepdims=True)
    c_mean = jnp.where(cand, hi_mean, 0.0).sum(axis=-1, keepdims=True)
    c_fate = jnp.where(c_mean >= t_high, KEEP, jnp.where(c_mean >= t_low, LOW, PRUNE))
    # c stays high: the least significant old high token (c included) may go down
    hv = _argmin(hi_mean, hi_pos, hi_held & old)[..., None]
    hv_mean = jnp.take_along_axis(hi_mean, hv, -1)
    hv_fate = jnp.where((t_low <= hv_mean) & (hv_mean < t_high), LOW,  # lines 8-11
                        jnp.where(hv_mean < t_low, PRUNE, KEEP))
    is_hv = jnp.arange(hi_mean.shape[-1]) == hv
    # c joins the low tier: the least significant low token goes if below alpha_low / n (c,
    # at least that significant, never is)
    lv = _argmin(lo_mean, lo_pos, lo_held)[..., None]
    lv_mean = jnp.take_along_axis(lo_mean, lv, -1)
    prune_lv = (has_c & (c_fate == LOW) & lo_held.any(axis=-1, keepdims=True)
                & (lv_mean < t_low))
    gen_hi = jnp.where(cand, c_fate, KEEP)
    gen_hi = jnp.where(has_c & (c_fate == KEEP) & is_hv, hv_fate, gen_hi)
    gen_lo = jnp.where(prune_lv & (jnp.arange(lo_mean.shape[-1]) == lv), PRUNE, KEEP)

    fate_hi = jnp.where(prompt, jnp.where(cand, prompt_fate, KEEP), gen_hi)
    fate_lo = jnp.where(prompt, KEEP, gen_lo)
    return jnp.where(hi_held, fate_hi, KEEP), jnp.where(lo_held, fate_lo, KEEP)


def _fill_plan(keep: jax.Array, n_add: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """A tier of slots [R, C] keeps `keep` and gains n_add [R] tokens, and must end dense in
    [0, new_len): tokens kept at or past new_len move into the vacant slots below it, then
    the additions fill the rest. Returns (new_len [R], mover_dst [R, C]: the slot a kept
    token moves to or -1, add_dst [R, C]: the slot of the r-th addition or -1)."""
    r, c = keep.shape
    j = jnp.arange(c, dtype=jnp.int32)
    new_len = keep.sum(-1, dtype=jnp.int32) + n_add
    displaced = keep & (j >= new_len[:, None])
    vacant = ~keep & (j < new_len[:, None])
    rows = jnp.arange(r)[:, None]
    vac_rank = jnp.cumsum(vacant, -1) - vacant
    by_rank = jnp.full((r, c), -1, jnp.int32).at[
        rows, jnp.where(vacant, vac_rank, c)].set(jnp.broadcast_to(j, (r, c)), mode="drop")
    disp_rank = jnp.cumsum(displaced, -1) - displaced
    mover_dst = jnp.where(displaced, jnp.take_along_axis(by_rank, disp_rank, -1), -1)
    rank = displaced.sum(-1, keepdims=True) + j
    add_dst = jnp.where(j < n_add[:, None],
                        jnp.take_along_axis(by_rank, jnp.clip(rank, 0, c - 1), -1), -1)
    return new_len, mover_dst, add_dst


def _ranked(mask: jax.Array) -> jax.Array:
    """Indices of the set entries of mask [R, C] in order, padded with -1: [R, C]."""
    r, c = mask.shape
    rank = jnp.cumsum(mask, -1) - mask
    return jnp.full((r, c), -1, jnp.int32).at[
        jnp.arange(r)[:, None], jnp.where(mask, rank, c)].set(
        jnp.broadcast_to(jnp.arange(c, dtype=jnp.int32), (r, c)), mode="drop")


def _address(addr: jax.Array, slot: jax.Array) -> jax.Array:
    """addr [R, C] at slots [R, K] (-1 stays -1)."""
    return jnp.where(slot >= 0, jnp.take_along_axis(addr, jnp.maximum(slot, 0), -1), -1)


def compact(free: FreeList, tables: PageTables, counts: TierCounts, fate_hi: jax.Array,
            fate_lo: jax.Array, page: int) -> tuple[FreeList, PageTables, TierCounts,
                                                    TierMoves, jax.Array]:
    """Apply `place`'s fates: demoted tokens join the low tier, pruned ones go, both tiers
    end dense, emptied pages drop their reference and the low tier takes the pages it
    grows by. Returns (free, tables, counts, moves, ok); when the pool cannot give the low
    pages or a row's two sides would meet, nothing changes and ok is False."""
    lead = counts.high.shape
    w = tables.pages.shape[-1]
    flat = lambda x: x.reshape(-1, x.shape[-1])  # noqa: E731
    hi_addr, hi_held = map(flat, slot_addresses(tables.pages, counts.high, page, False))
    lo_addr, lo_held = map(flat, slot_addresses(tables.pages, counts.low, page, True))
    fate_hi, fate_lo = flat(fate_hi), flat(fate_lo)
    demoted = hi_held & (fate_hi == LOW)
    new_hi, hi_mover_dst, _ = _fill_plan(hi_held & (fate_hi == KEEP),
                                         jnp.zeros(hi_addr.shape[0], jnp.int32))
    new_lo, lo_mover_dst, add_dst = _fill_plan(lo_held & (fate_lo == KEEP),
                                               demoted.sum(-1, dtype=jnp.int32))

    old_hp, old_lp = tables.num_pages.reshape(-1), tables.low_pages.reshape(-1)
    new_hp = (new_hi + page - 1) // page
    new_lp = (new_lo + 2 * page - 1) // (2 * page)
    fits = (new_hp + new_lp <= w).all()
    col = jnp.arange(w, dtype=jnp.int32)
    rows = flat(tables.pages)
    from_right = w - 1 - col  # a low page's index at each column
    freed = (((col >= new_hp[:, None]) & (col < old_hp[:, None]))
             | ((from_right >= new_lp[:, None]) & (from_right < old_lp[:, None])))
    after_free = unref(free, jnp.where(freed, rows, NULL_PAGE))
    new_free, ids, ok = allocate(after_free, jnp.where(fits, jnp.maximum(new_lp - old_lp, 0), 0),
                                 w)
    ok = ok & fits
    k = from_right - old_lp[:, None]  # the k-th new low page sits k columns left of the old
    grown = (k >= 0) & (from_right < new_lp[:, None])
    new_rows = jnp.where(freed, NULL_PAGE, rows)
    new_rows = jnp.where(grown, jnp.take_along_axis(ids, jnp.clip(k, 0, w - 1), -1), new_rows)
    new_tables = tables.replace(pages=new_rows.reshape(tables.pages.shape),
                                num_pages=new_hp.reshape(lead), low_pages=new_lp.reshape(lead))
    new_lo_addr = flat(slot_addresses(new_tables.pages, new_lo.reshape(lead), page, True)[0])

    keep_hi = hi_mover_dst >= 0
    keep_lo = lo_mover_dst >= 0
    src_d = _ranked(demoted)
    moves = TierMoves(
        high_src=jnp.where(keep_hi, hi_addr, -1),
        high_dst=_address(hi_addr, hi_mover_dst),  # high destinations keep their pages
        demote_src=_address(hi_addr, src_d),
        demote_dst=_address(new_lo_addr, jnp.where(src_d >= 0, add_dst[:, :src_d.shape[-1]],
                                                   -1)),
        low_src=jnp.where(keep_lo, lo_addr, -1),
        low_dst=_address(new_lo_addr, lo_mover_dst),
    )
    moves = TierMoves(*(jnp.where(ok, m, -1).reshape(*lead, -1) for m in moves))
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
    Every source is read before any destination is written."""
    low_format = pool.kv_format.halved()
    moving = lambda src, dst: (src >= 0) & (dst >= 0)  # noqa: E731
    high = pool.take_tokens(*_slot(moves.high_src, page))
    k, v = pool.take_tokens(*_slot(moves.demote_src, page)).dense()
    demoted = KVPages.from_dense(k, v, low_format)
    low = pool.as_format(low_format).take_tokens(*_slot(moves.low_src, page))
    pool = pool.put_tokens(*_slot(moves.high_dst, page), high,
                           moving(moves.high_src, moves.high_dst))
    out = pool.as_format(low_format)
    out = out.put_tokens(*_slot(moves.low_dst, page), low, moving(moves.low_src, moves.low_dst))
    out = out.put_tokens(*_slot(moves.demote_dst, page), demoted,
                         moving(moves.demote_src, moves.demote_dst))
    return out.as_format(pool.kv_format)


def write_tokens(pool: KVPages, addr: jax.Array, k: jax.Array, v: jax.Array,
                 page: int) -> KVPages:
    """Keys and values [..., D] quantized one token at a time into the high-tier slots at
    meta addresses `addr` [...] (-1: dropped); the format needs per-token scales."""
    tokens = KVPages.from_dense(k[..., None, :], v[..., None, :], pool.kv_format, pool.dtype)
    return pool.put_tokens(*_slot(addr, page), tokens, addr >= 0)
