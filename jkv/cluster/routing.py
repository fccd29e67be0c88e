"""Which replica a request goes to: the one holding the longest prefix of it, unless that one
is too busy (KV-aware routing, a pure function so it can be tested without a cluster).

Each replica reports what it holds (`ReplicaView`): the sessions it served and the chained
block hashes of the KV it can give back (its device prefix cache and its store). Block hashes
are chained, so a replica holding a prompt's hash i holds its blocks 0..i: the longest prefix a
replica holds is the last of the prompt's hashes it reports. Only the replicas whose queue is
within `bound` requests of the shortest are candidates. Among them a request goes to the one
that served its session (of several, the one holding the longest prefix of its prompt: a
conversation moved under load is held by both, its newer turns by the one it moved to), else
to the one holding the longest prefix; a holder past the bound is passed over for the best
holder within it, and where none within it holds anything, for the least loaded. A request no
replica holds anything of starts a conversation whose KV will stay where it lands: it goes to
the candidate holding the fewest sessions (the one whose memory the fewest conversations
share), as SGLang's and Ray's prefix routers send a request that matches nothing to the
smallest tree; placing sessions by queue alone left one replica with most of the long
conversations. Equal counts are ranked by a hash of the request's key (its session, else its
first block) with each replica's name (rendezvous hashing): new sessions spread evenly over
idle replicas, where ranking by name piled them on the first.
"""

from __future__ import annotations

import hashlib
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field

HASH_BYTES = 8  # of each block hash a replica reports: a 2^-64 collision never matters here


@dataclass(frozen=True)
class ReplicaView:
    """What the router knows of one replica: its name, requests queued or running on it,
    the sessions it served and the block hashes (their first HASH_BYTES) it holds."""

    name: str
    queue: int
    sessions: Collection[str] = frozenset()
    blocks: Collection[bytes] = field(default_factory=frozenset)


def held_prefix(view: ReplicaView, hashes: Sequence[bytes]) -> int:
    """Blocks of a prompt (its chained block hashes) that `view` holds: one past the last
    hash it reports."""
    for i in range(len(hashes) - 1, -1, -1):
        if hashes[i][:HASH_BYTES] in view.blocks:
            return i + 1
    return 0


def tie_rank(key: str, name: str) -> bytes:
    """Where replica `name` comes among equally loaded ones for a request of `key`."""
    return hashlib.blake2b(f"{key}\0{name}".encode(), digest_size=8).digest()


def rank_replicas(views: Sequence[ReplicaView], hashes: Sequence[bytes],
                  session: str | None, bound: int) -> list[list[str]]:
    """Replica names in ranked groups, most preferred first (what a Ray Serve request
    router returns): [[the affine replica], [the others]], the affine one being, among the
    replicas within `bound` of the shortest queue, the best holder (`best_holder`); for a
    request no replica holds anything of, the one within the bound holding the fewest
    sessions; else (only replicas past the bound hold it) every replica in one group from
    the least loaded."""
    if bound < 0:
        raise ValueError(f"bound must be >= 0 requests, got {bound}")
    if not views:
        return []
    key = session if session is not None else hashes[0].hex() if hashes else ""
    by_load = sorted(views, key=lambda v: (v.queue, tie_rank(key, v.name)))
    near = [v for v in by_load if v.queue - by_load[0].queue <= bound]
    affine = best_holder(near, hashes, session)
    if affine is None and best_holder(by_load, hashes, session) is None:
        # a new conversation: where the fewest others keep their KV
        affine = min(near, key=lambda v: (len(v.sessions), tie_rank(key, v.name)))
    if affine is None:
        return [[v.name for v in by_load]]
    return [[affine.name], [v.name for v in by_load if v is not affine]]


def best_holder(views: Sequence[ReplicaView], hashes: Sequence[bytes],
                session: str | None) -> ReplicaView | None:
    """Of `views` (least loaded first), the one holding the request's session with the
    longest prefix of it, else the one holding the longest prefix; None where none holds
    anything of it."""
    holders = [v for v in views if session is not None and session in v.sessions]
    held = [(held_prefix(v, hashes), v) for v in holders or views]
    best, view = max(held, key=lambda x: x[0])  # (max keeps the first: least loaded)
    return view if best or holders else None


__all__ = ["HASH_BYTES", "ReplicaView", "best_holder", "held_prefix", "rank_replicas",
           "tie_rank"]
