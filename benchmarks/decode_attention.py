"""Decode attention over paged KV: jkv's Pallas kernel per format vs JAX's paged_attention and
the xla path, as bytes of KV read per second against the device-to-device copy bandwidth.

    python benchmarks/decode_attention.py           # GPU: batch {1,8,64} x context {1K,8K,32K}
    python benchmarks/decode_attention.py --smoke   # CPU: tiny sizes, interpret mode

Shapes are one Llama-3-8B layer (32 query heads, 8 KV heads, head_dim 128), pages of 16
tokens scattered over the pool. Writes
benchmarks/results/decode_attention/decode_attention[-sweep]-<device>-<date>.json and its plot.
"""

from __future__ import annotations

import argparse
import functools
import math
import time
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from harness import add_out_argument, write_results
from tqdm import tqdm

from jkv.kv.format import KV_FORMATS, KVFormat
from jkv.kv.pages import KVPages
from jkv.pallas_kernels.paged_decode_attention import (
    DEQUANT,
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
               num_stages: int = 2) -> list[dict]:
    q, k, v, table, lengths = make_inputs(rng, batch, context)
    width = table.shape[-1]
    splits = splits_for(batch, width, ppb)
    rows = []
    for fmt in FORMATS:
        f = KV_FORMATS[fmt]
        pages = KVPages.from_dense(k, v, KVFormat(f.k_bits, f.v_bits, GROUP))
        fn = jax.jit(functools.partial(paged_decode_attention, k_splits=splits,
                                       pages_per_block=ppb, num_warps=num_warps,
                                       num_stages=num_stages, interpret=interpret))
        t = timeit(fn, q, pages, table, lengths)
        rows.append({"impl": f"jkv {fmt}", "seconds": t, "num_warps": num_warps,
                     **({"dequant": "f16"} if f.quantized else {}),
                     "num_stages": num_stages, "pages_per_block": ppb,
                     "kv_bytes": kv_bytes(fmt, batch * context, batch * width)})
        del pages
    if not interpret:
        rows += [r for r in bench_jax_baseline(q, k, v, table, batch, context, [ppb])
                 if r.get("best")]
    xla = jax.jit(functools.partial(paged_decode_attention_reference, dtype=jnp.bfloat16))
    t = timeit(xla, q, KVPages(k, v), table, lengths)
    rows.append({"impl": "xla bf16", "seconds": t, "kv_bytes": kv_bytes("bf16", batch * context,
                                                                        batch * width)})
    return rows


def bench_jax_baseline(q, k, v, table, batch: int, context: int, ppbs: list[int],
                       deadline: float = math.inf) -> list[dict]:
    """jax.experimental.pallas.ops.gpu.paged_attention: head-major pages, one table per row,
    each row's pages adjacent. bf16 at every pages-per-block x split setting (the best
    marked), int8 at bf16's best."""
    from jax.experimental.pallas.ops.gpu.paged_attention import paged_attention

    width = table.shape[-1]
    # its layout: pages [Hkv, P', page, D] with row b's pages at the same ids for every head
    kh = k[table].transpose(1, 0, 2, 3, 4).reshape(HKV, batch * width, PAGE, D)
    vh = v[table].transpose(1, 0, 2, 3, 4).reshape(HKV, batch * width, PAGE, D)
    tables = jnp.arange(batch * width, dtype=jnp.int32).reshape(batch, width)
    lengths = jnp.full((batch,), context, jnp.int32)
    qs = q / math.sqrt(D)
    nbytes = kv_bytes("bf16", batch * context, batch * width)
    rows = []
    for ppb in ppbs:
        for splits in split_options(batch, width, ppb):
            if time.perf_counter() > deadline:
                break
            fn = jax.jit(functools.partial(paged_attention, pages_per_compute_block=ppb,
                                           k_splits=splits))
            rows.append({"impl": "jax paged_attention bf16", "pages_per_block": ppb,
                         "k_splits": splits, "table": "contiguous", "kv_bytes": nbytes,
                         "seconds": timeit(fn, qs, kh, vh, tables, lengths)})
    if not rows:
        return rows
    top = min(rows, key=lambda r: r["seconds"])
    top["best"] = True
    if time.perf_counter() > deadline:
        return rows
    fn = jax.jit(functools.partial(paged_attention, pages_per_compute_block=top[
        "pages_per_block"], k_splits=top["k_splits"]))
    ks = jnp.abs(kh).max(-1) / 127
    vs = jnp.abs(vh).max(-1) / 127
    k8 = jnp.round(kh / ks[..., None]).astype(jnp.int8)
    v8 = jnp.round(vh / vs[..., None]).astype(jnp.int8)
    t = timeit(fn, qs, k8, v8, tables, lengths, ks.astype(jnp.float32), vs.astype(jnp.float32))
    rows.append({"impl": "jax paged_attention int8", "pages_per_block": top["pages_per_block"],
                 "k_splits": top["k_splits"], "table": "contiguous", "best": True, "seconds": t,
                 "kv_bytes": int(HKV * batch * context * (2 * D + 8))})
    return rows


