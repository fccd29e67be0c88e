"""Trace-driven simulation of KV reuse across N replicas: at what scale KV-aware routing and a
shared persistent tier pay, and where the shared tier's coordinator or bandwidth becomes the
limit. store_sim.py's conversations and placement objects, on several servers, no model.

    python benchmarks/cluster_sim.py                     # N = 8..64, every router, both stores
    python benchmarks/cluster_sim.py --replicas 16 --routers kv,pow2 --stores shared

Sessions (ShareGPT-shaped, `store_sim.chat_sessions`) arrive at --rate-per-replica x N; a turn
goes to the replica its router picks and waits in that replica's FCFS queue. A job holds its
replica's GPU for all its work: restoring its session's history from where the replica finds
the longest of it (its device prefix cache, its host tier, its private disk or the shared tier:
`jkv.store.Placement` objects; recomputed instead where reading would take longer, as when many
reads split the shared tier), prefilling the rest and its new tokens, decoding its reply at a
batch's GPU time per token (so queueing counts other jobs' decode as a batched engine's
throughput would); TTFT is its wait, restore and prefill. Its KV then goes to the device cache
and the host tier (the store's write-behind) and, with the shared tier, through the coordinator
(one commit at a time) into the shared tier, where every replica finds it once committed; reads
of the shared tier split its aggregate bandwidth. The next turn comes a think time after the
reply. Turns arriving from --warmup seconds to the last conversation's arrival are measured.
Routers: kv (jkv.cluster's `rank_replicas`, each replica reporting what jkv.cluster.replica
reports: the sessions it served and those its own tiers hold, not a shared tier's, and how
many it served in the last minute; equal queues and counts ranked by the session's rendezvous
hash), pow2 (Ray Serve's default), prefix (Ray's
PrefixCacheAffinityRouter), random.

Prints hit tokens by tier (shares of the history tokens the turns bring), TTFT, load skew and
the shared tier's coordinator and bandwidth utilisation per (N, router, store); writes
benchmarks/results/cluster_sim/cluster_sim-<date>.json and its plot.
"""

from __future__ import annotations

import argparse
import heapq
import math
import platform
import shlex
import sys
import time
from collections.abc import Callable

import numpy as np
import store_sim
from cluster_sim_model import (
    ASSUMED,
    ROUTERS,
    Coordinator,
    Costs,
    Replica,
    Router,
    SharedReads,
    SharedTier,
    costs_from,
    measured_rates,
)
from harness import add_out_argument, write_results

ARRIVE, READ, END, COMMIT = range(4)
TIERS = ("device", "host", "store", "recomputed")


