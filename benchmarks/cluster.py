"""Multi-turn chats against jkv replicas on Ray Serve, one run per request router: how much of
each prompt the replica it reached already held, TTFT, and how evenly the replicas were used.

    python benchmarks/cluster.py                          # CPU: 2 replicas, kv / pow2 / prefix
    python benchmarks/cluster.py --routers kv,pow2 --conversations 24 --rate 1
    python benchmarks/cluster.py --conversations 20 --think-time 5 --no-one-replica \
        --host-cache-sizes 96MiB,128MiB --cluster-args "--max-num-seqs 4 --device-cache-bytes 16MiB"

The workload is serve.py's (ShareGPT's turn counts and lengths; each turn resends the whole
history, with a session id). Each router gets a fresh `python -m jkv.cluster`: without
`--shared-store` a replica holds only what it computed or stored itself; with it, the replicas
share one store made empty for each run. Per router: prefix hit tokens (the `cached_tokens` of
every answer's usage) and where they were found (the usage's `cached_tokens_by_tier`: device
prefix cache, host tier, the store on disk), their share of all prompt tokens, TTFT p50/p99,
the requests per replica (from `x-jkv-replica`) and the turns answered by another replica
than their conversation's previous turn.
`--host-cache-sizes` repeats the runs at each size of a replica's host tier: routing pays
most where a replica's memory holds the conversations routed to it but not all of them.
Writes benchmarks/results/cluster/cluster-<device>-<date>.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter

import httpx
import numpy as np
from harness import add_out_argument, write_results
from serve import device_kind, free_port, make_workload, wait_healthy

from jkv.config_checks import parse_bytes

ROUTERS = ("kv", "pow2", "prefix")


def start_cluster(args, router: str, replicas: int, host_cache: str | None,
                  store_dir: str | None) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = [sys.executable, "-m", "jkv.cluster", "--port", str(port), "--router", router,
           "--replicas", str(replicas), "--max-model-len", str(args.max_model_len),
           "--log-level", "warning", *shlex.split(args.cluster_args)]
    if host_cache is not None:
        cmd += ["--host-cache-bytes", host_cache]
    if store_dir is not None:
        cmd += ["--store-dir", store_dir]
    proc = subprocess.Popen(cmd, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    wait_healthy(proc, cmd, base, args.startup_timeout,
                 lambda: os.killpg(proc.pid, signal.SIGKILL))  # (its Ray too)
    return proc, base


def stop_cluster(proc: subprocess.Popen) -> None:
    """SIGTERM (the cluster takes Serve and its local Ray down), then its whole process
    group killed if it has not exited (no Ray left for the next run to join)."""
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(120)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)


async def one_turn(client: httpx.AsyncClient, model: str, messages: list[dict],
                   max_tokens: int, session: str) -> dict:
    """A streamed turn: TTFT, the replica that answered and the usage's cached tokens."""
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}, "session_id": session}
    t0, first, usage = time.perf_counter(), None, None
    async with client.stream("POST", "/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            return {"error": f"{r.status_code}: {(await r.aread())[:200]!r}"}
        replica = r.headers.get("x-jkv-replica")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            usage = event.get("usage") or usage
            if first is None and any(c.get("delta", {}).get("content")
                                     for c in event.get("choices", [])):
                first = time.perf_counter()
    details = (usage or {}).get("prompt_tokens_details") or {}
    return {"ttft": (first or time.perf_counter()) - t0, "replica": replica,
            "prompt_tokens": (usage or {}).get("prompt_tokens", 0),
            "cached_tokens": details.get("cached_tokens", 0),
            "cached_by_tier": details.get("cached_tokens_by_tier") or {}}


async def conversation(client, model: str, conv: dict, start: float, args, out: list) -> None:
    await asyncio.sleep(max(0.0, start + conv["arrival"] - time.perf_counter()))
    history = [{"role": "system", "content": "You are a helpful assistant."}]
    session, budget = f"conv-{id(conv)}", int(args.max_model_len * 0.8) - args.max_tokens
    for turn in conv["turns"]:
        history.append({"role": "user", "content": turn["user"]})
        while sum(len(m["content"].split()) for m in history) > budget and len(history) > 2:
            del history[1:3]
        result = await one_turn(client, model, history, args.max_tokens, session)
        out.append({**result, "session": session})
        if "error" in result:
            return
        history.append({"role": "assistant", "content": turn["reply"]})
        await asyncio.sleep(turn["think"])


async def run(base: str, convs: list[dict], args) -> list[dict]:
    out: list[dict] = []
    async with httpx.AsyncClient(base_url=base, timeout=args.timeout) as client:
        model = (await client.get("/v1/models")).json()["data"][0]["id"]
        start = time.perf_counter()
        await asyncio.gather(*(conversation(client, model, c, start, args, out)
                               for c in convs))
    return out


def summary(router: str, replicas: int, results: list[dict], wall_s: float) -> dict:
    ok = [r for r in results if "error" not in r]
    per_replica = Counter(r["replica"] for r in ok)
    last: dict[str, str] = {}  # each conversation's replica so far
    moved = 0
    for r in ok:  # (in the order answers arrived: a conversation's turns are in order)
        moved += r["session"] in last and last[r["session"]] != r["replica"]
        last[r["session"]] = r["replica"]
    ttft = [r["ttft"] for r in ok]
    hit, prompt = sum(r["cached_tokens"] for r in ok), sum(r["prompt_tokens"] for r in ok)
    by_tier: Counter = Counter()
    for r in ok:
        by_tier.update(r["cached_by_tier"])
    return {"router": router, "replicas": replicas, "wall_s": wall_s,
            "turns": len(results), "errors": len(results) - len(ok),
            "prefix_hit_tokens": hit, "hit_tokens_by_tier": dict(by_tier),
            "prompt_tokens": prompt,
            "hit_share": hit / prompt if prompt else 0.0,
            "ttft_p50_s": float(np.percentile(ttft, 50)) if ttft else None,
            "ttft_p99_s": float(np.percentile(ttft, 99)) if ttft else None,
            "requests_per_replica": dict(per_replica),
            "moved_turns": moved,  # answered by another replica than the conversation's last
            "load_skew": (max(per_replica.values()) / max(1, min(per_replica.values()))
                          if per_replica else None)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--routers", default=",".join(ROUTERS), help="routers to run, in order")
    ap.add_argument("--replicas", type=int, default=2, help="replicas of each cluster")
    ap.add_argument("--one-replica", action=argparse.BooleanOptionalAction, default=True,
                    help="first run the workload on one replica with the same flags: what "
                         "one replica's memory holds, which routing over more should beat")
    ap.add_argument("--conversations", type=int, default=10, help="conversations per run")
    ap.add_argument("--rate", type=float, default=0.5, help="conversation arrivals per second")
    ap.add_argument("--length-scale", type=float, default=0.3,
                    help="multiplies the ShareGPT message and reply lengths")
    ap.add_argument("--think-time", type=float, default=0.5,
                    help="mean seconds between a reply and the next message")
    ap.add_argument("--max-tokens", type=int, default=8, help="new tokens asked per turn")
    ap.add_argument("--max-model-len", type=int, default=2048, help="each replica's context")
    ap.add_argument("--cluster-args", default="--max-num-seqs 4",
                    help="more flags for python -m jkv.cluster (server flags apply per replica)")
    ap.add_argument("--host-cache-sizes", default="",
                    help="comma-separated sizes of each replica's host tier (--host-cache-bytes), "
                         "each run with every router; empty: as --cluster-args says")
    ap.add_argument("--shared-store", action=argparse.BooleanOptionalAction, default=False,
                    help="the replicas share one store on disk (--store-dir), empty for each "
                         "run")
    ap.add_argument("--seed", type=int, default=0, help="workload seed")
    ap.add_argument("--timeout", type=float, default=600, help="seconds per HTTP request")
    ap.add_argument("--startup-timeout", type=float, default=300,
                    help="seconds to wait for a cluster to come up")
    add_out_argument(ap, "cluster")
    args = ap.parse_args()
    sizes = [s.strip() for s in args.host_cache_sizes.split(",") if s.strip()] or [None]
    for size in sizes:  # (a typo fails before any cluster runs)
        try:
            parse_bytes(size or 0, "--host-cache-sizes")
        except ValueError as e:
            ap.error(str(e))
    convs = make_workload(args.conversations, args.rate, args.length_scale, args.think_time,
                          args.seed)
    device, rows, path = device_kind(), [], None
    stem = f"cluster-{device.replace(' ', '_').lower() or 'cpu'}"
    runs = [(r, args.replicas) for r in args.routers.split(",")]
    if args.one_replica:  # what one replica's memory holds, any router being the same
        runs.insert(0, ("kv", 1))
    for size in sizes:
        for router, replicas in runs:
            rows.append(run_cluster(args, router, replicas, size, convs))
            print_row(rows[-1])
            path = write_results(args.out, stem, {"replica_device": device, "rows": rows},
                                 args, over=path)  # after each run: a time limit keeps what ran
    for size in sizes:
        print_ratios(args.replicas, [r for r in rows if r.get("host_cache") == size])


def print_ratios(replicas: int, rows: list[dict]) -> None:
    """The KV-aware router's hit tokens over each other run's (at one host tier size)."""
    base = next((r for r in rows if r["router"] == "kv" and r["replicas"] == replicas
                 and "error" not in r), None)
    for r in rows:
        if base is not None and r is not base and r.get("prefix_hit_tokens"):
            print(f"kv on {replicas} / {label(r)}: "
                  f"{base['prefix_hit_tokens'] / r['prefix_hit_tokens']:.2f}x hit tokens")


def run_cluster(args, router: str, replicas: int, host_cache: str | None,
                convs: list[dict]) -> dict:
    """One fresh cluster with `router` over `replicas` (and `host_cache`, a size of each
    replica's host tier, or None), the whole workload through it: its summary row, or the
    error that kept it from starting (the other runs go on)."""
    row: dict = {"router": router, "replicas": replicas, "host_cache": host_cache,
                 "host_cache_bytes": parse_bytes(host_cache) if host_cache else None,
                 "shared_store": args.shared_store}
    with tempfile.TemporaryDirectory(prefix="jkv-cluster-store-") as tmp:
        try:
            proc, base = start_cluster(args, router, replicas, host_cache,
                                       tmp if args.shared_store else None)
        except SystemExit as e:
            return {**row, "error": str(e)}
        try:
            t0 = time.perf_counter()
            results = asyncio.run(run(base, convs, args))
            return {**row, **summary(router, replicas, results, time.perf_counter() - t0)}
        finally:
            stop_cluster(proc)


def label(r: dict) -> str:
    size = f", host {r['host_cache']}" if r.get("host_cache") else ""
    store = ", shared store" if r.get("shared_store") else ""
    return f"{r['router']} x{r['replicas']}{size}{store}"


def print_row(r: dict) -> None:
    if "error" in r:
        print(f"{label(r)}: {r['error']}", flush=True)
        return
    print(f"{label(r)}: hit tokens {r['prefix_hit_tokens']:>7} ({r['hit_share']:.1%} of "
          f"{r['prompt_tokens']}; {r['hit_tokens_by_tier']}), TTFT p50 {r['ttft_p50_s']:.2f} s "
          f"p99 {r['ttft_p99_s']:.2f} "
          f"s, per replica {r['requests_per_replica']}, moved turns {r['moved_turns']}, "
          f"errors {r['errors']}, "
          f"{r['wall_s']:.0f} s", flush=True)


if __name__ == "__main__":
    main()
