"""The block-pages layout: every (layer, KV head) of a sequence holds one page per
`page_size` tokens, a page taken with its first token.

A full block (a page per layer and KV head) holds exactly its tokens' KV, so blocks are what
the device prefix cache shares between sequences (`PrefixCache`, by chained block hashes:
imported into a table on `open`, exported on `close`), and one layer of a sequence can live
on the host while its others stay (LayerKV: `hold_on_host`, `bring_layer`). Pages change
hands between slots and the prefix cache only here, so which pages a release frees is known
exactly and the host count of free pages never waits for the device.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jkv.kv.allocator import drop_blocks, export_blocks, import_blocks, release, reserve
from jkv.kv.buckets import bucket
from jkv.kv.kv_state import KVState
from jkv.kv.layer_pages import bring_layer, drop_layers
from jkv.kv.page_cost import PageCost
from jkv.kv.pages import KVPages
from jkv.kv.prefix_cache import PrefixCache, block_hashes
from jkv.kv.sharding import KVPlacement


def own_layer_pages(tokens: int, page_size: int, shared_blocks: int, kv_heads: int) -> int:
    """Pages one layer of a sequence holding `tokens` tokens has past the `shared_blocks`
    blocks it shares with the prefix cache."""
    return (-(-tokens // page_size) - shared_blocks) * kv_heads


class BlockPages:
    """Block pages and the device prefix cache of their full blocks, over a `KVState`."""

    name = "blocks"
    pages_on_fill = False  # a row's next page is taken with its first token
    filling_scores = False
    lossy_recompute = False

    @staticmethod
    def table_width(pages: int) -> int:
        """Page-table width for rows of at most `pages` pages: a power of two, at least 4."""
        return bucket(pages, 4)

    blocks = property(lambda self: self._blocks,
                      doc="Page ids of the prefix cache's blocks [rows, L, H].")
    tier_refusals = 0  # compactions the pool was too short for: blocks are never compacted

    def __init__(self, kv: KVState, *, cost: PageCost, page_size: int, max_pages: int,
                 total_pages: int, one_page: int, enable_prefix_caching: bool,
                 device_cache_bytes: int | None, hash_seed: bytes, max_num_seqs: int,
                 placement: KVPlacement) -> None:
        self.kv, self.cost, self.page_size = kv, cost, page_size
        self.num_layers, self.num_kv_heads = cost.layers, cost.heads // cost.layers
        self.max_pages, self.max_num_seqs, self.hash_seed = max_pages, max_num_seqs, hash_seed
        self.enable_prefix_caching = enable_prefix_caching
        capacity = total_pages // cost.heads if enable_prefix_caching else 0
        max_rows = None
        if device_cache_bytes is not None:
            max_rows = device_cache_bytes // (one_page * cost.heads)
        self.prefix = PrefixCache(capacity, max_rows)
        self._blocks = jax.device_put(
            jnp.zeros((max(capacity, 1), self.num_layers, self.num_kv_heads), jnp.int32),
            placement.replicated)
        self._slot_rows: list[list[int]] = [[] for _ in range(max_num_seqs)]  # cache rows read
        self._drops: list[tuple[int, int, int]] = []  # layers sent out, pages not yet dropped

    # ------------------------------------------------------------------ the budget

    @property
    def evictable_pages(self) -> int:
        """Pages of cached blocks no sequence holds."""
        return self.prefix.num_evictable * self.cost.heads

    @property
    def cached_pages(self) -> int:
        return len(self.prefix) * self.cost.heads

    num_compiles = 0  # no calls of its own in a step

    @staticmethod
    def seed_tag(policy: None) -> bytes:
        """Block hashes' seed as it is."""
        return b""

    def shared_rows(self, slot: int) -> list[int]:
        return self._slot_rows[slot]

    def resident(self, slot: int) -> int:
        return self.num_layers - len(self.kv.offloaded.get(slot, ()))

    def layer_own_pages(self, slot: int, tokens: int | None = None) -> int:
        """Pages one layer of `slot` holds past the blocks it shares with the prefix cache,
        when it holds `tokens` tokens (default: those it holds)."""
        tokens = len(self.kv.slot_tokens[slot]) if tokens is None else tokens
        return own_layer_pages(tokens, self.page_size, len(self._slot_rows[slot]),
                               self.num_kv_heads)

    def pages_offloadable(self, slot: int) -> int:
        return self.layer_own_pages(slot) * self.resident(slot)

    def pages_held(self, slot: int) -> int:
        blocks = -(-len(self.kv.slot_tokens[slot]) // self.page_size)
        r, shared = self.resident(slot), min(len(self._slot_rows[slot]), blocks)
        return (blocks * r + shared * (self.num_layers - r)) * self.num_kv_heads

    def pages_freed_by_close(self, slot: int) -> int:
        held = -(-len(self.kv.slot_tokens[slot]) // self.page_size)
        rows = self._slot_rows[slot]
        # its own pages (resident layers only) and the cached rows only it pins, which
        # become evictable (every layer's pages)
        return ((held - len(rows)) * self.num_kv_heads * self.resident(slot)
                + self.prefix.num_sole(rows) * self.cost.heads)

    def tier_tokens(self, slot: int, tokens: int) -> dict[str, int]:
        """Tokens `slot` keeps per tier, summed over (layer, KV head): all of its full pages'
        in the high tier."""
        return {"high": tokens // self.page_size * self.page_size * self.cost.heads}

    def lookup(self, hashes: Sequence[bytes]) -> tuple[int, int]:
        rows = self.prefix.lookup(hashes)
        return len(rows) * self.page_size, self.prefix.num_unreferenced(rows) * self.cost.heads

    def make_room(self, pages: int, keep_entry: int | None = None) -> bool:
        """Evict unreferenced cached blocks (least recently used first) until `pages` pages
        are free; False if that cannot be done."""
        short = pages - self.kv.free_pages
        if short > 0:
            self._drop_rows(self.prefix.evict(-(-short // self.cost.heads)))
        return self.kv.free_pages >= pages

    def _drop_rows(self, rows: list[int]) -> None:
        """Evicted cache rows: their pages are referenced by no table (only unreferenced rows
        are evicted), so each frees a whole block."""
        if rows:
            kv = self.kv
            kv.free, self._blocks = drop_blocks(kv.free, self.blocks,
                                                  jnp.asarray(rows, jnp.int32))
            kv.free_pages += len(rows) * self.cost.heads

    # ------------------------------------------------------------------ sequences

    def open(self, slot: int, hashes: Sequence[bytes], prompt_tokens: int) -> int:
        """Start the empty `slot` from the longest run of `hashes` (a prompt's blocks) the
        prefix cache holds (its pages imported into the slot's table); returns the tokens
        it holds."""
        rows = self.prefix.lookup(hashes)
        cached = len(rows) * self.page_size
        if rows:
            self.prefix.acquire(rows)
            padded = np.full(self.max_pages, -1, np.int32)
            padded[: len(rows)] = rows
            kv = self.kv
            kv.free, kv.tables = import_blocks(
                kv.free, kv.tables, self.blocks, np.int32(slot), jnp.asarray(padded),
                np.int32(len(rows)), np.int32(cached))
        self._slot_rows[slot] = rows
        return cached

    def grow(self, new_lengths: dict[int, int], need: int) -> jax.Array:
        """Reserve the pages for `new_lengths` (`need` of them, made room for); returns the
        device's ok flag."""
        kv = self.kv
        kv.free, kv.tables, ok = self._reserve(new_lengths)
        kv.free_pages -= need
        return ok

    def _reserve(self, new_lengths: dict[int, int]) -> tuple:
        """`allocator.reserve` to `new_lengths`; every other slot keeps its pages, and
        offloaded layers take none (their rows keep only their shared blocks)."""
        kv = self.kv
        lengths = np.zeros(self.max_num_seqs + 1, np.int32)
        for s, n in new_lengths.items():
            lengths[s] = n
        if not kv.offloaded:
            return reserve(kv.free, kv.tables, jnp.asarray(lengths))
        head = np.array([len(t) for t in kv.slot_tokens] + [0], np.int32)
        head[list(new_lengths)] = list(new_lengths.values())
        head = np.repeat(head[:, None], self.num_layers, 1)
        for s, held in kv.offloaded.items():
            head[s, list(held)] = 0
        head = np.repeat(head[..., None], self.num_kv_heads, 2)
        return reserve(kv.free, kv.tables, jnp.asarray(lengths), jnp.asarray(head))

    def reserve_blocks(self, slot: int, first: int, n: int) -> bool:
        """New pages for blocks [first, n) of `slot`, which holds `first` blocks; False
        when they cannot be had. The slot counts as holding them from now on."""
        need = self.cost.grow(first * self.page_size, (n - first) * self.page_size)
        if not self.make_room(need):
            return False
        # (with any layer of any slot offloaded, only this slot's resident rows grow)
        kv = self.kv
        kv.free, kv.tables, ok = self._reserve({slot: n * self.page_size})
        if not bool(ok):
            raise RuntimeError("page reservation failed although the host count allowed it")
        kv.free_pages -= need
        return True

    def close(self, slot: int, shareable: int, keep: bool) -> None:
        """End the sequence in `slot`: its first `shareable` full blocks go to the prefix
        cache when that is on (none unless `keep`), and the table's references are dropped,
        freeing pages no cache row holds."""
        kv, shared = self.kv, self._slot_rows[slot]
        tokens = kv.slot_tokens[slot]
        shareable = shareable if keep else 0
        if slot in kv.offloaded:  # its offloaded layers' blocks are not in the pool
            shareable = min(shareable, len(shared))
        resident = self.resident(slot)
        new_rows = self._export(slot, shareable) if self.enable_prefix_caching else {}
        # pages of shared rows evicted above were counted free when they were dropped
        kept = len(shared) + len(new_rows)
        mask = np.zeros(self.max_num_seqs + 1, bool)
        mask[slot] = True
        kv.free, kv.tables = release(kv.free, kv.tables, jnp.asarray(mask))
        held = -(-len(tokens) // self.page_size)
        kv.free_pages += (held - kept) * self.num_kv_heads * resident
        self._slot_rows[slot] = []

    def _export(self, slot: int, shareable: int) -> dict[int, int]:
        """`slot`'s shareable blocks past those it read into new cache rows; returns each
        new row's column of `slot`."""
        kv, shared = self.kv, self._slot_rows[slot]
        self.prefix.release(shared)
        hashes = block_hashes(kv.slot_tokens[slot], self.page_size, self.hash_seed,
                              max(shareable, len(shared)))
        new_rows: dict[int, int] = {}  # cache row -> the column of `slot` it takes
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
            kv.free, self._blocks = export_blocks(kv.free, kv.tables, self.blocks,
                                                    np.int32(slot), jnp.asarray(dest))
        return new_rows

    # ------------------------------------------------------------------ the model's calls

    def model_tiers(self) -> None:
        """What a model call reads of token tiers: nothing."""
        return None

    def took_meta(self, meta: object) -> None:
        """A model call returns no token metadata here."""

    def placement(self, slots: Sequence[int], added: Sequence[int], rows: int, tokens: int,
                  generation: bool) -> None:
        """Nothing is placed: a block's tokens stay as they are."""

    def after_call(self, plan: None) -> None:
        """Nothing to do after a model call."""

    def after_step(self) -> None:
        """Nothing to read back after a step."""

    def warmup(self) -> None:
        """Compile what a sequence's opening, growth and close call, on the scratch slot
        (empty): nothing changes."""
        kv, slot = self.kv, np.int32(self.max_num_seqs)  # (the scratch slot)
        none = jnp.asarray(np.full(self.max_pages, -1, np.int32))
        self.grow({}, 0)
        kv.free, kv.tables = import_blocks(kv.free, kv.tables, self.blocks, slot, none,
                                           np.int32(0), np.int32(0))
        kv.free, self._blocks = export_blocks(kv.free, kv.tables, self.blocks, slot, none)
        kv.free, kv.tables = release(kv.free, kv.tables,
                                     jnp.asarray(np.zeros(self.max_num_seqs + 1, bool)))

    # ------------------------------------------------------------------ layers on the host

    def hold_on_host(self, slot: int, hosts: dict[int, object]) -> int:
        """`slot`'s layers `hosts` (layer -> its host copy, holding the blocks past those
        shared with the prefix cache) leave the pool: their own pages are dropped from the
        table and freed. Returns the pages freed."""
        kv, first = self.kv, len(self._slot_rows[slot])
        kv.offloaded.setdefault(slot, {}).update(hosts)
        mask = np.zeros(self.num_layers, bool)
        mask[list(hosts)] = True
        kv.free, kv.tables = drop_layers(kv.free, kv.tables, np.int32(slot),
                                         jnp.asarray(mask), np.int32(first))
        freed = self.layer_own_pages(slot) * len(hosts)
        kv.free_pages += freed
        return freed

    def layer_sent(self, slot: int, layer: int, tokens: int) -> None:
        """Layer `layer` of `slot` (holding `tokens` tokens) was copied out inside a step:
        its own pages count free now and are dropped by the next `bring_layer` call, or by
        `drop_sent` (nothing reserves pages before either)."""
        self._drops.append((slot, layer, len(self._slot_rows[slot])))
        self.kv.free_pages += self.layer_own_pages(slot, tokens)

    def drop_sent(self) -> bool:
        """Drop the pages of layers sent out and not yet dropped; whether there were any."""
        kv, drops, self._drops = self.kv, self._drops, []
        for slot, layer, first in drops:
            kv.free, kv.tables = drop_layers(kv.free, kv.tables, np.int32(slot),
                                             np.int32(layer), np.int32(first))
        return bool(drops)

    def bring_layer(self, slot: int, layer: int, tokens: int, blocks: int, pages: KVPages,
                    pool: KVPages | None = None) -> tuple[KVPages, jax.Array]:
        """Give offloaded (slot, layer) the pages to hold `tokens` tokens and write its host
        copy's `blocks` blocks (`pages`, on their way to the device) into them, dropping a
        layer sent out before in the same call. `pool`: a step's pool (returned, the step
        keeps it); None: the state's own, written back. Returns (pool, the device's ok
        flag); RuntimeError when the pages cannot be had."""
        need = self.layer_own_pages(slot, tokens)
        if not self.make_room(need):
            raise RuntimeError(f"bringing back layer {layer} of slot {slot} needs {need} "
                               f"pages and only {self.kv.free_pages + self.evictable_pages} "
                               "can be had")
        drop = self._drops.pop() if self._drops else (0, -1, 0)
        self.drop_sent()
        args = np.array([slot, layer, tokens, len(self._slot_rows[slot]), blocks, *drop],
                        np.int32)
        kv, own = self.kv, pool is None
        kv.free, kv.tables, pool, ok = bring_layer(kv.free, kv.tables,
                                                   kv.pool if own else pool, args, pages)
        kv.free_pages -= need
        if own:
            kv.pool = pool
        return pool, ok

    def warmup_layer_moves(self, empty: list[KVPages], scratch: int) -> None:
        """Compile `bring_layer` for each host copy's shape in `empty` and both forms of
        `drop_layers`, on the `scratch` slot (nothing taken, nothing written)."""
        kv = self.kv
        self.drop_sent()
        slot, zero = np.int32(scratch), np.int32(0)
        nothing = np.array([scratch, 0, 0, 0, 0, 0, -1, 0], np.int32)
        for pages in empty:
            kv.free, kv.tables, kv.pool, _ = bring_layer(kv.free, kv.tables, kv.pool,
                                                         nothing, pages)
        kv.free, kv.tables = drop_layers(kv.free, kv.tables, slot, zero, zero)
        mask = jnp.zeros(self.num_layers, bool)
        kv.free, kv.tables = drop_layers(kv.free, kv.tables, slot, mask, zero)
