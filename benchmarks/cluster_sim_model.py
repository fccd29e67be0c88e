"""The parts of `cluster_sim.py`'s model: costs read from committed H200 results, the shared
tier's reads (its aggregate bandwidth split among the readers), its coordinator (one commit at
a time), a replica (an FCFS queue, a device prefix cache, a host tier, a private disk) and the
routers, each with the rule of the router it stands for."""

from __future__ import annotations

import argparse
import heapq
import json
import math
import random
import sys
from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from store_sim import kv_bytes_per_token  # noqa: E402

from jkv.cluster.routing import ACTIVE_S, ReplicaView, rank_replicas  # noqa: E402
from jkv.store import Placement  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
RESTORE_JSON = "restore/restore-nvidia_h200-llama3-8b-2026-11-27.json"
DECODE_JSON = "tier_cost/tier_cost-nvidia_h200-llama3-8b-2026-11-26.json"
ROUTERS = ("kv", "pow2", "prefix", "random")
PREFIX_MATCH_RATE = 0.1  # Ray's PrefixCacheAffinityRouter: a shorter match counts as none


def measured_rates(results: Path = RESULTS) -> dict:
    """The defaults the H200 runs measured, so that the simulation costs what the GPU does:
    prefill tokens/s and host-to-device bytes/s of the restore run's longest history
    (least fixed overhead), decode seconds per output token of tier_cost's largest batch
    (a step's time spread over its rows: a replica batches its decodes)."""
    restore = json.loads((results / RESTORE_JSON).read_text())
    row = max(restore["rows"], key=lambda r: r["history_tokens"])
    prompt = row["history_tokens"] + restore["args"]["new_tokens"]
    tier = json.loads((results / DECODE_JSON).read_text())
    big = max(tier["rows"], key=lambda r: r["batch"])
    return {"prefill_tokens_per_s": prompt / (row["recompute_ms"] / 1e3),
            "host_read_gbps": row["load_bytes_per_s"] / 1e9,
            "decode_ms_per_token": big["none_k8v4t"]["decode_step_ms"] / big["batch"],
            "from": {"prefill_tokens_per_s": f"{RESTORE_JSON}: {prompt} tokens recomputed in "
                                             f"{row['recompute_ms']:.0f} ms",
                     "host_read_gbps": f"{RESTORE_JSON}: load_bytes_per_s at "
                                       f"{row['history_tokens']} tokens",
                     "decode_ms_per_token": f"{DECODE_JSON}: a decode step of "
                                            f"{big['batch']} rows over {big['batch']}"}}


@dataclass(frozen=True)
class Costs:
    """What a replica's work and the tiers' reads cost."""

    kv_bytes_per_token: int
    prefill_tokens_per_s: float
    decode_s_per_token: float
    host_read_bps: float
    disk_read_bps: float  # a private disk; also the most one read of the shared tier gets
    shared_read_bps: float  # the shared tier's aggregate, split among its readers
    commits_per_s: float  # the coordinator's
    commits_per_save: int


def costs_from(args: argparse.Namespace, measured: dict) -> Costs:
    """The run's costs: the measured rates (`measured_rates`) unless the arguments set them."""
    pick = {k: measured[k] if getattr(args, k) is None else getattr(args, k)
            for k in ("prefill_tokens_per_s", "host_read_gbps", "decode_ms_per_token")}
    return Costs(kv_bytes_per_token=kv_bytes_per_token(args.model, args.kv_format),
                 prefill_tokens_per_s=pick["prefill_tokens_per_s"],
                 decode_s_per_token=pick["decode_ms_per_token"] / 1e3,
                 host_read_bps=pick["host_read_gbps"] * 1e9,
                 disk_read_bps=args.disk_read_gbps * 1e9,
                 shared_read_bps=args.shared_read_gbps * 1e9,
                 commits_per_s=args.coordinator_commits_per_s,
                 commits_per_save=args.commits_per_save)


ASSUMED = {  # what no committed result measured, and what the model simplifies
    "disk_read_gbps": "one NVMe drive (store_sim's default), not measured",
    "shared_read_gbps": "no shared store's bandwidth was measured",
    "coordinator_commits_per_s": "no committed result measures it; about what tensorstore "
                                 "0.1.86's DistributedCoordinatorServer committed one after "
                                 "another on a 2-core CPU over a local file base (84 a "
                                 "second, one writer, measured by hand)",
    "commits_per_save": "jkv.store.tiers._commit_shared: an entry's values (its 8 MiB "
                        "parts written together: about one commit in the same hand "
                        "measurement), then its meta record",
    "shared_tier_lru": "one LRU per shard of N (a session's shard: its number mod N)",
    "kv_router_blocks": "none reported: a prompt shares a prefix only with its session's"}


class SharedReads:
    """Reads of the shared tier: `bps` split equally among the reads in flight (processor
    sharing), none faster than `cap_bps`. `v` counts the bytes each read in flight has had,
    so a read of b bytes started at v0 ends when v reaches v0 + b, whoever joins meanwhile."""

    def __init__(self, bps: float, cap_bps: float) -> None:
        self.bps, self.cap = bps, cap_bps
        self.v = self.t = 0.0
        self.reads: list[tuple[float, int, int]] = []  # (v at its end, order, replica)
        self.order = 0

    def _rate(self) -> float:
        return min(self.cap, self.bps / len(self.reads))

    def _advance(self, now: float) -> None:
        if self.reads:
            self.v += (now - self.t) * self._rate()
        self.t = now

    def add(self, now: float, nbytes: float, replica: int) -> None:
        self._advance(now)
        self.order += 1
        heapq.heappush(self.reads, (self.v + nbytes, self.order, replica))

    def next_end(self) -> float:
        if not self.reads:
            return math.inf
        return self.t + max(self.reads[0][0] - self.v, 0.0) / self._rate()

    def pop(self, now: float) -> int:
        """The replica whose read ends now (at `next_end`)."""
        self._advance(now)
        return heapq.heappop(self.reads)[2]