def split_options(batch: int, width: int, ppb: int) -> list[int]:
    """Split-K factors around `splits_for`'s choice (half, it, double) that divide the row."""
    s = splits_for(batch, width, ppb)
    return sorted({x for x in (max(1, s // 2), s, 2 * s)
                   if x * ppb <= width and width % (x * ppb) == 0})


def rel_err(fn, q, pages, table, lengths, rows: int = 4) -> float:
    """||kernel - float32 reference|| / ||reference|| on the first `rows` sequences."""
    q, table, lengths = q[:rows], table[:rows], lengths[:rows]
    out = fn(q, pages, table, lengths).astype(jnp.float32)
    ref = paged_decode_attention_reference(q, pages, table, lengths)
    return float(jnp.linalg.norm(out - ref) / jnp.linalg.norm(ref))


@dataclass(frozen=True)
class Grid:
    """What a sweep tries: formats, how quantized pages are dequantized, and the kernel
    settings (None: the defaults of `tune_shape`), and whether JAX's kernel runs beside."""

    formats: tuple = tuple(FORMATS)
    dequant: tuple = ("f16",)
    ppbs: tuple | None = None
    warps: tuple | None = None
    stages: tuple | None = None
    jax_baseline: bool = True


def tune_shape(rng, batch: int, context: int, interpret: bool, full: bool,
               deadline: float, grid: Grid = Grid()) -> list[dict]:
    """Every setting of the decode kernel at one shape, per format, beside JAX's kernel and
    the xla path: rows with "setting" (all timed) and "best" (fastest per impl) marks.

    bf16 runs the whole grid (pages per block x split-K x warps x stages; `full` shapes add
    8 warps and 3 stages), then its best setting again with a contiguous page table (each
    row's pages adjacent, as JAX's kernel is given them) to separate scattered-page cost from
    kernel cost. Quantized formats run pages per block x warps at the best split, once per
    way of dequantizing (`grid.dequant`; the impl is "jkv <format> f16" for "f16", as in
    the results of 2026-11-27, and "jkv <format>" for "f32", as in earlier ones).
    """
    q, k, v, table, lengths = make_inputs(rng, batch, context)
    width = table.shape[-1]
    contiguous = 1 + jnp.arange(batch * HKV * width, dtype=jnp.int32).reshape(table.shape)
    base = {"batch": batch, "context": context}
    rows: list[dict] = []

    def timed(impl, fmt, fn, args, setting, table_kind="scattered"):
        if time.perf_counter() > deadline:
            return None
        try:
            seconds = timeit(fn, *args)
        except Exception as e:  # a setting Triton refuses: said, and the sweep goes on
            print(f"{impl} {setting}: {type(e).__name__}: {str(e)[:300]}")
            return None
        row = base | {"impl": impl, "table": table_kind, **setting, "seconds": seconds,
                      "kv_bytes": kv_bytes(fmt, batch * context, batch * width)}
        rows.append(row)
        return row

    def kernel(setting):
        return jax.jit(functools.partial(paged_decode_attention, interpret=interpret, **setting))

    ppbs = [p for p in (grid.ppbs or (4, 8, 16))
            if width % p == 0 and (interpret or p * PAGE >= 16)]
    warps = grid.warps or ((4, 8) if full else (4,))
    stages = grid.stages or ((2, 3) if full else (2,))
    keys = ("pages_per_block", "k_splits", "num_warps", "num_stages", "dequant")
    best: dict[str, dict] = {}
    for fmt in grid.formats:
        f = KV_FORMATS[fmt]
        pages = KVPages.from_dense(k, v, KVFormat(f.k_bits, f.v_bits, GROUP))
        for dq in ("f32",) if fmt == "bf16" else grid.dequant:
            impl = f"jkv {fmt}{' f16' if dq == 'f16' else ''}"
            if fmt == "bf16":
                settings = [dict(pages_per_block=p, k_splits=s, num_warps=w, num_stages=st)
                            for p in ppbs for s in split_options(batch, width, p)
                            for w in warps for st in stages]
            elif full:  # around bf16's best split and stages: pages per block x warps
                b0 = best.get("jkv bf16") or dict(k_splits=1, num_stages=2)
                settings = [dict(pages_per_block=p, k_splits=max(
                                     [x for x in split_options(batch, width, p)
                                      if x <= b0["k_splits"]] or [1]),
                                 num_warps=w, num_stages=b0["num_stages"])
                            for p in ppbs if p >= 8 or grid.ppbs for w in warps]
            else:  # small shapes: bf16's best setting
                b0 = best.get("jkv bf16")
                settings = [{k_: b0[k_] for k_ in keys[:4]}] if b0 else []
            settings = [g | {"dequant": dq} for g in settings]
            timed_rows = [r for r in (timed(impl, fmt, kernel(g), (q, pages, table, lengths), g)
                                      for g in settings) if r]
            if timed_rows:
                top = min(timed_rows, key=lambda r: r["seconds"])
                setting = {key: top[key] for key in keys}
                top["best"] = True
                top["rel_err"] = rel_err(kernel(setting), q, pages, table, lengths)
                best[impl] = top
                if fmt == "bf16":
                    timed("jkv bf16", fmt, kernel(setting), (q, pages, contiguous, lengths),
                          setting, "contiguous")
        del pages
    if not interpret and grid.jax_baseline:
        rows += [base | r for r in bench_jax_baseline(
            q, k, v, table, batch, context, [p for p in ppbs if p >= 8 or not full][-2:],
            deadline)]
    if time.perf_counter() < deadline:
        xla = jax.jit(functools.partial(paged_decode_attention_reference, dtype=jnp.bfloat16))
        rows.append(base | {"impl": "xla bf16", "table": "scattered", "best": True,
                            "seconds": timeit(xla, q, KVPages(k, v), table, lengths),
                            "kv_bytes": kv_bytes("bf16", batch * context, batch * width)})
    return rows


def shown_row(row: dict) -> bool:
    """A sweep row the table and plot show: the best setting of each impl, and jkv bf16's
    best again over adjacent pages."""
    return bool(row.get("best")) or (row["table"] == "contiguous"
                                     and row["impl"].startswith("jkv"))


def summarize_tuning(rows: list[dict], copy_bw: float) -> None:
    """Per shape: the best setting of each impl, its share of copy bandwidth, its speed
    against jkv bf16 and (quantized formats) the 0.85 x byte-ratio target."""
    print(f"{'batch':>5} {'ctx':>6} {'impl':<26}{'table':>11}{'ppb':>4}{'spl':>4}{'w':>3}"
          f"{'st':>3}{'us':>9}{'of copy':>8}{'vs bf16':>8}{'target':>7}{'err':>9}")
    for shape in dict.fromkeys((r["batch"], r["context"]) for r in rows):
        here = [r for r in rows if (r["batch"], r["context"]) == shape]
        bf16 = next((r for r in here if r["impl"] == "jkv bf16" and r.get("best")), None)
        shown = [r for r in here if shown_row(r)]
        for r in shown:
            speed = bf16["seconds"] / r["seconds"] if bf16 else math.nan
            target = (0.85 * bf16["kv_bytes"] / r["kv_bytes"]
                      if bf16 and r["impl"].startswith("jkv") and r["impl"] != "jkv bf16"
                      else math.nan)
            print(f"{shape[0]:>5} {shape[1]:>6} {r['impl']:<26}{r['table']:>11}"
                  f"{r.get('pages_per_block', ''):>4}{r.get('k_splits', ''):>4}"
                  f"{r.get('num_warps', ''):>3}{r.get('num_stages', ''):>3}"
                  f"{r['seconds'] * 1e6:>9.1f}{r['kv_bytes'] / r['seconds'] / copy_bw:>8.2f}"
                  f"{speed:>7.2f}x{target:>6.2f}x{r.get('rel_err', math.nan):>9.1e}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--smoke", action="store_true", help="tiny sizes in interpret mode (CPU)")
    ap.add_argument("--batches", default="1,8,64", help="comma-separated batch sizes")
    ap.add_argument("--contexts", default="1024,8192,32768", help="comma-separated contexts")
    ap.add_argument("--pages-per-block", type=int, default=8, help="pages per inner iteration")
    add_out_argument(ap, "decode_attention")
    ap.add_argument("--num-warps", type=int, default=4, help="Triton warps per program")
    ap.add_argument("--num-stages", type=int, default=2, help="Triton pipeline stages")
    ap.add_argument("--sweep", action="store_true",
                    help="tune instead: every kernel setting (pages per block x split-K x warps "
                         "x stages) per shape and format, largest shapes first, JAX's kernel at "
                         "each of its settings; the best per shape is marked and tabulated")
    ap.add_argument("--budget-s", type=float, default=math.inf,
                    help="with --sweep: stop starting new settings after this many seconds "
                         "(the JSON keeps what was timed)")
    ap.add_argument("--formats", default=",".join(FORMATS),
                    help="with --sweep: comma-separated KV formats (bf16 first: the quantized "
                         "ones take its best split and stages)")
    ap.add_argument("--dequant", default="f16",
                    help="with --sweep: comma-separated ways quantized pages are dequantized "
                         "(f16, the kernel's default: float16 codes and scales; f32: in "
                         "float32, cast to bf16)")
    ap.add_argument("--ppbs", default=None,
                    help="with --sweep: pages per block to try (default 4,8,16; quantized "
                         "formats at large shapes 8,16)")
    ap.add_argument("--warps", default=None,
                    help="with --sweep: Triton warps to try (default 4, and 8 at large shapes)")
    ap.add_argument("--stages", default=None,
                    help="with --sweep: pipeline stages to try (default 2, and 3 at large "
                         "shapes)")
    ap.add_argument("--no-jax-baseline", action="store_true",
                    help="with --sweep: leave out JAX's paged_attention")
    args = ap.parse_args()

    def ints(text):
        return tuple(int(x) for x in text.split(",")) if text else None

    grid = Grid(formats=tuple(args.formats.split(",")), dequant=tuple(args.dequant.split(",")),
                ppbs=ints(args.ppbs), warps=ints(args.warps), stages=ints(args.stages),
                jax_baseline=not args.no_jax_baseline)
    for fmt in grid.formats:
        if fmt not in FORMATS:
            ap.error(f"--formats: {fmt!r} is not one of {FORMATS}")
    for dq in grid.dequant:
        if dq not in DEQUANT:
            ap.error(f"--dequant: {dq!r} is not one of {DEQUANT}")
    interpret = args.smoke or jax.default_backend() == "cpu"
    batches = [1, 2] if args.smoke else [int(x) for x in args.batches.split(",")]
    contexts = [256] if args.smoke else [int(x) for x in args.contexts.split(",")]
    ppb = 2 if args.smoke else args.pages_per_block
    device = jax.devices()[0].device_kind
    copy_bw = copy_bandwidth(1 << 20 if args.smoke else 2 << 30)
    rng = np.random.default_rng()
    name = "cpu-smoke" if args.smoke else device.replace(" ", "_")
    stem = f"decode_attention{'-sweep' if args.sweep else ''}-{name}"
    path = None
    header = {"benchmark": "decode_attention-sweep" if args.sweep else "decode_attention",
              "device": device, "copy_bytes_per_s": copy_bw, "shape": {
                  "q_heads": HQ, "kv_heads": HKV, "head_dim": D, "page": PAGE, "group": GROUP,
                  "pages_per_block": None if args.sweep else ppb}}
    results = []
    if args.sweep:
        deadline = time.perf_counter() + args.budget_s
        # the shapes of the bandwidth targets first, largest first; then the rest smallest
        # first (more of them fit a budget)
        big = 64 * 8192
        shapes = sorted(((b, c) for b in batches for c in contexts),
                        key=lambda x: -x[0] * x[1] if x[0] * x[1] >= big else x[0] * x[1])
        for batch, context in tqdm(shapes, desc="shapes"):
            if time.perf_counter() > deadline:
                break
            full = batch * context >= big
            rows = tune_shape(rng, batch, context, interpret, full, deadline, grid)
            for r in rows:
                r["bytes_per_s"] = r["kv_bytes"] / r["seconds"]
                r["fraction_of_copy"] = r["bytes_per_s"] / copy_bw
            results += rows
            # written after every shape: a run cut short keeps what it measured
            best = [r for r in results if shown_row(r)]
            path = write_results(args.out, stem, header | {"results": best, "sweep": results},
                                 args, over=path)
        print(f"\n{device}, jax {jax.__version__}, copy bandwidth {copy_bw / 1e9:.1f} GB/s")
        summarize_tuning(results, copy_bw)
        return
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
    write_results(args.out, stem, header | {"results": results}, args)


if __name__ == "__main__":
    main()
