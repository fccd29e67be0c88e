"""Block sizes of the xla attention path (the CPU backend) for decode steps, on this machine.

    python benchmarks/xla_blocks.py [--shapes 4x512,16x512,32x512,8x2048] [--blocks 32,64,128,512]

One SmolLM2 layer (3 KV heads of 3 query heads, head_dim 64, pages of 16 tokens scattered
over the pool), one query per sequence: `xla_attention` at each `block_k` (page tokens per
block of its loop) for float32 pages, k8v4t pages, and LeanKV's two tiers (a quarter of the
tokens high in k8v4t, the rest low in k4v2t) with significance, against the default
(`block_k=None`, the rule in `xla_attention`). Medians over interleaved rounds, so every
setting sees the same machine. Writes
benchmarks/results/xla_blocks/xla_blocks-<device>-<date>.json and prints a table.
"""

from __future__ import annotations

import argparse
import functools
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).parent))
from harness import add_out_argument, write_results  # noqa: E402

from jkv.attention.xla import xla_attention  # noqa: E402
from jkv.kv.format import KVFormat  # noqa: E402
from jkv.kv.pages import KVPages  # noqa: E402

HKV, G, D, PAGE = 3, 3, 64, 16


def cases(batch: int, context: int, seed: int = 0) -> dict[str, tuple[tuple, dict]]:
    """(args, keyword args) of xla_attention per page layout, for `batch` rows of `context`
    page tokens and one window token each."""
    rng = np.random.default_rng(seed)
    width = max(64, context // PAGE)
    n = batch * HKV * width
    q = jnp.asarray(rng.standard_normal((batch, 1, HKV * G, D)), jnp.float32)
    window = jnp.asarray(rng.standard_normal((batch, HKV, 16, D)), jnp.float32)
    table = jnp.asarray(1 + rng.permutation(n).reshape(batch, HKV, width), jnp.int32)
    start = jnp.full((batch,), context, jnp.int32)
    tail = (window, window, start, jnp.ones((batch,), jnp.int32), start[:, None])
    dense = jnp.asarray(rng.standard_normal((n + 1, PAGE, D)), jnp.float32)
    held = jnp.full((batch, HKV), context, jnp.int32)
    f32 = KVPages.from_dense(dense, dense, KVFormat.parse("auto"))
    high = KVPages.from_dense(dense, dense, KVFormat.parse("k8v4t"))
    low = high.as_format(high.kv_format.halved())
    quarter = jnp.full((batch, HKV), context // 4, jnp.int32)
    return {
        "float32": ((q, f32, table, held, *tail), {}),
        "k8v4t": ((q, high, table, held, *tail), {}),
        "two tiers + significance": ((q, high, table, quarter, *tail), {
            "low_tier": low, "low_lengths": held - quarter, "return_significance": True}),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="4x512,16x512,32x512,8x2048",
                    help="batch x context pairs, comma separated")
    ap.add_argument("--blocks", default="32,64,128,512", help="block_k values to time")
    ap.add_argument("--rounds", type=int, default=6, help="interleaved rounds per setting")
    add_out_argument(ap, "xla_blocks")
    args = ap.parse_args()
    shapes = [tuple(int(x) for x in s.split("x")) for s in args.shapes.split(",") if s]
    blocks: list[int | None] = [None] + [int(b) for b in args.blocks.split(",") if b]
    rows = []
    for batch, context in tqdm(shapes, desc="shapes"):
        for layout, (a, kw) in cases(batch, context).items():
            fns = {bk: jax.jit(functools.partial(xla_attention, block_k=bk, **kw))
                   for bk in blocks}
            times: dict = {bk: [] for bk in blocks}
            for f in fns.values():
                jax.block_until_ready(f(*a))
            for _ in range(args.rounds):
                for bk, f in fns.items():
                    t0 = time.perf_counter()
                    for _ in range(10):
                        out = f(*a)
                    jax.block_until_ready(out)
                    times[bk].append((time.perf_counter() - t0) / 10 * 1e3)
            ms = {("default" if bk is None else str(bk)): float(np.median(t))
                  for bk, t in times.items()}
            rows.append({"batch": batch, "context": context, "layout": layout, "ms": ms})
    names = ["default"] + [str(b) for b in blocks[1:]]
    print(f"\nxla_attention decode, one SmolLM2 layer, ms (jax {jax.__version__}, "
          f"{jax.devices()[0].device_kind})")
    print("| batch x context | layout | " + " | ".join(names) + " |")
    print("|---|---|" + "---|" * len(names))
    for r in rows:
        print(f"| {r['batch']}x{r['context']} | {r['layout']} | "
              + " | ".join(f"{r['ms'][n]:.2f}" for n in names) + " |")
    device = jax.devices()[0].device_kind.replace(" ", "_").lower()
    write_results(args.out, f"xla_blocks-{device}",
                  {"device": jax.devices()[0].device_kind, "jax": jax.__version__, "rows": rows},
                  args)


if __name__ == "__main__":
    main()
