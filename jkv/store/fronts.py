"""Krul's lossless saving: a stored entry keeps only what a split restore of it loads.

A split restore (`jkv.engine.saved_pages.pyramid`) recomputes blocks [0, b_l) of each layer l
from the prompt's tokens while the rest loads, so those pages need not be stored at all:
where the restore planner's measured rates say a split pays (`restore_planning.saved_front`),
the save hands the store that pyramid, b [layers], and the entry keeps per layer only blocks
[b_l, n). A read puts the pages back in their places (zeros where nothing was kept) and hands
b over with them; the restore then recomputes at least those blocks of each layer, so no
missing page is ever attended. Only the root entry of a chain (blocks from 0) and only in the
pool's format: the blocks a lossy store converts, or a whole row, keep every page.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

FRONT = "recomputed_front"  # the entry array holding b [layers]


def drop_front(arrays: Mapping[str, np.ndarray], front: np.ndarray
               ) -> tuple[dict[str, np.ndarray], int]:
    """Pages [n, layers, ...] without each layer l's first front[l] blocks: every array as
    its layers' kept blocks one after the other [sum(n - front), ...], with `FRONT`; and the
    bytes left out."""
    front = np.asarray(front, np.int32)
    out: dict[str, np.ndarray] = {}
    dropped = 0
    for name, x in arrays.items():
        x = np.asarray(x)
        if x.ndim < 2 or x.shape[1] != front.shape[0] or front.max(initial=0) > x.shape[0]:
            raise ValueError(f"array {name} {x.shape} is not pages of {front.shape[0]} layers "
                             f"holding the front {front.tolist()}")
        out[name] = np.concatenate([x[b:, layer] for layer, b in enumerate(front)])
        dropped += x.nbytes - out[name].nbytes
    out[FRONT] = front
    return out, dropped


def restore_front(arrays: dict[str, np.ndarray], blocks: int) -> np.ndarray | None:
    """Put an entry's kept pages back in their places, in `arrays` (zeros in each layer's
    front: pages never to be attended); returns the front b [layers], None for an entry that
    kept every page. ValueError when the arrays do not add up to `blocks` blocks."""
    front = arrays.pop(FRONT, None)
    if front is None:
        return None
    front = np.asarray(front, np.int64)
    if front.ndim != 1 or (front < 0).any() or (front > blocks).any():
        raise ValueError(f"the entry's recomputed front {front.tolist()} does not fit "
                         f"{blocks} blocks")
    kept = blocks - front
    for name, x in arrays.items():
        if x.shape[0] != kept.sum():
            raise ValueError(f"array {name} holds {x.shape[0]} pages, the front keeps "
                             f"{int(kept.sum())}")
        full = np.zeros((blocks, front.shape[0], *x.shape[1:]), x.dtype)
        offsets = np.r_[0, np.cumsum(kept)]
        for layer, b in enumerate(front):
            full[b:, layer] = x[offsets[layer]:offsets[layer + 1]]
        arrays[name] = full
    return front


__all__ = ["FRONT", "drop_front", "restore_front"]
