"""Multi-turn chat serving over HTTP: the same conversation workload against a jkv server with
prefix caching on and one with it off, started one after the other in this run.

    python benchmarks/serve.py                      # CPU-sized defaults, SmolLM2
    python benchmarks/serve.py --conversations 200 --rate 2 --length-scale 1 \\
        --server-args "--kv-cache-bytes 8000000000"  # GPU

The workload follows the ShareGPT statistics CachedAttention and Krul report: 73% of
conversations are multi-turn and they average 5.75 turns; a turn averages 630 tokens, the
reply about 6.56x the user's message (so ~84 in, ~546 out). Conversations arrive as a Poisson
process (`--rate` per second); a conversation's next turn is sent when its reply is complete
plus an exponential think time. Each turn resends the whole history (a stateless client), the
history holding the dataset-length replies (as a replayed trace does) while the server is
asked for at most `--max-tokens` new tokens, so histories grow to thousands of tokens without
decoding them all. A history longer than the context drops its oldest turns.

With `--settings 'name=flags;...'` any server settings are compared instead (the store on
and off under a small device cache: 'store=--device-cache-bytes 50000000;no
store=--device-cache-bytes 50000000 --host-cache-bytes 0').

Prints TTFT and TPOT p50/p99, throughput and the prefix-cache hit rate per tier (device,
host, disk) per setting, and writes benchmarks/results/serve/serve-<device>-<date>.json and its
plot (the TTFT distributions).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable

import httpx
import numpy as np
import sharegpt
from harness import add_out_argument, write_results
from tqdm import tqdm

_WORDS = ("time way year work day part life case point group number world house area "
          "company problem service place hand party school country system program question "
          "government night story family fact money member water month lot right study book "
          "word business issue side kind head eye job game line end city office").split()


# ---------------------------------------------------------------------------- workload


def make_workload(n: int, rate: float, scale: float, think: float, seed: int) -> list[dict]:
    """Conversations: arrival time, and per turn the user's message and the recorded reply
    (as word lists; SmolLM2's tokenizer spends about one token per such word)."""
    rng = np.random.default_rng(seed)
    arrivals = np.cumsum(rng.exponential(1 / rate, n))
    convs = []
    for i in range(n):
        turns = sharegpt.num_turns(rng)

        def length(mean: float) -> int:
            return sharegpt.length(rng, mean, scale)

        convs.append({
            "arrival": float(arrivals[i]),
            "turns": [{"user": " ".join(rng.choice(_WORDS, length(sharegpt.MEAN_USER_TOKENS))),
                       "reply": " ".join(rng.choice(_WORDS, length(sharegpt.MEAN_REPLY_TOKENS))),
                       "think": float(rng.exponential(think))} for _ in range(turns)],
        })
    return convs


# ---------------------------------------------------------------------------- client


async def timed_stream(client: httpx.AsyncClient, path: str, body: dict,
                       is_token: Callable[[dict], bool]) -> dict:
    """POST a streaming request; its TTFT (to the first event `is_token` accepts), TPOT and
    token counts from the usage chunk, or {"error": ...}."""
    t0 = time.perf_counter()
    first = usage = None
    text = []
    async with client.stream("POST", path, json=body) as r:
        if r.status_code != 200:
            return {"error": f"{r.status_code}: {(await r.aread())[:200]!r}"}
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                return {"error": event["error"]["message"]}
            if event.get("usage"):
                usage = event["usage"]
            text += [c["delta"].get("content") or "" for c in event.get("choices", [])
                     if "delta" in c]
            if first is None and is_token(event):
                first = time.perf_counter()
    end = time.perf_counter()
    n = usage["completion_tokens"] if usage else 0
    first = first or end
    return {"ttft": first - t0, "e2e": end - t0, "output_tokens": n, "text": "".join(text),
            "prompt_tokens": usage["prompt_tokens"] if usage else 0,
            "tpot": (end - first) / (n - 1) if n > 1 else None}


async def one_turn(client: httpx.AsyncClient, model: str, messages: list[dict],
                   max_tokens: int, session: str) -> dict:
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}, "session_id": session}
    return await timed_stream(client, "/v1/chat/completions", body, lambda event: any(
        c["delta"].get("content") for c in event["choices"]))


