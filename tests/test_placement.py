"""Placement of sessions' KV in host memory and on disk: capacities hold under any sequence of
operations, and each policy gives up the item it says it does."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jkv.store import POLICIES, Move, Placement


def test_lru_demotes_the_least_recently_used_and_fifo_the_first_placed():
    for policy, gone in (("lru", "b"), ("fifo", "a")):
        p = Placement(policy, host_bytes=30, disk_bytes=100)
        for s in "abc":
            p.put(s, 10)
        p.access("a")  # a is now the most recently used, still the first placed
        moves = p.put("d", 10)
        assert moves == [Move(gone, "host", "disk"), Move("d", None, "host")], policy
        assert p.where(gone) == "disk" and p.bytes_used("host") == 30


def test_full_disk_drops_and_oversized_items_skip_a_tier():
    p = Placement("lru", host_bytes=20, disk_bytes=20)
    p.put("a", 20)
    p.put("b", 20)  # a to disk
    assert p.put("c", 20) == [Move("a", "disk", None), Move("b", "host", "disk"),
                              Move("c", None, "host")]
    assert p.put("big", 25) == [Move("big", None, None)] and p.where("big") is None
    q = Placement("lru", host_bytes=10, disk_bytes=40)
    assert q.put("x", 30) == [Move("x", None, "disk")]


def test_putting_a_session_again_replaces_its_copy():
    p = Placement("lru", host_bytes=100, disk_bytes=100)
    p.put("a", 10)
    assert p.put("a", 25) == [Move("a", "host", "host")]
    assert p.bytes_used("host") == 25 and p.sessions("host") == ["a"]


def test_scheduler_aware_keeps_items_whose_jobs_are_coming():
    # mean item 10 bytes: eviction window (30 + 30) / 10 = 6 jobs, prefetch window 3
    p = Placement("scheduler", host_bytes=30, disk_bytes=30)
    for s in "abc":
        p.put(s, 10)
    # LRU would demote a; a's job is queued, b's is not: b goes
    assert p.put("d", 10, queue=["a", "c"])[0] == Move("b", "host", "disk")
    # everything in the host tier is queued: the one whose job runs last goes
    assert p.put("e", 10, queue=["a", "c", "d", "e"])[0] == Move("d", "host", "disk")


def test_scheduler_aware_prefetches_queued_sessions_from_disk():
    p = Placement("scheduler", host_bytes=20, disk_bytes=40)
    for s in "abcd":
        p.put(s, 10)  # a, b on disk; c, d in host
    assert p.sessions("disk") == ["a", "b"]
    # b's job runs first, then c's; d is not queued: d makes room for b
    moves = p.prefetch(["b", "c"])
    assert moves == [Move("d", "host", "disk"), Move("b", "disk", "host")]
    assert p.access("b") == "host" and p.access("c") == "host"
    # a job later in the queue never displaces one that runs earlier
    p = Placement("scheduler", host_bytes=30, disk_bytes=40)
    for s, size in zip("abcde", (2, 2, 10, 10, 10), strict=True):
        p.put(s, size)  # a, b go to disk; mean 6.8 bytes: prefetch window 4 jobs
    assert p.prefetch(["c", "d", "e", "a"]) == [] and p.where("a") == "disk"
    assert p.prefetch(["a", "c", "d", "e"]) == [Move("e", "host", "disk"),
                                                Move("a", "disk", "host")]
    for policy in ("lru", "fifo"):
        q = Placement(policy, host_bytes=10, disk_bytes=10)
        q.put("a", 10)
        q.put("b", 10)
        assert q.prefetch(["a"]) == [] and q.where("a") == "disk"


def test_bad_arguments_raise_value_errors():
    with pytest.raises(ValueError, match="policy"):
        Placement("random", 1, 1)
    with pytest.raises(ValueError, match="host_bytes"):
        Placement("lru", -1, 1)
    with pytest.raises(ValueError, match="size"):
        Placement("lru", 1, 1).put("a", -1)


ops = st.lists(st.tuples(st.sampled_from(["put", "access", "prefetch", "drop"]),
                         st.integers(0, 7), st.integers(0, 40),
                         st.lists(st.integers(0, 7), max_size=6)), max_size=60)


@settings(max_examples=150, deadline=None)
@given(st.sampled_from(POLICIES), st.integers(0, 60), st.integers(0, 80), ops)
def test_capacities_hold_and_moves_match_the_state(policy, host, disk, ops):
    p = Placement(policy, host, disk)
    where: dict[int, str] = {}
    for op, s, size, queue in ops:
        if op == "put":
            moves = p.put(s, size, queue)
            assert moves[-1].session == s
        elif op == "prefetch":
            moves = p.prefetch(queue)
        else:
            moves = []
            if op == "access":
                assert p.access(s) == where.get(s)
            else:
                p.drop(s)
                where.pop(s, None)
        for m in moves:  # replaying the moves gives the placement's own state
            assert where.get(m.session) == m.src
            if m.dst is None:
                where.pop(m.session, None)
            else:
                where[m.session] = m.dst
        for tier in ("host", "disk"):
            assert p.bytes_used(tier) <= p.capacity[tier]
            assert sorted(p.sessions(tier)) == sorted(k for k, v in where.items() if v == tier)
