"""Verified restores, the store's side: the fingerprint an entry keeps, and how far a
restore's may be from it.

An entry whose blocks end at position p keeps, where its request had computed the token at
p, that token's fingerprint (`jkv.engine.fingerprints`: the sketched final hidden state),
with p, the token id and whether it was pooled (computed over the other tokens' KV only as
the pool holds it), as two arrays of the entry: the checksum covers them, and moves between
tiers and recompressions keep them. A restore that ends at p, of a prompt with the
same token there, computes that state again over the restored KV (the scheduler's
`jkv.sched.restore_checks`). `distance` says how far the two are; over `tolerance`, which
each KV format's measured noise sets, the KV restored is not what the model computed: the
restore is discarded and recomputed, and the entry's chain is quarantined
(`StoreReader.quarantine`).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import NamedTuple

import numpy as np

MARK_AT = "verify_at"  # the entry array holding the fingerprint's position, token, pooled
MARK = "verify_mark"  # the entry array holding the fingerprint

# By "<token policy>:<KV format>" (block pages: "none", whatever their policy), (pooled, in
# a chunk): the largest distance between a restore's fingerprint and its entry's that runs
# of `benchmarks/restore.py --verify` measured over the fidelity documents and chats
# (benchmarks/results/restore_verify/), times its margin, for a fingerprint computed over
# the pool's KV alone (its token the first its row fed: decoded, or a chunk's first; a
# restore gives that KV as it was, so only rounding and, under a token policy, placements
# since differ) and for one computed inside a prefill chunk (it read the chunk's earlier
# tokens in the model dtype, which the restore gives as the pool stores them; converted
# forms are counted so too). None is below 0.024, room for a bfloat16 model's rounding
# (float32 restores of block pages measure about 2e-6). Token policies are not verified: a
# restored row's tokens were placed (kept, evicted, demoted) after the fingerprint was
# taken, so an honest distance depends on the model (on SmolLM2 streaming's reached 0.058,
# on a tiny random model 0.29) and no one tolerance separates it from a wrong restore's.
TOLERANCE: dict[str, tuple[float, float]] = {
    "none:auto": (0.024, 0.024),
    "none:int8": (0.024, 0.024),
    "none:int4": (0.024, 0.13),
    "none:k8v4": (0.024, 0.071),
    "none:k4v2": (0.024, 0.24),
    "none:k2v2": (0.024, 0.37),
    "none:k8v4t": (0.024, 0.041),
    "none:k4v2t": (0.024, 0.24),
    "none:k4v8t": (0.024, 0.23),
    "none:k2v4t": (0.024, 0.48),
}


class Mark(NamedTuple):
    """The fingerprint of the token at `position` (`token`, its id) that an entry keeps;
    `pooled`: computed over the other tokens' KV only as the pool holds it."""

    position: int
    token: int
    vector: np.ndarray  # float32 [SKETCH_DIMS]
    pooled: bool = False


def mark_arrays(mark: tuple | None) -> dict[str, np.ndarray]:
    """`mark` (a `Mark`) as the entry's arrays (none without one)."""
    if mark is None:
        return {}
    position, token, vector, pooled = mark
    return {MARK_AT: np.asarray([position, token, pooled], np.int32),
            MARK: np.asarray(vector, np.float32).reshape(-1)}


def pop_mark(arrays: dict[str, np.ndarray]) -> Mark | None:
    """The fingerprint `mark_arrays` put among an entry's `arrays`, taken out of them (None
    when it has none, or one not of that shape)."""
    at, vector = arrays.pop(MARK_AT, None), arrays.pop(MARK, None)
    if (at is None or vector is None or at.shape != (3,) or vector.ndim != 1
            or vector.dtype != np.float32):
        return None
    return Mark(int(at[0]), int(at[1]), np.array(vector), bool(at[2]))


def tolerance(policy: str, kv_format: str, forms: Iterable[str] = (),
              pooled: bool = False) -> float | None:
    """The largest distance a restore into a pool of `kv_format` whose tokens `policy`
    places ("none": block pages) may show, for a fingerprint `pooled` or not, its entries
    stored in `forms` too (converted: in-a-chunk figures, the coarsest counting); None where
    one of them was not measured (the restore is not verified)."""
    forms = set(forms)
    names = {f"{policy}:{f}" for f in (kv_format, *forms)}
    if not names <= TOLERANCE.keys():
        return None
    return max(TOLERANCE[n][0 if pooled and not forms else 1] for n in names)


def distance(stored: np.ndarray, computed: np.ndarray) -> float:
    """How far a restore's fingerprint is from the stored one, relative to the stored one's
    norm (0: the same state)."""
    norm = float(np.linalg.norm(stored))
    return float(np.linalg.norm(np.asarray(computed) - stored)) / max(norm, 1e-30)

