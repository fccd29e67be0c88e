"""Each Pallas kernel compiled for an NVIDIA GPU without one: the Triton IR JAX lowers a kernel
to for CUDA, compiled by the `triton` package for a Hopper target, gives the shared memory a
block asks for and, with `--ops`, the kernel's instruction mix. A kernel that asks for more
shared memory than a block has fails when XLA compiles it on the GPU, after the machine's
start has been paid; this finds it on a CPU first. The mix (global loads, shared-memory
traffic, barriers, tensor-core ops, all instructions, counted in the PTX) compares two
versions of a kernel, or jkv's bf16 kernel with JAX's own `paged_attention` (`--kernels
jax`), before a GPU times them: a proxy, not a timing.

    pip install triton                               # the compiler only: no GPU needed
    python benchmarks/triton_check.py                # both kernels at Llama-3-8B's shape
    python benchmarks/triton_check.py --kernels shared --shape smollm2 --stages 1,2
    python benchmarks/triton_check.py --kernels decode,jax --formats bf16,k8v4 --ppbs 8 \
        --stages 3 --ops

XLA compiles the same IR with its own copy of Triton, whose passes may differ from the
package's: read the figures across `--stages` (one stage: no software pipelining, so loads
the loop does not vary stay hoisted out of it) as the range to expect, not as XLA's number.
Each setting takes a minute or less to compile. It reads the IR through a private JAX hook
(`jax._src.pallas.triton.lowering`), so a JAX release may move it.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

BLOCK_LIMIT = 232_448  # bytes of shared memory one block may use on an H100 or H200
SHAPES = {"smollm2": (9, 3, 64), "llama3-8b": (32, 8, 128)}  # query heads, KV heads, dim

_COMPILE = """
import collections, json, re, sys
import triton
from triton.backends.compiler import GPUTarget
path, warps, stages, cc = sys.argv[1], *map(int, sys.argv[2:5])
kernel = triton.compile(path, target=GPUTarget("cuda", cc, 32),
                        options={"num_warps": warps, "num_stages": stages})
ops = collections.Counter(re.findall(r"^\\s+(?:@!?%\\w+\\s+)?([a-z][\\w.]*)",
                                     kernel.asm["ptx"], re.M))
