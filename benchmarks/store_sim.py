"""Trace-driven simulation of KV placement in host memory and on disk (CachedAttention 4.3.3,
figure 21): LRU, FIFO and scheduler-aware placement on the same trace, no model.

    python benchmarks/store_sim.py                                   # defaults below
    python benchmarks/store_sim.py --capacities 16G/256G,16G/1T --sessions 5000

Sessions (conversations) arrive as a Poisson process with ShareGPT-shaped turns
(`sharegpt.py`); a turn's job joins one FCFS queue, runs for an exponential service time,
and the session's next turn arrives after an exponential think time. When a job starts, its
session's KV is looked up (a host hit, a disk hit or a miss); when it ends, the session's KV
(its whole history, up to --max-model-len tokens, at the model's KV bytes per token) is saved
to host memory, and the placement policy (`jkv.store.placement`, the object the store uses) makes
room. The scheduler-aware policy sees the queue: it keeps the KV of queued jobs and
prefetches them from disk into host memory, one read at a time at --disk-read-gbps; a job that
starts before its prefetch has finished counts as a disk hit. The queue's timing does not
depend on the policy, so every policy sees the very same trace.

Prints hit rates per tier for each capacity setting and policy; writes
benchmarks/results/store_sim/store_sim-<date>.json and its plot (the hit rates).

With --profile (an AdaptCache quality profile, `benchmarks/adapt_profile.py`), the same trace
goes through fixed-method LRU stores (full bf16 entries, and every compression method of the
profile at each measured rate) and AdaptCache's policy at several --alphas instead; each job's
TTFT (its history loaded from its tier or recomputed, plus its new tokens' prefill) and answer
quality are averaged (`adapt_sim.py`): writes store_sim-adaptcache-<date>.json and an SVG of
TTFT against quality per capacity setting.

    python benchmarks/store_sim.py \
        --profile benchmarks/results/adapt_profile/adapt_profile-smollm2-135m-2026-11-29.json

`--trace documents` replaces the conversations with AdaptCache's own setting: questions
about shared long contexts (LongBench-like lengths, Poisson arrivals, optionally
Zipf-popular), each document's KV saved and reused. `--trace serve` replays
benchmarks/serve.py's workload instead (to set the simulator beside a real serving run:
benchmarks/adapt_orders.py).
"""

from __future__ import annotations

import argparse
import heapq
import re
import sys
from collections import deque
from pathlib import Path

import adapt_sim
import numpy as np
import sharegpt
from harness import add_out_argument, write_results
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import jax.numpy as jnp  # noqa: E402

from jkv.config import PRESETS  # noqa: E402
from jkv.kv.format import KVFormat  # noqa: E402
from jkv.kv.page_pool import page_bytes  # noqa: E402
from jkv.store import POLICIES, Placement  # noqa: E402
from jkv.store.adapt_profile import Profile  # noqa: E402

PLACEMENT_CAPACITIES = "32G/256G,32G/2T"
ADAPT_CAPACITIES = "2G/16G,4G/64G"
_UNITS = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def parse_bytes(text: str) -> int:
    m = re.fullmatch(r"(\d+(?:\.\d+)?)\s*([KMGT]?)i?B?", text.strip(), re.IGNORECASE)
    if not m:
        raise ValueError(f"not a size: {text!r} (e.g. 64G, 2T, 512M)")
    return int(float(m.group(1)) * _UNITS[m.group(2).upper()])


def kv_bytes_per_token(model: str, kv_format: str) -> int:
    cfg = PRESETS[model]
    page = 16
    one = page_bytes(KVFormat.parse(kv_format), page, cfg.head_dim, jnp.bfloat16)
    return one * cfg.num_layers * cfg.num_kv_heads // page


# ---------------------------------------------------------------------------- trace


def make_trace(args) -> tuple[list[tuple], dict]:
    """The --trace's events (`chat_trace` or `document_trace`)."""
    return {"documents": document_trace, "serve": serve_trace, "chat": chat_trace}[args.trace](args)


