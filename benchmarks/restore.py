"""Time to first token of a follow-up turn: its history restored from the KV store against
recomputed, side by side in one run on the same inputs; and how far layer-wise loading
overlaps the restore with compute.

    python benchmarks/restore.py                       # SmolLM2 (embedded), 1K/2K/4K histories
    python benchmarks/restore.py --lengths 2048 --kv-format k8v4 --repeats 5
    python benchmarks/restore.py --preset llama3-8b --lengths 1024,4096,16384   # GPU
    python benchmarks/restore.py --verify   # verified restores (restore_verify.py)

The host-to-device copy rate is measured first (pageable numpy buffers, and pinned host
buffers where the backend has them), so the load times can be read against it.

For each history length a first engine prefills the history and hands its full pages to two
`jkv.store.KVStore`s, one with a host tier only and one with a persistent tier only
(tensorstore OCDBT in a temporary directory). Then, with prefix caching off, the follow-up
prompt (history + --new-tokens) is timed to its first token:

- recompute: the whole prompt prefilled;
- host, disk: the store's lookup and load (read, checksum and header checks), the pages
  written into the pool, the new tokens prefilled (all layers in one compiled step);
- layerwise: the same from the host tier with execution="layerwise", each layer's pages
  copied to the device a read buffer of layers ahead of the layer computing;
- load: the host-tier load and page writes alone; compute, compute_lw: the new tokens'
  prefill alone (history already in place) in one compiled step and layer by layer. Overlap
  is perfect when layerwise = max(load, compute_lw);
- split_<r> (`--split-ratios`): host, with about r of the history's block-layers recomputed
  (Krul's pyramid: the first layers recompute most) while the rest loads; r = 0 is host,
  r = 1 recomputes the history through the restore path.

Each is run once untimed first (compilation), then --repeats times; the median is reported.
Prints a table and writes benchmarks/results/restore/restore-<device>-<date>.json and its plot.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

import numpy as np
from harness import add_out_argument, write_results
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import restore_verify  # noqa: E402

from jkv.config import PRESETS, CacheConfig, EngineConfig, StoreConfig  # noqa: E402
from jkv.engine.engine import Engine, Row, SavedPages  # noqa: E402
from jkv.engine.sampling import SamplingParams  # noqa: E402
from jkv.kv.format import KVFormat  # noqa: E402
from jkv.models.loaders import random_params  # noqa: E402
from jkv.models.params_cache import load_params  # noqa: E402
from jkv.sched.restore_planning import split_share  # noqa: E402
from jkv.store.store import KVStore  # noqa: E402

GREEDY = SamplingParams(max_tokens=1, temperature=0)
PATHS = ("recompute", "host", "disk", "layerwise", "load", "compute", "compute_lw")


def prefill(eng: Engine, slot: int, prompt: list[int], cached: int) -> int:
    """Feed the prompt from `cached` on; returns the first sampled token."""
    key = eng.request_key(0)
    while cached < len(prompt):
        chunk = prompt[cached: cached + eng.prefill_chunk]
        (s,), _ = eng.step([Row(slot, chunk, GREEDY, key, 0)], [])
        cached += len(chunk)
    return s.token


def restore(eng: Engine, store: KVStore, prompt: list[int], recompute: float = 0.0
            ) -> tuple[int, int]:
    """Look the prompt up in `store`, load the hit and open a slot with it (`recompute`:
    that share split off and recomputed)."""
    hit = store.lookup(eng.cache.prompt_hashes(prompt))
    arrays, hashes, *_ = store.load(hit)
    return eng.open(prompt, restore=SavedPages(hit.blocks, arrays, hashes),
                    recompute=recompute)


def timed(fn, repeats: int) -> tuple[float, int]:
    """(median ms of `repeats` runs after an untimed one, the untimed run's result)."""
    first = fn()[1]
    samples = [fn()[0] for _ in range(repeats)]
    return float(np.median(samples)), first


def ttft_run(eng: Engine, prompt: list[int], store: KVStore | None = None,
             recompute: float = 0.0) -> tuple[float, int]:
    """Time to the first token of `prompt`: recomputed, or restored from `store`."""
    t0 = time.perf_counter()
    slot, cached = (eng.open(prompt) if store is None
                    else restore(eng, store, prompt, recompute))
    token = prefill(eng, slot, prompt, cached)
    ms = (time.perf_counter() - t0) * 1e3
    eng.close(slot)
    return ms, token


def load_run(eng: Engine, store: KVStore, prompt: list[int]) -> tuple[float, int]:
    t0 = time.perf_counter()
    slot, cached = restore(eng, store, prompt)  # all layers written, awaited (scan engine)
    ms = (time.perf_counter() - t0) * 1e3
    token = prefill(eng, slot, prompt, cached)
    eng.close(slot)
    return ms, token


def compute_run(eng: Engine, store: KVStore, prompt: list[int]) -> tuple[float, int]:
    slot, cached = restore(eng, store, prompt)
    eng.connector.write([slot])  # the history in place before the clock starts
    jax.block_until_ready(eng.cache.pool)
    t0 = time.perf_counter()
    token = prefill(eng, slot, prompt, cached)
    ms = (time.perf_counter() - t0) * 1e3
    eng.close(slot)
    return ms, token


def host_to_device(nbytes: int = 1 << 30, repeats: int = 5) -> dict[str, float | None]:
    """Bytes per second copied host -> device: from pageable numpy memory, and from a pinned
    host buffer (None where the backend has no pinned_host memory)."""
    dev = jax.devices()[0]
    target = jax.sharding.SingleDeviceSharding(dev, memory_kind=dev.default_memory().kind)
    x = np.random.default_rng(0).integers(0, 255, nbytes, dtype=np.uint8)

    def rate(src) -> float:
        jax.block_until_ready(jax.device_put(src, target))
        samples = []
        for _ in range(repeats):
            t = time.perf_counter()
            jax.block_until_ready(jax.device_put(src, target))
            samples.append(time.perf_counter() - t)
        return nbytes / float(np.median(samples))

    out: dict[str, float | None] = {"pageable": rate(x), "pinned": None}
    try:
        pinned = jax.device_put(x, jax.sharding.SingleDeviceSharding(dev,
                                                                     memory_kind="pinned_host"))
        out["pinned"] = rate(pinned)
    except (ValueError, RuntimeError) as e:  # JaxRuntimeError is a RuntimeError
        print(f"no pinned host -> device copy here ({type(e).__name__}); pageable rate only")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--model", default=None,
                    help="a .gguf file or HF model directory; default: embedded SmolLM2")
    ap.add_argument("--preset", default=None, choices=sorted(PRESETS),
                    help="random weights of this model shape instead of --model (timing only)")
    ap.add_argument("--lengths", default="1024,2048,4096", help="history lengths in tokens")
    ap.add_argument("--new-tokens", type=int, default=84,
                    help="tokens of the follow-up message (ShareGPT's mean user turn)")
    ap.add_argument("--kv-format", default="auto", help="KV format of the pages and entries")
    ap.add_argument("--prefill-chunk", type=int, default=512, help="engine prefill chunk")
    ap.add_argument("--repeats", type=int, default=3, help="timed runs per setting")
    ap.add_argument("--split-ratios", default="0.25,0.5,0.75,1",
                    help="recompute shares of split restores to time (empty: none)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the random token ids")
    restore_verify.add_arguments(ap)  # --verify: verified restores measured instead
    add_out_argument(ap, "restore")
    args = ap.parse_args()
    if args.verify:
        return restore_verify.verify(args)
    lengths = [int(x) for x in args.lengths.split(",")]
    splits = [float(x) for x in args.split_ratios.split(",") if x]
    dtype = jnp.bfloat16 if jax.default_backend() != "cpu" else jnp.float32
    h2d = host_to_device()
    print("host -> device: " + ", ".join(f"{k} {v / 1e9:.1f} GB/s" for k, v in h2d.items()
                                         if v is not None))
    fmt = KVFormat.parse(args.kv_format)
    max_len = max(lengths) + args.new_tokens + 16
    if args.preset:  # random weights: any context length times the same
        cfg = PRESETS[args.preset]
        cfg = cfg.replace(max_position_embeddings=max(cfg.max_position_embeddings, max_len))
        params = random_params(cfg, args.seed, dtype)
    else:
        cfg, params = load_params(args.model, dtype)
    # two sequences of max_len at 16-bit (or float32 on CPU) pages, with room to spare
    per_token = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * jnp.dtype(dtype).itemsize
    pool_bytes = max(2_000_000_000, int(1.25 * 2 * max_len * per_token))

    def make_engine(**kw) -> Engine:
        return Engine(cfg, params, cache=CacheConfig(page_size=16, kv_cache_bytes=pool_bytes,
                                                     kv_format=fmt),
                      config=EngineConfig(max_model_len=max_len, max_num_seqs=2,
                                          prefill_chunk=args.prefill_chunk, **kw))

    device = jax.devices()[0]
    tag = "cpu" if device.platform == "cpu" else device.device_kind.replace(" ", "_").lower()

    def save(rows: list[dict]) -> None:  # after every length: a run cut short keeps its rows
        stem = f"restore-{tag}" + (f"-{args.preset}" if args.preset else "")
        write_results(args.out, stem, {
            "benchmark": "restore", "device": device.device_kind, "jax": jax.__version__,
            "model": args.preset or args.model or "smollm2", "host_to_device_bytes_per_s": h2d,
            "rows": rows}, args)

    rng = np.random.default_rng(args.seed)
    scan = make_engine(enable_prefix_caching=False)
    layerwise = make_engine(enable_prefix_caching=False, execution="layerwise")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        fmt_args = {"model": scan.fingerprint, "kv_format": scan.kv_format, "page_size": 16}
        host = KVStore(StoreConfig(host_cache_bytes=2**35), **fmt_args)
        disk = KVStore(StoreConfig(store_dir=tmp, disk_cache_bytes=2**40), **fmt_args)
        for length in tqdm(lengths, desc="history lengths"):
            history = rng.integers(0, cfg.vocab_size, length).tolist()
            follow_up = history + rng.integers(0, cfg.vocab_size, args.new_tokens).tolist()
            saver = make_engine()
            slot, cached = saver.open(history)
            prefill(saver, slot, history, cached)
            saved = saver.gather(slot)
            for store in (host, disk):
                store.save(saved.num_blocks, saved.arrays, saved.hashes)
                store.flush()
            del saver, saved

            runs = {"recompute": partial(ttft_run, scan, follow_up),
                    "host": partial(ttft_run, scan, follow_up, host),
                    "disk": partial(ttft_run, scan, follow_up, disk),
                    "layerwise": partial(ttft_run, layerwise, follow_up, host),
                    "load": partial(load_run, scan, host, follow_up),
                    "compute": partial(compute_run, scan, host, follow_up),
                    "compute_lw": partial(compute_run, layerwise, host, follow_up),
                    **{f"split_{r:g}": partial(ttft_run, scan, follow_up, host, r)
                       for r in splits}}
            times, tokens = {}, {}
            for k, fn in runs.items():
                times[k], tokens[k] = timed(fn, args.repeats)
            rows.append({"history_tokens": length,
                         "entry_bytes": host.snapshot()["bytes"]["host"],
                         **{f"{k}_ms": v for k, v in times.items()},
                         "speedup_host": times["recompute"] / times["host"],
                         "speedup_disk": times["recompute"] / times["disk"],
                         "speedup_layerwise": times["recompute"] / times["layerwise"],
                         "overlap_bound_ms": max(times["load"], times["compute_lw"]),
                         "load_bytes_per_s": host.snapshot()["bytes"]["host"] / times["load"]
                         * 1e3,
                         "read_buffer_layers": layerwise.read_buffer_layers(
                             host.snapshot()["bytes"]["host"], args.new_tokens),
                         # the share restore planning would recompute, from the rates
                         # the engine and store measured in these runs
                         "planned_split": split_share(
                             length * scan.stats.prefill_token_seconds,
                             host.snapshot()["bytes"]["host"] / scan.connector.load_bytes_per_s,
                             host.snapshot()["bytes"]["host"] / host.read_bytes_per_s["host"],
                             scan.split_overlap),
                         "same_first_token": len(set(tokens.values())) == 1,
                         "first_tokens": tokens})
            save(rows)
            for store in (host, disk):  # the next length starts from empty stores
                store.clear()
        host.close()
        disk.close()
    print(f"{'history':>8}{'entry MB':>9}" + "".join(f"{k:>11}" for k in PATHS)
          + f"{'bound':>9}{'host x':>8}{'disk x':>8}{'lw x':>7}{'buffer':>8}{'load GB/s':>10}"
          "  same token")
    for r in rows:
        print(f"{r['history_tokens']:>8}{r['entry_bytes'] / 1e6:>9.1f}"
              + "".join(f"{r[k + '_ms']:>9.0f}ms" for k in PATHS)
              + f"{r['overlap_bound_ms']:>7.0f}ms{r['speedup_host']:>8.1f}{r['speedup_disk']:>8.1f}"
              f"{r['speedup_layerwise']:>7.1f}{r['read_buffer_layers']:>8}"
              f"{r['load_bytes_per_s'] / 1e9:>10.2f}"
              f"  {r['same_first_token'] or r['first_tokens']}")
    if splits:
        print("\nsplit restores (host tier; r: share of the history recomputed)")
        print(f"{'history':>8}" + "".join(f"{'r=' + format(r, 'g'):>10}"
                                          for r in [0.0, *splits]) + f"{'recompute':>11}")
        for r in rows:
            print(f"{r['history_tokens']:>8}{r['host_ms']:>8.0f}ms"
                  + "".join(f"{r[f'split_{x:g}_ms']:>8.0f}ms" for x in splits)
                  + f"{r['recompute_ms']:>9.0f}ms  planned r={r['planned_split']:.2f}")


if __name__ == "__main__":
    main()
