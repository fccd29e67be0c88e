"""Decode attention over paged KV: jkv's Pallas kernel per format vs JAX's paged_attention and
the xla path, as bytes of KV read per second against the device-to-device copy bandwidth.

    python benchmarks/kernels.py                 # GPU: batch {1,8,64} x context {1K,8K,32K}
    python benchmarks/kernels.py --smoke         # CPU: tiny sizes, interpret mode

Shapes are one Llama-3-8B layer (32 query heads, 8 KV heads, head_dim 128), pages of 16
tokens scattered over the pool. Writes benchmarks/results/kernels-<device>-<date>.json.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import math
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from tqdm import tqdm

from jkv.config import KV_FORMATS, KVFormat
from jkv.pallas_kernels.kv_pages import KVPages
from jkv.pallas_kernels.paged_decode_attention import (
    paged_decode_attention,
    paged_decode_attention_reference,
)

HQ, HKV, D, PAGE, GROUP = 32, 8, 128, 16, 64
FORMATS = ["bf16", "int8", "k8v4", "int4", "k4v2"]


def timeit(fn, *args, reps: int = 20, trials: int = 5, **kwargs) -> float:
    """Median seconds per call: warm up, then synchronise around batches of calls."""
    jax.block_until_ready(fn(*args, **kwargs))
    times = []
    for _ in range(trials):
        t = time.perf_counter()
        for _ in range(reps):
            out = fn(*args, **kwargs)
        jax.block_until_ready(out)
        times.append((time.perf_counter() - t) / reps)
    return float(np.median(times))


def copy_bandwidth(nbytes: int) -> float:
    """Device-to-device copy rate, counting bytes read plus bytes written."""
    x = jax.random.bits(jax.random.PRNGKey(0), (nbytes // 4,), jnp.uint32)
    f = jax.jit(lambda x: x ^ jnp.uint32(1))
    return 2 * nbytes / timeit(f, x)


def kv_bytes(fmt: str, tokens: int, pages: int) -> int:
    """Bytes the kernel must read: codes plus scales, all KV heads, one layer."""
    f = KV_FORMATS[fmt]
    per_token = f.bytes_per_token(D, 2)
    return int(HKV * (tokens * per_token + pages * f.key_page_overhead_bytes(D)))


def make_inputs(rng, batch: int, context: int):
    width = context // PAGE
    num_pages = batch * HKV * width + 1
    q = jnp.asarray(rng.normal(size=(batch, HQ, D)), jnp.bfloat16)
    k = jax.random.normal(jax.random.PRNGKey(int(rng.integers(1 << 30))), (num_pages, PAGE, D),
                          jnp.bfloat16)
    v = jax.random.normal(jax.random.PRNGKey(int(rng.integers(1 << 30))), (num_pages, PAGE, D),
                          jnp.bfloat16)
    table = jnp.asarray(1 + rng.permutation(num_pages - 1).reshape(batch, HKV, width), jnp.int32)
    lengths = jnp.full((batch, HKV), context, jnp.int32)
    return q, k, v, table, lengths


def splits_for(batch: int, width: int, ppb: int, programs: int = 264) -> int:
    s = 1 << max(0, math.ceil(math.log2(max(1, programs // (batch * HKV)))))
    return max(1, min(s, width // ppb))


def bench_case(rng, batch: int, context: int, interpret: bool, ppb: int, num_warps: int = 4,
               num_stages: int = 2, formats: list[str] = FORMATS,
               baselines: bool = True) -> list[dict]:
    q, k, v, table, lengths = make_inputs(rng, batch, context)
    width = table.shape[-1]
    splits = splits_for(batch, width, ppb)
    rows = []
    for fmt in formats:
        f = KV_FORMATS[fmt]
        pages = KVPages.from_dense(k, v, KVFormat(f.k_bits, f.v_bits, GROUP))
        fn = jax.jit(functools.partial(paged_decode_attention, k_splits=splits,
                                       pages_per_block=ppb, num_warps=num_warps,
                                       num_stages=num_stages, interpret=interpret))
        t = timeit(fn, q, pages, table, lengths)
        rows.append({"impl": f"jkv {fmt}", "seconds": t, "num_warps": num_warps,
                     "num_stages": num_stages, "pages_per_block": ppb,
                     "kv_bytes": kv_bytes(fmt, batch * context, batch * width)})
        del pages
    if not baselines:
        return rows
    if not interpret:
        rows += bench_jax_baseline(q, k, v, table, batch, context, ppb)
    xla = jax.jit(functools.partial(paged_decode_attention_reference, dtype=jnp.bfloat16))
    t = timeit(xla, q, KVPages(k, v), table, lengths)
    rows.append({"impl": "xla bf16", "seconds": t, "kv_bytes": kv_bytes("bf16", batch * context,
                                                                        batch * width)})
    return rows


def bench_jax_baseline(q, k, v, table, batch: int, context: int, ppb: int) -> list[dict]:
    """jax.experimental.pallas.ops.gpu.paged_attention: head-major pages, one table per row."""
    from jax.experimental.pallas.ops.gpu.paged_attention import paged_attention

    width = table.shape[-1]
    # its layout: pages [Hkv, P', page, D] with row b's pages at the same ids for every head
    kh = k[table].transpose(1, 0, 2, 3, 4).reshape(HKV, batch * width, PAGE, D)
    vh = v[table].transpose(1, 0, 2, 3, 4).reshape(HKV, batch * width, PAGE, D)
    tables = jnp.arange(batch * width, dtype=jnp.int32).reshape(batch, width)
    lengths = jnp.full((batch,), context, jnp.int32)
    splits = splits_for(batch, width, ppb)
    qs = q / math.sqrt(D)
    rows = []
    fn = jax.jit(functools.partial(paged_attention, pages_per_compute_block=ppb, k_splits=splits))
    rows.append({"impl": "jax paged_attention bf16", "seconds": timeit(fn, qs, kh, vh, tables,
                                                                        lengths),
                 "kv_bytes": kv_bytes("bf16", batch * context, batch * width)})
    ks = jnp.abs(kh).max(-1) / 127
    vs = jnp.abs(vh).max(-1) / 127
    k8 = jnp.round(kh / ks[..., None]).astype(jnp.int8)
    v8 = jnp.round(vh / vs[..., None]).astype(jnp.int8)
    t = timeit(fn, qs, k8, v8, tables, lengths, ks.astype(jnp.float32), vs.astype(jnp.float32))
    rows.append({"impl": "jax paged_attention int8", "seconds": t,
                 "kv_bytes": int(HKV * batch * context * (2 * D + 8))})
    return rows


def sweep(rng, batch: int, context: int, interpret: bool) -> None:
    print(f"{'warps':>5} {'stages':>6} {'ppb':>4} " + "".join(f"{f:>10}" for f in FORMATS)
          + "   (microseconds)")
    for warps in (4, 8):
        for stages in (1, 2, 3):
            for ppb in (4, 8, 16):
                rows = bench_case(rng, batch, context, interpret, ppb, warps, stages,
                                  baselines=False)
                print(f"{warps:>5} {stages:>6} {ppb:>4} "
                      + "".join(f"{r['seconds'] * 1e6:>10.1f}" for r in rows), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--smoke", action="store_true", help="tiny sizes in interpret mode (CPU)")
    ap.add_argument("--batches", default="1,8,64", help="comma-separated batch sizes")
    ap.add_argument("--contexts", default="1024,8192,32768", help="comma-separated contexts")
    ap.add_argument("--pages-per-block", type=int, default=8, help="pages per inner iteration")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results"),
                    help="directory for the JSON result")
    ap.add_argument("--num-warps", type=int, default=4, help="Triton warps per program")
    ap.add_argument("--num-stages", type=int, default=2, help="Triton pipeline stages")
    ap.add_argument("--sweep", action="store_true",
                    help="time kernel variants (warps x stages x pages per block) at one size "
                         "(the first batch and context) instead of the full table")
    args = ap.parse_args()
    interpret = args.smoke or jax.default_backend() == "cpu"
    batches = [1, 2] if args.smoke else [int(x) for x in args.batches.split(",")]
    contexts = [256] if args.smoke else [int(x) for x in args.contexts.split(",")]
    ppb = 2 if args.smoke else args.pages_per_block
    device = jax.devices()[0].device_kind
    copy_bw = copy_bandwidth(1 << 20 if args.smoke else 2 << 30)
    rng = np.random.default_rng()
    if args.sweep:
        sweep(rng, batches[0], contexts[0], interpret)
        return
    results = []
    for batch in tqdm(batches, desc="batch"):
        for context in tqdm(contexts, desc="context", leave=False):
            for row in bench_case(rng, batch, context, interpret, ppb, args.num_warps,
                                  args.num_stages):
                row |= {"batch": batch, "context": context,
                        "bytes_per_s": row["kv_bytes"] / row["seconds"]}
                row["fraction_of_copy"] = row["bytes_per_s"] / copy_bw
                results.append(row)
    print(f"\n{device}, jax {jax.__version__}, copy bandwidth {copy_bw / 1e9:.1f} GB/s")
    print(f"{'batch':>5} {'ctx':>6} {'impl':<26}{'us':>10}{'GB/s':>9}{'of copy':>9}"
          f"{'vs bf16':>9}")
    base = {(r["batch"], r["context"]): r["seconds"] for r in results
            if r["impl"] == "jkv bf16"}
    for r in results:
        speed = base[(r["batch"], r["context"])] / r["seconds"]
        print(f"{r['batch']:>5} {r['context']:>6} {r['impl']:<26}{r['seconds'] * 1e6:>10.1f}"
              f"{r['bytes_per_s'] / 1e9:>9.1f}{r['fraction_of_copy']:>9.2f}{speed:>8.2f}x")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    name = "cpu-smoke" if args.smoke else device.replace(" ", "_")
    path = out / f"kernels-{name}-{datetime.date.today().isoformat()}.json"
    path.write_text(json.dumps({
        "benchmark": "kernels", "date": datetime.date.today().isoformat(), "device": device,
        "jax": jax.__version__, "copy_bytes_per_s": copy_bw, "shape": {
            "q_heads": HQ, "kv_heads": HKV, "head_dim": D, "page": PAGE, "group": GROUP,
            "pages_per_block": ppb}, "results": results}, indent=2) + "\n")
    print(f"wrote {path}; plot it with: python benchmarks/plot_kernels.py {path}")


if __name__ == "__main__":
    main()
