"""benchmarks/cluster_sim.py on a tiny cluster: the routers and tiers do what the simulation
claims of them, so its figures at 8-64 replicas mean what docs/results.md says."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
cluster_sim = pytest.importorskip("cluster_sim")


def run(*argv: str) -> dict[tuple[str, str], dict]:
    """One sweep on 8 replicas, 40 conversations each, every turn measured: rows by
    (router, store)."""
    args = cluster_sim.parse_args(["--replicas", "8", "--sessions-per-replica", "40",
                                   "--warmup", "0", *argv])
    costs = cluster_sim.costs_from(args, cluster_sim.measured_rates())
    rows = cluster_sim.sweep(args, costs, lambda _: None)
    return {(r["router"], r["store"]): r for r in rows}


def test_affinity_keeps_returning_turns_on_the_device_and_random_routing_does_not():
    """With a device cache that holds everything and no load bound, the kv router sends
    every returning turn to the replica that served its session, so its whole history is a
    device hit; random routing over 8 replicas finds it there about 1 time in 8."""
    rows = run("--routers", "kv,random", "--stores", "private", "--device", "1T",
               "--route-bound", "100000")
    kv, rand = rows["kv", "private"], rows["random", "private"]
    assert kv["returning_turns"] > 200
    assert kv["returning_whole_from_device"] > 0.99
    assert kv["hit_share"]["recomputed"] == 0
    assert 0.05 < rand["returning_whole_from_device"] < 0.25
    assert rand["hit_share"]["device"] < 0.4


def test_the_shared_tier_turns_private_misses_into_hits_until_its_coordinator_falls_behind():
    """pow2 lands a returning turn elsewhere most of the time: with private disks most
    history is recomputed, with the shared tier (commits keeping up) nearly none is; with a
    coordinator far slower than the saves, entries reach the shared tier too late."""
    fast = run("--routers", "pow2", "--coordinator-commits-per-s", "1000")
    private, shared = fast["pow2", "private"], fast["pow2", "shared"]
    assert private["hit_share"]["recomputed"] > 0.5
    assert shared["hit_share"]["recomputed"] < 0.02
    assert shared["hit_share"]["store"] > 0.8 and shared["coordinator_utilisation"] < 0.1
    slow = run("--routers", "pow2", "--stores", "shared", "--coordinator-commits-per-s", "2")
    assert slow["pow2", "shared"]["coordinator_utilisation"] > 1
    assert slow["pow2", "shared"]["hit_share"]["recomputed"] > 0.5


def test_the_kv_router_keeps_affinity_with_the_shared_tier():
    """A replica reports only what it alone holds (not the shared tier's sessions, every
    replica's alike): with the shared tier too the kv router keeps each session where it was
    served."""
    rows = run("--routers", "kv", "--stores", "shared", "--device", "1T",
               "--coordinator-commits-per-s", "1000", "--route-bound", "100000")
    assert rows["kv", "shared"]["returning_whole_from_device"] > 0.99
