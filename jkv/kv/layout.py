"""How a sequence's KV sits in the pool: the interface every layout gives the manager.

A layout (`block_pages.BlockPages`, `tiered_rows.TieredRows`) owns what is particular to
its arrangement of pages: what it keeps for reuse after a sequence ends (cached blocks, kept
rows), how a sequence starts from that, grows and ends, how many pages it holds, and what a
model call reads and leaves behind. The manager holds what all layouts share (pool, free
list, tables, slots) and asks its layout for the rest, so no caller tests which layout it has.
A layout may offer more that only its own connector calls (`BlockPages.reserve_blocks` and
its layer moves, `TieredRows.moves`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import jax


class Layout(Protocol):
    name: str  # "blocks", "rows": stored entries of two layouts never match
    pages_on_fill: bool  # pages are taken as they fill (else with their first token)
    filling_scores: bool  # the filling pages carry each token's significance
    lossy_recompute: bool  # a sequence's KV recomputed from its tokens differs from it
    tier_refusals: int  # placements the pool was too short for
    num_compiles: int  # compiled variants of the layout's own step calls

    @staticmethod
    def table_width(pages: int) -> int:
        """Page-table width for rows of at most `pages` pages."""

    @staticmethod
    def seed_tag(policy: object) -> bytes:
        """Added to the block hashes' seed (entries of two layouts never match)."""

    @property
    def evictable_pages(self) -> int:
        """Pages kept for reuse that an allocation may evict."""

    @property
    def cached_pages(self) -> int:
        """Pages kept for reuse."""

    def shared_rows(self, slot: int) -> list[int]:
        """Prefix-cache rows `slot` started from (none where blocks are not shared)."""

    def pages_held(self, slot: int) -> int:
        """Pages of the pool `slot` holds."""

    def layer_own_pages(self, slot: int, tokens: int | None = None) -> int:
        """Pages one layer of `slot` holds past shared ones (the most of any layer)."""

    def pages_offloadable(self, slot: int) -> int:
        """Pages offloading every resident layer of `slot` frees."""

    def pages_freed_by_close(self, slot: int) -> int:
        """How much the available pages grow when `slot` closes."""

    def tier_tokens(self, slot: int, tokens: int) -> dict[str, int]:
        """Tokens of `slot` (holding `tokens`) kept per tier, over (layer, KV head)."""

    def lookup(self, hashes: Sequence[bytes]) -> tuple[int, int]:
        """(tokens a prompt with these block hashes starts with, pages that takes)."""

    def make_room(self, pages: int) -> bool:
        """Evict what is kept for reuse until `pages` pages are free."""

    def open(self, slot: int, hashes: Sequence[bytes], prompt_tokens: int) -> int:
        """Start the empty `slot` for a prompt of `prompt_tokens` (`hashes`: its blocks')
        from what is kept; the tokens it then holds."""

    def grow(self, new_lengths: dict[int, int], need: int) -> jax.Array:
        """Take `need` pages for slots growing to `new_lengths`; the device's ok flag."""

    def close(self, slot: int, shareable: int, keep: bool) -> None:
        """End `slot`'s sequence, keeping what can be reused when `keep`."""

    def model_tiers(self) -> tuple | None:
        """What a model call reads of token tiers (None: nothing)."""

    def took_meta(self, meta: object) -> None:
        """The token metadata a model call returned."""

    def placement(self, slots: Sequence[int], added: Sequence[int], rows: int, tokens: int,
                  generation: bool) -> object | None:
        """What is due after a model call over `slots` (padded to rows x tokens), decided
        before it runs (a layer on the host has its share done while it is in the pool)."""

    def after_call(self, plan: object | None) -> None:
        """After a model call: `placement`'s plan for it."""

    def after_step(self) -> None:
        """After a step's calls have finished."""

    def warmup(self) -> None:
        """Compile the layout's own calls (nothing changes)."""