class Cluster:
    """One run: N replicas, one router, the shared tier or private disks, over a trace."""

    def __init__(self, n: int, router: str, shared: bool, costs: Costs,
                 args: argparse.Namespace) -> None:
        self.costs, self.args, self.shared = costs, args, shared
        disk = 0 if shared else args.disk
        self.replicas = [Replica(args.policy, args.device, args.host, disk) for _ in range(n)]
        self.tier = SharedTier(args.policy, n, args.disk) if shared else None
        self.reads = SharedReads(costs.shared_read_bps, costs.disk_read_bps)
        self.coordinator = Coordinator(costs.commits_per_s)
        self.router = Router(router, self.replicas, args.route_bound,
                             math.inf if args.prefix_imbalance is None else args.prefix_imbalance,
                             args.seed)
        self.events: list[tuple] = []
        self.order = 0
        self.hits = dict.fromkeys(TIERS, 0)
        self.ttft: list[float] = []
        self.commit_delays: list[float] = []
        self.returning = self.whole_from_device = self.declined = 0
        self.write_bytes = self.read_bytes = self.commit_s = 0.0
        self.window = (0.0, 0.0)  # turns arriving in it are measured

    def push(self, t: float, kind: int, what) -> None:
        self.order += 1
        heapq.heappush(self.events, (t, self.order, kind, what))

    def run(self, sessions: dict, arrivals: np.ndarray, think: dict) -> dict:
        """Replay the trace, measuring the turns that arrive from --warmup seconds to the
        last conversation's arrival (the cluster filled, still fed); the run's figures."""
        self.sessions, self.think = sessions, think
        self.window = (self.args.warmup, float(arrivals[-1]))
        self.turn = dict.fromkeys(sessions, 0)
        self.held = dict.fromkeys(sessions, 0)  # history tokens a session's next turn brings
        for s, t in zip(sessions, arrivals, strict=True):
            self.push(float(t), ARRIVE, s)
        now = 0.0
        while self.events or self.reads.reads:
            if self.reads.next_end() <= (self.events[0][0] if self.events else np.inf):
                now = self.reads.next_end()
                self.compute(self.reads.pop(now), now)
                continue
            now, _, kind, what = heapq.heappop(self.events)
            if kind == ARRIVE:
                if now <= self.window[1]:  # (later turns: no more measured, none waited for)
                    self.arrive(what, now)
            elif kind == READ:
                self.compute(what, now)
            elif kind == END:
                self.end(what, now)
            else:
                self.tier.put(*what)
        return self.figures(self.window[1] - self.window[0])

    def arrive(self, s: int, now: float) -> None:
        i = self.router.route(s, self.held[s] + self.sessions[s][self.turn[s]][0], now)
        rep = self.replicas[i]
        rep.requests += self.measured(now)
        rep.load += 1
        rep.served.add(s)  # (a replica reports the sessions queued on it too)
        rep.recent[s] = now
        rep.recent.move_to_end(s)
        rep.queue.append((s, now))
        if not rep.running:
            self.start(i, now)

    def start(self, i: int, now: float) -> None:
        """Replica i's next job: its history read from the tier holding most of it."""
        rep = self.replicas[i]
        s, arrived = rep.queue.popleft()
        rep.running = True
        new, out = self.sessions[s][self.turn[s]]
        history = self.held[s]
        tier, hit = self.lookup(rep, s, history)
        rate, per = self.read_rate(tier), self.costs.kv_bytes_per_token
        declined = hit > 0 and per / rate > 1 / self.costs.prefill_tokens_per_s
        hit = 0 if declined else hit  # reading is slower than recomputing: the planner's choice
        rep.job = (s, arrived, now, history - hit + new, out)
        nbytes = hit * per
        if self.measured(arrived):
            self.hits[tier] += hit
            self.hits["recomputed"] += history - hit
            self.returning += history > 0
            self.whole_from_device += history > 0 and tier == "device" and hit == history
            self.read_bytes += nbytes if tier == "store" else 0
            self.declined += declined
        if tier == "store" and self.shared and hit:
            self.reads.add(now, nbytes, i)
            return
        self.push(now + nbytes / rate, READ, i)

    def read_rate(self, tier: str) -> float:
        """Bytes/s a read from `tier` would get now: the shared tier's is its aggregate split
        with the reads in flight (jkv's restore planner weighs a read against recomputing
        from rates like these; here without its split of a history between the two)."""
        c = self.costs
        if tier == "store" and self.shared:
            return min(c.disk_read_bps, c.shared_read_bps / (len(self.reads.reads) + 1))
        return {"device": np.inf, "host": c.host_read_bps, "store": c.disk_read_bps}[tier]

    def measured(self, arrived: float) -> bool:
        """Whether a turn that arrived then counts (it arrived in the window)."""
        return self.window[0] <= arrived <= self.window[1]

    def lookup(self, rep: Replica, s: int, history: int) -> tuple[str, int]:
        """(tier, tokens) of the longest stored prefix of `s`'s history this replica can
        read, the faster tier among equals; its use counted by that tier's placement."""
        per = self.costs.kv_bytes_per_token
        held = [("device", rep.device), ("host" if rep.store.where(s) == "host" else "store",
                                         rep.store)]
        if self.tier is not None:
            held.append(("store", self.tier))
        best = max(held, key=lambda h: min(h[1].size(s) // per, history))
        tokens = min(best[1].size(s) // per, history)
        if not tokens:
            return "device", 0
        best[1].access(s)
        return best[0], tokens

    def compute(self, i: int, now: float) -> None:
        """Replica i's history is read: prefill, first token, decode."""
        s, arrived, _, prefill, out = self.replicas[i].job
        first = now + prefill / self.costs.prefill_tokens_per_s
        if self.measured(arrived):
            self.ttft.append(first - arrived)
        self.push(first + out * self.costs.decode_s_per_token, END, i)

    def end(self, i: int, now: float) -> None:
        """Replica i's job is done: its KV saved, the session's next turn due, the next job."""
        rep = self.replicas[i]
        s, arrived, started, _, out = rep.job
        measured = self.measured(arrived)
        new = self.sessions[s][self.turn[s]][0]
        self.held[s] = min(self.held[s] + new + out, self.args.max_model_len)
        size = self.held[s] * self.costs.kv_bytes_per_token
        rep.device.put(s, size)
        rep.store.put(s, size, [q for q, _ in rep.queue] if self.args.policy == "scheduler"
                      else ())
        if self.shared:
            visible = self.coordinator.commit(now, self.costs.commits_per_save)
            self.push(visible, COMMIT, (s, size))
            if measured:
                self.commit_s += self.costs.commits_per_save / self.costs.commits_per_s
                self.commit_delays.append(visible - now)
                self.write_bytes += (new + out) * self.costs.kv_bytes_per_token
        self.turn[s] += 1
        if self.turn[s] < len(self.sessions[s]):
            self.push(now + self.think[s][self.turn[s]], ARRIVE, s)
        rep.busy += (now - started) * measured
        rep.running = False
        rep.load -= 1
        if rep.queue:
            self.start(i, now)

    def figures(self, duration: float) -> dict:
        """Hit tokens by tier, TTFT, load skew and utilisations of the measured turns (the
        utilisations: of the work they asked for over the window's `duration`)."""
        n, c = len(self.replicas), self.costs
        history = sum(self.hits.values())
        requests = [r.requests for r in self.replicas]
        out = {"hit_tokens": dict(self.hits),
               "hit_share": {t: v / max(history, 1) for t, v in self.hits.items()},
               "ttft_p50_s": float(np.percentile(self.ttft, 50)),
               "ttft_p99_s": float(np.percentile(self.ttft, 99)),
               "ttft_mean_s": float(np.mean(self.ttft)),
               "load_skew": max(requests) / np.mean(requests),
               "requests_per_replica_max_min": [max(requests), min(requests)],
               "replica_utilisation": sum(r.busy for r in self.replicas) / (n * duration),
               "returning_turns": self.returning,
               "returning_whole_from_device": self.whole_from_device / max(self.returning, 1),
               "reads_declined": self.declined,
               "duration_s": duration}
        if self.shared:
            out |= {"coordinator_utilisation": self.commit_s / duration,
                    "commit_delay_p99_s": float(np.percentile(self.commit_delays, 99)),
                    "store_read_utilisation": self.read_bytes / (c.shared_read_bps * duration),
                    "store_write_gbps": self.write_bytes / duration / 1e9}
        else:
            out |= {"store_read_utilisation": self.read_bytes / (n * c.disk_read_bps * duration)}
        return out


def make_trace(n: int, args: argparse.Namespace) -> tuple[dict, np.ndarray, dict, dict]:
    """N replicas' worth of store_sim's conversations (--sessions-per-replica x N arriving at
    --rate-per-replica x N) and each turn's think time before it, drawn once so that every
    router and store sees the same turns."""
    trace_args = argparse.Namespace(sessions=n * args.sessions_per_replica,
                                    rate=n * args.rate_per_replica,
                                    length_scale=args.length_scale)
    rng = np.random.default_rng(args.seed)
    sessions, arrivals = store_sim.chat_sessions(trace_args, rng)
    think = {s: rng.exponential(args.think, len(turns)).tolist()
             for s, turns in sessions.items()}
    per = store_sim.kv_bytes_per_token(args.model, args.kv_format)
    live = 0.0  # Little's law: a replica's KV between turns = arrivals x bytes x think
    for s, turns in sessions.items():
        held = np.minimum(np.cumsum([u + r for u, r in turns]), args.max_model_len)
        live += float(np.dot(held[:-1], think[s][1:])) * per
    stats = {"sessions": len(sessions), "turns": sum(map(len, sessions.values())),
             "kv_bytes_per_token": per,
             "kv_between_turns_per_replica_gb": args.rate_per_replica * live / len(sessions)
             / 1e9}
    return sessions, arrivals, think, stats


def sweep(args: argparse.Namespace, costs: Costs,
          progress: Callable[[str], None]) -> list[dict]:
    """Every (N, store, router) run, each N's trace shared by its runs."""
    rows = []
    for n in args.replicas:
        sessions, arrivals, think, stats = make_trace(n, args)
        progress(f"N={n}: {stats['sessions']} sessions, {stats['turns']} turns, "
                 f"{stats['kv_between_turns_per_replica_gb']:.0f} GB of KV between turns "
                 "per replica")
        for store in args.stores:
            for router in args.routers:
                t0 = time.perf_counter()
                sim = Cluster(n, router, store == "shared", costs, args)
                row = {"replicas": n, "router": router, "store": store, "trace": stats,
                       **sim.run(sessions, arrivals, think)}
                rows.append(row)
                progress(f"  {store:<8}{router:<7}{time.perf_counter() - t0:6.1f} s")
    return rows


def print_table(rows: list[dict]) -> None:
    """A line per run: hit shares by tier, TTFT, skew, coordinator and store utilisation."""
    print(f"{'N':>3} {'store':<8}{'router':<7}{'device':>7}{'host':>7}{'store':>7}"
          f"{'recomp':>7}{'TTFT p50':>9}{'p99':>7}{'skew':>6}{'coord':>6}{'bw':>6}")
    for r in rows:
        share = r["hit_share"]
        coord = r.get("coordinator_utilisation")
        print(f"{r['replicas']:>3} {r['store']:<8}{r['router']:<7}"
              + "".join(f"{share[t]:>7.1%}" for t in TIERS)
              + f"{r['ttft_p50_s']:>8.2f}s{r['ttft_p99_s']:>6.2f}s{r['load_skew']:>6.2f}"
              + (f"{coord:>6.2f}" if coord is not None else f"{'-':>6}")
              + f"{r['store_read_utilisation']:>6.2f}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The run's settings from `argv` (default: the command line)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--replicas", default="8,16,32,64", help="comma-separated N to run")
    ap.add_argument("--routers", default=",".join(ROUTERS), help=f"of {ROUTERS}")
    ap.add_argument("--stores", default="private,shared",
                    help="private: a disk per replica; shared: one tier all replicas read "
                         "and write (N x --disk bytes)")
    ap.add_argument("--sessions-per-replica", type=int, default=160,
                    help="conversations in the trace per replica")
    ap.add_argument("--rate-per-replica", type=float, default=0.3,
                    help="conversation arrivals per second per replica (Poisson)")
    ap.add_argument("--think", type=float, default=30.0,
                    help="mean seconds between a reply and the user's next turn "
                         "(capacities are set against the KV it keeps between turns)")
    ap.add_argument("--warmup", type=float, default=160.0,
                    help="seconds before the turns measured (conversations under way)")
    ap.add_argument("--length-scale", type=float, default=1.0,
                    help="multiplies the ShareGPT message and reply lengths")
    ap.add_argument("--model", default="llama3-8b", help="whose KV bytes per token")
    ap.add_argument("--kv-format", default="auto", help="stored KV format (auto: bf16)")
    ap.add_argument("--max-model-len", type=int, default=8192,
                    help="context limit: longer histories keep their last tokens")
    ap.add_argument("--device", type=store_sim.parse_bytes, default="4G",
                    help="each replica's device prefix cache (HBM left to it), bytes")
    ap.add_argument("--host", type=store_sim.parse_bytes, default="8G",
                    help="each replica's host tier, bytes")
    ap.add_argument("--disk", type=store_sim.parse_bytes, default="64G",
                    help="each replica's private disk, or its share of the shared tier")
    ap.add_argument("--policy", choices=("lru", "fifo", "scheduler"), default="lru",
                    help="placement of host, disk and shared tiers (the device cache: LRU; "
                         "scheduler: look-ahead eviction by the replica's queue, no prefetch)")
    add_cost_arguments(ap)
    ap.add_argument("--seed", type=int, default=0, help="trace and router seed")
    add_out_argument(ap, "cluster_sim")
    args = ap.parse_args(argv)
    try:
        args.replicas = [int(n) for n in args.replicas.split(",")]
    except ValueError:
        ap.error(f"--replicas: comma-separated integers, got {args.replicas!r}")
    args.routers, args.stores = args.routers.split(","), args.stores.split(",")
    if any(n < 1 for n in args.replicas) or not set(args.routers) <= set(ROUTERS) \
            or not set(args.stores) <= {"private", "shared"}:
        ap.error(f"--replicas >= 1, --routers of {ROUTERS}, --stores of private,shared")
    if args.coordinator_commits_per_s <= 0 or args.shared_read_gbps <= 0:
        ap.error("--coordinator-commits-per-s and --shared-read-gbps must be > 0")
    return args


def add_cost_arguments(ap: argparse.ArgumentParser) -> None:
    """What the work and the tiers cost, and the routers' thresholds."""
    ap.add_argument("--prefill-tokens-per-s", type=float,
                    help="default: the H200 restore run's (cluster_sim_model.RESTORE_JSON)")
    ap.add_argument("--decode-ms-per-token", type=float,
                    help="GPU time per output token in a batch (default: the H200 "
                         "tier_cost run's largest batch, cluster_sim_model.DECODE_JSON)")
    ap.add_argument("--host-read-gbps", type=float,
                    help="host-to-device restore rate (default: the H200 restore run's)")
    ap.add_argument("--disk-read-gbps", type=float, default=3.0,
                    help="a private disk's read rate, and the most one read of the shared "
                         "tier gets (assumed: one NVMe drive, store_sim's default)")
    ap.add_argument("--shared-read-gbps", type=float, default=20.0,
                    help="the shared tier's aggregate read bandwidth (assumed: no shared "
                         "store was measured)")
    ap.add_argument("--coordinator-commits-per-s", type=float, default=80.0,
                    help="commits the OCDBT coordinator makes a second, one at a time "
                         "(assumed: see the result's `assumed`)")
    ap.add_argument("--commits-per-save", type=int, default=2,
                    help="commits a saved entry takes (jkv.store.tiers commits a shared "
                         "entry's values, then its meta record)")
    ap.add_argument("--route-bound", type=int, default=4,
                    help="kv: queue length over the shortest at which affinity gives way "
                         "(python -m jkv.cluster's --route-bound)")
    ap.add_argument("--prefix-imbalance", type=float,
                    help="prefix: longest minus shortest queue above which it falls back to "
                         "pow2 (default: never, Ray's default, which jkv.cluster deploys)")


def main() -> None:
    args = parse_args()
    command = shlex.join(["python", "benchmarks/cluster_sim.py", *sys.argv[1:]])
    measured = measured_rates()
    costs = costs_from(args, measured)
    print(f"prefill {costs.prefill_tokens_per_s:.0f} tokens/s, decode "
          f"{costs.decode_s_per_token * 1e3:.3f} ms/token, host {costs.host_read_bps / 1e9:.2f}"
          f" GB/s, disk {args.disk_read_gbps} GB/s, shared {args.shared_read_gbps} GB/s, "
          f"coordinator {args.coordinator_commits_per_s:g} commits/s")
    rows = sweep(args, costs, print)
    print_table(rows)
    write_results(args.out, "cluster_sim",
                  {"benchmark": "cluster_sim", "modeled": True, "costs": "h200-llama3-8b",
                   "command": command, "python": platform.python_version(),
                   "costs_values": vars(costs), "costs_from": measured["from"],
                   "assumed": ASSUMED, "rows": rows}, args)


if __name__ == "__main__":
    main()