def document_trace(args) -> tuple[list[tuple], dict]:
    """AdaptCache's setting (section 3): --documents long contexts (LongBench-like: lengths
    log-normal around --document-tokens, within --max-model-len), --requests questions
    arriving as a Poisson process, each about one document (Zipf-popular with exponent
    --zipf; 0: uniform) with --question-tokens of its own; one FCFS server. Events as
    `chat_trace`'s, the document standing for the session: its first question prefills it
    (its tokens are new then), and every job saves its KV."""
    rng = np.random.default_rng(args.seed)
    per_token = kv_bytes_per_token(args.model, args.kv_format)
    tokens = [min(sharegpt.length(rng, args.document_tokens), args.max_model_len)
              for _ in range(args.documents)]
    weights = 1.0 / np.arange(1, args.documents + 1) ** args.zipf
    docs = rng.choice(args.documents, size=args.requests, p=weights / weights.sum())
    arrivals = np.cumsum(rng.exponential(1 / args.rate, args.requests))
    events: list[tuple] = []
    seen: set[int] = set()
    free = 0.0  # when the server is next free
    pending: list[tuple] = []  # (end time, document) of the job running
    for t, d in zip(arrivals, docs, strict=True):
        d = int(d)
        events.append(("arrive", float(t), d))
        start = max(float(t), free)
        new = args.question_tokens + (0 if d in seen else tokens[d])
        seen.add(d)
        pending.append((start, "start", d, new))
        free = start + rng.exponential(args.service)
        pending.append((free, "end", d, tokens[d] * per_token))
    # in time order; at equal times an arrival before the start it allows
    order = {"arrive": 0, "end": 1, "start": 2}
    events = sorted(events + [(k, t, d, x) for t, k, d, x in pending],
                    key=lambda e: (e[1], order[e[0]]))
    stats = {"documents": args.documents, "jobs": args.requests, "sessions": args.documents,
             "kv_bytes_per_token": per_token, "mean_turns": args.requests / args.documents,
             "mean_final_kv_bytes": float(np.mean(tokens)) * per_token, "zipf": args.zipf}
    return events, stats


def chat_trace(args) -> tuple[list[tuple], dict]:
    """Events in time order: ("arrive", t, session) when a turn's job joins the queue,
    ("start", t, session, its new tokens) when it leaves the queue and runs, ("end", t,
    session, kv_bytes) when it is done and the session's KV is saved."""
    rng = np.random.default_rng(args.seed)
    sessions, arrivals = chat_sessions(args, rng)
    turns = {}
    for s, lengths in sessions.items():
        held = np.cumsum([u + r for u, r in lengths])  # its history after each turn
        turns[s] = deque((u, min(int(h), args.max_model_len), None)
                         for (u, _), h in zip(lengths, held, strict=True))
    return fcfs_events(turns, arrivals, rng, args)


def chat_sessions(args, rng: np.random.Generator) -> tuple[dict[int, list[tuple[int, int]]],
                                                            np.ndarray]:
    """--sessions ShareGPT-shaped conversations, each a list of turns (user tokens, reply
    tokens), and their Poisson arrival times at --rate (also what benchmarks/cluster_sim.py
    replays on several servers)."""
    sessions = {}
    for s in range(args.sessions):
        n = sharegpt.num_turns(rng)
        sessions[s] = [(sharegpt.length(rng, sharegpt.MEAN_USER_TOKENS, args.length_scale),
                        sharegpt.length(rng, sharegpt.MEAN_REPLY_TOKENS, args.length_scale))
                       for _ in range(n)]
    return sessions, np.cumsum(rng.exponential(1 / args.rate, args.sessions))


def serve_trace(args) -> tuple[list[tuple], dict]:
    """benchmarks/serve.py's workload for the same --sessions, --rate, --length-scale,
    --think and --seed (its conversations, arrivals and think times), on chat_trace's one
    FCFS server. serve.py's histories hold the recorded replies, not the model's answers, so
    what a turn finds stored is its previous prompt (the answer saved after it differs) and
    its new tokens are the previous reply and its own message; a history over serve.py's
    budget (90% of --max-model-len less --max-tokens) drops its oldest turns. A word counts
    --tokens-per-word tokens (chat template included)."""
    from serve import make_workload

    convs = make_workload(args.sessions, args.rate, args.length_scale, args.think, args.seed)
    budget = int(args.max_model_len * 0.9) - args.max_tokens
    turns = {}
    for s, conv in enumerate(convs):
        history, reply, out = [1], 0, deque()  # (the system message: a few words)
        for turn in conv["turns"]:
            user = len(turn["user"].split())
            history.append(user)
            while sum(history) > budget and len(history) > 2:
                del history[1:3]
            out.append((round((reply + user) * args.tokens_per_word),
                        round(sum(history) * args.tokens_per_word), turn["think"]))
            reply = len(turn["reply"].split())
            history.append(reply)
        turns[s] = out
    rng = np.random.default_rng(args.seed)
    return fcfs_events(turns, np.array([c["arrival"] for c in convs]), rng, args)


