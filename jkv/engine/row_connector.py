"""KV of a token-tier row leaving the pool and coming back: a token-tier engine's connector.

A token-tier row (`TieredRows`) is no run of blocks: the store keeps it whole, as its pages in
`tier_entries.row_layout`'s order with each page's head, tier, index and token metadata
(`gather`), found only whole and written into an empty slot (`restore`), its compression
kept. A row restored from a smaller stored form (`row_forms`: tokens dropped) is approximate:
never kept on the device, saved only to a lossy store, in that form.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import jax
import numpy as np

from jkv.engine.connector import KVConnector
from jkv.engine.saved_pages import PendingRestore, SavedPages
from jkv.kv.pages import KVPages
from jkv.kv.prefix_cache import block_hashes
from jkv.kv.tier_entries import TIER_ARRAYS, place_row, row_layout, tier_counts
from jkv.policies.stored_forms import convert_row


class RowConnector(KVConnector):
    """Saves and restores whole token-tier rows; the rest as `KVConnector` does."""

    stored_whole = True  # looked up and saved whole, restored into an empty slot
    splits_restores = False

    def restorable(self, saved: SavedPages, token_ids: Sequence[int]) -> tuple[
            dict[str, np.ndarray], np.ndarray, np.ndarray]:
        """A saved token-tier row (`gather`) checked for `token_ids` and this pool: (its
        layout, tier counts high, low [L, H]). ValueError if it is another prompt's, not a
        whole token-tier row, inconsistent, or wider than this pool's table."""
        c, ps = self.cache, self.cache.page_size
        n = saved.num_blocks
        if not 1 <= n <= (len(token_ids) - 1) // ps:
            raise ValueError(f"a saved token-tier row of {n} blocks does not fit a prompt of "
                             f"{len(token_ids)} tokens")
        if saved.hashes[n - 1] != block_hashes(token_ids, ps, c.hash_seed, n)[n - 1]:
            raise ValueError("the saved pages are not this prompt's (block hashes differ)")
        arrays = saved.arrays
        missing = [k for k in TIER_ARRAYS if k not in arrays]
        if missing:
            raise ValueError(f"the saved pages are not a token-tier row (no {missing})")
        layout = {k: np.asarray(arrays[k]) for k in TIER_ARRAYS[:4]}
        rows = len(layout["tier_head"])
        heads = self.num_layers * self.num_kv_heads
        if any(x.shape != (rows,) for x in layout.values()) or not (
                (layout["tier_head"] >= 0) & (layout["tier_head"] < heads)
                & (layout["tier_tokens"] >= 0)).all():
            raise ValueError("the saved token-tier row's page layout is malformed")
        high, low = tier_counts(layout, heads)
        if (high + low > n * ps).any():  # bounds first: the layout is built from them
            raise ValueError("the saved token-tier row holds more tokens than its blocks")
        if (-(-high // ps) + -(-low // (2 * ps)) > c.max_pages).any():
            raise ValueError("the saved token-tier row is wider than this pool's page tables")
        want = row_layout(high, low, ps)
        if any(not np.array_equal(layout[k], want[k]) for k in want):
            raise ValueError("the saved token-tier row's pages do not match its tier counts")
        pages = {k: v for k, v in arrays.items() if k not in TIER_ARRAYS}
        c.pool.check_saved(pages, (), rows)
        if any(len(x) != rows for x in pages.values()):
            raise ValueError(f"the saved token-tier row's pages are not {rows} rows")
        for k in ("tier_score", "tier_pos"):
            if np.shape(arrays[k]) != (rows, 2 * ps):
                raise ValueError(f"saved {k} is {list(np.shape(arrays[k]))}, expected "
                                 f"[{rows}, {2 * ps}]")
        shape = (self.num_layers, self.num_kv_heads)
        return layout, high.reshape(shape), low.reshape(shape)

    def restore_row(self, slot: int, saved: SavedPages, token_ids: Sequence[int]) -> int:
        """Start the empty `slot` with a saved token-tier row (its compression kept); returns
        the tokens it then holds (0 when its pages cannot be had: recomputed instead). A row
        stored in a smaller form (`saved.exact_blocks`: tokens dropped by the store) makes
        the slot's row approximate (`approximate_row`)."""
        layout, high, low = self.restorable(saved, token_ids)
        arrays = saved.arrays
        pages = KVPages.from_arrays(self.cache.pool.kv_format, {
            k: np.asarray(v) for k, v in arrays.items() if k not in TIER_ARRAYS})
        tokens = saved.num_blocks * self.cache.page_size
        compiled = place_row._cache_size()
        t0 = time.perf_counter()
        if not self.cache.layout.moves.place_tiers(slot, layout, pages,
                                             np.asarray(arrays["tier_score"]),
                                             np.asarray(arrays["tier_pos"]), high, low, tokens):
            return 0
        jax.block_until_ready(self.cache.pool)
        if place_row._cache_size() == compiled:  # a compile is not a load rate
            self._learn_load(pages.nbytes, time.perf_counter() - t0)
        if saved.exact_blocks is not None and saved.exact_blocks < saved.num_blocks:
            self._pending[slot] = PendingRestore(approx_from=0, form=saved.form)
        return tokens

    def warmup(self) -> None:
        """The block copies (`KVConnector.warmup`), and a whole row's save for every bucket
        of pages (`RowMoves.warmup`; its restore compiles on first use)."""
        super().warmup()
        self.cache.layout.moves.warmup()

    def approximate_row(self, slot: int) -> bool:
        """Whether `slot`'s token-tier row was restored from a smaller stored form (or one saved
        approximate): it is not kept on the device (exact-hash lookups), and only a lossy
        store is handed it, marked approximate, in that form (`gather`)."""
        p = self._pending.get(slot)
        return p is not None and p.approx_from is not None

    def gather(self, slot: int, start: int = 0, approximate: bool = False) -> SavedPages:
        """The token-tier row `slot` holds (its full pages' tokens, as their tiers keep them),
        as device arrays being copied out of the pool (`rows` of them real); marked
        approximate (`exact_blocks` 0) and named in its form when it was restored from a
        smaller one. (`start` and `approximate` are the block pages' own: a row is saved
        whole.)"""
        c = self.cache
        layout, pages, score, pos = c.layout.moves.tier_pages(slot)
        n = len(c.slot_tokens[slot]) // c.page_size
        approx = self.approximate_row(slot)
        return SavedPages(n, {**pages.arrays(), **layout, "tier_score": score, "tier_pos": pos},
                          block_hashes(c.slot_tokens[slot], c.page_size, c.hash_seed, n),
                          exact_blocks=0 if approx else None,
                          rows=int((layout["tier_head"] >= 0).sum()),
                          form=self._pending[slot].form if approx else None)

    def restore(self, slot: int, first: int, saved: SavedPages, token_ids: Sequence[int],
                loaded_from: np.ndarray | None = None) -> int:
        """A saved row into `slot` unless it already holds `first` blocks (a kept row on the
        device: a row is never restored in part); returns the tokens it then holds."""
        return first * self.cache.page_size or self.restore_row(slot, saved, token_ids)

    def keepable(self, slot: int) -> bool:
        """A row restored from a smaller form is not kept on the device."""
        return not self.approximate_row(slot)

    def saved_hashes(self, slot: int, approximate: bool = False) -> list[bytes]:
        """None: a row is saved whole, never as a tail of stored blocks."""
        return []

    def convert_stored(self, arrays: dict, src: str, dst: str, dtype) -> dict[str, np.ndarray]:
        """A stored row in form `src` as form `dst`: the pool's format or a row form, which
        drops tokens (`stored_forms.convert_row`)."""
        c, t = self.cache, self.cache.layout.policy
        return convert_row(arrays, src, dst, c.pool.kv_format, heads=c.cost.heads,
                           page=c.page_size, sinks=t.sinks, recent=t.recent_window)
