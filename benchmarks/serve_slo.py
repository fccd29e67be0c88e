"""LayerKV's serving evaluation in spirit (its figures 4 and 6-8): single-turn requests of
mixed prompt lengths arrive as a Poisson process at a server whose KV pages run short, for
three settings side by side, each on its own server started in this run:

- no offload: `--no-layer-offload` (a prompt waits for pages; running requests are preempted
  and recomputed when the pool runs out: vLLM's behaviour);
- offload: `--layer-offload` (a prompt is admitted with some layers' KV on the host; running
  requests move layers to the host instead of being preempted);
- offload + SLO: the same with `--ttft-slo-ms`/`--tpot-slo-ms` given to the server (TPOT
  slack caps the prefill tokens of a step, TTFT deadlines order the queue).

    python benchmarks/serve_slo.py                       # CPU-sized defaults, SmolLM2
    python benchmarks/serve_slo.py --rates 1,2,4 --lengths 1024,2048,4096,8192 \\
        --max-model-len 8448 --ttft-slo-ms 2000 --tpot-slo-ms 100 --vocab 128256 \\
        --server-args "--model random:llama3-8b --kv-cache-bytes 3000000000 \\
                       --max-num-seqs 32 --host-cache-bytes 0"   # GPU, random 8B weights

Prompts are random token ids of exactly the lengths asked (sent to /v1/completions with
ignore_eos, so every request decodes `--max-tokens` tokens). Every setting sees the same
requests at each rate. Reported per setting and rate: TTFT mean and p99 (overall and per
prompt length), TPOT p50/p99, the share of requests that missed either target (the targets
are the same for all three settings; only the third tells the server), preemptions and layer
offload counters. Writes benchmarks/results/serve_slo/serve_slo-<device>-<date>.json and its
plot (TTFT p99, TPOT p99 and the violation rate against the arrival rate), after each
setting (the JSON's `complete` says whether every setting finished).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import time
from pathlib import Path

import httpx
import numpy as np
from harness import add_out_argument, write_results
from serve import device_kind, pct, scrape, start_server, stop_server, timed_stream
from tqdm import tqdm


def make_requests(n: int, rate: float, lengths: list[int], vocab: int,
                  seed: int) -> list[dict]:
    """`n` requests: Poisson arrivals at `rate` per second, prompt lengths drawn evenly from
    `lengths`, random token ids below `vocab` (past the first 256: no control tokens)."""
    rng = np.random.default_rng(seed)
    arrivals = np.cumsum(rng.exponential(1 / rate, n))
    return [{"arrival": float(t), "prompt": rng.integers(256, vocab, int(m)).tolist()}
            for t, m in zip(arrivals, rng.choice(lengths, n), strict=True)]


async def one_request(client: httpx.AsyncClient, model: str, prompt: list[int],
                      max_tokens: int) -> dict:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    # a token is any event with a choice, even one with no text yet
    return await timed_stream(client, "/v1/completions", body,
                              lambda event: bool(event.get("choices")))


async def run_requests(base: str, model: str, reqs: list[dict], args, desc: str) -> list:
    async def one(req, start, bar):
        await asyncio.sleep(max(0.0, start + req["arrival"] - time.perf_counter()))
        out = await one_request(client, model, req["prompt"], args.max_tokens)
        bar.update(1)
        return out

    limits = httpx.Limits(max_connections=1000, max_keepalive_connections=100)
    async with httpx.AsyncClient(base_url=base, timeout=args.timeout, limits=limits) as client:
        with tqdm(total=len(reqs), desc=desc, leave=False) as bar:
            start = time.perf_counter()
            return await asyncio.gather(*(one(r, start, bar) for r in reqs))


def summarize(results: list[dict], reqs: list[dict], args, before: dict, after: dict
              ) -> dict:
    ok = [r for r in results if "error" not in r]
    ttft_slo, tpot_slo = args.ttft_slo_ms / 1000, args.tpot_slo_ms / 1000
    missed = [r["ttft"] > ttft_slo or (r["tpot"] or 0.0) > tpot_slo for r in ok]

    def delta(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    by_length = {}
    for m in sorted({r["prompt_tokens"] for r in ok}):
        ttft = [r["ttft"] for r in ok if r["prompt_tokens"] == m]
        by_length[str(m)] = {"requests": len(ttft), "ttft_mean_s": float(np.mean(ttft)),
                             "ttft_p99_s": pct(ttft, 99)}
    return {
        "requests": len(results), "errors": len(results) - len(ok),
        "ttft_mean_s": float(np.mean([r["ttft"] for r in ok])) if ok else None,
        "ttft_p99_s": pct([r["ttft"] for r in ok], 99),
        "tpot_p50_s": pct([r["tpot"] for r in ok], 50),
        "tpot_p99_s": pct([r["tpot"] for r in ok], 99),
        "slo_violation_rate": float(np.mean(missed)) if ok else None,
        "ttft_by_prompt_length": by_length,
        "preemptions": delta("jkv_preemptions_total"),
        "recomputed_tokens": delta("jkv_recomputed_tokens_total"),
        "layers_offloaded": delta("jkv_layer_offload_layers_total"),
        "admitted_offloaded": delta("jkv_layer_offload_admissions_total"),
        "layer_major_prefills": delta("jkv_layer_offload_layer_major_prefills_total"),
        "admissions_held": delta("jkv_layer_offload_admissions_held_total"),
        "layer_fetches": delta("jkv_layer_offload_fetches_total"),
        "bytes_to_host": delta("jkv_layer_offload_bytes_to_host_total"),
        # the server's learned step costs at the end (what its SLO checks weighed)
        "step_costs": {k.split('"')[1]: v for k, v in after.items()
                       if k.startswith("jkv_step_cost_seconds{")},
        # each request in arrival order: where a tail comes from
        "per_request": [{"arrival_s": round(q["arrival"], 3), "prompt": len(q["prompt"]),
                         "ttft_s": None if "error" in r else round(r["ttft"], 3),
                         "tpot_ms": None if "error" in r or r["tpot"] is None
                         else round(r["tpot"] * 1000, 1)}
                        for q, r in zip(reqs, results, strict=True)],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--requests", type=int, default=16, help="requests per arrival rate")
    ap.add_argument("--rates", default="0.1,0.2,0.3",
                    help="arrival rates to run, requests per second (Poisson)")
    ap.add_argument("--lengths", default="512,1024,2048,4096",
                    help="prompt lengths in tokens, drawn evenly")
    ap.add_argument("--max-tokens", type=int, default=32, help="tokens decoded per request")
    ap.add_argument("--ttft-slo-ms", type=float, default=15000,
                    help="the TTFT target violations are counted against (and the third "
                         "setting's server default)")
    ap.add_argument("--tpot-slo-ms", type=float, default=1500,
                    help="the TPOT target, likewise")
    ap.add_argument("--max-model-len", type=int, default=4224, help="server context length")
    ap.add_argument("--server-args",
                    default="--kv-cache-bytes 400000000 --max-num-seqs 8 --host-cache-bytes 0 "
                            "--no-enable-prefix-caching --precompile",
                    help="more flags for every server (python -m jkv.server --help); the "
                         "default pool holds about two of the longest prompts (float32 "
                         "SmolLM2 on CPU: 46 KB a token)")
    ap.add_argument("--settings", default="no offload,offload,offload + SLO",
                    help="settings to run, in order")
    ap.add_argument("--vocab", type=int, default=49152, help="token ids are drawn below this")
    ap.add_argument("--seed", type=int, default=0, help="workload seed")
    ap.add_argument("--timeout", type=float, default=1200, help="seconds per HTTP request")
    ap.add_argument("--startup-timeout", type=float, default=900,
                    help="seconds to wait for a server to come up (it compiles first)")
    add_out_argument(ap, "serve_slo")
    args = ap.parse_args()
    rates = [float(r) for r in args.rates.split(",")]
    lengths = [int(m) for m in args.lengths.split(",")]
    flags = {"no offload": ["--no-layer-offload"], "offload": ["--layer-offload"],
             "offload + SLO": ["--layer-offload", "--ttft-slo-ms", str(args.ttft_slo_ms),
                               "--tpot-slo-ms", str(args.tpot_slo_ms)]}
    settings = args.settings.split(",")
    unknown = [s for s in settings if s not in flags]
    if unknown:
        ap.error(f"unknown settings {unknown}; choose from {list(flags)}")

    rows: dict[str, dict[str, dict]] = {}
    device, path = device_kind(), None
    for setting in settings:
        proc, base = start_server(args, flags[setting])
        try:
            model = httpx.get(base + "/v1/models").json()["data"][0]["id"]
            # warm-up: one request of each length, alone (caches and allocations settle)
            warm = [{"arrival": 0.0, "prompt": r["prompt"]} for r in make_requests(
                len(lengths), 1.0, lengths, args.vocab, args.seed + 99)]
            for r in warm:
                asyncio.run(run_requests(base, model, [r], args, f"{setting}: warm-up"))
            rows[setting] = {}
            for i, rate in enumerate(rates):
                reqs = make_requests(args.requests, rate, lengths, args.vocab, args.seed + i)
                before = scrape(base)
                results = asyncio.run(run_requests(base, model, reqs, args,
                                                   f"{setting} @ {rate:g}/s"))
                rows[setting][f"{rate:g}"] = summarize(results, reqs, args, before,
                                                       scrape(base))
        finally:
            stop_server(proc)
        # what has finished is written (and replaced as more finishes), so a run cut short by
        # a time limit keeps its finished settings
        path = report(rows, settings, rates, lengths, device, args, path)


def report(rows: dict[str, dict[str, dict]], settings: list[str], rates: list[float],
           lengths: list[int], device: str, args, path: Path | None) -> Path:
    """Print the table of the settings finished so far and write them (over `path`)."""
    import jax

    def ms(v):
        return f"{v * 1000:.0f}ms" if v is not None else "-"

    print(f"\n{'setting':<16}{'rate':>6}{'TTFT mean':>11}{'TTFT p99':>10}{'TPOT p50':>10}"
          f"{'TPOT p99':>10}{'SLO miss':>9}{'preempt':>9}{'offl lay':>9}{'errors':>7}")
    for setting, by_rate in rows.items():
        for rate, r in by_rate.items():
            print(f"{setting:<16}{rate:>6}{ms(r['ttft_mean_s']):>11}{ms(r['ttft_p99_s']):>10}"
                  f"{ms(r['tpot_p50_s']):>10}{ms(r['tpot_p99_s']):>10}"
                  f"{r['slo_violation_rate']:>9.0%}{r['preemptions']:>9.0f}"
                  f"{r['layers_offloaded']:>9.0f}{r['errors']:>7}")
    tag = (device or "cpu").replace(" ", "_").lower()
    result = {"benchmark": "serve_slo", "device": device, "jax": jax.__version__,
              "cpu_count": os.cpu_count(), "rates": rates, "lengths": lengths,
              "complete": len(rows) == len(settings), "results": rows}
    return write_results(args.out, f"serve_slo-{tag}", result, args, over=path)


if __name__ == "__main__":
    main()