def fcfs_events(turns: dict[int, deque], arrivals: np.ndarray, rng: np.random.Generator,
                args) -> tuple[list[tuple], dict]:
    """The events of sessions arriving at `arrivals` whose turns (new tokens, tokens of KV
    saved at its end, think seconds after it: None, drawn) run one at a time, FCFS, each for
    an exponential service time (chat_trace's events)."""
    per_token = kv_bytes_per_token(args.model, args.kv_format)
    pending = [(t, 0, s) for s, t in enumerate(arrivals)]
    heapq.heapify(pending)  # (time, kind: 0 arrival / 1 end, session)
    queue: deque[int] = deque()
    now, running = 0.0, None
    events: list[tuple] = []
    saved = dict.fromkeys(turns, 0)
    while pending or queue:
        if running is None and queue:  # the server is free: the next job starts now
            s = queue.popleft()
            events.append(("start", now, s, turns[s][0][0]))
            running = s
            heapq.heappush(pending, (now + rng.exponential(args.service), 1, s))
            continue
        now, kind, s = heapq.heappop(pending)
        if kind == 0:
            events.append(("arrive", now, s))
            queue.append(s)
        else:
            _, saved[s], think = turns[s].popleft()
            events.append(("end", now, s, saved[s] * per_token))
            running = None
            if turns[s]:
                think = rng.exponential(args.think) if think is None else think
                heapq.heappush(pending, (now + think, 0, s))
    jobs = sum(1 for e in events if e[0] == "start")
    stats = {"sessions": len(turns), "jobs": jobs, "kv_bytes_per_token": per_token,
             "mean_turns": jobs / len(turns),
             "mean_final_kv_bytes": float(np.mean(list(saved.values()))) * per_token}
    return events, stats


# ---------------------------------------------------------------------------- replay


def replay(events: list[tuple], policy: str, host: int, disk: int, read_bps: float) -> dict:
    """Run the trace through one placement; hit counts per tier and the moves made."""
    p = Placement(policy, host, disk)
    queue: deque[int] = deque()
    ready_at: dict[int, float] = {}  # prefetched sessions: when their read completes
    read_free = 0.0  # prefetch reads run one at a time
    hits = {"host": 0, "disk": 0, "miss": 0}
    moves = {"demoted": 0, "dropped": 0, "prefetched": 0}

    def count(ms, now: float, prefetch: bool = False) -> None:
        nonlocal read_free
        for m in ms:
            if m.src == "host" and m.dst == "disk":
                moves["demoted"] += 1
            elif m.dst is None and m.src is not None:
                moves["dropped"] += 1
            elif prefetch and m.src == "disk" and m.dst == "host":
                moves["prefetched"] += 1
                read_free = max(read_free, now) + p.size(m.session) / read_bps
                ready_at[m.session] = read_free

    for event in events:
        kind, now, s = event[:3]
        if kind == "arrive":
            queue.append(s)
        elif kind == "start":
            queue.popleft()
            tier = p.access(s)
            if tier == "host" and ready_at.get(s, 0.0) > now:
                tier = "disk"  # its prefetch had not finished: the rest is read on demand
            hits[tier or "miss"] += 1
        else:
            count(p.put(s, event[3], queue), now)
            ready_at.pop(s, None)
        count(p.prefetch(queue), now, prefetch=True)
    jobs = sum(hits.values())
    return {"host_hit_rate": hits["host"] / jobs, "disk_hit_rate": hits["disk"] / jobs,
            "hit_rate": (hits["host"] + hits["disk"]) / jobs, **hits, **moves}


