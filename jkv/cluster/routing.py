"""Which replica a request goes to: the one holding the longest prefix of it, unless that one
is too busy (KV-aware routing, a pure function so it can be tested without a cluster).

Each replica reports what it holds (`ReplicaView`): the sessions it served and the chained
block hashes of the KV it can give back (its device prefix cache and its store). Block hashes
are chained, so a replica holding a prompt's hash i holds its blocks 0..i: the longest prefix a
replica holds is the last of the prompt's hashes it reports. A prefix every replica holds (the
chat template's system prompt) is no reason to prefer one, so only what a replica holds beyond
it counts. Only the replicas whose queue is within `bound` requests of the shortest are
candidates. Among them a request goes to the one that served its session (of several, the one
holding the longest prefix of its prompt: a conversation moved under load is held by both, its
newer turns by the one it moved to), else to the one holding the longest prefix; a holder past
the bound is passed over for the best holder within it, and where none within it holds
anything, for the least loaded. A request no replica holds more of than every replica does
starts a conversation whose KV will stay where it lands: it goes to the candidate with the
shortest queue, of equal queues the one with the fewest active sessions (served in the last
minute: the conversations whose history its memory must keep), as SGLang's and Ray's prefix
routers send a request that matches nothing to the smallest tree. Equal ones are ranked by a
hash of the request's key (its session, else its first block) with each replica's name
(rendezvous hashing): new sessions spread evenly over idle replicas, where ranking by name
piled them on the first.
"""

from __future__ import annotations

import hashlib
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field

HASH_BYTES = 8  # of each block hash a replica reports: a 2^-64 collision never matters here
ACTIVE_S = 60.0  # a session a replica served this recently is active: its next turn likely


@dataclass(frozen=True)
class ReplicaView:
    """What the router knows of one replica: its name, requests queued or running on it,
    the sessions it served, the block hashes (their first HASH_BYTES) it holds and how many
    sessions it served in the last ACTIVE_S seconds (`active`: their next turns likely to
    come)."""

    name: str
    queue: int
    sessions: Collection[str] = frozenset()
    blocks: Collection[bytes] = field(default_factory=frozenset)
    active: int = 0


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
    replicas within `bound` of the shortest queue, the best holder (`best_holder`, counting
    only blocks past those every replica holds); for a request none holds more of, the
    shortest queue, then the fewest active sessions; else (only replicas past the
    bound hold it) every replica in one group from the least loaded."""
    if bound < 0:
        raise ValueError(f"bound must be >= 0 requests, got {bound}")
    if not views:
        return []
    key = session if session is not None else hashes[0].hex() if hashes else ""
    by_load = sorted(views, key=lambda v: (v.queue, tie_rank(key, v.name)))
    near = [v for v in by_load if v.queue - by_load[0].queue <= bound]
    common = min(held_prefix(v, hashes) for v in views)
    affine = best_holder(near, hashes, session, common)
    if affine is None and best_holder(by_load, hashes, session, common) is None:
        # a new conversation: least loaded, then where the fewest others need their KV kept
        affine = min(near, key=lambda v: (v.queue, v.active, tie_rank(key, v.name)))
    if affine is None:
        return [[v.name for v in by_load]]
    return [[affine.name], [v.name for v in by_load if v is not affine]]


def best_holder(views: Sequence[ReplicaView], hashes: Sequence[bytes],
                session: str | None, common: int) -> ReplicaView | None:
    """Of `views` (least loaded first), the one holding the request's session with the
    longest prefix of it, else the one holding the longest prefix; None where none holds
    the session or more than the `common` blocks every replica holds."""
    holders = [v for v in views if session is not None and session in v.sessions]
    held = [(held_prefix(v, hashes), v) for v in holders or views]
    best, view = max(held, key=lambda x: x[0])  # (max keeps the first: least loaded)
    return view if best > common or holders else None


__all__ = ["ACTIVE_S", "HASH_BYTES", "ReplicaView", "best_holder", "held_prefix", "rank_replicas",
           "tie_rank"]
