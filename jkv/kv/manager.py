"""The KV cache manager: the page pool and everything that says who holds which page.

One owner of the page budget. It holds the pool (`KVPages`), the filling pages, the free list
with its reference counts and the page tables (`allocator`), the device prefix cache (its
host index and the device array of its blocks' page ids) and the sequence slots with the
tokens each holds. The engine asks it for room before a step; the scheduler's plan asks its
`cost` how many pages tokens take; neither computes page counts another way.

A host count of free pages mirrors the device free list so that planning never waits for
the device: pages only become shared between a slot and the prefix cache (imported on
`open`, exported on `close`), so which pages a release frees is known here exactly.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import jax
import jax.numpy as jnp
import numpy as np

from jkv.kv import tier_step
from jkv.kv.allocator import (
    drop_blocks,
    export_blocks,
    import_blocks,
    init_free,
    init_tables,
    release,
    reserve,
)
from jkv.kv.buckets import bucket
from jkv.kv.format import KVFormat
from jkv.kv.layer_pages import bring_layer, drop_layers
from jkv.kv.page_cost import PageCost
from jkv.kv.page_pool import init_filling, page_bytes
from jkv.kv.pages import KVPages
from jkv.kv.prefix_cache import PrefixCache, block_hashes
from jkv.kv.tier_entries import (
    Entry,
    TierEntries,
    adopt,
    forget,
    gather_row,
    init_entries,
    move_row,
    place_row,
    row_layout,
)
from jkv.kv.token_tiers import init_counts, init_meta
from jkv.kv.transfer import scatter_pages, slot_page_ids


@dataclass(frozen=True)
class TierPolicy:
    """How a token leaving the newest `recent_window` is placed: `name` leankv (high while
    its mean attention is at least alpha_high / n, low while at least alpha_low / n, else
    pruned), streaming (kept if among the first `sinks`) or h2o (kept while among the
    `heavy_ratio * n` most attended); decode steps place their tokens every `interval`
    steps."""

    name: str
    recent_window: int
    alpha_high: float = 0.0
    alpha_low: float = 0.0
    sinks: int = 0
    heavy_ratio: float = 0.0
    interval: int = 1


@dataclass
class FinishedKV:
    """What ended sequences held as they ended: the sum over them of the pool's bytes per
    token of context, and their tokens per tier, summed over (layer, KV head)."""

    sequences: int = 0
    bytes_per_token: float = 0.0
    tokens: dict = field(default_factory=lambda: dict.fromkeys(
        ("high", "low", "pruned", "window"), 0))


class _State:
    """What only the manager writes: the device KV state (pool, filling pages, free list,
    page tables, prefix-cache blocks, token-tier metadata and counts, kept rows' tables) and
    the host mirrors planning reads (free pages, tier counts, offloaded layers, tokens
    held). Everything else reads it through the manager's read-only properties."""

    meta = counts = entry_tables = entry_counts = None


def _read_only(name: str, doc: str) -> property:
    return property(lambda self: getattr(self._s, name), doc=doc)


class KVCacheManager:
    """Pages, tables, slots and the device prefix cache of one engine: the only writer of
    device KV state. Other parts read it through the properties below and change it
    through the methods (`grow`, `open`, `close`, `run_model`, `write_pages`, the layer
    moves); assigning to a property raises AttributeError."""

    pool = _read_only("pool", "The page pool (`KVPages`).")
    filling = _read_only("filling", "The pages being filled, beside the pool.")
    free = _read_only("free", "The device free list (`allocator.FreeList`).")
    tables = _read_only("tables", "The slots' page tables (`allocator.PageTables`).")
    blocks = _read_only("blocks", "Page ids of the prefix cache's blocks [rows, L, H].")
    meta = _read_only("meta", "Token tiers: each page's token metadata (score, pos).")
    counts = _read_only("counts", "Token tiers: each row's tier counts on the device.")
    entry_tables = _read_only("entry_tables", "Token tiers: kept rows' page tables.")
    entry_counts = _read_only("entry_counts", "Token tiers: kept rows' tier counts.")
    free_pages = _read_only("free_pages", "Host mirror of the device's free page count.")
    high = _read_only("high", "Host mirror of the high tiers' token counts [slots, L, H].")
    low = _read_only("low", "Host mirror of the low tiers' token counts [slots, L, H].")
    offloaded = _read_only("offloaded", "slot -> {layer: its host copy} (LayerKV).")
    slot_tokens = _read_only("slot_tokens", "The token ids whose KV each slot holds.")

    def __init__(self, *, num_layers: int, num_kv_heads: int, head_dim: int, dtype,
                 kv_format: KVFormat, page_size: int, kv_cache_bytes: int, max_model_len: int,
                 max_num_seqs: int, enable_prefix_caching: bool,
                 device_cache_bytes: int | None, hash_seed: bytes,
                 tiers: TierPolicy | None = None) -> None:
        self._s = _State()
        self._drops: list[tuple[int, int, int]] = []  # layers sent out, pages not yet dropped
        self.page_size, self.max_model_len = page_size, max_model_len
        self.num_layers, self.num_kv_heads = num_layers, num_kv_heads
        self.tiers = tiers
        # token tiers take a row's pages as its pages fill (the page being filled stays
        # beside the pool); otherwise a row's next page is taken with its first token
        self.cost = PageCost(page_size, num_layers * num_kv_heads, on_fill=tiers is not None,
                             layers=num_layers)
        self.one_page = one_page = page_bytes(kv_format, page_size, head_dim, dtype)
        num_pages = kv_cache_bytes // one_page
        # table width; with tiers, room for both sides' partly filled pages, and a multiple
        # of 32 rather than a power of two (a tiered step's work grows with the width)
        spare = 0 if tiers is None else 2
        need = -(-max_model_len // page_size) + spare
        self.max_pages = bucket(need, 4) if tiers is None else -(-need // 32) * 32
        one_seq = self.cost.pages(max_model_len)
        if num_pages - 1 < one_seq:
            raise ValueError(
                f"kv_cache_bytes={kv_cache_bytes} holds {num_pages} pages but one "
                f"sequence of max_model_len={max_model_len} needs {one_seq}; raise "
                f"kv_cache_bytes to at least {(one_seq + 1) * one_page} or lower max_model_len")
        self.total_pages = num_pages - 1  # page 0 is the null page
        self._s.free_pages = self.total_pages  # host mirror of free.num_free
        slots = max_num_seqs + 1  # the last slot is scratch for padding rows
        self.max_num_seqs, self.scratch = max_num_seqs, max_num_seqs
        device = jax.devices()[0]
        # committed like the step's outputs, so the first call compiles what later ones reuse
        self._s.pool = jax.device_put(KVPages.zeros(num_pages, page_size, head_dim, dtype,
                                                 kv_format), device)
        self._s.filling = jax.device_put(init_filling(slots, num_layers, num_kv_heads, page_size,
                                                   head_dim, dtype, tiers is not None), device)
        self._s.free = jax.device_put(init_free(num_pages, page_size), device)
        self._s.tables = jax.device_put(init_tables(slots, num_layers, num_kv_heads,
                                                 self.max_pages), device)
        shape = (slots, num_layers, num_kv_heads)
        if tiers is not None:
            self._s.meta = jax.device_put(init_meta(num_pages, page_size), device)
            self._s.counts = jax.device_put(init_counts(shape), device)
        self._s.high = np.zeros(shape, np.int64)  # host mirror of the tier counts
        self._s.low = np.zeros(shape, np.int64)
        self.tier_ok: list[jax.Array] = []  # retier results not yet read
        self.unplaced = np.zeros(max_num_seqs, np.int64)  # decode tokens retier has not seen
        self.tier_refusals = 0  # compactions the pool was too short for
        self.finished = FinishedKV()

        # prefix-cache blocks hold every token of a block; token tiers do not: a tiered
        # sequence is kept whole as an entry (`tier_entries`) instead
        self.enable_prefix_caching = enable_prefix_caching
        blocks = enable_prefix_caching and tiers is None
        capacity = self.total_pages // self.cost.heads if blocks else 0
        max_rows = None
        if device_cache_bytes is not None:
            max_rows = device_cache_bytes // (one_page * self.cost.heads)
        self.prefix = PrefixCache(capacity, max_rows)
        self.max_entry_pages = (self.total_pages if device_cache_bytes is None
                                else device_cache_bytes // one_page)
        self.entries: TierEntries | None = None
        if enable_prefix_caching and tiers is not None:
            self.entries = TierEntries(max_num_seqs)
            self._s.entry_tables, self._s.entry_counts = jax.device_put(init_entries(
                max_num_seqs, num_layers, num_kv_heads, self.max_pages), device)
        self._s.blocks = jax.device_put(
            jnp.zeros((max(capacity, 1), num_layers, num_kv_heads), jnp.int32), device)
        self.hash_seed = hash_seed

        self._free_slots = list(range(max_num_seqs - 1, -1, -1))
        self._s.slot_tokens: list[list[int]] = [[] for _ in range(max_num_seqs)]
        self._slot_rows: list[list[int]] = [[] for _ in range(max_num_seqs)]  # cache rows read
        # slot -> {layer: its `layer_offload.HostLayer`}: layers held on the host, which
        # hold no pages of their own (every page count below counts resident layers' only)
        self._s.offloaded: dict[int, dict[int, object]] = {}

    # ------------------------------------------------------------------ the budget

    @property
    def block_pages(self) -> int:
        """Pages one block (page_size tokens of one sequence) takes."""
        return self.cost.heads

    @property
    def num_free_slots(self) -> int:
        return len(self._free_slots)

    @property
    def available_pages(self) -> int:
        """Pages a new allocation can have: free ones plus unreferenced cached blocks and
        kept tiered sequences."""
        kept = self.entries.pages if self.entries is not None else 0
        return self.free_pages + self.prefix.num_evictable * self.cost.heads + kept

    @property
    def pages_used(self) -> int:
        """Pages held by running sequences, the prefix cache and kept tiered sequences."""
        return self.total_pages - self.free_pages

    @property
    def pages_cached(self) -> int:
        """Pages held by the prefix cache's blocks and by kept tiered sequences."""
        kept = self.entries.pages if self.entries is not None else 0
        return len(self.prefix) * self.cost.heads + kept

    def resident(self, slot: int) -> int:
        """Layers of `slot` whose pages are in the pool (the others: `offloaded`)."""
        return self.num_layers - len(self.offloaded.get(slot, ()))

    def shared_rows(self, slot: int) -> list[int]:
        """The prefix-cache rows `slot` started from (its first blocks' pages)."""
        return self._slot_rows[slot]

    def pages_to_grow(self, slot: int, num_tokens: int) -> int:
        """New pages `slot` needs to hold `num_tokens` more tokens (in its resident layers)."""
        grow = self.cost.grow(len(self.slot_tokens[slot]), num_tokens)
        return grow // self.num_layers * self.resident(slot)

    def layer_own_pages(self, slot: int, tokens: int | None = None) -> int:
        """Pages one layer of `slot` holds past the blocks it shares with the prefix cache,
        when it holds `tokens` tokens (default: those it holds)."""
        tokens = len(self.slot_tokens[slot]) if tokens is None else tokens
        return (-(-tokens // self.page_size) - len(self._slot_rows[slot])) * self.num_kv_heads

    def pages_offloadable(self, slot: int) -> int:
        """Pages offloading every resident layer of `slot` frees (its own, not shared)."""
        return self.layer_own_pages(slot) * self.resident(slot)

    def pages_held(self, slot: int) -> int:
        """Pages of the pool `slot` holds (shared ones included)."""
        if self.tiers is None:
            blocks = -(-len(self.slot_tokens[slot]) // self.page_size)
            r, shared = self.resident(slot), min(len(self._slot_rows[slot]), blocks)
            return (blocks * r + shared * (self.num_layers - r)) * self.num_kv_heads
        p = self.page_size
        return int((-(-self.high[slot] // p)).sum() + (-(-self.low[slot] // (2 * p))).sum())

    def pages_freed_by_close(self, slot: int) -> int:
        """How much `available_pages` grows when `close(slot)` runs."""
        if self.tiers is not None:
            return self.pages_held(slot)
        held = -(-len(self.slot_tokens[slot]) // self.page_size)
        rows = self._slot_rows[slot]
        # its own pages (resident layers only) and the cached rows only it pins, which
        # become evictable (every layer's pages)
        return ((held - len(rows)) * self.num_kv_heads * self.resident(slot)
                + self.prefix.num_sole(rows) * self.cost.heads)

    def prompt_hashes(self, token_ids: Sequence[int]) -> list[bytes]:
        """Block hashes of the part of a prompt that could come from the prefix cache or the
        store (all full blocks but the last token: that one is always computed, for its
        logits)."""
        n = (len(token_ids) - 1) // self.page_size
        return block_hashes(token_ids, self.page_size, self.hash_seed, n)

    def lookup(self, hashes: Sequence[bytes]) -> tuple[int, int]:
        """(tokens found in the prefix cache or, with token tiers, a kept sequence, pages
        that opening the sequence would take from `available_pages`: cached blocks no one
        else holds, or a copy of the kept sequence). No side effects."""
        if self.entries is not None:  # a kept tiered sequence: opening copies its pages
            found = self.entries.lookup(hashes)
            if found is None:
                return 0, 0
            row, blocks = found
            return blocks * self.page_size, self.entries.get(row).pages
        rows = self.prefix.lookup(hashes)
        return len(rows) * self.page_size, self.prefix.num_unreferenced(rows) * self.cost.heads

    def make_room(self, pages: int, keep_entry: int | None = None) -> bool:
        """Evict cached blocks and kept tiered sequences (least recently used first; never
        entry `keep_entry`) until `pages` pages are free; False if that cannot be done."""
        short = pages - self.free_pages
        if short > 0:
            self._drop_rows(self.prefix.evict(-(-short // self.cost.heads)))
        while self.free_pages < pages and self.entries is not None:
            row = self.entries.oldest(keep=keep_entry)
            if row is None:
                break
            self._drop_entry(row)
        return self.free_pages >= pages

    def _drop_entry(self, row: int) -> None:
        """Release a kept tiered sequence's pages (no table shares them)."""
        mask = np.zeros(self.entries.rows, bool)
        mask[row] = True
        st = self._s
        st.free, st.entry_tables = release(self.free, self.entry_tables, jnp.asarray(mask))
        st.entry_tables, st.entry_counts = forget(self.entry_tables, self.entry_counts,
                                                  np.int32(row))
        self._s.free_pages += self.entries.remove(row).pages

    def _drop_rows(self, rows: list[int]) -> None:
        """Evicted cache rows: their pages are referenced by no table (only unreferenced rows
        are evicted), so each frees a whole block."""
        if rows:
            self._s.free, self._s.blocks = drop_blocks(self.free, self.blocks,
                                                 jnp.asarray(rows, jnp.int32))
            self._s.free_pages += len(rows) * self.cost.heads

    def _finished(self, slot: int) -> None:
        """What `slot` holds as it ends, into `finished`."""
        n = len(self.slot_tokens[slot])
        if not n:
            return
        f = self.finished
        f.sequences += 1
        f.bytes_per_token += self.pages_held(slot) * self.one_page / n
        heads = self.cost.heads
        window = (n % self.page_size) * heads
        if self.tiers is None:
            f.tokens["high"] += n * heads - window
        else:
            high, low = int(self.high[slot].sum()), int(self.low[slot].sum())
            f.tokens["high"] += high
            f.tokens["low"] += low
            f.tokens["pruned"] += n * heads - window - high - low
        f.tokens["window"] += window

    # ------------------------------------------------------------------ slots

    def is_open(self, slot: int) -> bool:
        return 0 <= slot < self.max_num_seqs and slot not in self._free_slots

    def open(self, token_ids: Sequence[int], use_prefix_cache: bool = True,
             max_cached: int | None = None) -> tuple[int, int]:
        """Take a free slot for `token_ids`; returns (slot, tokens found in the prefix cache
        or, with token tiers, in a kept sequence, which the slot now holds; 0 without
        `use_prefix_cache`, at most `max_cached`)."""
        if not self._free_slots:
            raise RuntimeError("no free sequence slot")
        slot = self._free_slots.pop()
        hashes = self.prompt_hashes(token_ids) if use_prefix_cache else []
        if max_cached is not None:
            hashes = hashes[:max_cached // self.page_size]
        if self.entries is not None:
            cached = self._adopt(slot, hashes)
            self.slot_tokens[slot] = list(token_ids[:cached])
            return slot, cached
        rows = self.prefix.lookup(hashes)
        cached = len(rows) * self.page_size
        if rows:
            self.prefix.acquire(rows)
            padded = np.full(self.max_pages, -1, np.int32)
            padded[: len(rows)] = rows
            self._s.free, self._s.tables = import_blocks(
                self.free, self.tables, self.blocks, np.int32(slot), jnp.asarray(padded),
                np.int32(len(rows)), np.int32(cached))
        self.slot_tokens[slot] = list(token_ids[:cached])
        self._slot_rows[slot] = rows
        return slot, cached

    def _adopt(self, slot: int, hashes: Sequence[bytes]) -> int:
        """Start `slot` from the longest kept tiered sequence ending at one of `hashes` (a
        prompt's block hashes), if one is kept: a copy of it, or when its pages cannot be
        had besides it, the entry itself (it is no longer kept). Returns the tokens the
        slot holds."""
        found = self.entries.lookup(hashes)
        if found is None:
            return 0
        row, _ = found
        entry = self.entries.get(row)
        self.entries.touch(row)
        others = self.available_pages - self.free_pages - entry.pages  # evictable besides it
        if (self.free_pages + others < entry.pages  # no copy: evict nothing, take it over
                or not self.make_room(entry.pages, keep_entry=row)):
            self._s.entry_tables, self._s.entry_counts, self._s.tables, self._s.counts = move_row(
                self.entry_tables, self.entry_counts, self.tables, self.counts,
                np.int32(row), np.int32(slot), np.int32(entry.tokens))
            self.entries.remove(row)
            self.high[slot], self.low[slot] = entry.high, entry.low
            return entry.tokens
        (self._s.pool, self._s.meta, self._s.free, self._s.tables, self._s.counts, ok) = adopt(
            self.pool, self.meta, self.free, self.tables, self.counts, self.entry_tables,
            self.entry_counts, np.int32(row), np.int32(slot))
        if not bool(ok):
            raise RuntimeError("copying a kept sequence failed although the host count "
                               "allowed it")
        self._s.free_pages -= entry.pages
        self.high[slot], self.low[slot] = entry.high, entry.low
        return entry.tokens

    def tier_pages(self, slot: int) -> tuple[dict[str, np.ndarray], KVPages, jax.Array,
                                             jax.Array]:
        """The pages `slot`'s tiers hold, as the store keeps a tiered row: (the layout,
        `tier_entries.row_layout`, padded to a bucket of pages with head -1; the pages and
        their token metadata score, pos, device arrays being gathered)."""
        layout = row_layout(self.high[slot], self.low[slot], self.page_size)
        n = len(layout["tier_head"])
        rows = bucket(max(n, 1))
        padded = {k: np.pad(x, (0, rows - n), constant_values=-1 if k == "tier_head" else 0)
                  for k, x in layout.items()}
        pages, score, pos = gather_row(self.pool, self.meta, self.tables, np.int32(slot),
                                       *(jnp.asarray(padded[k]) for k in
                                         ("tier_head", "tier_low", "tier_index")))
        return padded, pages, score, pos

    def place_tiers(self, slot: int, layout: dict[str, np.ndarray], pages: KVPages,
                    score: np.ndarray, pos: np.ndarray, high: np.ndarray, low: np.ndarray,
                    tokens: int) -> bool:
        """Start the empty `slot` with saved tiered pages (`tier_pages`' form, checked by the
        caller; high, low [L, H]) holding its first `tokens` tokens; False when the pages
        cannot be had (nothing changes)."""
        n = len(layout["tier_head"])
        if not self.make_room(n):
            return False
        rows = bucket(max(n, 1))

        def pad(x: np.ndarray, fill: int = 0) -> jax.Array:
            return jnp.asarray(np.pad(x, [(0, rows - n)] + [(0, 0)] * (x.ndim - 1),
                                      constant_values=fill))

        pages = KVPages.from_arrays(pages.kv_format, {k: pad(x) for k, x in
                                                      pages.arrays().items()})
        (self._s.pool, self._s.meta, self._s.free, self._s.tables, self._s.counts, ok) = place_row(
            self.pool, self.meta, self.free, self.tables, self.counts, pages, pad(score),
            pad(pos), pad(layout["tier_head"], -1), pad(layout["tier_low"]),
            pad(layout["tier_index"]), jnp.asarray(high, jnp.int32), jnp.asarray(low, jnp.int32),
            np.int32(slot), np.int32(tokens))
        if not bool(ok):
            raise RuntimeError("placing restored tiers failed although the host count allowed it")
        self._s.free_pages -= n
        self.high[slot], self.low[slot] = high, low
        return True

    def grow(self, new_lengths: dict[int, int], spare: int = 0) -> jax.Array:
        """Give slots the pages to hold `new_lengths[slot]` tokens in their resident
        layers (evicting cached blocks if needed), with `spare` more pages free after (what
        the step brings in of offloaded layers); returns the device's ok flag (read it with
        the step's outputs). RuntimeError when the pages cannot be had."""
        need = sum(self.pages_to_grow(s, n - len(self.slot_tokens[s]))
                   for s, n in new_lengths.items())
        if not self.make_room(need + spare):
            raise RuntimeError(f"the step needs {need + spare} KV pages and only "
                               f"{self.available_pages} can be had")
        if self.tiers is not None:  # the tokens of pages the step fills join the high tiers
            p = self.page_size
            lengths = np.zeros(self.max_num_seqs + 1, np.int32)
            for s, n in new_lengths.items():
                lengths[s] = n
            held = np.array([len(t) for t in self.slot_tokens] + [0])
            n_new = np.where(lengths > 0, (lengths // p - held // p) * p, 0)
            self._s.free, self._s.tables, self._s.counts, ok = tier_step.grow(
                self.free, self.tables, self.counts, jnp.asarray(n_new, jnp.int32))
            self._s.high += n_new[:, None, None]
        else:
            self._s.free, self._s.tables, ok = self._reserve(new_lengths)
        self._s.free_pages -= need
        return ok

    def _reserve(self, new_lengths: dict[int, int]) -> tuple:
        """`allocator.reserve` to `new_lengths`; every other slot keeps its pages, and
        offloaded layers take none (their rows keep only their shared blocks)."""
        lengths = np.zeros(self.max_num_seqs + 1, np.int32)
        for s, n in new_lengths.items():
            lengths[s] = n
        if not self.offloaded:
            return reserve(self.free, self.tables, jnp.asarray(lengths))
        head = np.array([len(t) for t in self.slot_tokens] + [0], np.int32)
        head[list(new_lengths)] = list(new_lengths.values())
        head = np.repeat(head[:, None], self.num_layers, 1)
        for s, held in self.offloaded.items():
            head[s, list(held)] = 0
        head = np.repeat(head[..., None], self.num_kv_heads, 2)
        return reserve(self.free, self.tables, jnp.asarray(lengths), jnp.asarray(head))

    def retier(self, slots: Sequence[int], added: Sequence[int], rows: int, tokens: int,
               generation: bool) -> None:
        """Algorithm 1 and compaction (`tier_step.retier`) for `slots`, which hold the tokens
        of `slot_tokens` and the `added` ones a step just fed; dispatched, not awaited
        (`sync_tiers` reads what it did). `rows` and `tokens` are the call's padded shape.

        Decode steps (`generation`) are placed together, once a slot has `interval` tokens
        not yet placed: the pass over every held token's attention is what placement costs,
        whether one token leaves the window or `interval` do. Tokens a sequence ends with
        unplaced stay in the high tier. With no slots (warmup) the call runs, to compile."""
        t = self.tiers
        if generation and slots:
            pending = self.unplaced[list(slots)] + 1
            if pending.max() < t.interval:
                self.unplaced[list(slots)] = pending
                return
        n_prev, n = np.zeros(rows, np.int32), np.zeros(rows, np.int32)
        index = np.full(rows, self.scratch, np.int32)
        for i, (s, a) in enumerate(zip(slots, added, strict=True)):
            held = len(self.slot_tokens[s])
            index[i], n_prev[i], n[i] = s, held - self.unplaced[s], held + a
            self.unplaced[s] = 0
        st = self._s
        (st.pool, st.meta, st.free, st.tables, st.counts, ok) = tier_step.retier(
            self.pool, self.meta, self.free, self.tables, self.counts, jnp.asarray(index),
            jnp.asarray(n_prev), jnp.asarray(n),
            jnp.asarray([t.alpha_high, t.alpha_low, t.sinks, t.heavy_ratio], jnp.float32),
            policy=t.name, recent=t.recent_window,
            max_moves=t.interval if generation else tokens + t.interval - 1,
            generation=generation, max_tokens=self.max_model_len)
        self.tier_ok.append(ok)

    def warmup(self) -> None:
        """Compile the calls that keep, copy and drop tiered sequences, on empty rows (the
        scratch slot and a spare entry row): nothing changes."""
        if self.entries is None or self.entries.spare_row() is None:
            return
        row, slot = np.int32(self.entries.spare_row()), np.int32(self.scratch)
        (self._s.pool, self._s.meta, self._s.free, self._s.tables, self._s.counts, _) = adopt(
            self.pool, self.meta, self.free, self.tables, self.counts, self.entry_tables,
            self.entry_counts, row, slot)
        self._s.tables, self._s.counts, self._s.entry_tables, self._s.entry_counts = move_row(
            self.tables, self.counts, self.entry_tables, self.entry_counts, slot, row,
            np.int32(0))  # there and back
        self._s.entry_tables, self._s.entry_counts, self._s.tables, self._s.counts = move_row(
            self.entry_tables, self.entry_counts, self.tables, self.counts, row, slot,
            np.int32(0))
        self._s.free, self._s.entry_tables = release(self.free, self.entry_tables,
                                               jnp.zeros(self.entries.rows, bool))
        self._s.entry_tables, self._s.entry_counts = forget(self.entry_tables,
                                                            self.entry_counts, row)

    def sync_tiers(self) -> None:
        """Read back what the step's `retier` calls did: tier counts and free pages."""
        oks, high, low, num_free = jax.device_get((self.tier_ok, self.counts.high,
                                                  self.counts.low, self.free.num_free))
        self.tier_refusals += sum(not bool(ok) for ok in oks)
        self.tier_ok = []
        self._s.high, self._s.low = high.astype(np.int64), low.astype(np.int64)
        self._s.free_pages = int(num_free)

    def _keep(self, slot: int) -> None:
        """Move the tiered sequence in `slot` (its full pages' tokens) to an entry row and
        free the slot. An entry of the same tokens is dropped first, and the least recently
        used one when no row is spare; then the oldest while the kept pages exceed the
        device cache's budget."""
        n = len(self.slot_tokens[slot]) // self.page_size * self.page_size
        key = block_hashes(self.slot_tokens[slot], self.page_size, self.hash_seed)[-1]
        same = self.entries.row_of(key)
        if same is not None:  # the same tokens kept before: the newer compression replaces it
            self._drop_entry(same)
        if self.entries.spare_row() is None:
            self._drop_entry(self.entries.oldest())
        row = self.entries.spare_row()
        self._s.tables, self._s.counts, self._s.entry_tables, self._s.entry_counts = move_row(
            self.tables, self.counts, self.entry_tables, self.entry_counts, np.int32(slot),
            np.int32(row), np.int32(n))
        self.entries.add(row, Entry(key, n, self.pages_held(slot), self.high[slot].copy(),
                                    self.low[slot].copy()))
        while self.entries.pages > self.max_entry_pages:
            self._drop_entry(self.entries.oldest())
        self.high[slot], self.low[slot] = 0, 0
        self.unplaced[slot] = 0
        self.slot_tokens[slot], self._slot_rows[slot] = [], []
        self._free_slots.append(slot)

    def reserve_blocks(self, slot: int, first: int, n: int) -> jax.Array | None:
        """New pages for blocks [first, n) of `slot`, which holds `first` blocks, as page
        ids [bucket(n - first), layers, KV heads] (padding: null); None when they cannot be
        had. The slot counts as holding them from now on (`add_tokens`)."""
        if n <= first:
            return None
        need = self.cost.grow(first * self.page_size, (n - first) * self.page_size)
        if not self.make_room(need):
            return None
        # (with any layer of any slot offloaded, only this slot's resident rows grow)
        self._s.free, self._s.tables, ok = self._reserve({slot: n * self.page_size})
        if not bool(ok):
            raise RuntimeError("page reservation failed although the host count allowed it")
        self._s.free_pages -= need
        return self.page_ids(slot, first, n)

    def page_ids(self, slot: int, first: int, stop: int, count: int | None = None) -> jax.Array:
        """Page ids of `slot`'s blocks [first, first + count) as [count, layers, KV heads],
        null from `stop` on; `count` defaults to bucket(stop - first)."""
        count = bucket(stop - first) if count is None else count
        return slot_page_ids(self.tables.pages, np.int32(slot), np.int32(first),
                             np.int32(stop), count=count)

    def add_tokens(self, slot: int, token_ids: Sequence[int]) -> None:
        """`slot` now holds the KV of `token_ids` too (after the step that wrote it, or a
        restore that will)."""
        self.slot_tokens[slot].extend(int(t) for t in token_ids)

    def close(self, slot: int, shareable: int, finished: bool = True,
              keep: bool = True, ahead: int = 0) -> None:
        """End the sequence in `slot`: its first `shareable` full blocks (those whose KV is
        exactly its tokens') go to the prefix cache when that is on, and the table's
        references are dropped, freeing pages no cache row holds. With token tiers and
        prefix caching on, the sequence's full pages are kept whole instead (an entry of
        `tier_entries`, evictable). `finished` (not preempted): what it held counts in
        `finished`. `keep` False: nothing is kept (no block exported, no row kept).
        `ahead`: pages its resident layers took for a prompt they do not hold yet (a
        layer-major prefill under way), freed with it."""
        self._s.free_pages += ahead
        tokens, shared = self.slot_tokens[slot], self._slot_rows[slot]
        shareable = shareable if keep else 0
        if slot in self.offloaded:  # its offloaded layers' blocks are not in the pool
            shareable = min(shareable, len(shared))
        resident = self.resident(slot)
        if finished:
            self._finished(slot)
        self.offloaded.pop(slot, None)
        if self.entries is not None and keep and len(tokens) >= self.page_size:
            self._keep(slot)
            return
        new_rows: dict[int, int] = {}  # cache row -> the column of `slot` it takes
        if self.enable_prefix_caching and self.entries is None:  # keep False: shareable 0
            self.prefix.release(shared)
            hashes = block_hashes(tokens, self.page_size, self.hash_seed,
                                  max(shareable, len(shared)))
            for i in range(len(shared), len(hashes)):
                row, evicted = self.prefix.insert(hashes[i], i)
                # a row given to an earlier column of this close holds nothing yet: that
                # column simply stays the slot's (freed with it)
                self._drop_rows([r for r in evicted if r not in new_rows])
                for r in evicted:
                    new_rows.pop(r, None)
                if row is not None:
                    new_rows[row] = i
            self.prefix.touch([r for r in shared if self.prefix.holds(r)] + list(new_rows))
            if new_rows:
                dest = np.full(self.max_pages, -1, np.int32)
                for row, i in new_rows.items():
                    dest[i] = row
                self._s.free, self._s.blocks = export_blocks(self.free, self.tables, self.blocks,
                                                       np.int32(slot), jnp.asarray(dest))
        # pages of shared rows evicted above were counted free when they were dropped
        kept = len(shared) + len(new_rows)
        mask = np.zeros(self.max_num_seqs + 1, bool)
        mask[slot] = True
        self._s.free, self._s.tables = release(self.free, self.tables, jnp.asarray(mask))
        if self.tiers is not None:
            self._s.counts = tier_step.clear(self.counts, jnp.asarray(mask))
            self._s.free_pages += self.pages_held(slot)
            self.high[slot], self.low[slot] = 0, 0
            self.unplaced[slot] = 0
        else:
            held = -(-len(tokens) // self.page_size)
            self._s.free_pages += (held - kept) * self.num_kv_heads * resident
        self.slot_tokens[slot], self._slot_rows[slot] = [], []
        self._free_slots.append(slot)

    # ------------------------------------------------------------------ writes by the model

    def run_model(self, call: Callable) -> object:
        """Run a model call over the pool: `call(pool, filling, table_pages, tiers)` (tiers:
        (meta, counts) under token tiers, else None) returns (out, pool, filling, meta); the
        pool, filling pages and token metadata it returns become the manager's (the model
        writes a step's KV into pages the manager gave out). Returns out."""
        tiers = None if self.tiers is None else (self.meta, self.counts)
        out, self._s.pool, self._s.filling, meta = call(self.pool, self.filling,
                                                        self.tables.pages, tiers)
        if self.tiers is not None:
            self._s.meta = meta
        return out

    def write_pages(self, ids: jax.Array, pages: KVPages) -> None:
        """Write `pages` into the pool at page ids `ids` (a restore's loaded blocks, into
        pages `reserve_blocks` gave out)."""
        self._s.pool = scatter_pages(self.pool, ids, pages)

    # ------------------------------------------------------------------ layers on the host

    def hold_on_host(self, slot: int, hosts: dict[int, object]) -> int:
        """`slot`'s layers `hosts` (layer -> its host copy, holding the blocks past those
        shared with the prefix cache) leave the pool: their own pages are dropped from the
        table and freed. Returns the pages freed."""
        first = len(self._slot_rows[slot])
        self.offloaded.setdefault(slot, {}).update(hosts)
        mask = np.zeros(self.num_layers, bool)
        mask[list(hosts)] = True
        self._s.free, self._s.tables = drop_layers(self.free, self.tables, np.int32(slot),
                                                   jnp.asarray(mask), np.int32(first))
        freed = self.layer_own_pages(slot) * len(hosts)
        self._s.free_pages += freed
        return freed

    def layer_sent(self, slot: int, layer: int, tokens: int) -> None:
        """Layer `layer` of `slot` (holding `tokens` tokens) was copied out inside a step:
        its own pages count free now and are dropped by the next `bring_layer` call, or by
        `drop_sent` (nothing reserves pages before either)."""
        self._drops.append((slot, layer, len(self._slot_rows[slot])))
        self._s.free_pages += self.layer_own_pages(slot, tokens)

    def drop_sent(self) -> bool:
        """Drop the pages of layers sent out and not yet dropped; whether there were any."""
        drops, self._drops = self._drops, []
        for slot, layer, first in drops:
            self._s.free, self._s.tables = drop_layers(self.free, self.tables, np.int32(slot),
                                                       np.int32(layer), np.int32(first))
        return bool(drops)

    def bring_layer(self, slot: int, layer: int, tokens: int, blocks: int, pages: KVPages,
                    pool: KVPages | None = None) -> tuple[KVPages, jax.Array]:
        """Give offloaded (slot, layer) the pages to hold `tokens` tokens and write its host
        copy's `blocks` blocks (`pages`, on their way to the device) into them, dropping a
        layer sent out before in the same call. `pool`: a step's pool (returned, the step
        keeps it); None: the manager's own, written back. Returns (pool, the device's ok
        flag); RuntimeError when the pages cannot be had."""
        need = self.layer_own_pages(slot, tokens)
        if not self.make_room(need):
            raise RuntimeError(f"bringing back layer {layer} of slot {slot} needs {need} "
                               f"pages and only {self.available_pages} can be had")
        drop = self._drops.pop() if self._drops else (0, -1, 0)
        self.drop_sent()
        first = len(self._slot_rows[slot])
        args = np.array([slot, layer, tokens, first, blocks, *drop], np.int32)
        own = pool is None
        self._s.free, self._s.tables, pool, ok = bring_layer(
            self.free, self.tables, self.pool if own else pool, args, pages)
        self._s.free_pages -= need
        if own:
            self._s.pool = pool
        return pool, ok

    def all_resident(self, slot: int) -> None:
        """Every layer of `slot` is back in the pool (`bring_layer` brought each)."""
        self.offloaded.pop(slot, None)

    def warmup_layer_moves(self, empty: list[KVPages]) -> None:
        """Compile `bring_layer` for each host copy's shape in `empty` and both forms of
        `drop_layers`, on the scratch slot (nothing taken, nothing written)."""
        self.drop_sent()
        slot, zero = np.int32(self.scratch), np.int32(0)
        nothing = np.array([self.scratch, 0, 0, 0, 0, 0, -1, 0], np.int32)
        for pages in empty:
            self._s.free, self._s.tables, self._s.pool, _ = bring_layer(
                self.free, self.tables, self.pool, nothing, pages)
        self._s.free, self._s.tables = drop_layers(self.free, self.tables, slot, zero, zero)
        mask = jnp.zeros(self.num_layers, bool)
        self._s.free, self._s.tables = drop_layers(self.free, self.tables, slot, mask, zero)