async def conversation(client, model: str, conv: dict, start: float, args, results: list,
                       bar, index: int = 0) -> None:
    await asyncio.sleep(max(0.0, start + conv["arrival"] - time.perf_counter()))
    history: list[dict] = [{"role": "system", "content": "You are a helpful assistant."}]
    session = f"conv-{id(conv)}"
    budget = int(args.max_model_len * 0.9) - args.max_tokens  # words ~ tokens, some slack
    for t, turn in enumerate(conv["turns"]):
        history.append({"role": "user", "content": turn["user"]})
        while sum(len(m["content"].split()) for m in history) > budget and len(history) > 2:
            del history[1:3]  # drop the oldest turn (a user message and its reply)
        out = await one_turn(client, model, history, args.max_tokens, session)
        out["turn"] = (index, t)
        results.append(out)
        bar.update(1)
        if "error" in out:
            return
        history.append({"role": "assistant", "content": turn["reply"]})
        await asyncio.sleep(turn["think"])


async def run_workload(base: str, model: str, convs: list[dict], args) -> tuple[list, float]:
    results: list[dict] = []
    limits = httpx.Limits(max_connections=1000, max_keepalive_connections=100)
    async with httpx.AsyncClient(base_url=base, timeout=args.timeout, limits=limits) as client:
        with tqdm(total=sum(len(c["turns"]) for c in convs), desc="turns", leave=False) as bar:
            start = time.perf_counter()
            await asyncio.gather(*(conversation(client, model, c, start, args, results, bar,
                                                i) for i, c in enumerate(convs)))
            elapsed = time.perf_counter() - start
    return results, elapsed


# ---------------------------------------------------------------------------- servers


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(args, flags: list[str]) -> tuple[subprocess.Popen, str]:
    """A jkv server on a free local port with `args.server_args` and `flags`, once healthy."""
    port = free_port()
    cmd = [sys.executable, "-m", "jkv.server", "--host", "127.0.0.1", "--port", str(port),
           "--max-model-len", str(args.max_model_len), "--log-level", "warning",
           *flags, *shlex.split(args.server_args)]
    proc = subprocess.Popen(cmd)
    base = f"http://127.0.0.1:{port}"
    wait_healthy(proc, cmd, base, args.startup_timeout, proc.kill)
    return proc, base


