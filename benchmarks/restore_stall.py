"""Running requests' TPOT while another request restores a long history from the disk tier:
the store read on the serving loop (`store_read_ahead` off) against on the store's reader
thread while the request waits (on), side by side in one run on the same inputs.

    python benchmarks/restore_stall.py [--history 4096] [--running 4] [--repeats 2]

A first scheduler prefills a `--history`-token conversation whose KV goes to a persistent
tier (tensorstore OCDBT in a temporary directory; no host tier, so the restore reads disk).
Then, per setting and repeat, a fresh engine and scheduler over the same store: `--running`
requests decode; their mean step time over `--window` decode-only steps is their TPOT
without a restore; then the conversation's next turn (history + 16 tokens) arrives and they
decode another `--window` tokens, the restore among them: their TPOT with the restore. Also
the steps from the turn's arrival to its first token alone (mean and slowest). The
restore itself (the copy into the pool, the new tokens' prefill) runs in steps of the
running requests either way; what differs is where the disk read, checksum and decode run.
Each setting runs once untimed first (on CPU a step or copy shape compiles when first used).
Prints a table and writes benchmarks/results/restore_stall-<device>-<date>.json.
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
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from tqdm import tqdm  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from results_io import write_results  # noqa: E402

from jkv.config import CacheConfig, EngineConfig, SchedulerConfig, StoreConfig  # noqa: E402
from jkv.engine import Engine  # noqa: E402
from jkv.models import load_params  # noqa: E402
from jkv.sampling import SamplingParams  # noqa: E402
from jkv.scheduler import Request, Scheduler, generate_all  # noqa: E402


def make(cfg, params, args, store_dir: str, read_ahead: bool) -> Scheduler:
    eng = Engine(cfg, params, cache=CacheConfig(page_size=16, kv_cache_bytes=1 << 30),
                 config=EngineConfig(max_model_len=args.history + 256,
                                     max_num_seqs=args.running + 1, prefill_chunk=512,
                                     enable_prefix_caching=False))
    store = StoreConfig(host_cache_bytes=0, store_dir=store_dir, disk_cache_bytes=1 << 34)
    return Scheduler(eng, SchedulerConfig(restore_planning=False,
                                          store_read_ahead=read_ahead), store=store)


def measure(sched: Scheduler, history: list[int], args, rng) -> dict:
    greedy = SamplingParams(max_tokens=10_000, temperature=0, ignore_eos=True)
    running = [Request(rng.integers(0, 1000, 64).tolist(), greedy) for _ in range(args.running)]
    for r in running:
        sched.add(r)
    while not all(r.output for r in running):  # all decoding
        sched.step()
    for _ in range(3):  # warm
        sched.step()
    base = []
    for _ in range(args.window):
        t0 = time.perf_counter()
        sched.step()
        base.append(time.perf_counter() - t0)
    follow = Request(history + rng.integers(0, 1000, 16).tolist(),
                     SamplingParams(max_tokens=1, temperature=0))
    sched.add(follow)
    steps, until_first = [], None
    start = len(running[0].output)
    while len(running[0].output) < start + args.window or until_first is None:
        t0 = time.perf_counter()
        sched.step()
        steps.append(time.perf_counter() - t0)
        if until_first is None and follow.output:
            until_first = len(steps)
    during = steps[:until_first]
    with_restore = steps[:args.window]
    for r in running:
        sched.abort(r)
    while sched.num_unfinished:
        sched.step()
    restored = sched.snapshot()["prefix_hit_tokens"]["disk"]
    sched.close()
    return {"tpot_alone_ms": 1e3 * float(np.mean(base)),
            "tpot_with_restore_ms": 1e3 * float(np.mean(with_restore)),
            "baseline_step_ms": 1e3 * float(np.median(base)),
            "during_mean_ms": 1e3 * float(np.mean(during)),
            "during_max_ms": 1e3 * float(np.max(during)), "steps_during": len(during),
            "restored_tokens": int(restored),
            "steps_with_restore_ms": [round(1e3 * x, 1) for x in with_restore]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--history", type=int, default=4096, help="tokens of the restored history")
    ap.add_argument("--running", type=int, default=4, help="requests decoding meanwhile")
    ap.add_argument("--window", type=int, default=64,
                    help="tokens the running requests decode without, then with the restore")
    ap.add_argument("--repeats", type=int, default=2,
                    help="timed runs per setting, interleaved, after one untimed run each")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results"))
    args = ap.parse_args()
    dtype = jnp.float32 if jax.default_backend() == "cpu" else jnp.bfloat16
    cfg, params = load_params(None, dtype)
    rng = np.random.default_rng(args.seed)
    history = rng.integers(0, 1000, args.history).tolist()
    rows: dict[str, list[dict]] = {"loop": [], "read_ahead": []}
    with tempfile.TemporaryDirectory() as tmp:
        first = make(cfg, params, args, tmp, True)
        generate_all(first, [Request(history, SamplingParams(max_tokens=1, temperature=0))])
        first.close()  # the entry is on disk
        # one untimed run per setting first: on CPU a shape compiles when first used (a
        # server on a GPU compiles them all before it listens), and a compile is not a stall
        todo = [(name, rep) for rep in range(-1, args.repeats) for name in rows]
        for name, rep in tqdm(todo, desc="runs", unit="run"):
            sched = make(cfg, params, args, tmp, name == "read_ahead")
            run = measure(sched, history, args, rng)
            if rep >= 0:
                rows[name].append(run)
    summary = {}
    print(f"\n{'store read':>12} {'TPOT alone':>11} {'with restore':>13} {'ratio':>6} "
          f"{'arrival to first token: mean':>29} {'slowest':>8} {'restored':>9}")
    for name, runs in rows.items():
        worst = max(runs, key=lambda r: r["tpot_with_restore_ms"] / r["tpot_alone_ms"])
        ratio = worst["tpot_with_restore_ms"] / worst["tpot_alone_ms"]
        summary[name] = {**worst, "ratio": ratio}
        print(f"{name:>12} {worst['tpot_alone_ms']:>9.1f}ms "
              f"{worst['tpot_with_restore_ms']:>11.1f}ms {ratio:>6.2f} "
              f"{worst['during_mean_ms']:>27.0f}ms {worst['during_max_ms']:>6.0f}ms "
              f"{worst['restored_tokens']:>9}")
    tag = "cpu" if jax.default_backend() == "cpu" else "gpu"
    write_results(Path(args.out), f"restore_stall-{tag}",
                  {"device": jax.devices()[0].device_kind, "jax": jax.__version__,
                   "runs": rows, "worst": summary}, None, args)


if __name__ == "__main__":
    main()
