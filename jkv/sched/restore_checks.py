"""Verified restores, the scheduler's side: each request's latest fingerprints, and the check
a restore of it is given.

Every step returns, per row, the fingerprints of the block starts it computed
(`jkv.engine.fingerprints`, `Sampled.marks`); a request keeps its latest few (`record`),
each marked pooled when its token was the first its row fed (so it read the other tokens'
KV only as the pool holds them, as a restore gives it), and a save of its full blocks can
keep the one of the token just past them with the entry (`for_save`). A restore that ends
where its entry's fingerprint was taken, of a prompt with the same token there, is given a
`RestoreCheck` (`plan_check`): the request's first step computes that token over the
restored KV, and the scheduler's store side compares the two
(`jkv.sched.store_side.StoreSide.after_step`; `jkv.store.verify` for the tolerance).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from jkv.store.verify import Mark

KEEP = 4  # fingerprints a request keeps: its latest block starts


@dataclass(frozen=True)
class RestoreCheck:
    """What a restored request's first computed token is checked against."""

    key: str  # the entry restored (its chain is quarantined if the check fails)
    position: int  # the restored length: the first position the request computes
    vector: np.ndarray  # the entry's fingerprint of the token there
    tolerance: float  # the largest distance allowed (`jkv.store.verify.tolerance`)
    tier: str = "host"  # where the entry was read from
    restored: int = 0  # tokens the restore gave (counted as store hits unless it fails)


def record(kept: dict[int, tuple[np.ndarray, bool]], positions: np.ndarray,
           vectors: np.ndarray, start: int) -> None:
    """Add the fingerprints of a row that fed tokens from position `start` on (positions
    [2], -1 none; vectors [2, SKETCH_DIMS]) to the request's `kept` (position: (vector,
    pooled)), dropping all but its latest `KEEP`."""
    for p, v in zip(positions.tolist(), vectors, strict=True):
        if p >= 0:
            kept[p] = (np.array(v, np.float32), p == start)
    for p in sorted(kept)[:-KEEP]:
        del kept[p]


def for_save(kept: dict[int, tuple[np.ndarray, bool]], blocks: int, page_size: int,
             tokens: Sequence[int]) -> Mark | None:
    """What a save of the first `blocks` blocks of a request that holds `tokens` keeps: the
    fingerprint of the token just past them; None when that token has not been computed
    (the blocks end what it holds) or is not among its latest."""
    p = blocks * page_size
    got = kept.get(p) if blocks else None
    return None if got is None or p >= len(tokens) else Mark(p, int(tokens[p]), *got)


def plan_check(mark: Mark | None, tokens: Sequence[int], held: int, tolerance: float | None,
               key: str, tier: str = "host", restored: int = 0) -> RestoreCheck | None:
    """The check of a restore (of entry `key`, read from `tier`, giving `restored` tokens)
    that leaves a prompt of `tokens` holding `held` tokens, from the entry's fingerprint
    `mark`: None (not verified) without one, without a tolerance, or where the prompt's
    token at `held` is not the one the fingerprint was taken of."""
    if (mark is None or tolerance is None or mark.position != held or held >= len(tokens)
            or tokens[held] != mark.token):
        return None
    return RestoreCheck(key, held, mark.vector, tolerance, tier, restored)
