"""Whether a request's tokens depend on how full the pool is: the same requests, greedy, on a
pool that holds them all and on a small one, per KV policy.

    python benchmarks/pool_independence.py [--policies none,leankv] [--requests 8]
                                           [--prompt 640] [--generate 32]
                                           [--small-seqs 2.5] [--large-mb 512]

The small pool holds `--small-seqs` sequences of max_model_len (1024) in the policy's own
pages. A policy's compression should not depend on its neighbours or on the pool: the small pool
makes the scheduler offload layers (LayerKV, block pages), preempt, or run fewer requests at
once, and each of those must leave every request's tokens as on the large pool. Reported per
policy: the share of generated positions equal on both pools (position by position), the
requests whose tokens all agree, and on the small pool the preemptions, layers offloaded and
compactions the pool was too short for. Writes
benchmarks/results/pool_independence/pool_independence-<device>-<date>.json and prints a table.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import jax  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from bench_model import add_model_args, load_model, result_stem  # noqa: E402
from harness import add_out_argument, write_results  # noqa: E402

from jkv.config import CacheConfig, EngineConfig, SchedulerConfig  # noqa: E402
from jkv.engine.engine import Engine  # noqa: E402
from jkv.engine.sampling import SamplingParams  # noqa: E402
from jkv.sched.scheduler import Request, Scheduler, generate_all  # noqa: E402

PAGE = 16


def run(cfg, params, policy: str, pool_bytes: int, prompts: list[list[int]], generate: int,
        backend: str, batched: int | None) -> dict:
    """Every prompt on one engine: its tokens, the pool's counters and the bytes one
    sequence of max_model_len takes in it."""
    engine = Engine(cfg, params, cache=CacheConfig(
        page_size=PAGE, kv_cache_bytes=pool_bytes, kv_policy=policy),
        config=EngineConfig(max_model_len=1024, max_num_seqs=len(prompts), prefill_chunk=256,
                            attention_backend=backend, enable_prefix_caching=False))
    sched = Scheduler(engine, SchedulerConfig(max_num_batched_tokens=batched))
    requests = [Request(p, SamplingParams(max_tokens=generate, temperature=0, ignore_eos=True))
                for p in prompts]
    generate_all(sched, requests)
    snap = sched.snapshot()
    return {"tokens": [r.output for r in requests], "preemptions": snap["preemptions"],
            "layers_offloaded": snap.get("layer_offload", {}).get("layers_offloaded", 0),
            "tier_refusals": getattr(engine.cache.layout, "tier_refusals", 0),
            "sequence_bytes": (engine.cache.cost.pages(1024) + 1) * engine.cache.one_page}


def agreement(a: list[list[int]], b: list[list[int]]) -> tuple[float, int]:
    """(the share of positions equal, the requests equal throughout)."""
    same = sum(x == y for ra, rb in zip(a, b, strict=True) for x, y in zip(ra, rb, strict=True))
    return same / sum(len(r) for r in a), sum(ra == rb for ra, rb in zip(a, b, strict=True))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--policies", default="none,leankv", help="kv_policy values, comma-separated")
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=640, help="prompt tokens per request")
    ap.add_argument("--generate", type=int, default=32, help="greedy tokens per request")
    ap.add_argument("--small-seqs", type=float, default=2.5,
                    help="the small pool, in sequences of max_model_len")
    ap.add_argument("--large-mb", type=int, default=512, help="the large pool, MiB")
    ap.add_argument("--max-batched-tokens", type=int, default=None,
                    help="tokens per step (default: one prefill chunk, 256, which requests "
                         "share: where a prompt's chunks end then depends on its neighbours)")
    add_out_argument(ap, "pool_independence")
    add_model_args(ap)
    args = ap.parse_args()
    cfg, params, _, make_prompts, model = load_model(args)
    prompts = make_prompts(args.requests, args.prompt)
    rows = {}
    for policy in args.policies.split(","):
        large = run(cfg, params, policy, args.large_mb << 20, prompts, args.generate,
                    args.attention_backend, args.max_batched_tokens)
        small_bytes = int(args.small_seqs * large["sequence_bytes"])
        small = run(cfg, params, policy, small_bytes, prompts, args.generate,
                    args.attention_backend, args.max_batched_tokens)
        share, whole = agreement(large["tokens"], small["tokens"])
        rows[policy] = {"agreement": share, "requests_equal": whole, "small_bytes": small_bytes,
                        **{k: small[k] for k in ("preemptions", "layers_offloaded",
                                                 "tier_refusals")}}
    print(f"\n{model}: {args.requests} prompts of {args.prompt} tokens, {args.generate} greedy "
          f"tokens, a pool of {args.small_seqs} sequences against {args.large_mb} MiB")
    print("| policy | small pool MiB | agreement | requests equal | preemptions | "
          "layers offloaded | tier refusals |\n|---|---|---|---|---|---|---|")
    for policy, r in rows.items():
        print(f"| {policy} | {r['small_bytes'] / 2**20:.1f} | {r['agreement']:.3f} | "
              f"{r['requests_equal']}/{args.requests} | "
              f"{r['preemptions']} | {r['layers_offloaded']} | {r['tier_refusals']} |")
    write_results(args.out, result_stem("pool_independence", args), {
        "model": model, "device": jax.devices()[0].device_kind, "jax": jax.__version__,
        "rows": rows}, args)


if __name__ == "__main__":
    main()