# ---------------------------------------------------------------------------- output


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--sessions", type=int, default=5000, help="conversations in the trace")
    ap.add_argument("--rate", type=float, default=1.0,
                    help="conversation arrivals per second (Poisson)")
    ap.add_argument("--think", type=float, default=600.0,
                    help="mean seconds between a reply and the user's next turn")
    ap.add_argument("--length-scale", type=float, default=1.0,
                    help="with --trace chat: multiplies the ShareGPT message and reply lengths "
                         "(benchmarks/serve.py's --length-scale)")
    ap.add_argument("--service", type=float, default=0.34,
                    help="mean seconds one turn's job runs (one FCFS server)")
    ap.add_argument("--model", choices=sorted(PRESETS),
                    help="model whose KV bytes per token size the entries (default: llama3-8b; "
                         "with --profile, the profile's model)")
    ap.add_argument("--kv-format", default="auto", help="stored KV format (auto: bf16)")
    ap.add_argument("--max-model-len", type=int, default=8192,
                    help="context limit: longer histories keep their last tokens")
    ap.add_argument("--capacities",
                    help="comma-separated host/disk capacity settings (default: "
                         f"{PLACEMENT_CAPACITIES}; with --profile, {ADAPT_CAPACITIES})")
    ap.add_argument("--disk-read-gbps", type=float, default=3.0,
                    help="disk read bandwidth (prefetches, and loads with --profile), GB/s")
    ap.add_argument("--policies", default=",".join(POLICIES), help="policies to compare")
    ap.add_argument("--profile",
                    help="an AdaptCache quality profile (benchmarks/adapt_profile.py): compare "
                         "fixed-method LRU stores and AdaptCache on TTFT and quality instead")
    ap.add_argument("--alphas", default="1,3,10,30,100,300",
                    help="with --profile: AdaptCache's quality weights (seconds of load a "
                         "use trades for a whole unit of quality)")
    ap.add_argument("--quality-floor", type=float, default=0.0,
                    help="with --profile: AdaptCache never keeps a form below this quality")
    ap.add_argument("--half-life", default="600",
                    help="with --profile: seconds over which an entry's hit count halves, or "
                         "auto: learned from the reuse gaps (what the store does by default)")
    ap.add_argument("--decode-backend",
                    help="with --profile: count converting a compressed form back at the "
                         "profile's decode rates for this JAX backend (e.g. cpu; default: "
                         "free)")
    ap.add_argument("--host-read-gbps", type=float, default=10.0,
                    help="with --profile: host-to-device load bandwidth, GB/s")
    ap.add_argument("--prefill-tokens-per-s", type=float, default=500.0,
                    help="with --profile: prefill rate for a miss's history and each new "
                         "turn (the default: SmolLM2 on this 2-core CPU)")
    ap.add_argument("--trace", choices=("chat", "documents", "serve"), default="chat",
                    help="chat: ShareGPT-shaped conversations (CachedAttention); documents: "
                         "questions about shared long contexts (AdaptCache's LongBench "
                         "setting); serve: benchmarks/serve.py's workload (its recorded "
                         "replies: a turn reuses its previous prompt)")
    ap.add_argument("--max-tokens", type=int, default=16,
                    help="with --trace serve: serve.py's --max-tokens (its history budget)")
    ap.add_argument("--tokens-per-word", type=float, default=1.13,
                    help="with --trace serve: tokens a workload word takes, chat template "
                         "included (SmolLM2: 445 prompt tokens for 393 words measured)")
    ap.add_argument("--documents", type=int, default=1100,
                    help="with --trace documents: how many contexts")
    ap.add_argument("--document-tokens", type=float, default=6000,
                    help="with --trace documents: mean context length in tokens")
    ap.add_argument("--requests", type=int, default=5000,
                    help="with --trace documents: questions in the trace")
    ap.add_argument("--question-tokens", type=int, default=64,
                    help="with --trace documents: a question's own tokens")
    ap.add_argument("--zipf", type=float, default=0.0,
                    help="with --trace documents: popularity exponent (0: every document alike)")
    ap.add_argument("--seed", type=int, default=0, help="trace seed")
    add_out_argument(ap, "store_sim")
    args = ap.parse_args()
    profile = None
    if args.profile is not None:
        try:
            profile = Profile.load(args.profile)
        except ValueError as e:
            ap.error(f"--profile: {e}")
        if args.kv_format not in ("auto", "bf16"):
            ap.error("--kv-format: a profile's rates are against bf16 entries (auto or bf16)")
    args.model = args.model or (profile.model if profile else "llama3-8b")
    args.capacities = args.capacities or (ADAPT_CAPACITIES if profile else
                                          PLACEMENT_CAPACITIES)
    policies = args.policies.split(",")
    for p in policies:
        if p not in POLICIES:
            ap.error(f"--policies: {p!r} is not one of {POLICIES}")
    try:
        caps = [tuple(parse_bytes(x) for x in c.split("/")) for c in args.capacities.split(",")]
        alphas = [float(a) for a in args.alphas.split(",")]
    except ValueError as e:
        ap.error(f"--capacities or --alphas: {e}")
    if any(len(c) != 2 for c in caps):
        ap.error("--capacities: each setting is host/disk, e.g. 32G/2T")
    if args.half_life != "auto":
        try:
            if not float(args.half_life) > 0:
                raise ValueError
        except ValueError:
            ap.error(f"--half-life: seconds > 0 or auto, got {args.half_life!r}")

    events, trace = make_trace(args)
    unit = "document" if args.trace == "documents" else "session"
    print(f"{trace['sessions']} {unit}s, {trace['jobs']} jobs ({trace['mean_turns']:.2f} per "
          f"{unit}), {trace['kv_bytes_per_token'] / 1024:.0f} KiB of KV per token, mean "
          f"final {unit} {trace['mean_final_kv_bytes'] / 2**30:.2f} GiB")
    names = args.capacities.split(",")
    if profile is not None:
        compare_compression(events, trace, profile, alphas, dict(zip(names, caps, strict=True)),
                            args)
        return
    rows: dict[str, dict[str, dict]] = {}
    with tqdm(total=len(caps) * len(policies), desc="replaying", unit="run") as bar:
        for name, (host, disk) in zip(names, caps, strict=True):
            rows[name] = {}
            for policy in policies:
                rows[name][policy] = replay(events, policy, host, disk,
                                            args.disk_read_gbps * 1e9)
                bar.update(1)
    print(f"{'capacity':<14}{'policy':<11}{'host hit':>9}{'disk hit':>9}{'overall':>9}"
          f"{'demoted':>9}{'dropped':>9}{'prefetched':>11}")
    for name, by_policy in rows.items():
        for policy, r in by_policy.items():
            print(f"{name:<14}{policy:<11}{r['host_hit_rate']:>9.1%}{r['disk_hit_rate']:>9.1%}"
                  f"{r['hit_rate']:>9.1%}{r['demoted']:>9}{r['dropped']:>9}"
                  f"{r['prefetched']:>11}")

    write_results(args.out, "store_sim", {"benchmark": "store_sim", "trace": trace,
                                          "results": rows}, args)


