"""Blocks held in several arrays, read as one without copying them (a stored run of blocks
that is a chain of entries), and the power-of-two runs a restore writes them in."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


class BlockRuns:
    """Arrays of one trailing shape and dtype joined along axis 0 without a copy: a slice of
    rows that lies in one of them is a view of it, one across them is copied (only those
    rows); `np.asarray` joins them all."""

    def __init__(self, parts: Sequence[np.ndarray]) -> None:
        if not parts:
            raise ValueError("BlockRuns needs at least one array")
        self.parts = [np.asarray(p) for p in parts]
        first = self.parts[0]
        if any(p.shape[1:] != first.shape[1:] or p.dtype != first.dtype for p in self.parts):
            raise ValueError("BlockRuns' arrays must share their trailing shape and dtype")
        self.starts = [0]
        for p in self.parts:
            self.starts.append(self.starts[-1] + len(p))
        self.shape = (self.starts[-1], *first.shape[1:])
        self.dtype = first.dtype
        self.ndim = len(self.shape)

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)

    @property
    def bounds(self) -> list[int]:
        """Where each array but the first begins, in rows."""
        return self.starts[1:-1]

    def __len__(self) -> int:
        return self.shape[0]

    def head(self, n: int) -> BlockRuns:
        """The first `n` rows, still in parts."""
        parts = [p[: max(0, min(len(p), n - s))] for p, s in zip(self.parts, self.starts,
                                                                     strict=False)]
        return BlockRuns([p for p in parts if len(p)] or [self.parts[0][:0]])

    def __getitem__(self, key):
        rows, rest = (key[0], key[1:]) if isinstance(key, tuple) else (key, ())
        if not isinstance(rows, slice) or rows.step not in (None, 1):
            return np.asarray(self)[key]
        a, b, _ = rows.indices(len(self))
        pieces = [p[max(a, s) - s:min(b, s + len(p)) - s]
                  for p, s in zip(self.parts, self.starts, strict=False)
                  if max(a, s) < min(b, s + len(p))]
        out = (pieces[0] if len(pieces) == 1 else np.concatenate(pieces) if pieces
               else self.parts[0][:0])
        return out[(slice(None), *rest)] if rest else out

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        out = self.parts[0] if len(self.parts) == 1 else np.concatenate(self.parts)
        return out if dtype is None else out.astype(dtype)


def power_of_two_runs(n: int, cuts: Sequence[int] = (), offset: int = 0) -> list[tuple[int,
                                                                                        int]]:
    """[start, stop) runs covering [0, n), each a power of two long, longest first, none
    crossing a cut (`cuts` in the rows of `offset` + start: where a `BlockRuns`' arrays
    meet, so every run is a view)."""
    edges = sorted({0, n, *(c - offset for c in cuts if 0 < c - offset < n)})
    out = []
    for lo, hi in zip(edges, edges[1:], strict=False):
        start = lo
        while start < hi:
            size = 1 << ((hi - start).bit_length() - 1)
            out.append((start, start + size))
            start += size
    return out
