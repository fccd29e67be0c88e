"""What LeanKV's per-step tiering costs beside a decode step, on this machine, in one run.

    python benchmarks/tier_cost.py [--batches 1,8,32] [--context 1024] [--repeats 10]
                                   [--new-tokens 16] [--out benchmarks/results]

For each batch size: the decode step of jkv's engine on SmolLM2-135M (the embedded default,
float32, `kv_format=k8v4`, every sequence holding --context tokens; the median of the steps
that decode all of them and prefill none, after a run that compiles), and one generation-
phase tiering step over the same rows at SmolLM2's shape (30 layers x 3 KV heads, pages of
16 tokens, K8V4 high tier with per-token key scales and its K4V2 low tier in the same pool):
adding the step's significance to every held token, Algorithm 1 for every (sequence, layer,
head), the compaction of both tiers and the moves of tokens and metadata, as one jitted call
(`jkv.cache.token_tiers`). The rows start from a prompt-phase placement of random heavy-
tailed significance. The engine does not run tiers yet (issue 13): this measures the tiering
work on its own, beside the step it will join.
Writes benchmarks/results/tier_cost-<date>.json.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import os
import statistics
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from tqdm import tqdm  # noqa: E402

from jkv import LLM, SamplingParams  # noqa: E402
from jkv.cache import allocator as alloc  # noqa: E402
from jkv.cache import token_tiers as tt  # noqa: E402
from jkv.config import KVFormat  # noqa: E402
from jkv.pallas_kernels.kv_pages import KVPages  # noqa: E402

LAYERS, HEADS, HEAD_DIM, PAGE, RECENT = 30, 3, 64, 16, 64
ALPHA_HIGH, ALPHA_LOW = 1.0, 0.1


ALPHAS = dict(alpha_high=jnp.float32(ALPHA_HIGH), alpha_low=jnp.float32(ALPHA_LOW))


@functools.partial(jax.jit, donate_argnums=(0, 1), static_argnames="max_moves")
def prompt_step(pool, meta, free, tables, counts, sig_high, sig_low, n, max_moves):
    """The prompt phase over rows that each just took n tokens."""
    meta = tt.add_significance(meta, tables.pages, counts, PAGE, sig_high, sig_low)
    fate_hi, fate_lo = tt.place(meta, tables.pages, counts, jnp.int32(0), n, jnp.asarray(True),
                                page=PAGE, recent=RECENT, **ALPHAS)
    free, tables, counts, moves, ok = tt.compact(free, tables, counts, fate_hi, fate_lo, PAGE,
                                                 max_moves)
    return (tt.move_pages(pool, moves, PAGE), tt.move_tokens(meta, moves), free, tables,
            counts, ok)


@functools.partial(jax.jit, donate_argnums=(0, 1))
def tier_step(pool, meta, free, tables, counts, sig_high, sig_low, n):
    """One decode step of tiering for every row: significance in, Algorithm 1 (one candidate
    and its victim per row), compaction, moves."""
    meta = tt.add_significance(meta, tables.pages, counts, PAGE, sig_high, sig_low)
    decided = tt.place_generation(meta, tables.pages, counts, n, page=PAGE, recent=RECENT,
                                  **ALPHAS)
    free, tables, counts, moves, ok = tt.compact_one(free, tables, counts, *decided, PAGE)
    return (tt.move_pages(pool, moves, PAGE), tt.move_tokens(meta, moves), free, tables,
            counts, ok)


def tier_rows(batch: int, context: int, rng: np.random.Generator) -> tuple:
    """State for `batch` sequences of `context` tokens, placed once by the prompt phase."""
    width = context // PAGE + 2
    rows = (batch, LAYERS, HEADS)
    num_pages = batch * LAYERS * HEADS * width + 1
    fmt = KVFormat.parse("k8v4t")
    pool = KVPages.zeros(num_pages, PAGE, HEAD_DIM, jnp.float32, fmt)
    free = alloc.init_free(num_pages, PAGE)
    tables = alloc.init_tables(batch, LAYERS, HEADS, width)
    counts = tt.init_counts(rows)
    meta = tt.init_meta(num_pages, PAGE)
    free, tables, counts, addr, ok = tt.grow_high(free, tables, counts,
                                                  jnp.full(rows, context), PAGE, context)
    assert bool(ok)
    k = jnp.asarray(rng.normal(size=(*rows, context, HEAD_DIM)), jnp.float32)
    pool = tt.write_tokens(pool, addr, k, k, PAGE)
    meta = tt.write_meta(meta, addr, jnp.arange(context), jnp.zeros(addr.shape))
    # heavy-tailed sums of attention: a token's mean is about its score / (context - pos)
    sig = rng.lognormal(0.0, 1.5, (*rows, width * PAGE)) * (context - np.arange(width * PAGE))
    sig = jnp.asarray(sig / (3 * context), jnp.float32)
    low = jnp.zeros((*rows, 2 * width * PAGE), jnp.float32)
    state = prompt_step(pool, meta, free, tables, counts, sig, low, jnp.int32(context),
                        max_moves=context)
    assert bool(state[-1])
    high, low_tokens = (int(x.sum()) for x in (state[4].high, state[4].low))
    step_sig = (jnp.asarray(rng.random((*rows, width * PAGE)) / context, jnp.float32),
                jnp.asarray(rng.random((*rows, 2 * width * PAGE)) / context, jnp.float32))
    return state[:5], step_sig, (high, low_tokens)


def time_tiers(batch: int, context: int, repeats: int, rng) -> tuple[float, dict]:
    state, (sig_high, sig_low), (high, low) = tier_rows(batch, context, rng)
    n = jnp.int32(context + 1)
    times = []
    for i in range(repeats + 1):  # the first call compiles
        t0 = time.perf_counter()
        out = tier_step(*state, sig_high, sig_low, n)
        jax.block_until_ready(out)
        if i:
            times.append(time.perf_counter() - t0)
        state = out[:5]
    total = batch * LAYERS * HEADS * context
    return statistics.median(times), {"high": high / total, "low": low / total,
                                      "pruned": 1 - (high + low) / total}


def time_decode(batch: int, context: int, new_tokens: int, rng) -> float:
    """Median seconds of the engine's steps that decode every sequence and prefill none."""
    # the first sequences decode while later ones prefill: enough tokens that all of them
    # then decode together for new_tokens steps
    tokens = new_tokens + 2 * -(-batch * context // 512) + 1
    llm = LLM(dtype="float32", kv_format="k8v4", max_model_len=context + tokens + 16,
              max_num_seqs=batch, enable_prefix_caching=False, host_cache_bytes=0)
    vocab = llm.engine.cfg.vocab_size
    prompts = [rng.integers(100, vocab, context).tolist() for _ in range(batch)]
    engine_step, times = llm.engine.step, []

    def timed_step(prefill, decode):
        t0 = time.perf_counter()
        out = engine_step(prefill, decode)
        if not prefill and len(decode) == batch:
            times.append(time.perf_counter() - t0)
        return out

    llm.engine.step = timed_step
    sp = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
    llm.generate(prompts, sp)  # compiles every shape
    times.clear()
    llm.generate(prompts, sp)
    llm.close()
    if len(times) < new_tokens:
        raise RuntimeError(f"only {len(times)} steps decoded all {batch} sequences at once")
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--batches", default="1,8,32", help="batch sizes, comma separated")
    ap.add_argument("--context", type=int, default=1024, help="tokens each sequence holds")
    ap.add_argument("--repeats", type=int, default=10,
                    help="timed tiering steps per batch (median)")
    ap.add_argument("--new-tokens", type=int, default=16,
                    help="decode steps the engine's step time is the median of")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results"),
                    help="directory for the JSON result")
    args = ap.parse_args()
    batches = [int(b) for b in args.batches.split(",") if b]
    if not batches or min(batches) < 1 or args.context < 2 * RECENT:
        ap.error(f"--batches must be positive and --context at least {2 * RECENT}")
    rng = np.random.default_rng(0)
    rows = []
    for batch in tqdm(batches, desc="batches"):
        tier_s, mix = time_tiers(batch, args.context, args.repeats, rng)
        step_s = time_decode(batch, args.context, args.new_tokens, rng)
        rows.append({"batch": batch, "decode_step_ms": step_s * 1e3,
                     "tier_step_ms": tier_s * 1e3, "tier_fraction": tier_s / step_s,
                     "tokens": mix})
    print(f"\nSmolLM2-135M shape, {args.context} tokens per sequence, jax {jax.__version__} "
          f"on {jax.devices()[0].device_kind}")
    print(f"{'batch':>6}{'decode step ms':>16}{'tiering ms':>12}{'tiering/step':>14}"
          f"{'high/low/pruned':>20}")
    for r in rows:
        mix = r["tokens"]
        print(f"{r['batch']:>6}{r['decode_step_ms']:>16.1f}{r['tier_step_ms']:>12.2f}"
              f"{r['tier_fraction']:>13.1%}"
              f"{mix['high']:>10.2f}/{mix['low']:.2f}/{mix['pruned']:.2f}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    date = datetime.date.today().isoformat()
    path = out / f"tier_cost-{date}.json"
    path.write_text(json.dumps({"rows": rows, "device": jax.devices()[0].device_kind,
                                "jax": jax.__version__, "date": date,
                                "args": {k: v for k, v in vars(args).items() if k != "out"}},
                               indent=2) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