class Coordinator:
    """The shared tier's OCDBT coordinator: commits one at a time in arrival order, so an
    entry is in the shared tier (other replicas find it) only once its commits are done."""

    def __init__(self, commits_per_s: float) -> None:
        self.commit_s = 1.0 / commits_per_s
        self.free = 0.0

    def commit(self, now: float, commits: int) -> float:
        """When a save of `commits` commits asked for at `now` is visible."""
        self.free = max(now, self.free) + commits * self.commit_s
        return self.free


class SharedTier:
    """The shared persistent tier's contents: `shards` placements of `shard_bytes` each, a
    session's entry in shard (session mod shards). One LRU per shard stands for one over the
    whole tier (close when shards are many and even) and keeps each eviction's sort short."""

    def __init__(self, policy: str, shards: int, shard_bytes: int) -> None:
        self.shards = [Placement(policy, shard_bytes, 0) for _ in range(shards)]

    def of(self, session: int) -> Placement:
        return self.shards[session % len(self.shards)]

    def where(self, session: int) -> str | None:
        return self.of(session).where(session)

    def size(self, session: int) -> int:
        return self.of(session).size(session)

    def access(self, session: int) -> str | None:
        return self.of(session).access(session)

    def put(self, session: int, size: int) -> None:
        self.of(session).put(session, size)

    def sessions(self) -> list[int]:
        return [s for shard in self.shards for s in shard.sessions("host")]


class Replica:
    """One replica: its FCFS queue (jobs waiting: session, arrival), whether a job runs,
    its load (requests queued or running: what Serve's routers compare), its device prefix
    cache (LRU, dropping what it evicts), its host tier with the private disk behind it
    (`store`; no disk where the shared tier stands behind the host)."""

    def __init__(self, policy: str, device: int, host: int, disk: int) -> None:
        self.device = Placement("lru", device, 0)
        self.store = Placement(policy, host, disk)
        self.queue: deque[tuple[int, float]] = deque()
        self.running = False
        self.load = 0
        self.served: set[int] = set()
        self.recent: OrderedDict[int, float] = OrderedDict()  # session: served when, latest last
        self.requests = 0
        self.busy = 0.0
        self.job: tuple = ()


class Router:
    """Picks the replica for a session's turn. kv: `rank_replicas` itself over what each
    replica reports (the sessions it served: a shared tier's are every replica's, so not
    reported); pow2: the shorter queue of two drawn; prefix: Ray's PrefixCacheAffinityRouter's
    rule; random."""

    def __init__(self, kind: str, replicas: Sequence[Replica], bound: int, imbalance: float,
                 seed: int) -> None:
        if kind not in ROUTERS:
            raise ValueError(f"router must be one of {ROUTERS}, got {kind!r}")
        self.kind, self.replicas, self.bound, self.imbalance = kind, replicas, bound, imbalance
        self.rng = random.Random(seed)
        self.views = [ReplicaView("", -1) for _ in replicas]  # rebuilt as loads change
        self.last: dict[int, tuple[int, int]] = {}  # prefix: (replica, prompt) of the last turn
        self.tenant = [0] * len(replicas)  # prefix: prompt tokens its tree holds per replica

    def route(self, session: int, prompt: int, now: float) -> int:
        """The replica (index) for a turn of `session` with `prompt` tokens at time `now`."""
        if self.kind == "kv":
            views = self.views
            for i, r in enumerate(self.replicas):
                while r.recent and next(iter(r.recent.values())) < now - ACTIVE_S:
                    r.recent.popitem(last=False)
                if (views[i].queue, views[i].active) != (r.load, len(r.recent)):
                    views[i] = ReplicaView(f"{i:04d}", r.load, r.served, active=len(r.recent))
            # no block hashes: in this trace a prompt shares a prefix only with its session's
            return int(rank_replicas(views, (), session, self.bound)[0][0])
        if self.kind == "pow2":
            return self._pow2()
        if self.kind == "random":
            return self.rng.randrange(len(self.replicas))
        return self._prefix(session, prompt)

    def _pow2(self) -> int:
        n = len(self.replicas)
        if n == 1:
            return 0
        i, j = self.rng.randrange(n), self.rng.randrange(n - 1)
        j += j >= i
        return i if self.replicas[i].load <= self.replicas[j].load else j

    def _prefix(self, session: int, prompt: int) -> int:
        """Ray's rule: pow2 while the longest queue exceeds the shortest by more than the
        threshold; else the replica whose tree matches the longest prefix (the last turn's:
        its prompt is a prefix of this one), or, under a 10% match, the smallest tenant (its
        tree holding the fewest tokens; no eviction of the tree here), the shorter queue
        among equals. The prompt goes into the chosen replica's tree."""
        loads = [r.load for r in self.replicas]
        last = self.last.get(session)
        if max(loads) - min(loads) > self.imbalance:
            choice = self._pow2()
        elif last is not None and last[1] >= PREFIX_MATCH_RATE * prompt:
            choice = last[0]
        else:
            least = min(self.tenant)
            choice = min((i for i, t in enumerate(self.tenant) if t == least),
                         key=loads.__getitem__)
        self.last[session] = (choice, prompt)
        self.tenant[choice] += prompt
        return choice