def compare_compression(events: list[tuple], trace: dict, profile: Profile,
                        alphas: list[float], caps: dict[str, tuple[int, int]], args) -> None:
    """Fixed-method LRU stores and AdaptCache at each alpha on the same trace (adapt_sim)."""
    rng = np.random.default_rng(args.seed + 1)
    kinds = {s: profile.kinds[i] for s, i in
             enumerate(rng.integers(len(profile.kinds), size=trace["sessions"]))}
    per_token = trace["kv_bytes_per_token"]
    names = adapt_sim.stores(profile, alphas)
    rows: dict[str, dict[str, dict]] = {}
    with tqdm(total=len(caps) * len(names), desc="replaying", unit="run") as bar:
        for cap, (host, disk) in caps.items():
            rows[cap] = {}
            for name, store in names:
                rows[cap][name] = adapt_sim.replay(events, store, host, disk, profile, kinds,
                                                   per_token, args)
                bar.update(1)
    checks = {cap: adapt_sim.checks(by_store) for cap, by_store in rows.items()}
    print(f"{'capacity':<14}{'store':<26}{'TTFT mean':>10}{'quality':>9}{'host hit':>9}"
          f"{'disk hit':>9}")
    for cap, by_store in rows.items():
        for name, r in by_store.items():
            print(f"{cap:<14}{name:<26}{r['mean_ttft_s']:>9.3f}s{r['mean_quality']:>9.4f}"
                  f"{r['host_hit_rate']:>9.1%}{r['disk_hit_rate']:>9.1%}")
        for key, rivals in (("best_ttft_ratio", "LRU baseline (full, KIVI, StreamingLLM)"),
                            ("best_ttft_ratio_any_format", "fixed store (any format)")):
            best = checks[cap][key]
            if best:
                print(f"{cap}: {best['adaptcache']} TTFT {best['ttft_ratio']:.2f}x lower than "
                      f"{best['rival']} (the fastest {rivals} of equal or better quality)")
        ratios = checks[cap]["ttft_ratio_to_fixed_frontier"]
        if ratios:
            name = max(ratios, key=ratios.get)
            print(f"{cap}: {name} TTFT {ratios[name]:.2f}x lower than the fixed stores' "
                  "frontier interpolated at its quality")
        for name, ok in checks[cap]["beats_streaming_on_quality"].items():
            print(f"{cap}: {name}: {'an' if ok else 'no'} AdaptCache point of equal or lower "
                  "TTFT has higher quality")
    write_results(args.out, "store_sim-adaptcache",
                  {"benchmark": "store_sim", "mode": "compression", "trace": trace,
                   "profile": profile.to_json(), "results": rows, "checks": checks},
                  args)


if __name__ == "__main__":
    main()
