"""Would the device pool gain from holding Krul's shared form? Decode attention over shared
coefficient pages (`shared_pages_attention`: keys rebuilt per position in the kernel, since the
form keeps keys before their rotation) against paged decode over k8v4 pages, at the same bytes
per token and layer.

    python benchmarks/shared_pages.py                # the cost of each at the device's limits
    python benchmarks/shared_pages.py --time         # GPU: both kernels timed side by side

Without --time it counts, per token and layer of the history, the bytes each kernel reads and
the FLOPs it does, and turns them into a lower bound on time from two device limits: the
measured copy bandwidth (benchmarks/results/decode_attention, H200) and the tensor cores'
dense 16-bit FLOP rate (the spec sheet: an estimate no kernel reaches). The shared pages
are sized to k8v4's bytes: a group of G layers holds R_k + R_v = 1.5 * Hkv * D * G 8-bit
coefficients per token.
With --time (a GPU), both kernels run on random operands of those shapes and ranks at each
batch x context and the table gets their measured times. Writes
benchmarks/results/shared_pages/shared_pages-<device or "estimate">-<date>.json.
"""

from __future__ import annotations

import argparse
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np
from harness import add_out_argument, write_results

from jkv.kv.format import KV_FORMATS
from jkv.kv.pages import KVPages
from jkv.kv.quant import pack
from jkv.kv.shared_pages import CoefficientPages, LayerBases, page_width
from jkv.pallas_kernels.paged_decode_attention import paged_decode_attention
from jkv.pallas_kernels.shared_pages_attention import shared_pages_attention

SHAPES = {"smollm2": (9, 3, 64), "llama3-8b": (32, 8, 128)}  # query heads, KV heads, head dim
COPY_BYTES_PER_S = 4.17e12  # H200, kernels-sweep-NVIDIA_H200-2026-11-27-dequant.json
PEAK_FLOPS = 989e12  # H200 SXM dense bf16 tensor FLOP/s (spec sheet)
PAGE = 64


def costs(hq: int, hkv: int, d: int, group: int) -> dict:
    """Bytes and FLOPs per history token and layer: k8v4 pages against shared pages of the
    same bytes (ranks split evenly between keys and values)."""
    k8v4 = KV_FORMATS["k8v4"].bytes_per_token(d, 2) * hkv
    rank = int(1.5 * hkv * d * group) // 2  # each side's rank at k8v4's bytes
    dense_flops = 4 * hq * d  # scores and the weighted sum
    # keys rebuilt twice per KV head (the key and its rotate-half: 2 * 2 R D), the rank-space
    # weighted sum of values (2 R per query head), the scores (2 D per query head)
    shared_flops = 4 * rank * d * hkv + 2 * rank * hq + 2 * hq * d
    shared_bytes = 2 * rank / group  # 8-bit codes of both sides, read by each layer
    rows = {}
    for name, nbytes, flops in [("k8v4 pages", k8v4, dense_flops),
                                ("shared pages", shared_bytes, shared_flops)]:
        seconds = max(nbytes / COPY_BYTES_PER_S, flops / PEAK_FLOPS)
        rows[name] = {"bytes": nbytes, "flops": flops, "flops_per_byte": flops / nbytes,
                      "bound": "FLOPs" if flops / PEAK_FLOPS > nbytes / COPY_BYTES_PER_S
                      else "bytes", "ns_at_limit": seconds * 1e9}
    rows["shared pages"]["rank"] = rank
    # the rank per side at which the shared pages' time at the limits meets k8v4's
    per_rank = max(2 / group / COPY_BYTES_PER_S, (4 * d * hkv + 2 * hq) / PEAK_FLOPS)
    rows["shared pages"]["even_rank"] = int(rows["k8v4 pages"]["ns_at_limit"] / 1e9 / per_rank)
    return rows


def estimate(groups: list[int]) -> list[dict]:
    rows = []
    for model, (hq, hkv, d) in SHAPES.items():
        for g in groups:
            c = costs(hq, hkv, d, g)
            rows.append({"model": model, "group": g, "rank": c["shared pages"]["rank"],
                         "even_rank": c["shared pages"]["even_rank"],
                         **{f"{k} {name}": v for name, row in c.items()
                            for k, v in row.items() if k not in ("rank", "even_rank")},
                         "shared over k8v4": (c["shared pages"]["ns_at_limit"]
                                              / c["k8v4 pages"]["ns_at_limit"])})
    print(f"{'model':10} {'G':>2} {'rank':>5} {'k8v4 B':>7} {'shared B':>8} {'FLOP/B':>7} "
          f"{'bound':>6} {'shared/k8v4 at limits':>22} {'even rank':>9}")
    for r in rows:
        print(f"{r['model']:10} {r['group']:>2} {r['rank']:>5} {r['bytes k8v4 pages']:>7.0f} "
              f"{r['bytes shared pages']:>8.0f} {r['flops_per_byte shared pages']:>7.0f} "
              f"{r['bound shared pages']:>6} {r['shared over k8v4']:>21.2f}x "
              f"{r['even_rank']:>9}")
    return rows


