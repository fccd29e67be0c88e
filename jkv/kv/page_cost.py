"""How many pages tokens take: the one formula that allocation and planning share.

A sequence keeps a page per (layer, KV head) for every `page_size` tokens it holds, so the
engine's KV cache manager (which allocates) and the scheduler's plan (which predicts) ask the
same `PageCost` instead of each deriving it.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PageCost:
    """Pages of one sequence: `heads` (layers x KV heads) pages per `page_size` tokens,
    taken with a page's first token, or (`on_fill`, token tiers) once the page is full: the
    page being filled stays beside the pool, and a full page's tokens join a tier's end,
    which takes one new page per row whatever the tier holds."""

    page_size: int
    heads: int
    on_fill: bool = False
    layers: int = 1  # of which `heads` are layers x KV heads (layer-wise offload's unit)

    def __post_init__(self) -> None:
        if self.page_size <= 0 or self.heads <= 0:
            raise ValueError(f"page_size and heads must be positive, got {self.page_size} "
                             f"and {self.heads}")
        if self.layers <= 0 or self.heads % self.layers:
            raise ValueError(f"layers must divide heads ({self.heads}), got {self.layers}")

    def layer_pages(self, tokens: int) -> int:
        """Pages one layer of a sequence holding `tokens` tokens occupies (at most)."""
        return self.pages(tokens) // self.layers

    def pages(self, tokens: int) -> int:
        """Pages a sequence holding `tokens` tokens occupies; with token tiers at most: a
        row's two tiers may each end in a part-filled page, one page more than the tokens
        of its full pages fill (high / page + low / (2 page) of them, rounded up each)."""
        if self.on_fill:
            full = tokens // self.page_size
            return (full + (full > 0)) * self.heads
        return -(-tokens // self.page_size) * self.heads

    def grow(self, held: int, n: int) -> int:
        """New pages a sequence holding `held` tokens takes to add `n` more."""
        return self.pages(held + n) - self.pages(held)

    def fits(self, held: int, want: int, pages: int) -> int:
        """The most of `want` tokens that `pages` free pages let a sequence holding `held`
        tokens add."""
        full = held // self.page_size if self.on_fill else -(-held // self.page_size)
        more = max(pages, 0) // self.heads
        if self.on_fill and not full:  # the first full page brings the tiers' extra one
            more = max(more - 1, 0)
        room = (full + more) * self.page_size
        if self.on_fill:
            room += self.page_size - 1  # the next page's tokens but its last are free
        return max(0, min(want, room - held))
