"""KV-aware routing's rule, without a cluster: session first, then the longest held prefix,
unless that replica is busier than the least loaded by more than the bound; against a
brute-force statement of the same rule on random replicas, and a planted bug."""

from __future__ import annotations

import hashlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jkv.cluster import routing
from jkv.cluster.routing import HASH_BYTES, ReplicaView, held_prefix, rank_replicas


def chain(tokens: list[int], block: int = 4) -> list[bytes]:
    out, prev = [], b"seed"
    for i in range(len(tokens) // block):
        prev = hashlib.blake2b(prev + bytes(tokens[i * block:(i + 1) * block]),
                               digest_size=16).digest()
        out.append(prev)
    return out


def test_the_replica_holding_the_longest_prefix_wins_within_the_bound():
    prompt = chain(list(range(40)))
    a = ReplicaView("a", 3, blocks={h[:HASH_BYTES] for h in prompt[:4]})
    b = ReplicaView("b", 5, blocks={h[:HASH_BYTES] for h in prompt[:8]})
    c = ReplicaView("c", 1)
    assert held_prefix(b, prompt) == 8 and held_prefix(c, prompt) == 0
    assert rank_replicas([a, b, c], prompt, None, bound=4) == [["b"], ["c", "a"]]
    # b's queue is 4 longer than c's: past a bound of 3 the best holder within it (a, 4
    # blocks) takes it; past a bound of 1 (a too) the least loaded
    assert rank_replicas([a, b, c], prompt, None, bound=3) == [["a"], ["c", "b"]]
    assert rank_replicas([a, b, c], prompt, None, bound=1) == [["c", "a", "b"]]
    # the session's replica first, whatever the others hold
    a_session = ReplicaView("a", 3, sessions={"chat-1"})
    assert rank_replicas([a_session, b, c], prompt, "chat-1", 4) == [["a"], ["c", "b"]]
    assert rank_replicas([], prompt, None, 4) == []
    with pytest.raises(ValueError, match="bound"):
        rank_replicas([a], prompt, None, -1)


def test_a_moved_conversation_stays_with_its_newest_turns():
    """A conversation moved under load is held by both replicas: its next turn goes to the
    one holding the longer prefix (its newer turns), though the other is less busy."""
    prompt = chain(list(range(40)))
    old = ReplicaView("old", 1, {"s"}, {h[:HASH_BYTES] for h in prompt[:3]})
    new = ReplicaView("new", 3, {"s"}, {h[:HASH_BYTES] for h in prompt[:9]})
    assert rank_replicas([old, new], prompt, "s", bound=4) == [["new"], ["old"]]
    # the newer holder too busy: the older holder, within the bound, before a replica
    # holding nothing of it
    other = ReplicaView("other", 0)
    assert rank_replicas([old, new, other], prompt, "s", bound=1) == [["old"], ["other", "new"]]


def test_new_sessions_spread_over_idle_replicas():
    """Equal queues are ranked by the request's own hash with each replica, not by name:
    200 new sessions on 4 idle replicas land 50 +- 20 on each."""
    idle = [ReplicaView(name, 0) for name in ("a", "b", "c", "d")]
    first = [rank_replicas(idle, [], f"chat-{i}", 4)[0][0] for i in range(200)]
    assert all(30 <= first.count(name) <= 70 for name in "abcd"), sorted(first)


def test_a_new_conversation_goes_where_the_fewest_sessions_are_active():
    """A request no replica holds anything of goes to the shortest queue and, of equal
    queues, to the replica with the fewest sessions active, not the fewest remembered (its
    KV stays where it lands; a session long done needs nothing kept)."""
    a = ReplicaView("a", 1, sessions={f"s{i}" for i in range(2)}, active=2)
    b = ReplicaView("b", 1, sessions={f"s{i}" for i in range(2, 16)}, active=1)
    c = ReplicaView("c", 0, sessions=set(), active=9)
    prompt = chain(list(range(40)))
    assert rank_replicas([a, b, c], prompt, "new", bound=4)[0] == ["c"]
    assert rank_replicas([a, b], prompt, "new", bound=4) == [["b"], ["a"]]
    assert rank_replicas([a, b], prompt, None, bound=4) == [["b"], ["a"]]


def test_a_prefix_every_replica_holds_places_nothing():
    """The system prompt every conversation starts with is held by every replica: a new
    conversation sharing only that is placed as one sharing nothing, by active sessions,
    not sent to the holder of the system prompt ranked first; a longer prefix still wins."""
    prompt = chain(list(range(40)))
    system = {h[:HASH_BYTES] for h in prompt[:2]}
    views = [ReplicaView(n, 0, {f"{n}{i}" for i in range(3)}, system, active=3) for n in "ab"]
    key_first = rank_replicas(views, prompt[:2], "new", 4)[0][0]  # (the tie rank's choice)
    a = next(v for v in views if v.name == key_first)
    b = ReplicaView("b" if a.name == "a" else "a", 0, {"s4"}, system, active=1)
    assert rank_replicas([a, b], prompt, "new", bound=4)[0] == [b.name]
    c = ReplicaView("c", 2, {"s5"}, {h[:HASH_BYTES] for h in prompt[:3]}, active=5)
    assert rank_replicas([a, b, c], prompt, "new", bound=4)[0] == ["c"]


def brute_force(views, hashes, session, bound):
    """The rule stated directly: the affine replica (session, else longest prefix past what
    every replica holds; of several holding the session, the longest prefix; ties to the
    least loaded then the tie rank; else the shortest queue within the bound, then
    the fewest active sessions) first if within the bound, else all by load."""
    key = session if session is not None else hashes[0].hex() if hashes else ""
    order = sorted(views, key=lambda v: (v.queue, routing.tie_rank(key, v.name)))
    shortest = order[0].queue
    prefixes = {v.name: max([i + 1 for i, h in enumerate(hashes)
                             if h[:HASH_BYTES] in v.blocks], default=0) for v in views}
    common = min(prefixes.values())

    def best(among):
        with_session = [v for v in among if session in v.sessions]
        candidates = with_session or among
        longest = max(prefixes[v.name] for v in candidates)
        return (next(v for v in candidates if prefixes[v.name] == longest)
                if longest > common or with_session else None)

    near = [v for v in order if v.queue - shortest <= bound]
    affine = best(near)
    if affine is None and best(order) is None:
        fewest = min((v.queue, v.active) for v in near)
        affine = next(v for v in sorted(near, key=lambda v: routing.tie_rank(key, v.name))
                      if (v.queue, v.active) == fewest)
    if affine is None:
        return [[v.name for v in order]]
    return [[affine.name], [v.name for v in order if v.name != affine.name]]


views = st.lists(st.tuples(st.integers(0, 6), st.sets(st.sampled_from("xyz"), max_size=2),
                           st.integers(0, 10), st.integers(0, 3)), min_size=1, max_size=5)


@settings(max_examples=200, deadline=None)
@given(views, st.sampled_from(["x", "y", "q", None]), st.integers(0, 4), st.integers(0, 12))
def test_the_rule_matches_its_brute_force_statement(spec, session, bound, length):
    prompt = chain(list(range(4 * length)))
    replicas = [ReplicaView(f"r{i}", q, s, {h[:HASH_BYTES] for h in prompt[:n]}, active)
                for i, (q, s, n, active) in enumerate(spec)]
    assert rank_replicas(replicas, prompt, session, bound) == brute_force(
        replicas, prompt, session, bound)


def test_a_planted_bug_is_caught(monkeypatch):
    """Counting held blocks from the front (stopping at the first hash missing) instead of
    the last hash held: a replica reporting a sparse set would look shorter."""
    def first_gap(view, hashes):
        n = 0
        while n < len(hashes) and hashes[n][:HASH_BYTES] in view.blocks:
            n += 1
        return n // 2  # and halved: a prefix undercounted

    monkeypatch.setattr(routing, "held_prefix", first_gap)
    prompt = chain(list(range(40)))
    a = ReplicaView("a", 0, blocks={h[:HASH_BYTES] for h in prompt[:2]})
    b = ReplicaView("b", 1, blocks={h[:HASH_BYTES] for h in prompt[:3]})
    assert rank_replicas([a, b], prompt, None, 2) != brute_force([a, b], prompt, None, 2)


def test_every_routed_request_has_a_text_for_rays_prefix_router():
    """Ray's prefix-affinity router divides by the length of a request's text: a request
    with no prompt (a health check, the ingress's probe, an empty chat) carries its method
    and path instead, or its routing would fail and be retried for ever."""
    from jkv.cluster.asgi import RoutedRequest

    for r in (RoutedRequest("GET", "/health"), RoutedRequest("POST", "/v1/chat/completions",
                                                              messages=[])):
        assert "".join(m["content"] for m in r.messages)
    said = [{"role": "user", "content": "hi"}]
    assert RoutedRequest("POST", "/", messages=said).messages == said
