"""Running requests' TPOT while another request restores a long history from the disk tier:
the store read on the serving loop (`store_read_ahead` off) against on the store's reader
thread while the request waits (on), side by side in one run on the same inputs.

    python benchmarks/restore_stall.py [--history 4096] [--running 4] [--repeats 8]
    python benchmarks/restore_stall.py --preset llama3-8b    # GPU: random weights, that shape

A first scheduler prefills a `--history`-token conversation whose KV goes to a persistent
tier (tensorstore OCDBT in a temporary directory; no host tier, so the restore reads disk).
Then, per setting and repeat, a fresh engine and scheduler over the same store: `--running`
requests decode `--window` tokens (the earlier window), then the conversation's next turn
(history + 16 tokens) arrives and they decode another `--window` tokens, the restore among
them (the restore window). A third setting, `none`, runs the same with no turn arriving: the
same tokens at the same positions without a restore. Their TPOT without the restore is the
run's own earlier window times the mean growth the `none` runs see from their earlier to
their restore window (a decode step grows with its context, and the windows sit at
different lengths); the ratio is the restore window's TPOT over that. Also the steps from
the turn's arrival to its first token alone (mean and slowest). The restore itself (the copy
into the pool, the new tokens' prefill) runs in steps of the running requests either way;
what differs is where the disk read, checksum and decode run. Each setting runs once
untimed first (on CPU a step or copy shape compiles when first used). Prints a table and
writes benchmarks/results/restore_stall/restore_stall-<device>-<date>.json.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import jax  # noqa: E402
import numpy as np  # noqa: E402
from tqdm import tqdm  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from bench_model import add_model_args, load_model, result_stem  # noqa: E402
from harness import add_out_argument, write_results  # noqa: E402

from jkv.config import CacheConfig, EngineConfig, SchedulerConfig, StoreConfig  # noqa: E402
from jkv.engine.engine import Engine  # noqa: E402
from jkv.engine.sampling import SamplingParams  # noqa: E402
from jkv.sched.scheduler import Request, Scheduler, generate_all  # noqa: E402


def make(cfg, params, args, store_dir: str, read_ahead: bool) -> Scheduler:
    eng = Engine(cfg, params, cache=CacheConfig(page_size=16,
                                                kv_cache_bytes=args.kv_cache_bytes),
                 config=EngineConfig(max_model_len=args.history + 256,
                                     max_num_seqs=args.running + 1, prefill_chunk=512,
                                     enable_prefix_caching=False))
    store = StoreConfig(host_cache_bytes=0, store_dir=store_dir, disk_cache_bytes=1 << 34)
    return Scheduler(eng, SchedulerConfig(restore_planning=False,
                                          store_read_ahead=read_ahead), store=store)


def measure(sched: Scheduler, history: list[int] | None, args, rng) -> dict:
    """Step times of the earlier and the restore window; `history` None: no turn arrives."""
    greedy = SamplingParams(max_tokens=10_000, temperature=0, ignore_eos=True)
    running = [Request(rng.integers(0, 1000, 64).tolist(), greedy) for _ in range(args.running)]
    for r in running:
        sched.add(r)
    while not all(r.output for r in running):  # all decoding
        sched.step()
    for _ in range(3):  # warm
        sched.step()
    before = []
    for _ in range(args.window):
        t0 = time.perf_counter()
        sched.step()
        before.append(time.perf_counter() - t0)
    follow = None
    if history is not None:
        follow = Request(history + rng.integers(0, 1000, 16).tolist(),
                         SamplingParams(max_tokens=1, temperature=0))
        sched.add(follow)
    steps, until_first = [], None if follow else 0
    start = len(running[0].output)
    while len(running[0].output) < start + args.window or until_first is None:
        t0 = time.perf_counter()
        sched.step()
        steps.append(time.perf_counter() - t0)
        if until_first is None and follow.output:
            until_first = len(steps)
    during = steps[:until_first] or [0.0]
    window = steps[:args.window]
    for r in running:
        sched.abort(r)
    while sched.num_unfinished:
        sched.step()
    restored = sched.snapshot()["prefix_hit_tokens"]["disk"]
    sched.close()
    return {"tpot_before_ms": 1e3 * float(np.mean(before)),
            "tpot_window_ms": 1e3 * float(np.mean(window)),
            "during_mean_ms": 1e3 * float(np.mean(during)),
            "during_max_ms": 1e3 * float(np.max(during)), "steps_during": until_first,
            "restored_tokens": int(restored),
            "steps_before_ms": [round(1e3 * x, 1) for x in before],
            "steps_window_ms": [round(1e3 * x, 1) for x in window]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--history", type=int, default=4096, help="tokens of the restored history")
    ap.add_argument("--running", type=int, default=4, help="requests decoding meanwhile")
    ap.add_argument("--window", type=int, default=64,
                    help="tokens the running requests decode without, then with the restore")
    ap.add_argument("--repeats", type=int, default=8,
                    help="timed runs per setting, interleaved, after one untimed run each")
    ap.add_argument("--seed", type=int, default=0, help="seed of the random token ids")
    add_model_args(ap)
    add_out_argument(ap, "restore_stall")
    args = ap.parse_args()
    cfg, params, dtype, _, _ = load_model(args)
    per_token = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * dtype.itemsize
    # the pool: twice what the requests hold, 1 GiB at least
    args.kv_cache_bytes = max(1 << 30, 2 * (args.history + 256 * (args.running + 1)) * per_token)
    rng = np.random.default_rng(args.seed)
    history = rng.integers(0, 1000, args.history).tolist()
    rows: dict[str, list[dict]] = {"none": [], "loop": [], "read_ahead": []}
    with tempfile.TemporaryDirectory() as tmp:
        first = make(cfg, params, args, tmp, True)
        generate_all(first, [Request(history, SamplingParams(max_tokens=1, temperature=0))])
        first.close()  # the entry is on disk
        # one untimed run per setting first: on CPU a shape compiles when first used (a
        # server on a GPU compiles them all before it listens), and a compile is not a stall
        todo = [(name, rep) for rep in range(-1, args.repeats) for name in rows]
        for name, rep in tqdm(todo, desc="runs", unit="run"):
            sched = make(cfg, params, args, tmp, name == "read_ahead")
            run = measure(sched, None if name == "none" else history, args, rng)
            if rep >= 0:
                rows[name].append(run)
    growth = [r["tpot_window_ms"] / r["tpot_before_ms"] for r in rows["none"]]
    mean_growth = float(np.mean(growth))  # the context's part, the runs' noise averaged out
    print(f"\nno restore: the restore window's steps {mean_growth:.3f}x the earlier "
          f"window's ({', '.join(f'{g:.3f}' for g in growth)}: the context grows)")
    summary = {}
    print(f"\n{'store read':>12} {'TPOT without':>13} {'with restore':>13} {'ratio':>6} "
          f"{'arrival to first token: mean':>29} {'slowest':>8} {'restored':>9}")
    for name in ("loop", "read_ahead"):
        for run in rows[name]:
            run["tpot_without_ms"] = run["tpot_before_ms"] * mean_growth
            run["ratio"] = run["tpot_window_ms"] / run["tpot_without_ms"]
        worst = max(rows[name], key=lambda r: r["ratio"])
        summary[name] = {**worst, "ratios": [r["ratio"] for r in rows[name]]}
        print(f"{name:>12} {worst['tpot_without_ms']:>11.1f}ms "
              f"{worst['tpot_window_ms']:>11.1f}ms {worst['ratio']:>6.2f} "
              f"{worst['during_mean_ms']:>27.0f}ms {worst['during_max_ms']:>6.0f}ms "
              f"{worst['restored_tokens']:>9}")
    write_results(args.out, result_stem("restore_stall", args),
                  {"device": jax.devices()[0].device_kind, "jax": jax.__version__,
                   "runs": rows, "growth_without_restore": growth, "mean_growth": mean_growth,
                   "worst": summary}, args)


if __name__ == "__main__":
    main()
