"""How close each KV format stays to the unquantized cache on SmolLM2.

    python benchmarks/kv_quality.py [--tokens 64] [--backend xla|pallas] [--formats int8,k4v2]

Five prompts; the baseline format (`auto`: pages in model dtype) generates `--tokens` greedy
tokens. Each format then
  - replays those tokens one decode step at a time over its own cache (teacher forcing) and is
    compared with the baseline's next-token distribution at every step: top-1 agreement and
    mean KL(baseline || format);
  - generates greedily on its own: the fraction of positions where it produces the baseline's
    token, and how many tokens it produces before the first difference.
Writes benchmarks/results/kv_quality/kv_quality-<backend>-<date>.json and prints a markdown
table.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from tqdm import tqdm  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import add_out_argument, write_results  # noqa: E402

from jkv.attention.layer_kv import LayerKV  # noqa: E402
from jkv.kv.allocator import init_free, init_tables, reserve  # noqa: E402
from jkv.kv.buckets import bucket  # noqa: E402
from jkv.kv.format import KV_FORMATS  # noqa: E402
from jkv.kv.page_pool import FillingPages, init_filling, page_bytes  # noqa: E402
from jkv.kv.pages import KVPages  # noqa: E402
from jkv.models import forward, lm_head, load_params  # noqa: E402
from jkv.models.loaders import default_model_path  # noqa: E402
from jkv.models.tokenizer import load_tokenizer  # noqa: E402

PROMPTS = [
    "The history of computing is a story of abstraction. Early machines were programmed by "
    "rewiring panels, then by punching cards, and later by writing assembly code that mapped "
    "one to one onto the instructions of a particular processor. High-level languages such as "
    "Fortran and Lisp let programmers describe what they wanted rather than how the hardware "
    "should do it, and compilers took over the tedious work of translation. In short,",
    "Explain, step by step, why the sky is blue and why sunsets are red. Start with sunlight.",
    "def merge_sort(xs):\n    \"\"\"Sort a list with merge sort.\"\"\"\n",
    "Write a short story about a lighthouse keeper who finds a message in a bottle. The "
    "keeper had lived alone on the island for eleven years, and every morning",
    "List five tips for staying productive while working from home, with one sentence each:",
]
FORMATS = ["int8", "k8v4", "int4", "k4v2"]
PAGE = 16


def replay(cfg, params, kv_format, prompts, n, backend, feed=None):
    """Greedy generation (feed None) or teacher forcing (feed [B, n] tokens) over a cache in
    `kv_format`: returns the tokens and the float32 logits of each of the n steps."""
    b = len(prompts)
    plen = np.array([len(p) for p in prompts])
    width = bucket(-(-int(plen.max() + n) // PAGE), 4)
    dtype = params["embed"].dtype
    per_row = cfg.num_layers * cfg.num_kv_heads * width
    pool = KVPages.zeros(b * per_row + 1, PAGE, cfg.head_dim, dtype, kv_format)
    free = init_free(b * per_row + 1, PAGE)
    filling = init_filling(b, cfg.num_layers, cfg.num_kv_heads, PAGE, cfg.head_dim, dtype)
    tables = init_tables(b, cfg.num_layers, cfg.num_kv_heads, width)
    free, tables, ok = reserve(free, tables, jnp.asarray(plen + n, jnp.int32))
    assert bool(ok)

    @jax.jit
    def step(pool, filling, tokens, positions, valid, last):
        kv = LayerKV(pool=pool, fill_k=filling.k, fill_v=filling.v, pages=tables.pages)
        hidden, kv = forward(params, cfg, tokens, positions, valid, kv, backend)
        h = jnp.take_along_axis(hidden, last[:, None, None], axis=1)[:, 0]
        return lm_head(params, h), kv.pool, FillingPages(k=kv.fill_k, v=kv.fill_v)

    t = bucket(int(plen.max()), 16)
    tokens = np.zeros((b, t), np.int32)
    for i, p in enumerate(prompts):
        tokens[i, : len(p)] = p
    positions = np.broadcast_to(np.arange(t, dtype=np.int32), (b, t))
    logits, pool, filling = step(pool, filling, tokens, positions, positions < plen[:, None],
                                 jnp.asarray(plen - 1, jnp.int32))
    out_tokens, out_logits = [], []
    for s in range(n):
        logits = np.asarray(logits)
        out_logits.append(logits)
        nxt = logits.argmax(-1) if feed is None else feed[:, s]
        out_tokens.append(nxt)
        if s + 1 < n:
            logits, pool, filling = step(pool, filling, jnp.asarray(nxt[:, None], jnp.int32),
                                         jnp.asarray((plen + s)[:, None], jnp.int32),
                                         jnp.ones((b, 1), bool), jnp.zeros(b, jnp.int32))
    return np.stack(out_tokens, 1), np.stack(out_logits, 1)


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=64, help="tokens generated per prompt")
    ap.add_argument("--backend", default="xla", choices=["xla", "pallas"],
                    help="attention backend (pallas runs interpreted on CPU: slow)")
    ap.add_argument("--formats", default=",".join(FORMATS),
                    help="comma-separated KV formats compared with the baseline")
    ap.add_argument("--dtype", default="float32", help="model dtype (float32 or bfloat16)")
    add_out_argument(ap, "kv_quality")
    args = ap.parse_args()
    cfg, params = load_params(None, jnp.dtype(args.dtype))
    tok = load_tokenizer(default_model_path())
    prompts = [tok.encode(p) for p in PROMPTS]
    n = args.tokens
    base_tokens, base_logits = replay(cfg, params, KV_FORMATS["auto"], prompts, n, args.backend)
    base_lp = log_softmax(base_logits)
    rows = []
    for name in tqdm(args.formats.split(","), desc="formats"):
        fmt = KV_FORMATS[name]
        _, forced = replay(cfg, params, fmt, prompts, n, args.backend, feed=base_tokens)
        free_tokens, _ = replay(cfg, params, fmt, prompts, n, args.backend)
        lp = log_softmax(forced)
        kl = (np.exp(base_lp) * (base_lp - lp)).sum(-1)  # [B, n]
        same = free_tokens == base_tokens
        first_diff = [int(np.argmin(r)) if not r.all() else n for r in same]
        rows.append({
            "format": name,
            # in a full page of bf16 model, key scales and value scales included
            "bytes_per_token_per_head": page_bytes(fmt, PAGE, cfg.head_dim, jnp.bfloat16) / PAGE,
            "teacher_forced_top1_agreement": float((forced.argmax(-1) == base_tokens).mean()),
            "mean_kl": float(kl.mean()),
            "max_kl": float(kl.max()),
            "greedy_token_agreement": float(same.mean()),
            "greedy_identical_prefix": first_diff,
        })
    bf16_bytes = page_bytes(KV_FORMATS["auto"], PAGE, cfg.head_dim, jnp.bfloat16) / PAGE
    lines = [
        f"SmolLM2-135M-Instruct, {len(prompts)} prompts x {n} tokens, {args.dtype} model, "
        f"{args.backend} attention, page size {PAGE}; baseline: unquantized pages "
        f"({jax.devices()[0].device_kind}, jax {jax.__version__}). "
        "Bytes per token and KV head count a full page of a bf16 model, scales included.", "",
        "| format | bytes/token/head (vs bf16) | teacher-forced top-1 | mean KL | max KL "
        "| free greedy agreement | identical prefix per prompt |",
        "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(
            f"| {r['format']} | {r['bytes_per_token_per_head']:.0f} "
            f"({r['bytes_per_token_per_head'] / bf16_bytes:.2f}x) "
            f"| {r['teacher_forced_top1_agreement']:.3f} | {r['mean_kl']:.4f} "
            f"| {r['max_kl']:.3f} | {r['greedy_token_agreement']:.3f} "
            f"| {r['greedy_identical_prefix']} |")
    print("\n" + "\n".join(lines))
    write_results(args.out, f"kv_quality-{args.backend}", {
        "model": "SmolLM2-135M-Instruct", "dtype": args.dtype, "backend": args.backend,
        "tokens": n, "prompts": PROMPTS, "page_size": PAGE, "rows": rows}, args)


if __name__ == "__main__":
    main()