print(json.dumps({"shared": kernel.metadata.shared, "ops": ops}))
"""
# instruction classes of `--ops`: name -> PTX opcode prefixes
OP_CLASSES = {"global loads": ("ld.global", "cp.async.ca", "cp.async.cg"),
              "shared ld/st": ("ld.shared", "st.shared", "ldmatrix"),
              "barriers": ("bar.sync", "barrier"), "mma": ("mma", "wgmma")}


def triton_ir(fn: Callable, *args: Any) -> list[str]:
    """The Triton modules (text) that tracing `fn(*args)` for CUDA lowers its Pallas calls to."""
    from jax._src.pallas.triton import lowering, pallas_call_registration

    modules, lower = [], lowering.lower_jaxpr_to_triton_module

    def keep(*a, **kw):
        result = lower(*a, **kw)
        modules.append(result.module.operation.get_asm(enable_debug_info=False))
        return result

    pallas_call_registration.lowering.lower_jaxpr_to_triton_module = keep
    try:
        jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))
    finally:
        pallas_call_registration.lowering.lower_jaxpr_to_triton_module = lower
    return modules


def compiled(module: str, num_warps: int, num_stages: int, cc: int = 90) -> dict:
    """`module` compiled by the `triton` package (in a process of its own: its LLVM and
    jaxlib's are kept apart): the bytes of shared memory a block asks for (`shared`) and
    how often each PTX opcode occurs (`ops`)."""
    with tempfile.NamedTemporaryFile("w", suffix=".ttir", delete=False) as f:
        f.write(module)
    try:
        env = {**os.environ, "TRITON_DEFAULT_FP_FUSION": "1"}
        done = subprocess.run([sys.executable, "-c", _COMPILE, f.name, str(num_warps),
                               str(num_stages), str(cc)], capture_output=True, text=True,
                              env=env, timeout=600)
    finally:
        os.unlink(f.name)
    lines = done.stdout.strip().splitlines()
    if done.returncode or not lines:
        raise RuntimeError(f"triton could not compile the kernel:\n{done.stderr[-2000:]}")
    return json.loads(lines[-1])


def op_mix(ops: dict[str, int]) -> dict[str, int]:
    """PTX opcode counts summed into `OP_CLASSES`, and all instructions."""
    mix = {name: sum(n for op, n in ops.items() if op.startswith(prefixes))
           for name, prefixes in OP_CLASSES.items()}
    return {**mix, "all": sum(ops.values())}


def shared_kernel(shape: str, pages_per_block: int, num_warps: int, num_stages: int):
    """`shared_pages_attention` at `shape`, one layer per group, ranks at k8v4's bytes (as
    benchmarks/shared_pages.py times it): the function and its arguments."""
    from shared_pages import PAGE, coefficient_pool, costs

    from jkv.kv.shared_pages import LayerBases, page_width
    from jkv.pallas_kernels.shared_pages_attention import shared_pages_attention

    rng = np.random.default_rng(0)
    hq, hkv, d = SHAPES[shape]
    rank = costs(hq, hkv, d, 1)["shared pages"]["rank"]
    w, width = page_width(rank, 8), 2 * pages_per_block
    q = jnp.asarray(rng.standard_normal((1, 1, hq, d)), jnp.bfloat16)
    k_pool, v_pool = (coefficient_pool(rng, width + 1, rank) for _ in range(2))
    bases = LayerBases(*(jnp.zeros(s, dt) for s, dt in [
        ((1, w, hkv * d), jnp.float16), ((1, hkv * d), jnp.float32),
        ((1, w, hkv * d), jnp.float16), ((1, hkv * d), jnp.float32)]))
    table = jnp.arange(1, width + 1, dtype=jnp.int32)[None]
    lengths = jnp.full((1,), width * PAGE, jnp.int32)
    inv = jnp.ones((d // 2,), jnp.float32)
    fn = functools.partial(shared_pages_attention, pages_per_block=pages_per_block,
                           num_warps=num_warps, num_stages=num_stages)
    return fn, (q, k_pool, v_pool, bases, table, table, lengths, jnp.zeros_like(lengths), inv)


def decode_kernel(shape: str, fmt: str, pages_per_block: int, num_warps: int,
                  num_stages: int):
    """`paged_decode_attention` over `fmt` pages of 16 tokens at `shape`."""
    from jkv.kv.format import KV_FORMATS
    from jkv.kv.pages import KVPages
    from jkv.pallas_kernels.paged_decode_attention import paged_decode_attention

    hq, hkv, d = SHAPES[shape]
    width = 2 * pages_per_block
    k = jnp.zeros((hkv * width + 1, 16, d), jnp.bfloat16)
    pages = KVPages.from_dense(k, k, KV_FORMATS[fmt])
    table = jnp.arange(1, hkv * width + 1, dtype=jnp.int32).reshape(1, hkv, width)
    fn = functools.partial(paged_decode_attention, pages_per_block=pages_per_block,
                           num_warps=num_warps, num_stages=num_stages)
    return fn, (jnp.zeros((1, hq, d), jnp.bfloat16), pages, table,
                jnp.full((1, hkv), width * 16, jnp.int32))


def jax_kernel(shape: str, pages_per_block: int, num_warps: int, num_stages: int):
    """JAX's own `paged_attention` over bf16 pages of 16 tokens at `shape` (the baseline
    benchmarks/decode_attention.py times)."""
    from jax.experimental.pallas.ops.gpu.paged_attention import paged_attention

    hq, hkv, d = SHAPES[shape]
    width = 2 * pages_per_block
    k = jnp.zeros((hkv, width + 1, 16, d), jnp.bfloat16)
    fn = functools.partial(paged_attention, pages_per_compute_block=pages_per_block,
                           k_splits=1, num_warps=num_warps, num_stages=num_stages)
    return fn, (jnp.zeros((1, hq, d), jnp.bfloat16), k, k,
                jnp.arange(1, width + 1, dtype=jnp.int32)[None],
                jnp.full((1,), width * 16, jnp.int32))


def kernel_call(kernel: str, shape: str, fmt: str | None, ppb: int, warps: int, stages: int):
    """The function and arguments of one row of the table."""
    if kernel == "shared":
        return shared_kernel(shape, ppb, warps, stages)
    if kernel == "jax":
        return jax_kernel(shape, ppb, warps, stages)
    return decode_kernel(shape, fmt, ppb, warps, stages)


def parse_args() -> argparse.Namespace:
    """The command line: which kernels, at which shape and settings (--help)."""
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kernels", default="shared,decode",
                    help="kernels to compile: shared (shared_pages_attention), decode "
                         "(paged_decode_attention, one row per format), jax (JAX's own "
                         "paged_attention over bf16 pages, the decode kernel's baseline)")
    ap.add_argument("--shape", default="llama3-8b", choices=sorted(SHAPES),
                    help="the model whose heads and head dim the kernels get")
    ap.add_argument("--formats", default="bf16,int8,k8v4,int4,k4v2",
                    help="the decode kernel's page formats")
    ap.add_argument("--ppbs", default="1,4", help="pages per block, comma-separated")
    ap.add_argument("--warps", default="4", help="Triton warps per program, comma-separated")
    ap.add_argument("--stages", default="1,2,3", help="Triton pipeline stages, comma-separated")
    ap.add_argument("--cc", type=int, default=90, help="compute capability (90: Hopper)")
    ap.add_argument("--ops", action="store_true",
                    help="also print each setting's instruction mix (PTX opcodes by class)")
    return ap.parse_args()


def main() -> None:
    """Compile each kernel at each setting; print the shared memory table (and the mix)."""
    args = parse_args()
    ints = lambda text: [int(x) for x in text.split(",")]  # noqa: E731
    stages = ints(args.stages)
    cases = [(kernel, fmt, p, w) for kernel in args.kernels.split(",")
             for fmt in (args.formats.split(",") if kernel == "decode" else [None])
             for p in ints(args.ppbs) for w in ints(args.warps)]
    print(f"{'kernel':8} {'format':6} {'ppb':>3} {'warps':>5} "
          + " ".join(f"{'stages ' + str(s):>14}" for s in stages))
    over, mixes = 0, []
    for kernel, fmt, ppb, warps in cases:
        cells = []
        for st in stages:
            fn, operands = kernel_call(kernel, args.shape, fmt, ppb, warps, st)
            found = max((compiled(m, warps, st, args.cc) for m in triton_ir(fn, *operands)),
                        key=lambda c: c["shared"])
            over += found["shared"] > BLOCK_LIMIT
            cells.append(f"{found['shared']:>12,}{'!' if found['shared'] > BLOCK_LIMIT else ' '} ")
            mixes.append((f"{kernel:8} {fmt or '-':6} {ppb:>3} {warps:>5} {st:>6}",
                          op_mix(found["ops"])))
        print(f"{kernel:8} {fmt or '-':6} {ppb:>3} {warps:>5} " + " ".join(cells), flush=True)
    print(f"bytes of shared memory per block; '!': over the {BLOCK_LIMIT:,} a block has "
          f"({over} settings)")
    if args.ops:
        names = [*OP_CLASSES, "all"]
        print(f"\n{'kernel':8} {'format':6} {'ppb':>3} {'warps':>5} {'stages':>6} "
              + " ".join(f"{n:>13}" for n in names))
        for label, mix in mixes:
            print(label + " " + " ".join(f"{mix[n]:>13,}" for n in names))
        print("PTX instructions in the compiled kernel, by class (static counts, not executed)")


if __name__ == "__main__":
    main()
