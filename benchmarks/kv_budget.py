"""Sequences and decode throughput at a fixed KV byte budget (LeanKV's figure 14 in spirit).

    python benchmarks/kv_budget.py [--requests 24] [--prompt 256] [--generate 512]
                                   [--budget-seqs 4] [--configs none:bf16,none:k8v4,leankv]
                                   [--repeats 1] [--preset llama3-8b]

Every configuration gets the same KV budget: the bytes bf16 pages take for `--budget-seqs`
sequences of prompt + generated tokens (a float32 model's `none:bf16` pool gets twice the
bytes, so it holds what bf16 pages would). `--requests` requests (prompts of `--prompt` tokens
cut from this machine's Python sources for the embedded SmolLM2, random ids for a `--preset`'s
random weights; `--generate` tokens each, EOS ignored) go in at once;
the scheduler admits what fits; every step shape is compiled before (`Engine.warmup`), so
no compilation is timed. Reported per configuration: the most sequences running at
once and the mean over the run's steps (a pool admitted on current lengths preempts later:
the mean is what it sustains), decode tokens per second over the steps that only decoded,
the whole run's generated tokens per second, preemptions, and KV bytes per token as
sequences ended. With `--repeats N` the configurations run N times in turn (A B A B ...: a
slow spell of the machine falls on all of them) and each row is its median run by decode
throughput (the slower middle one of an even count), every run's figure beside it. Writes
benchmarks/results/kv_budget/kv_budget-<device>[-<preset>]-<date>.json and its plot, and
prints a table.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from tqdm import tqdm  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from bench_model import add_model_args, load_model, result_stem  # noqa: E402
from harness import add_out_argument, write_results  # noqa: E402

from jkv.config import CacheConfig, EngineConfig  # noqa: E402
from jkv.engine.engine import Engine  # noqa: E402
from jkv.engine.sampling import SamplingParams  # noqa: E402
from jkv.kv.format import KVFormat  # noqa: E402
from jkv.kv.page_pool import page_bytes  # noqa: E402
from jkv.sched.scheduler import Request, Scheduler  # noqa: E402

PAGE = 16


def parse(text: str) -> dict:
    """none:<format> or leankv[:<alpha_high>:<alpha_low>]."""
    parts = text.split(":")
    if parts[0] == "none" and len(parts) == 2:
        return {"kv_format": parts[1]}
    if parts[0] == "leankv" and len(parts) in (1, 3):
        knobs = {} if len(parts) == 1 else {"kv_alpha_high": float(parts[1]),
                                             "kv_alpha_low": float(parts[2])}
        return {"kv_policy": "leankv", **knobs}
    raise SystemExit(f"--configs: {text!r} is neither none:<format> nor "
                     "leankv[:<alpha_high>:<alpha_low>]")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=24, help="requests sent at once")
    ap.add_argument("--prompt", type=int, default=256, help="prompt tokens per request")
    ap.add_argument("--generate", type=int, default=512, help="tokens generated per request")
    ap.add_argument("--budget-seqs", type=int, default=4,
                    help="the KV budget: bf16 pages for this many whole sequences")
    ap.add_argument("--max-num-seqs", type=int, default=32, help="sequence slots")
    ap.add_argument("--configs", default="none:bf16,none:k8v4,leankv",
                    help="comma-separated none:<format> or leankv[:<alpha_high>:<alpha_low>]")
    ap.add_argument("--repeats", type=int, default=1,
                    help="runs of every configuration, in turn; rows report the median run")
    add_model_args(ap)
    add_out_argument(ap, "kv_budget")
    args = ap.parse_args()
    if args.repeats < 1:
        ap.error("--repeats must be at least 1")

    cfg, params, dtype, make_prompts, model = load_model(args)
    ps = make_prompts(args.requests, args.prompt)
    seq = args.prompt + args.generate
    heads = cfg.num_layers * cfg.num_kv_heads
    bf16_page = page_bytes(KVFormat(), PAGE, cfg.head_dim, jnp.bfloat16)
    budget = (args.budget_seqs * -(-seq // PAGE) * heads + 1) * bf16_page

    runs: dict[str, list[dict]] = {}
    order = args.configs.split(",") * args.repeats
    for text in tqdm(order, desc="runs", unit="run"):
        knobs = parse(text)
        f32_pages = knobs.get("kv_format") in ("bf16", "auto") and dtype == jnp.float32
        cache = CacheConfig(page_size=PAGE, kv_cache_bytes=budget * (2 if f32_pages else 1),
                            **knobs)
        engine = Engine(cfg, params, cache=cache, config=EngineConfig(
            max_model_len=seq + PAGE, max_num_seqs=args.max_num_seqs, prefill_chunk=256,
            attention_backend=args.attention_backend, enable_prefix_caching=False))
        engine.warmup()  # compile every step shape first: no compilation in the timed steps
        sched = Scheduler(engine)
        requests = [Request(p, SamplingParams(max_tokens=args.generate, temperature=0,
                                              ignore_eos=True)) for p in ps]
        for r in requests:
            sched.add(r)
        peak, running, t0 = 0, [], time.perf_counter()
        with tqdm(total=args.requests * args.generate, desc=text, unit="tok", leave=False) as bar:
            while sched.num_unfinished:
                sched.step()
                now = sched.snapshot()["num_requests_running"]
                peak = max(peak, now)
                running.append(now)
                bar.update(sum(len(r.output) for r in requests) - bar.n)
        seconds = time.perf_counter() - t0
        stats, st = sched.snapshot(), engine.stats
        runs.setdefault(text, []).append({
            "peak_sequences": peak, "mean_sequences": sum(running) / len(running),
            "kv_cache_bytes": cache.kv_cache_bytes,
            "decode_tokens_per_s": st.decode_tokens / max(st.decode_seconds, 1e-9),
            "generated_tokens_per_s": args.requests * args.generate / seconds,
            "seconds": seconds, "preemptions": stats["preemptions"],
            "kv_bytes_per_token": stats["kv_bytes_per_token"], "kv_tiers": stats["kv_tiers"]})

    rows = {}
    for text, done in runs.items():
        ranked = sorted(done, key=lambda r: r["decode_tokens_per_s"])
        rows[text] = {**ranked[(len(ranked) - 1) // 2],
                      "decode_tokens_per_s_runs": [r["decode_tokens_per_s"] for r in done]}
    base = next(iter(rows.values()))
    print(f"\n{model}, {args.attention_backend} attention on {jax.devices()[0].device_kind}: "
          f"KV budget {budget / 2**20:.1f} MiB of bf16 pages ({args.budget_seqs} sequences of "
          f"{seq} tokens); {args.requests} requests\n")
    print("| config | peak seqs | mean seqs | x first | decode tok/s | x first | runs' decode "
          "tok/s | run tok/s | preempt | bytes/token |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for text, r in rows.items():
        print(f"| {text} | {r['peak_sequences']} | {r['mean_sequences']:.1f} | "
              f"{r['mean_sequences'] / base['mean_sequences']:.2f} | "
              f"{r['decode_tokens_per_s']:.1f} | "
              f"{r['decode_tokens_per_s'] / base['decode_tokens_per_s']:.2f} | "
              f"{' / '.join(f'{x:.1f}' for x in r['decode_tokens_per_s_runs'])} | "
              f"{r['generated_tokens_per_s']:.1f} | {r['preemptions']} | "
              f"{r['kv_bytes_per_token']:.0f} |")
    write_results(args.out, result_stem("kv_budget", args),
                  {"device": jax.devices()[0].device_kind, "jax": jax.__version__,
                   "model": model, "budget_bf16_bytes": budget, "rows": rows}, args)


if __name__ == "__main__":
    main()
