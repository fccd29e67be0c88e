"""What leaves the pool and comes back, as the connector hands it around: `SavedPages` (a
sequence's saved blocks), `PendingRestore` (what a slot's KV still owes to them) and
`pyramid`, Krul's split of a restore between recomputed and loaded blocks (6.2)."""

from __future__ import annotations

from dataclasses import dataclass

import jax
import numpy as np

from jkv.kv.pages import KVPages


@dataclass
class SavedPages:
    """A sequence's first `num_blocks` full blocks in the pool's format: `arrays` as
    `KVPages.arrays()` names them, each [>= num_blocks, layers, KV heads, page, ...], rows past
    `num_blocks` padding (a whole row's: its pages and layout, `rows`). Host arrays, or
    device arrays still being gathered (`gather`). With `start` > 0 (a store save of the
    blocks after those already stored, `gather(start=...)`) the arrays hold blocks [start,
    num_blocks) from their first row, and `hashes` still start at block 0."""

    num_blocks: int
    arrays: dict[str, np.ndarray | jax.Array]
    hashes: list[bytes]  # chained block hashes of its tokens (model, format, page size)
    # blocks from this one on hold approximate KV (moved by `rebase`): usable by the prompt
    # they were made for, never shared under their tokens' hashes
    exact_blocks: int | None = None
    # a whole row (`RowConnector.gather`): the arrays are its pages in `tier_entries.row_layout`'s
    # order, this many rows of them real, not blocks
    rows: int | None = None
    start: int = 0
    # a row restored from a smaller stored form (`row_forms`, with exact_blocks 0):
    # that form's name, which a store keeps it under (only smaller forms after it)
    form: str | None = None
    # per layer l, blocks [0, front[l]) were not stored (Krul's lossless saving,
    # `jkv.store.fronts`): a restore recomputes at least those
    front: np.ndarray | None = None

    def fetch(self) -> SavedPages:
        """The same blocks as host arrays of exactly `num_blocks - start` rows (`rows` for a
        whole row; waits for the copy)."""
        arrays = jax.device_get(self.arrays)
        n = self.num_blocks - self.start if self.rows is None else self.rows
        return SavedPages(self.num_blocks, {f: np.asarray(x)[:n] for f, x in arrays.items()},
                          self.hashes[: self.num_blocks], self.exact_blocks, self.rows,
                          self.start, self.form, self.front)


@dataclass
class PendingRestore:
    """What a slot's KV still owes to saved pages."""

    # unwritten pages in runs: (layer, page ids, their contents as host arrays), k a power
    # of two: every layer's (layer None: ids [k, layers, KV heads], contents [k, layers, KV
    # heads, ...]) or one layer's (ids [k, KV heads], contents [k, KV heads, ...])
    runs: list[tuple[int | None, np.ndarray, KVPages]] | None = None
    unwritten_from: int | None = None  # first block restored but not yet written
    approx_from: int | None = None  # first block moved by `rebase` (approximate KV)
    split: bool = False  # some blocks are recomputed meanwhile: its time is not a load rate
    form: str | None = None  # a row restored from this smaller stored form

    @property
    def nbytes(self) -> int:
        return sum(pages.nbytes for _, _, pages in self.runs or ())

    def layer_runs(self, index: int) -> list[tuple[np.ndarray, KVPages]]:
        """Layer `index`'s runs: (ids [k, KV heads], contents [k, KV heads, ...])."""
        return [(ids[:, index], pages.layer(index)) if layer is None else (ids, pages)
                for layer, ids, pages in self.runs or () if layer in (None, index)]


def pyramid(first: int, n: int, num_layers: int, recompute: float, chunk: int) -> np.ndarray:
    """Krul's split of saved blocks [first, n) (6.2): layer l recomputes blocks [first, b_l)
    and loads [b_l, n); returns b [layers]. The recomputed share falls linearly with depth
    (the pyramid: the first layers load least, so their compute starts at once) and never
    grows (eq. 4-5: a layer's recomputed tokens are a prefix of the layer below's, whose
    hidden states it needs); about `recompute` of the (n - first) x layers block-layers are
    recomputed, and b_l - first is a multiple of `chunk` blocks (or n - first)."""
    if not 0.0 <= recompute <= 1.0:
        raise ValueError(f"recompute must be in [0, 1], got {recompute}")
    if chunk < 1:
        raise ValueError(f"chunk must be at least 1 block, got {chunk}")
    depth = np.arange(num_layers) / max(num_layers - 1, 1)
    if num_layers == 1:
        share = np.full(1, recompute)
    elif recompute <= 0.5:  # a triangle: 2r at the first layer down to 0 at the last
        share = 2 * recompute * (1 - depth)
    else:  # a trapezoid: everything at the first layer down to 2r - 1 at the last
        share = 1 - 2 * (1 - recompute) * depth
    grid = np.unique(np.r_[np.arange(0, n - first, chunk), n - first])
    nearest = np.abs(grid[None, :] - share[:, None] * (n - first)).argmin(axis=1)
    return first + grid[nearest].astype(np.int64)


def split_chunk(prefill_chunk: int, page_size: int) -> int:
    """Blocks a split restore's recomputed part moves by (`pyramid`'s chunk): a quarter of a
    prefill chunk."""
    return max(1, prefill_chunk // (4 * page_size))


__all__ = ["PendingRestore", "SavedPages", "pyramid", "split_chunk"]