def timeit(fn, *args, reps: int = 20) -> float:
    jax.block_until_ready(fn(*args))
    t = time.perf_counter()
    for _ in range(reps):
        out = fn(*args)
    jax.block_until_ready(out)
    return (time.perf_counter() - t) / reps


def coefficient_pool(rng, pages: int, rank: int) -> CoefficientPages:
    width = page_width(rank, 8)
    return CoefficientPages(
        codes=pack(jnp.asarray(rng.integers(0, 256, (pages, PAGE, width)), jnp.uint8), 8),
        scale=jnp.asarray(rng.random((pages, width)) * 0.01, jnp.float16),
        zero=jnp.asarray(rng.standard_normal((pages, width)), jnp.float16), bits=8)


def time_case(rng, model: str, batch: int, context: int, group: int) -> dict:
    """Both kernels on one layer at batch x context (bfloat16 queries)."""
    hq, hkv, d = SHAPES[model]
    rank = costs(hq, hkv, d, group)["shared pages"]["rank"]
    width = context // PAGE
    q = jnp.asarray(rng.standard_normal((batch, hq, d)), jnp.bfloat16)
    k_pool, v_pool = (coefficient_pool(rng, batch * width + 1, rank) for _ in range(2))
    table = jnp.asarray(1 + rng.permutation(batch * width).reshape(batch, width), jnp.int32)
    w = page_width(rank, 8)
    bases = LayerBases(*(jnp.asarray(rng.standard_normal(s) / 16, dt) for s, dt in [
        ((batch, w, hkv * d), jnp.float16), ((batch, hkv * d), jnp.float32),
        ((batch, w, hkv * d), jnp.float16), ((batch, hkv * d), jnp.float32)]))
    lengths = jnp.full((batch,), context, jnp.int32)
    inv = jnp.asarray(1.0 / 500000 ** (np.arange(0, d, 2) / d), jnp.float32)
    splits = 1 << int(np.log2(max(1, min(264 // (batch * hkv), width))))
    shared = jax.jit(functools.partial(shared_pages_attention, pages_per_block=1,
                                       k_splits=splits))  # one program per SM or more
    t_shared = timeit(shared, q[:, None], k_pool, v_pool, bases, table, table, lengths,
                      jnp.zeros_like(lengths), inv)
    del k_pool, v_pool
    n = batch * hkv * (context // 16) + 1
    pages = KVPages.from_dense(
        *(jnp.asarray(rng.standard_normal((n, 16, d)), jnp.bfloat16) for _ in range(2)),
        KV_FORMATS["k8v4"])
    kv_table = jnp.asarray(1 + rng.permutation(n - 1).reshape(batch, hkv, -1), jnp.int32)
    splits = 1 << int(np.log2(max(1, min(264 // (batch * hkv), context // 16 // 4))))
    dense = jax.jit(functools.partial(paged_decode_attention, pages_per_block=4,
                                      k_splits=splits))
    t_dense = timeit(dense, q, pages, kv_table, jnp.full((batch, hkv), context, jnp.int32))
    print(f"{model} G={group} {batch}x{context}: shared {t_shared * 1e3:.3f} ms, "
          f"k8v4 {t_dense * 1e3:.3f} ms ({t_shared / t_dense:.2f}x)")
    return {"model": model, "group": group, "rank": rank, "batch": batch, "context": context,
            "shared_seconds": t_shared, "k8v4_seconds": t_dense}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--groups", default="1,3",
                    help="layers per group in the estimate (default 1,3)")
    ap.add_argument("--time", action="store_true",
                    help="time both kernels (needs a GPU: the Triton lowering)")
    ap.add_argument("--time-group", type=int, default=1,
                    help="layers per group of the timed cases (default 1: the rank a layer "
                         "reads is what costs; larger groups only multiply it)")
    ap.add_argument("--shapes", default="8x4096,64x8192",
                    help="batch x context pairs timed with --time (default 8x4096,64x8192)")
    add_out_argument(ap, "shared_pages")
    args = ap.parse_args()
    groups = [int(g) for g in args.groups.split(",")]
    result = {"copy_bytes_per_s": COPY_BYTES_PER_S, "peak_flops": PEAK_FLOPS,
              "estimate": estimate(groups)}
    if args.time and jax.default_backend() != "gpu":
        ap.error("--time needs a GPU (the kernel is Triton-lowered)")
    device = jax.devices()[0].device_kind.replace(" ", "_") if args.time else "estimate"
    path = write_results(args.out, f"shared_pages-{device}", result, args)
    if args.time:  # written again after each case: a time limit keeps what finished
        rng, result["timed"] = np.random.default_rng(0), []
        for model in SHAPES:
            for shape in args.shapes.split(","):
                result["timed"].append(time_case(rng, model, *map(int, shape.split("x")),
                                                 args.time_group))
                write_results(args.out, f"shared_pages-{device}", result, args, over=path)


if __name__ == "__main__":
    main()
