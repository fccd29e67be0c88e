"""KV leaving the pool and coming back: what the store saves, restores and moves.

`gather` copies a slot's full blocks out of the pool (dispatched, not awaited: the store's
write-behind fetches them on another thread). `restore` gives a slot new pages for saved
blocks and queues their contents: written at once, or with layer-wise execution layer by
layer a read buffer of layers ahead of the layer computing (`stage`, CachedAttention 3.2.1).
`rebase` moves saved blocks to other positions for a truncated conversation (3.4).

A split restore (Krul 6.2) loads only part of each layer: `pyramid` (`saved_pages`) says which
blocks each layer loads, the rest being recomputed by the engine while the loads are in flight.

Saved pages are written as they come from the store (views of the entry's bytes: no padded
host copy), in runs of power-of-two lengths so that a few compiled shapes cover any restore.
Each slot has at most one `PendingRestore` record: the saved pages not yet written, and the first
block whose KV is not its tokens' own (restored but unwritten, or moved and so approximate).
Such blocks are never shared under their tokens' hashes (`shareable_blocks`); a store that
keeps approximate KV (a lossy one: `gather(approximate=True)`) is handed them marked so.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence

import jax
import numpy as np

from jkv.averages import moving_average
from jkv.engine.saved_pages import PendingRestore, SavedPages, pyramid
from jkv.engine.stored_kv import convert_stored
from jkv.kv.block_runs import BlockRuns, power_of_two_runs
from jkv.kv.buckets import bucket
from jkv.kv.manager import KVCacheManager
from jkv.kv.pages import KVPages
from jkv.kv.prefix_cache import block_hashes
from jkv.kv.rebase import rebase_pages
from jkv.kv.transfer import flat_run, gather_pages, scatter_pages


class KVConnector:
    """Saves, restores and moves the KV of one `KVCacheManager`'s slots, block pages by
    default (a token-tier engine's rows: `row_connector.RowConnector`)."""

    stored_whole = False  # entries are runs of blocks: found and saved in part (tails)
    splits_restores = True  # Krul's split: some blocks recomputed while the rest load

    def __init__(self, cache: KVCacheManager, *, num_layers: int, num_kv_heads: int,
                 rotate: Callable, layerwise: bool) -> None:
        """`rotate(keys [L, T, H, D], shift [L, T])`: the model's key rotation (`rebase`)."""
        self.cache = cache
        self.num_layers, self.num_kv_heads = num_layers, num_kv_heads
        self.layerwise = layerwise
        self._rotate = rotate
        self._pending: dict[int, PendingRestore] = {}
        self.load_bytes_per_s = 0.0  # measured restore rate (host arrays into the pool)
        self.join_copies = cache.placement.join_copies  # (`flat_run`; tests may set it)

    # ------------------------------------------------------------------ restores

    def restorable(self, saved: SavedPages, token_ids: Sequence[int]) -> int:
        """Blocks of `saved` that `token_ids` can take; ValueError if they are another
        prompt's (or another model's, format's or page size's: the hashes are seeded) or
        not in this pool's format, or blocks after the first (a tail, for the store)."""
        if saved.start:
            raise ValueError(f"saved pages from block {saved.start} on continue a stored run: "
                             "restore them through the store, which reads the whole run")
        ps = self.cache.page_size
        n = min(saved.num_blocks, (len(token_ids) - 1) // ps)
        if n and saved.hashes[n - 1] != block_hashes(token_ids, ps, self.cache.hash_seed,
                                                     n)[n - 1]:
            raise ValueError("the saved pages are not this prompt's (block hashes differ)")
        self.cache.pool.check_saved(saved.arrays, (self.num_layers, self.num_kv_heads), n)
        return n

    def restore(self, slot: int, first: int, saved: SavedPages, token_ids: Sequence[int],
                loaded_from: np.ndarray | None = None) -> int:
        """Give `slot` (holding `first` blocks) new pages for saved blocks [first, n) (never
        the prompt's last token: it is computed for its logits) and queue their contents
        (`loaded_from` [layers]: layer l only blocks [loaded_from[l], n), the others being
        recomputed: `pyramid`); returns the tokens the slot then holds (`first`'s when there
        is no room: those blocks are recomputed instead). The queue is written by `write`
        (`write_due`) or layer by layer in the slot's next step (`stage`)."""
        n = self.restorable(saved, token_ids)
        ids = self.cache.reserve_blocks(slot, first, n)
        if ids is None:
            return first * self.cache.page_size
        ids, fmt = np.asarray(ids), self.cache.pool.kv_format
        # host arrays, as warmup compiled the copies for (views: the store's are already,
        # a chain of entries in its parts, written in runs that stay inside one)
        arrays = {f: x if isinstance(x, BlockRuns) else np.asarray(x)
                  for f, x in saved.arrays.items()}
        cuts = next((x.bounds for x in arrays.values() if isinstance(x, BlockRuns)), [])

        def pages(a: int, b: int, layer: int | None = None) -> KVPages:
            at = slice(a, b) if layer is None else (slice(a, b), layer)
            return KVPages.from_arrays(fmt, {f: x[at] for f, x in arrays.items()})

        if loaded_from is None:
            runs = [(None, ids[a:b], pages(first + a, first + b))
                    for a, b in power_of_two_runs(n - first, cuts, first)]
        else:
            runs = [(layer, ids[lo - first + a:lo - first + b, layer],
                     pages(lo + a, lo + b, layer))
                    for layer in range(self.num_layers)
                    for lo in [min(max(int(loaded_from[layer]), first), n)]
                    for a, b in power_of_two_runs(n - lo, cuts, lo)]
        approx = None
        if saved.exact_blocks is not None and n > saved.exact_blocks:
            approx = max(saved.exact_blocks, first)
        self._pending[slot] = PendingRestore(runs, first, approx, split=loaded_from is not None)
        return n * self.cache.page_size

    def split(self, first: int, n: int, recompute: float, chunk: int,
              front: np.ndarray | None = None) -> np.ndarray | None:
        """Krul's split of restored blocks [first, n) with about `recompute` of them
        recomputed (`pyramid`, in steps of `chunk` blocks), raised to recompute at least the
        blocks [first, front[l]) of each layer l an entry did not store (`SavedPages.front`;
        both never grow with depth, so neither does the result); None when nothing is
        recomputed."""
        loaded_from = None
        if self.splits_restores and recompute and n > first:
            loaded_from = pyramid(first, n, self.num_layers, recompute, chunk)
        if front is not None:
            floor = np.clip(np.asarray(front, np.int64), first, n)
            loaded_from = floor if loaded_from is None else np.maximum(loaded_from, floor)
        return None if loaded_from is None or (loaded_from == first).all() else loaded_from

    def keepable(self, slot: int) -> bool:
        """Whether what `slot` holds may be kept on the device when it closes."""
        return True

    def convert_stored(self, arrays: dict, src: str, dst: str, dtype) -> dict[str, np.ndarray]:
        """A stored entry's arrays in form `src` as those of `dst` (`stored_kv`)."""
        return convert_stored(arrays, src, dst, dtype, rotate=self._rotate,
                              heads=self.num_kv_heads, page=self.cache.page_size)

    def write_due(self, slot: int) -> None:
        """Write `slot`'s queued restore now unless its next step stages it layer by layer
        (layer-wise execution, once a load rate has been measured: the first restore is
        written at once and timed)."""
        if not self.layerwise or not self.load_bytes_per_s:
            self.write([slot])

    def write(self, slots: Sequence[int]) -> None:
        """Write the queued restores of `slots` into the pool now, every layer at once
        (layer-wise execution otherwise writes them layer by layer in the slot's next step)."""
        for slot in slots:
            p = self._pending.get(slot)
            if p is not None and p.runs is not None:
                compiled = scatter_pages._cache_size()
                t0 = time.perf_counter()
                # every copy dispatched before any scatter: on a GPU they run beside the
                # compute queued before them (a split restore's recomputed part)
                runs = [(ids, self.cache.placement.put(pages))
                        for ids, pages in (flat_run(i, x, self.join_copies)
                                           for _, i, x in p.runs)]
                for ids, pages in runs:
                    self.cache.write_pages(ids, pages)
                jax.block_until_ready(self.cache.pool)
                # neither a compile nor waiting for recomputed blocks is a load rate
                if scatter_pages._cache_size() == compiled and not p.split:
                    self._learn_load(p.nbytes, time.perf_counter() - t0)
                self.written([slot])

    def write_all_but(self, slots: Sequence[int]) -> None:
        """Write every queued restore except those of `slots` (a step's rows, which stage
        theirs layer by layer)."""
        self.write([s for s, p in self._pending.items() if p.runs is not None
                    and s not in slots])

    def written(self, slots: Sequence[int]) -> None:
        """The restores of `slots` are in the pool: their blocks are the tokens' own again."""
        for slot in slots:
            p = self._pending.get(slot)
            if p is not None:
                p.runs = p.unwritten_from = None
                if p.approx_from is None:
                    del self._pending[slot]

    def forget(self, slot: int) -> None:
        """The slot closed: a restore never written is dropped."""
        self._pending.pop(slot, None)

    def saved_hashes(self, slot: int, approximate: bool = False) -> list[bytes]:
        """Chained hashes of `slot`'s shareable blocks (what `gather(slot, approximate=...)`
        saves)."""
        c = self.cache
        return block_hashes(c.slot_tokens[slot], c.page_size, c.hash_seed,
                            self.shareable_blocks(slot, approximate))

    def shareable_blocks(self, slot: int, approximate: bool = False) -> int:
        """Full blocks of `slot` whose KV is exactly its tokens' (all but moved or converted
        ones, and none past a restore that was never written); `approximate`: those too."""
        n = len(self.cache.slot_tokens[slot]) // self.cache.page_size
        p = self._pending.get(slot)
        if p is None:
            return n
        stops = (p.unwritten_from,) if approximate else (p.unwritten_from, p.approx_from)
        return min([n, *(x for x in stops if x is not None)])

    def _learn_load(self, nbytes: int, seconds: float) -> None:
        if seconds > 0:
            self.load_bytes_per_s = moving_average(self.load_bytes_per_s, nbytes / seconds)

    def read_buffer_layers(self, load_bytes: int, new_tokens: int,
                           prefill_token_seconds: float) -> int:
        """Layers of restored KV to have in flight ahead of the layer computing
        (CachedAttention 3.2.1): the buffer covers the gap between loading the history,
        T_load * L_hist, and prefilling the new tokens, T_pref * L_new; at least one layer.
        From measured rates; every layer until both have been measured."""
        layers = self.num_layers
        if not self.load_bytes_per_s or not prefill_token_seconds:
            return layers
        gap = load_bytes / self.load_bytes_per_s - prefill_token_seconds * new_tokens
        buffer_bytes = self.load_bytes_per_s * max(gap, 0.0)  # S_buf = B (T_load L_hist - ...)
        return min(layers, max(1, math.ceil(buffer_bytes / (load_bytes / layers))))

    def stage(self, slots: Sequence[int], new_tokens: int, prefill_token_seconds: float
              ) -> Callable | None:
        """A `before_layer` that writes the queued restores of `slots` into the pool layer by
        layer: each layer's pages are copied to the device a few layers ahead (the read
        buffer) while earlier layers compute, and scattered just before their layer. None
        when none of `slots` has one."""
        pending = [p for s in slots if (p := self._pending.get(s)) is not None
                   and p.runs is not None]
        if not pending:
            return None
        layers = self.num_layers
        ahead = self.read_buffer_layers(sum(p.nbytes for p in pending), new_tokens,
                                        prefill_token_seconds)
        staged: dict[int, list] = {}

        def stage(index: int) -> None:
            staged[index] = [(ids, self.cache.placement.put(pages)) for p in pending
                             for ids, pages in (flat_run(*r, self.join_copies)
                                                for r in p.layer_runs(index))]

        for index in range(min(ahead, layers)):
            stage(index)

        def before_layer(index: int, pool: KVPages, table_pages: jax.Array,
                         tiers: tuple | None) -> tuple[KVPages, jax.Array, tuple | None]:
            if index + ahead < layers:
                stage(index + ahead)
            for ids, pages in staged.pop(index, ()):
                pool = scatter_pages(pool, ids, pages)
            return pool, table_pages, tiers

        return before_layer

    # ------------------------------------------------------------------ saving, moving

    def gather(self, slot: int, start: int = 0, approximate: bool = False) -> SavedPages:
        """The full blocks `slot` holds from block `start` on (a store save of what it has
        not saved yet), as device arrays being copied out of the pool: the copy is
        dispatched, not awaited, and later steps may reuse the pages. `approximate`: with
        the blocks whose KV is not their tokens' own (moved, converted, or computed over
        such), from `exact_blocks` on; else only the blocks before them."""
        self.write([slot])
        n = self.shareable_blocks(slot, approximate)
        p = self._pending.get(slot)
        exact = None if p is None or p.approx_from is None or p.approx_from >= n else \
            p.approx_from
        start = min(start, n)
        c = self.cache
        arrays = gather_pages(c.pool, c.page_ids(slot, start, n)).arrays()
        for layer, h in c.offloaded.get(slot, {}).items():  # those blocks are on the host
            first, stop = max(h.first, start), min(h.first + h.blocks, n)
            if stop > first:
                host = h.host().arrays()
                arrays = {f: x.at[first - start:stop - start, layer].set(
                              host[f][first - h.first:stop - h.first])
                          for f, x in arrays.items()}
        return SavedPages(n, arrays, block_hashes(c.slot_tokens[slot], c.page_size,
                                                  c.hash_seed), exact_blocks=exact, start=start)

    def rebase(self, saved: SavedPages, token_ids: Sequence[int], keep: int,
               drop: int) -> SavedPages:
        """Saved pages of a sequence U moved for the prompt `token_ids` = U[:keep] +
        U[keep + drop:] (a conversation whose oldest turns after its first `keep` tokens
        were dropped): the tokens after `keep` move `drop` positions earlier, their keys
        re-rotated (CachedAttention 3.4). Returns the prompt's full blocks that the saved
        tokens cover (never its last token), hashed as the prompt's own; no blocks if none.
        Their KV is the KV those tokens had in U: attention saw the dropped turns."""
        if keep < 0 or drop < 0:
            raise ValueError(f"keep and drop must be >= 0, got {keep} and {drop}")
        if saved.front is not None and np.any(saved.front):
            raise ValueError("the saved blocks lack the front a split restore recomputes: "
                             "there is nothing to move for them")
        ps = self.cache.page_size
        m = min((saved.num_blocks * ps - drop) // ps, (len(token_ids) - 1) // ps)
        if m <= 0:
            return SavedPages(0, {}, [])
        t = np.arange(bucket(m) * ps)
        moved = t >= keep
        src = np.where(t < m * ps, t + drop * moved, 0).astype(np.int32)
        shift = np.where(moved, -drop, 0).astype(np.int32)
        rows = bucket(saved.num_blocks)
        pages = {}
        for f, x in saved.arrays.items():
            padded = np.zeros((rows, *x.shape[1:]), x.dtype)
            padded[: saved.num_blocks] = np.asarray(x)[: saved.num_blocks]
            pages[f] = padded
        out = rebase_pages(KVPages.from_arrays(self.cache.pool.kv_format, pages), src, shift,
                           rotate=self._rotate)
        return SavedPages(m, jax.device_get(out.arrays()),
                          self.cache.prompt_hashes(token_ids)[:m],
                          exact_blocks=min(m, keep // ps, m if saved.exact_blocks is None
                                           else saved.exact_blocks))

    def warmup(self) -> None:
        """Compile the page copies a KV store uses (saving a slot's blocks, restoring them
        at once or layer by layer) for every block count bucket, on null pages only."""
        c = self.cache
        count = 1
        while True:
            ids = c.page_ids(c.scratch, 0, 0, count=count)  # all null: nothing is written
            pages = jax.device_get(gather_pages(c.pool, ids))
            for run in (flat_run(np.zeros(ids.shape, np.int32), pages),
                        # one layer's pages: layer-wise staging, and split restores
                        flat_run(np.zeros(ids.shape[::2], np.int32), pages.layer(0),
                                 self.join_copies)):
                c.write_pages(run[0], c.placement.put(run[1]))
            if count >= c.max_pages:
                break
            count *= 2
        jax.block_until_ready(c.pool)
