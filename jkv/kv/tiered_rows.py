"""The tiered-rows layout (LeanKV, and StreamingLLM and H2O on the same machinery): each
(layer, KV head) of a sequence keeps its own tokens in a high tier from the left of its row
and a low tier (the same bytes read at half the bits) from the right, pages taken as they
fill; tokens leaving the recent window are placed (high, low or pruned) by a token policy's
fates (`TierPolicy`).

A tiered row holds no block's every token, so it is not shared by blocks: with prefix caching
on, an ended sequence is kept whole (`tier_entries`) and a prompt sharing all but its last
few blocks opens with a copy of it, cut to the blocks it shares. The store keeps it whole
too, and LayerKV moves a layer of it to the host and back (`row_moves`).
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jkv.kv import tier_step
from jkv.kv.allocator import free_count, release
from jkv.kv.kv_state import KVState, read_only
from jkv.kv.page_cost import PageCost
from jkv.kv.pages import KVPages
from jkv.kv.prefix_cache import block_hashes
from jkv.kv.row_moves import RowMoves
from jkv.kv.sharding import KVPlacement
from jkv.kv.tier_entries import (
    CUT_BLOCKS,
    Entry,
    TierEntries,
    adopt,
    forget,
    init_entries,
    move_row,
    truncate,
)
from jkv.kv.tier_step import Placement, TierPolicy
from jkv.kv.token_tiers import init_counts, init_meta


class _TierState:
    """The tiers' device arrays and their host mirrors (written here only)."""

    meta = counts = entry_tables = entry_counts = high = low = None