def wait_healthy(proc: subprocess.Popen, cmd: list[str], base: str, seconds: float,
                 kill: Callable[[], None]) -> None:
    """Until `base`/health answers 200; SystemExit (after `kill()` on a timeout) when the
    process exits first or `seconds` pass."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"{cmd[2]} exited with {proc.returncode}: {' '.join(cmd)}")
        try:
            if httpx.get(base + "/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    kill()
    raise SystemExit(f"{cmd[2]} did not come up in {seconds} s")


def stop_server(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()


def device_kind() -> str:
    """The accelerator the servers run on, as JAX names it."""
    return subprocess.run([sys.executable, "-c",
                           "import jax; print(jax.devices()[0].device_kind)"],
                          capture_output=True, text=True).stdout.strip()


def scrape(base: str) -> dict:
    out = {}
    for line in httpx.get(base + "/metrics", timeout=30).text.splitlines():
        if line.startswith("jkv_") and " " in line:
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def pct(values, q: float) -> float | None:
    values = [v for v in values if v is not None]
    return float(np.percentile(values, q)) if values else None


def summarize(results: list[dict], elapsed: float, before: dict, after: dict) -> dict:
    ok = [r for r in results if "error" not in r]

    def delta(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    query = delta("jkv_prefix_cache_query_tokens_total")
    hits = {tier: delta(f'jkv_prefix_cache_hit_tokens_total{{tier="{tier}"}}')
            for tier in ("device", "host", "disk")}
    return {
        "turns": len(results), "errors": len(results) - len(ok),
        "elapsed_s": elapsed,
        "ttft_p50_s": pct([r["ttft"] for r in ok], 50),
        "ttft_p99_s": pct([r["ttft"] for r in ok], 99),
        "tpot_p50_s": pct([r["tpot"] for r in ok], 50),
        "tpot_p99_s": pct([r["tpot"] for r in ok], 99),
        "output_tok_s": sum(r["output_tokens"] for r in ok) / elapsed,
        "turns_per_s": len(ok) / elapsed,
        "mean_prompt_tokens": float(np.mean([r["prompt_tokens"] for r in ok])) if ok else 0,
        "max_prompt_tokens": max((r["prompt_tokens"] for r in ok), default=0),
        "prefix_hit_rate": sum(hits.values()) / query if query else 0.0,
        "hit_rate_by_tier": {t: h / query if query else 0.0 for t, h in hits.items()},
        "prompt_tokens_computed": delta("jkv_prompt_tokens_total"),
        "preemptions": delta("jkv_preemptions_total"),
        "compilations": delta("jkv_compilations_total"),
        "store": {k: delta(f"jkv_store_{k}_total") for k in (
            "saves", "evictions", "converted_loads", "misses", "restores_declined",
            "restores_abandoned")},
        # what the store measured by the end (read and conversion rates, AdaptCache's
        # half-life): the figures its placement and restore planning weighed
        "store_rates": {name[len("jkv_store_"):]: value for name, value in after.items()
                        if name.startswith(("jkv_store_read_bytes_per_second",
                                            "jkv_store_convert_bytes_per_second",
                                            "jkv_store_adapt_half_life_seconds"))},
        "ttft_all_s": sorted(r["ttft"] for r in ok),
    }


def fidelity(results: list[dict], reference: list[dict]) -> dict:
    """Answers against the reference setting's for the same turns (the same prompts: each
    history holds the recorded replies): the share that are identical, and the mean share
    of the reference answer's words matched before the first difference (greedy decoding:
    any difference comes from the KV the history was restored with)."""
    ref = {r["turn"]: r["text"] for r in reference if "error" not in r}
    pairs = [(r["text"], ref[r["turn"]]) for r in results
             if "error" not in r and r["turn"] in ref]
    if not pairs:
        return {"turns_compared": 0}

    def prefix(a: str, b: str) -> float:
        wa, wb = a.split(), b.split()
        n = next((i for i, (x, y) in enumerate(zip(wa, wb, strict=False)) if x != y),
                 min(len(wa), len(wb)))
        return n / max(len(wb), 1) if wa != wb else 1.0

    return {"turns_compared": len(pairs),
            "identical_answers": float(np.mean([a == b for a, b in pairs])),
            "prefix_agreement": float(np.mean([prefix(a, b) for a, b in pairs]))}


# ---------------------------------------------------------------------------- plot


# ---------------------------------------------------------------------------- main


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--conversations", type=int, default=12, help="conversations in the run")
    ap.add_argument("--rate", type=float, default=0.2,
                    help="conversation arrivals per second (Poisson)")
    ap.add_argument("--length-scale", type=float, default=0.5,
                    help="multiplies the ShareGPT message and reply lengths")
    ap.add_argument("--think-time", type=float, default=1.0,
                    help="mean seconds between a reply and the user's next message")
    ap.add_argument("--max-tokens", type=int, default=16, help="new tokens asked per turn")
    ap.add_argument("--max-model-len", type=int, default=4096, help="server context length")
    ap.add_argument("--server-args", default="--kv-cache-bytes 2000000000 --max-num-seqs 8",
                    help="more flags for both servers (python -m jkv.server --help)")
    ap.add_argument("--settings", default="on,off",
                    help="settings to run, in order, each a server of its own: on/off (prefix "
                         "caching), or 'name=flags' entries separated by ';' (e.g. 'store=; "
                         "no store=--host-cache-bytes 0')")
    ap.add_argument("--reference",
                    help="a setting whose answers are the full-precision ones: every other "
                         "setting's answers are compared with them turn by turn (fidelity)")
    ap.add_argument("--seed", type=int, default=0, help="workload seed")
    ap.add_argument("--warmup", type=int, default=4,
                    help="conversations run (all at once) before measuring, to compile")
    ap.add_argument("--timeout", type=float, default=600, help="seconds per HTTP request")
    ap.add_argument("--startup-timeout", type=float, default=300,
                    help="seconds to wait for a server to come up")
    add_out_argument(ap, "serve")
    args = ap.parse_args()

    convs = make_workload(args.conversations, args.rate, args.length_scale, args.think_time,
                          args.seed)
    turns = [len(c["turns"]) for c in convs]
    print(f"{len(convs)} conversations, {sum(turns)} turns (mean {np.mean(turns):.2f}, "
          f"{np.mean([t > 1 for t in turns]):.0%} multi-turn)")
    rows, device = {}, None
    settings = {}
    for entry in args.settings.split(";" if "=" in args.settings else ","):
        name, _, flags = entry.partition("=")
        if not flags and name.strip() in ("on", "off"):
            name, flags = f"prefix caching {name.strip()}", (
                "--enable-prefix-caching" if name.strip() == "on" else
                "--no-enable-prefix-caching")
        settings[name.strip()] = shlex.split(flags)
    if args.reference is not None and args.reference not in settings:
        ap.error(f"--reference: {args.reference!r} is not one of the settings {list(settings)}")
    answers = {}
    for setting, flags in settings.items():
        proc, base = start_server(args, flags)
        try:
            model = httpx.get(base + "/v1/models").json()["data"][0]["id"]
            # warm-up: compile the common shapes before the clock starts
            warm = make_workload(args.warmup, 100.0, args.length_scale, 0.0, args.seed + 1)
            asyncio.run(run_workload(base, model, warm, args))
            before = scrape(base)
            results, elapsed = asyncio.run(run_workload(base, model, convs, args))
            rows[setting] = summarize(results, elapsed, before, scrape(base))
            answers[setting] = results
            device = device or device_kind()
        finally:
            stop_server(proc)

    print(f"\n{'setting':<20}{'TTFT p50':>10}{'TTFT p99':>10}{'TPOT p50':>10}{'TPOT p99':>10}"
          f"{'out tok/s':>11}{'turns/s':>9}{'hits dev/host/disk':>20}{'compiles':>10}"
          f"{'errors':>8}")

    def ms(v):
        return f"{v * 1000:.0f}ms" if v is not None else "-"

    for name, r in rows.items():
        hits = "/".join(f"{v:.0%}" for v in r["hit_rate_by_tier"].values())
        print(f"{name:<20}{ms(r['ttft_p50_s']):>10}{ms(r['ttft_p99_s']):>10}"
              f"{ms(r['tpot_p50_s']):>10}{ms(r['tpot_p99_s']):>10}{r['output_tok_s']:>11.1f}"
              f"{r['turns_per_s']:>9.2f}{hits:>20}"
              f"{r['compilations']:>10.0f}{r['errors']:>8}")
    if args.reference is not None:
        print(f"\nanswers against {args.reference!r}'s:")
        for name in rows:
            f = rows[name]["fidelity"] = fidelity(answers[name], answers[args.reference])
            if f["turns_compared"]:
                print(f"{name:<20} identical {f['identical_answers']:.0%}, words matched "
                      f"before the first difference {f['prefix_agreement']:.0%} "
                      f"({f['turns_compared']} turns)")
    import jax

    tag = (device or "cpu").replace(" ", "_").lower()
    result = {"benchmark": "serve", "device": device, "jax": jax.__version__,
              "cpu_count": os.cpu_count(),
              "workload": {"conversations": len(convs), "turns": sum(turns),
                           "mean_turns": float(np.mean(turns)),
                           "multi_turn_fraction": float(np.mean([t > 1 for t in turns]))},
              "results": rows}
    write_results(args.out, f"serve-{tag}", result, args)


if __name__ == "__main__":
    main()
