"""What LeanKV's tiering costs inside the engine's decode step, on this machine, in one run.

    python benchmarks/tier_cost.py [--batches 8,32] [--context 512] [--new-tokens 32]
                                   [--preset llama3-8b] [--out DIR]

For each batch size, SmolLM2-135M (the embedded default; float32 and xla attention on CPU)
or random weights of a `--preset`'s shape decodes `--batches` sequences of `--context` prompt
tokens (this machine's Python sources; random ids for a preset) twice:
with `kv_policy="none"` in k8v4t pages (leankv's high format: the same attention without
tiers) and with `kv_policy="leankv"` at its defaults. Reported per configuration: the mean
engine step that decodes every sequence and prefills none, over the last `--new-tokens`
such steps (rounded down to whole placement intervals, none of them compiling), and for
leankv the mean part of it spent in the tiering calls: `retier` (Algorithm 1's generation
phase for every (sequence, layer, KV head), compaction and the token moves, once per
`kv_placement_interval` steps) and `grow` (each step's new pages, in the tiered table);
each call timed by waiting for the device before and after it. `grow` is timed without
tiers too, where it only reserves pages: the tiering columns give both the tiered calls'
whole time and that time less the untiered `grow` (what tiers add to a step's page
bookkeeping). Means, not medians: placement runs in one step of each interval and its cost
is spread over all of them. The significance the attention computes on its way is part of
the leankv step, not of the tiering calls; the two step times side by side show it. Writes
benchmarks/results/tier_cost/tier_cost-<device>[-<preset>]-<date>.json and its plot.

With `--trace DIR`, one whole placement interval of leankv's decode steps at each batch (one
`retier` and its steps; left out of the means) is traced with `jax.profiler` into
DIR/leankv-b<batch>/; run with XLA_FLAGS="--xla_dump_to=DIR/hlo" as well (gpu_session.sh
narrows it to the step's and retier's modules), and `benchmarks/trace_ops.py
DIR/leankv-b<batch> DIR/hlo` splits the time by source operation.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import jax  # noqa: E402
from tqdm import tqdm  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from bench_model import add_model_args, load_model, result_stem  # noqa: E402
from harness import add_out_argument, write_results  # noqa: E402

from jkv.config import CacheConfig, EngineConfig  # noqa: E402
from jkv.engine.engine import Engine  # noqa: E402
from jkv.engine.sampling import SamplingParams  # noqa: E402
from jkv.sched.scheduler import Request, Scheduler  # noqa: E402


def measure(model: tuple, policy: str, batch: int, context: int, new_tokens: int,
            backend: str, trace: Path | None = None) -> dict:
    """Mean decode step (all `batch` rows decoding) and, with tiers, its tiering calls."""
    cfg, params, _, make_prompts, _ = model
    # the first sequences decode while later ones prefill: enough tokens that all of them
    # then decode together for new_tokens steps after the steps that compile
    tokens = 2 * new_tokens + 2 * -(-batch * context // 256) + 1
    if trace is not None and policy != "none":  # the traced interval is not timed
        tokens += CacheConfig().kv_placement_interval
    max_len = context + tokens + 16
    # every sequence's K and V unquantized at 16 bits, with room to spare (LLM's 512 MiB
    # default at least): nothing is preempted
    pool = max(512 << 20, int(1.25 * batch * max_len * cfg.num_layers * cfg.num_kv_heads
                              * cfg.head_dim * 2 * 2))
    engine = Engine(cfg, params, cache=CacheConfig(
        kv_format="k8v4t", kv_policy=policy, kv_cache_bytes=pool),
        config=EngineConfig(max_model_len=max_len, max_num_seqs=batch, prefill_chunk=256,
                            attention_backend=backend, enable_prefix_caching=False))
    cache = engine.cache
    policy = getattr(cache.layout, "policy", None)  # token tiers' placement, if any
    interval = 1 if policy is None else policy.interval
    steps, calls, current = [], {"retier": [], "grow": []}, {"retier": 0.0, "grow": 0.0}

    def timed(name, f):
        def call(*a, **k):
            jax.block_until_ready(cache.pool)  # what ran before is not counted
            t0 = time.perf_counter()
            out = f(*a, **k)
            jax.block_until_ready((cache.pool, cache.tables,
                                   getattr(cache.layout, "counts", None), out))
            current[name] += time.perf_counter() - t0
            return out
        return call

    cache.grow = timed("grow", cache.grow)
    if policy is not None:
        cache.layout.after_call = timed("retier", cache.layout.after_call)
    engine_step = engine.step
    tracing = {"want": trace is not None and policy is not None, "left": 0}

    def step(prefill, decode):
        current.update(retier=0.0, grow=0.0)
        compiles = engine.num_compiles
        everyone = not prefill and len(decode) == batch
        if tracing["want"] and everyone and len(steps) == interval:
            jax.profiler.start_trace(str(trace / f"{policy}-b{batch}"),
                                     create_perfetto_trace=True)
            tracing.update(want=False, left=interval)
        t0 = time.perf_counter()
        out = engine_step(prefill, decode)
        if tracing["left"] and everyone:  # one whole interval, left out of the means
            tracing["left"] -= 1
            if not tracing["left"]:
                jax.block_until_ready(cache.pool)
                jax.profiler.stop_trace()
            return out
        if everyone:
            if engine.num_compiles > compiles:  # what follows is timed from scratch
                steps.clear()
                for v in calls.values():
                    v.clear()
            else:
                steps.append(time.perf_counter() - t0)
                for k, v in calls.items():
                    v.append(current[k])
        return out

    engine.step = step
    sched = Scheduler(engine)
    sp = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
    for p in make_prompts(batch, context):
        sched.add(Request(p, sp))
    while sched.num_unfinished:
        sched.step()
    if tracing["left"]:  # the run ended inside the traced interval
        jax.profiler.stop_trace()
    stats = sched.snapshot()
    n = min(len(steps), new_tokens) // interval * interval
    if n < interval:
        raise RuntimeError(f"only {len(steps)} steps decoded all {batch} sequences at once "
                           "after the last compilation")
    steps = steps[-n:]
    retier, grow = calls["retier"][-n:], calls["grow"][-n:]
    out = {"decode_step_ms": statistics.mean(steps) * 1e3, "steps": n,
           "median_step_ms": statistics.median(steps) * 1e3,
           "grow_ms": statistics.mean(grow) * 1e3}
    if policy is not None:
        out |= {"retier_ms": statistics.mean(retier) * 1e3,
                "tiering_ms": (statistics.mean(retier) + statistics.mean(grow)) * 1e3,
                "placement_interval": interval, "placement_ms": max(retier) * 1e3,
                "kv_tiers": stats["kv_tiers"], "kv_bytes_per_token": stats["kv_bytes_per_token"]}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", default="8,32", help="batch sizes, comma separated")
    ap.add_argument("--context", type=int, default=512, help="prompt tokens per sequence")
    ap.add_argument("--new-tokens", type=int, default=32,
                    help="decode steps (all sequences decoding) the means are over")
    add_model_args(ap)
    add_out_argument(ap, "tier_cost")
    ap.add_argument("--trace", default=None,
                    help="write a jax.profiler trace of one placement interval of leankv's "
                         "steps at each batch under this directory (see "
                         "benchmarks/trace_ops.py); the traced steps are left out of the means")
    args = ap.parse_args()
    batches = [int(b) for b in args.batches.split(",") if b]
    if not batches or min(batches) < 1 or args.context < 128:
        ap.error("--batches must be positive and --context at least 128")
    model = load_model(args)
    rows = []
    for batch in tqdm(batches, desc="batches"):
        none = measure(model, "none", batch, args.context, args.new_tokens,
                       args.attention_backend)
        lean = measure(model, "leankv", batch, args.context, args.new_tokens,
                       args.attention_backend, Path(args.trace) if args.trace else None)
        added = lean["tiering_ms"] - none["grow_ms"]
        rows.append({"batch": batch, "none_k8v4t": none, "leankv": lean,
                     "tiering_fraction": lean["tiering_ms"] / lean["decode_step_ms"],
                     "tiering_added_ms": added,
                     "tiering_added_fraction": added / lean["decode_step_ms"],
                     "leankv_over_none": lean["decode_step_ms"] / none["decode_step_ms"]})
    print(f"\n{model[4]}, {args.attention_backend} attention, {args.context}-token prompts, "
          f"jax {jax.__version__} on {jax.devices()[0].device_kind}")
    print("| batch | none:k8v4t step ms | leankv step ms | retier ms | grow ms none / leankv | "
          "tiering ms (/step) | less none's grow (/step) | leankv/none |\n"
          "|---|---|---|---|---|---|---|---|")
    for r in rows:
        none, lean = r["none_k8v4t"], r["leankv"]
        print(f"| {r['batch']} | {none['decode_step_ms']:.1f} | {lean['decode_step_ms']:.1f} | "
              f"{lean['retier_ms']:.2f} | {none['grow_ms']:.2f} / {lean['grow_ms']:.2f} | "
              f"{lean['tiering_ms']:.2f} ({r['tiering_fraction']:.1%}) | "
              f"{r['tiering_added_ms']:.2f} ({r['tiering_added_fraction']:.1%}) | "
              f"{r['leankv_over_none']:.2f}x |")
    write_results(args.out, result_stem("tier_cost", args),
                  {"device": jax.devices()[0].device_kind, "jax": jax.__version__,
                   "model": model[4], "rows": rows}, args)


if __name__ == "__main__":
    main()