class TieredRows:
    """Per-head tiered rows over a `KVState`, and the ended rows kept whole on the device."""

    name = "rows"
    pages_on_fill = True  # the page being filled stays beside the pool
    filling_scores = True
    lossy_recompute = True  # placed per prompt chunk, not as its decode steps placed it

    @staticmethod
    def table_width(pages: int) -> int:
        """Page-table width for rows of at most `pages` pages: room for both sides' partly
        filled pages, a multiple of 32 (a tiered step's work grows with the width)."""
        return -(-(pages + 2) // 32) * 32

    meta = read_only("_t", "meta", "Each page's token metadata (score, pos).")
    counts = read_only("_t", "counts", "Each row's tier counts on the device.")
    entry_tables = read_only("_t", "entry_tables", "Kept rows' page tables.")
    entry_counts = read_only("_t", "entry_counts", "Kept rows' tier counts.")
    high = read_only("_t", "high", "Host mirror of the high tiers' tokens [slots, L, H].")
    low = read_only("_t", "low", "Host mirror of the low tiers' tokens [slots, L, H].")

    def __init__(self, kv: KVState, *, policy: TierPolicy, cost: PageCost, page_size: int,
                 max_pages: int, total_pages: int, one_page: int, enable_prefix_caching: bool,
                 device_cache_bytes: int | None, hash_seed: bytes, max_num_seqs: int,
                 max_model_len: int, placement: KVPlacement) -> None:
        self.kv, self.policy, self.cost, self.page_size = kv, policy, cost, page_size
        self.num_layers, self.num_kv_heads = cost.layers, cost.heads // cost.layers
        self.hash_seed, self.max_model_len = hash_seed, max_model_len
        self.max_num_seqs, self.scratch = max_num_seqs, max_num_seqs
        device = placement.replicated
        shape = (max_num_seqs + 1, self.num_layers, self.num_kv_heads)
        t = self._t = _TierState()
        t.meta = placement.make(lambda: init_meta(kv.pool.num_pages, page_size),
                                placement.pages)
        t.counts = jax.device_put(init_counts(shape), device)
        t.high = np.zeros(shape, np.int64)
        t.low = np.zeros(shape, np.int64)
        self.tier_ok: list[jax.Array] = []  # retier results not yet read
        self.unplaced = np.zeros(max_num_seqs, np.int64)  # decode tokens retier has not seen
        self.prompt_end = np.zeros(max_num_seqs + 1, np.int32)  # each slot's prompt length
        # on the device: where each slot's queries start adding significance (None: at 0)
        self.observe_from = (jax.device_put(np.zeros_like(self.prompt_end), device)
                             if policy.observation_window else None)
        self.tier_refusals = 0  # compactions the pool was too short for
        # the row's KV out of the pool and back: a layer (LayerKV), or whole (the store)
        self.moves = RowMoves(kv, t, self.layer_pages, self.make_room, page_size,
                              self.num_kv_heads)
        self.max_entry_pages = (total_pages if device_cache_bytes is None
                                else device_cache_bytes // one_page)
        self.entries: TierEntries | None = None
        if enable_prefix_caching:
            self.entries = TierEntries(max_num_seqs)
            t.entry_tables, t.entry_counts = jax.device_put(init_entries(
                max_num_seqs, self.num_layers, self.num_kv_heads, max_pages), device)

    # ------------------------------------------------------------------ the budget

    @property
    def evictable_pages(self) -> int:
        """Pages of the rows kept whole (every one can be evicted)."""
        return 0 if self.entries is None else self.entries.pages

    cached_pages = evictable_pages

    @staticmethod
    def seed_tag(policy: TierPolicy) -> bytes:
        """Added to block hashes' seed: stored rows and blocks never match."""
        return f"|{policy.name}".encode()

    @property
    def num_compiles(self) -> int:
        """Compiled variants of the placement call."""
        return tier_step.retier._cache_size()

    def shared_rows(self, slot: int) -> list[int]:
        return []

    def layer_pages(self, slot: int) -> np.ndarray:
        """Pages each layer of `slot` holds [layers] (as of the last step), wherever it is."""
        p, t = self.page_size, self._t
        return (-(-t.high[slot] // p)).sum(-1) + (-(-t.low[slot] // (2 * p))).sum(-1)

    def pages_held(self, slot: int) -> int:
        pages = self.layer_pages(slot)
        return int(pages.sum() - pages[list(self.kv.offloaded.get(slot, ()))].sum())

    def layer_own_pages(self, slot: int, tokens: int | None = None) -> int:
        """The most pages one layer of `slot` holds (no page of a row is shared)."""
        return int(self.layer_pages(slot).max(initial=0))

    pages_offloadable = pages_held

    def pages_freed_by_close(self, slot: int) -> int:
        return self.pages_held(slot)

    def tier_tokens(self, slot: int, tokens: int) -> dict[str, int]:
        """Tokens `slot` keeps per tier, summed over (layer, KV head)."""
        return {"high": int(self._t.high[slot].sum()), "low": int(self._t.low[slot].sum())}

    def lookup(self, hashes: Sequence[bytes]) -> tuple[int, int]:
        """(tokens of `hashes`' longest run of blocks that a kept row holds, at most
        `CUT_BLOCKS` short of its end; pages a copy of the row takes before it is cut)."""
        found = None if self.entries is None else self.entries.lookup(hashes, CUT_BLOCKS)
        if found is None:
            return 0, 0
        row, blocks = found
        return blocks * self.page_size, self.entries.get(row).pages

    def make_room(self, pages: int, keep_entry: int | None = None) -> bool:
        """Evict kept rows (least recently used first; never row `keep_entry`) until `pages`
        pages are free; False if that cannot be done."""
        while self.kv.free_pages < pages and self.entries is not None:
            row = self.entries.oldest(keep=keep_entry)
            if row is None:
                break
            self._drop_entry(row)
        return self.kv.free_pages >= pages

    def _drop_entry(self, row: int) -> None:
        """Release a kept row's pages (no table shares them)."""
        kv, t = self.kv, self._t
        mask = np.zeros(self.entries.rows, bool)
        mask[row] = True
        kv.free, t.entry_tables = release(kv.free, t.entry_tables, jnp.asarray(mask))
        t.entry_tables, t.entry_counts = forget(t.entry_tables, t.entry_counts, np.int32(row))
        kv.free_pages += self.entries.remove(row).pages

    # ------------------------------------------------------------------ sequences

    def open(self, slot: int, hashes: Sequence[bytes], prompt_tokens: int) -> int:
        """Start the empty `slot` for a prompt of `prompt_tokens` from the kept row holding
        the longest run of `hashes` (the prompt's block hashes; `lookup`), if one is kept: a
        copy of it, or when its pages cannot be had besides it, the row itself (it is no
        longer kept), cut to that run. Returns the tokens held."""
        self.prompt_end[slot] = prompt_tokens
        if self.policy.observation_window:  # (sent once here, not at every model call)
            self.observe_from = jax.device_put(
                np.maximum(self.prompt_end - self.policy.observation_window, 0),
                self.observe_from.sharding)
        found = None if self.entries is None else self.entries.lookup(hashes, CUT_BLOCKS)
        if found is None:
            return 0
        kv, t = self.kv, self._t
        row, blocks = found
        entry = self.entries.get(row)
        self.entries.touch(row)
        others = self.evictable_pages - entry.pages  # evictable besides it
        if (kv.free_pages + others < entry.pages  # no copy: evict nothing, take it over
                or not self.make_room(entry.pages, keep_entry=row)):
            t.entry_tables, t.entry_counts, kv.tables, t.counts = move_row(
                t.entry_tables, t.entry_counts, kv.tables, t.counts, np.int32(row),
                np.int32(slot), np.int32(entry.tokens))
            self.entries.remove(row)
        else:
            (kv.pool, t.meta, kv.free, kv.tables, t.counts, ok) = adopt(
                kv.pool, t.meta, kv.free, kv.tables, t.counts, t.entry_tables,
                t.entry_counts, np.int32(row), np.int32(slot))
            if not bool(ok):
                raise RuntimeError("copying a kept sequence failed although the host count "
                                   "allowed it")
            kv.free_pages -= entry.pages
        t.high[slot], t.low[slot] = entry.high, entry.low
        tokens = blocks * self.page_size
        if tokens < entry.tokens:
            self._cut(slot, tokens)
        return tokens

    def _cut(self, slot: int, tokens: int) -> None:
        """Cut the row opened in `slot` to its first `tokens` positions (`truncate`); its
        tier counts and the pages it frees read back."""
        kv, t = self.kv, self._t
        (kv.pool, t.meta, kv.free, kv.tables, t.counts, ok) = truncate(
            kv.pool, t.meta, kv.free, kv.tables, t.counts, np.int32(slot), np.int32(tokens),
            max_moves=CUT_BLOCKS * self.page_size)
        ok, high, low = jax.device_get((ok, t.counts.high[slot], t.counts.low[slot]))
        if not bool(ok):
            raise RuntimeError("cutting a kept sequence failed although it lost no more "
                               "tokens than it held")
        held = self.pages_held(slot)
        t.high[slot], t.low[slot] = high.astype(np.int64), low.astype(np.int64)
        kv.free_pages += held - self.pages_held(slot)

    def grow(self, new_lengths: dict[int, int], need: int) -> jax.Array:
        """The tokens of pages the step fills join the high tiers (`need` pages, made room
        for); returns the device's ok flag."""
        kv, t, p = self.kv, self._t, self.page_size
        lengths = np.zeros(self.max_num_seqs + 1, np.int32)
        for s, n in new_lengths.items():
            lengths[s] = n
        held = np.array([len(x) for x in kv.slot_tokens] + [0])
        n_new = np.where(lengths > 0, (lengths // p - held // p) * p, 0)
        resident = np.ones((self.max_num_seqs + 1, self.num_layers), bool)
        for s, layers in kv.offloaded.items():
            resident[s, list(layers)] = False
        kv.free, kv.tables, t.counts, ok = tier_step.grow(
            kv.free, kv.tables, t.counts, jnp.asarray(n_new, jnp.int32), jnp.asarray(resident))
        t.high += n_new[:, None, None]
        kv.free_pages -= need
        return ok

    def close(self, slot: int, shareable: int, keep: bool) -> None:
        """End the sequence in `slot`: with prefix caching on and `keep`, its full pages'
        row is kept whole (evictable); else its pages are released."""
        kv, t = self.kv, self._t
        if (self.entries is not None and keep and len(kv.slot_tokens[slot]) >= self.page_size
                and slot not in kv.offloaded):  # (a row is kept whole, in the pool)
            self._keep(slot)
        else:
            mask = np.zeros(self.max_num_seqs + 1, bool)
            mask[slot] = True
            kv.free, kv.tables = release(kv.free, kv.tables, jnp.asarray(mask))
            t.counts = tier_step.clear(t.counts, jnp.asarray(mask))
            kv.free_pages += self.pages_held(slot)
        t.high[slot], t.low[slot] = 0, 0
        self.unplaced[slot] = 0

    def _keep(self, slot: int) -> None:
        """Move the row in `slot` (its full pages' tokens) to an entry row. An entry of the
        same tokens is dropped first, and the least recently used one when no row is
        spare; then the oldest while the kept pages exceed the device cache's budget."""
        kv, t = self.kv, self._t
        n = len(kv.slot_tokens[slot]) // self.page_size * self.page_size
        hashes = tuple(block_hashes(kv.slot_tokens[slot], self.page_size, self.hash_seed))
        same = self.entries.row_of(hashes[-1])
        if same is not None:  # the same tokens kept before: the newer compression replaces it
            self._drop_entry(same)
        if self.entries.spare_row() is None:
            self._drop_entry(self.entries.oldest())
        row = self.entries.spare_row()
        kv.tables, t.counts, t.entry_tables, t.entry_counts = move_row(
            kv.tables, t.counts, t.entry_tables, t.entry_counts, np.int32(slot),
            np.int32(row), np.int32(n))
        self.entries.add(row, Entry(hashes, n, self.pages_held(slot), t.high[slot].copy(),
                                    t.low[slot].copy()))
        while self.entries.pages > self.max_entry_pages:
            self._drop_entry(self.entries.oldest())

    # ------------------------------------------------------------------ the model's calls

    def model_tiers(self) -> tuple:
        """What a model call reads and writes of the tiers: (meta, counts, the position from
        which each slot's queries add significance: None, every query)."""
        return self._t.meta, self._t.counts, self.observe_from

    def took_meta(self, meta: object) -> None:
        """A model call's token metadata (the step's significance added)."""
        self._t.meta = meta

    def placement(self, slots: Sequence[int], added: Sequence[int], rows: int, tokens: int,
                  generation: bool) -> Placement | None:
        """The placement (Algorithm 1 and compaction, `tier_step.retier`) due after a model
        call over `slots`, which hold the tokens of `slot_tokens` and the `added` ones the
        call feeds; `rows` and `tokens` are the call's padded shape. None: none is due.

        After decode calls (`generation`) a slot is placed once it has `interval` tokens
        not yet placed, its own count, whatever its neighbours' (a sequence's compression
        does not depend on what it is batched with): the pass over every held token's
        attention is what placement costs, whether one token leaves the window or `interval`
        do. Tokens a sequence ends with unplaced stay in the high tier. With no slots
        (warmup) one is due, to compile."""
        p = self.policy
        placed = list(zip(slots, added, strict=True))
        if generation:
            self.unplaced[list(slots)] += 1
            placed = [(s, a) for s, a in placed if self.unplaced[s] >= p.interval]
            if slots and not placed:
                return None
        n_prev, n = np.zeros(rows, np.int32), np.zeros(rows, np.int32)
        index = np.full(rows, self.scratch, np.int32)
        for i, (s, a) in enumerate(placed):
            held = len(self.kv.slot_tokens[s])
            index[i], n[i] = s, held + a
            n_prev[i] = held + (a if generation else 0) - self.unplaced[s]
            self.unplaced[s] = 0
        moves = (p.interval if generation else self.max_model_len if p.whole_row_moves
                 else tokens + p.interval - 1)
        return Placement(index, n_prev, n, moves, generation)

    def place(self, plan: Placement | None, live: np.ndarray | None = None,
              pool: KVPages | None = None, meta: object = None) -> tuple:
        """Run `plan` on its rows' layers where `live` [rows, layers] is set (default: those
        in the pool); dispatched, not awaited (`after_step` reads what it did). `pool` and
        `meta`: a call's own, under way (returned); None: the state's."""
        if plan is None:
            return pool, meta
        kv, t, p = self.kv, self._t, self.policy
        if live is None:
            live = np.ones((len(plan.index), self.num_layers), bool)
            for i, s in enumerate(plan.index):
                live[i, list(kv.offloaded.get(int(s), ()))] = False
        own = pool is None
        (pool, meta, kv.free, kv.tables, t.counts, ok) = tier_step.retier(
            kv.pool if own else pool, t.meta if own else meta, kv.free, kv.tables, t.counts,
            jnp.asarray(plan.index), jnp.asarray(plan.n_prev), jnp.asarray(plan.n),
            jnp.asarray(self.prompt_end[plan.index]), jnp.asarray(p.knobs, jnp.float32),
            jnp.asarray(live), fates=p.fates, recent=p.recent_window,
            max_moves=plan.max_moves, generation=plan.generation,
            max_tokens=self.max_model_len)
        self.tier_ok.append(ok)
        if own:
            kv.pool, t.meta = pool, meta
        return pool, meta

    def after_call(self, plan: Placement | None) -> None:
        """After a model call: its placement, on the layers in the pool (a layer on the host
        was placed while it was in: `row_moves`)."""
        self.place(plan)

    def after_step(self) -> None:
        """Read back what the step's placements did: tier counts and free pages."""
        kv, t = self.kv, self._t
        oks, high, low, num_free = jax.device_get((self.tier_ok, t.counts.high,
                                                  t.counts.low, kv.free.num_free))
        self.tier_refusals += sum(not bool(ok) for ok in oks)
        self.tier_ok = []
        t.high, t.low = high.astype(np.int64), low.astype(np.int64)
        kv.free_pages = free_count(num_free)

    def warmup(self) -> None:
        """Compile the calls that grow, end, keep, copy, cut and drop tiered sequences, on
        empty rows (the scratch slot and a spare entry row): nothing changes. Then read back
        the counts."""
        kv, t, none = self.kv, self._t, np.zeros(self.max_num_seqs + 1, bool)
        self.grow({}, 0)
        kv.free, kv.tables = release(kv.free, kv.tables, jnp.asarray(none))
        t.counts = tier_step.clear(t.counts, jnp.asarray(none))
        (kv.pool, t.meta, kv.free, kv.tables, t.counts, _) = truncate(
            kv.pool, t.meta, kv.free, kv.tables, t.counts, np.int32(self.scratch), np.int32(0),
            max_moves=CUT_BLOCKS * self.page_size)
        if self.entries is not None and self.entries.spare_row() is not None:
            kv, t = self.kv, self._t
            row, slot = np.int32(self.entries.spare_row()), np.int32(self.scratch)
            (kv.pool, t.meta, kv.free, kv.tables, t.counts, _) = adopt(
                kv.pool, t.meta, kv.free, kv.tables, t.counts, t.entry_tables,
                t.entry_counts, row, slot)
            kv.tables, t.counts, t.entry_tables, t.entry_counts = move_row(
                kv.tables, t.counts, t.entry_tables, t.entry_counts, slot, row,
                np.int32(0))  # there and back
            t.entry_tables, t.entry_counts, kv.tables, t.counts = move_row(
                t.entry_tables, t.entry_counts, kv.tables, t.counts, row, slot, np.int32(0))
            kv.free, t.entry_tables = release(kv.free, t.entry_tables,
                                              jnp.zeros(self.entries.rows, bool))
            t.entry_tables, t.entry_counts = forget(t.entry_tables, t.entry_counts, row)
        self.after_step()
