"""Shared-layer KV's frontier on SmolLM2: cross-layer shared bases (xKV) in groups of adjacent
layers, fixed or chosen per conversation (Krul), against per-layer low rank and jkv's quantized
formats, at equal TOTAL bytes (coefficients, bases, means, scales and zero points).

    python benchmarks/kv_frontier.py [--history 1536] [--doc-tokens 2048] [--docs evaluation]
        [--rates 0.1,0.2,0.3,0.45,0.6] [--groups 1,2,3,5] [--max-group 5] [--bits 16,8,4,2]
        [--sinks 4]

For each document (kv_fidelity.py's prose, code and chat, and a multi-turn chat of serve.py's
workload) its first `--history` tokens are prefilled by the engine (float32 pool) and saved; the
saved keys and values are compressed and restored into a fresh slot, and the rest of the
document (the next turn) is prefilled teacher-forced. Against the exact restore: the next turn's
perplexity change and top-1 agreement.

Forms (`jkv.kv.shared_basis`): per side, layers in adjacent groups (`g<G>`: fixed size;
`chosen`: the partition with the least truncation error at the rate, by dynamic programming,
per side and per conversation); each group one basis and quantized per-token coefficients; the
byte budget (`--rates` x the entry's bf16 bytes) spent on ranks greedily across all groups and
both sides; the history's first `--sinks` tokens (attention sinks: their small error costs
much) are kept whole in float16 and counted. Keys are fitted as the pool holds them (post-RoPE)
and un-rotated (pre-RoPE, re-rotated on reconstruction); g1 is per-layer low rank. Every
combination's relative error is measured; per (rate, grouping) the coefficient bits and key
variant with the least error are run through the model, and for the chosen grouping the other
key variant too. jkv's formats (`--formats`) are converted from the saved pages and back, at
their own rates.

Writes benchmarks/results/kv_frontier/kv_frontier-<date>.json and its plot; prints a table.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from tqdm import tqdm  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from harness import add_out_argument, write_results  # noqa: E402
from kv_fidelity import documents  # noqa: E402
from kv_sharing import PAGE, make_engine, prefill  # noqa: E402

from jkv.engine.saved_pages import SavedPages  # noqa: E402
from jkv.kv import shared_basis as sb  # noqa: E402
from jkv.kv.format import KV_FORMATS  # noqa: E402
from jkv.kv.kv_forms import convert_pages  # noqa: E402
from jkv.models import load_params  # noqa: E402
from jkv.models.loaders import default_model_path  # noqa: E402
from jkv.models.rope import apply_rope, inv_frequencies  # noqa: E402
from jkv.models.tokenizer import load_tokenizer  # noqa: E402

BLOCK = 64  # tokens per coefficient scale


def serve_chat(tokenizer, n_tokens: int, seed: int) -> list[int]:
    """A multi-turn chat of serve.py's workload (its users' messages and recorded replies),
    conversations joined until `n_tokens`."""
    from serve import make_workload

    messages: list[dict] = []
    for conv in make_workload(64, 1.0, 1.0, 0.0, seed):
        for turn in conv["turns"]:
            messages += [{"role": "user", "content": turn["user"]},
                         {"role": "assistant", "content": turn["reply"]}]
        ids = tokenizer.apply_chat_template(messages, tokenize=True)
        if len(ids) >= n_tokens:
            return ids[:n_tokens]
    raise SystemExit("serve.py's workload gave too few tokens")


# ---------------------------------------------------------------------------- layouts

def to_layers(x: np.ndarray) -> np.ndarray:
    """Saved pages [n, L, H, page, D] as [L, T, H, D]."""
    n, layers, heads, page, d = x.shape
    return np.moveaxis(x, (0, 3), (1, 2)).reshape(layers, n * page, heads, d)


def to_pages(x: np.ndarray, page: int) -> np.ndarray:
    """[L, T, H, D] as saved pages [T // page, L, H, page, D]."""
    layers, t, heads, d = x.shape
    return np.moveaxis(x.reshape(layers, t // page, page, heads, d), (1, 2), (0, 3))


def rope_keys(keys: np.ndarray, cfg, sign: int) -> np.ndarray:
    """Keys [L, T, H, D] rotated by +- their positions (-1: to pre-RoPE)."""
    inv = jnp.asarray(inv_frequencies(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling))
    pos = sign * jnp.broadcast_to(jnp.arange(keys.shape[1]), keys.shape[:2])
    return np.asarray(apply_rope(jnp.asarray(keys), pos, inv))


# ---------------------------------------------------------------------------- forms

def spectra(x: np.ndarray, sizes: set[int]) -> dict[tuple[int, int], sb.Spectrum]:
    """Every adjacent group's spectrum of sides x [L, T, F], group sizes in `sizes`."""
    layers = x.shape[0]
    return {(s, g): sb.spectrum(x[s:s + g]) for g in sorted(sizes)
            for s in range(layers - g + 1)}


def fixed_groups(layers: int, size: int) -> list[tuple[int, int]]:
    return [(s, min(size, layers - s)) for s in range(0, layers, size)]


def chosen_groups(specs, layers: int, max_group: int, rate: float, tokens: int,
                  features: int, bits: int) -> list[tuple[int, int]]:
    """The partition with the least truncation error when each group spends `rate` of its
    bf16 bytes."""
    specs = {grp: spec for grp, spec in specs.items() if grp[1] <= max_group}
    return sb.choose_groups(sb.grouping_costs(specs, rate, tokens, features, bits, BLOCK),
                            layers, max_group)


def shared_form(sides: dict[str, np.ndarray], groups: dict[str, list], specs: dict,
                rate: float, bits: int, sinks: int) -> tuple[dict[str, np.ndarray], dict]:
    """Each side [L, T, F] through the shared form at `rate` of the bf16 bytes, its first
    `sinks` tokens kept whole in float16 (`specs`: of the tokens after them): the
    reconstruction and what it kept (ranks, bytes)."""
    layers, tokens, features = next(iter(sides.values())).shape
    whole = len(sides) * layers * sinks * features * 2
    budget = int(rate * 2 * layers * tokens * features * 2) - whole
    order = [(side, grp) for side in sides for grp in groups[side]]
    ranks = sb.allocate_ranks([specs[side][grp] for side, grp in order], tokens - sinks,
                              features, bits, BLOCK, budget)
    out = {side: x.astype(np.float16).astype(np.float32) for side, x in sides.items()}
    used = whole
    for (side, (s, g)), rank in zip(order, ranks, strict=True):
        form = sb.fit(sides[side][s:s + g, sinks:], rank, bits, BLOCK, specs[side][(s, g)])
        out[side][s:s + g, sinks:] = sb.reconstruct(form, BLOCK)
        used += sb.side_bytes(tokens - sinks, g, features, rank, bits, BLOCK)
    return out, {"ranks": ranks, "bytes": used, "budget": budget,
                 "groups": {side: [list(grp) for grp in groups[side]] for side in sides}}


def as_pool(out: dict[str, np.ndarray], keys: str, cfg, shape) -> tuple[np.ndarray, ...]:
    """Reconstructed sides as the pool holds them [L, T, H, D] (pre-RoPE keys re-rotated)."""
    k = out["k"].reshape(shape)
    return (rope_keys(k, cfg, 1) if keys == "k_pre" else k), out["v"].reshape(shape)


def relative_error(x: np.ndarray, y: np.ndarray) -> float:
    """Mean over layers of ||x_l - y_l||^2 / ||x_l - mean_l||^2 (what the fits minimize)."""
    centered = x - x.mean(axis=1, keepdims=True)
    num = np.sum(np.square(x - y), axis=tuple(range(1, x.ndim)))
    return float(np.mean(num / np.sum(np.square(centered), axis=tuple(range(1, x.ndim)))))


def format_rate(name: str, cfg, tokens: int) -> float:
    """An entry's bytes in format `name` over its bf16 bytes (key page scales included)."""
    fmt = KV_FORMATS[name]
    per_head = (fmt.bytes_per_token(cfg.head_dim, 2)
                + fmt.key_page_overhead_bytes(cfg.head_dim) / PAGE)
    return per_head / (4 * cfg.head_dim)


# ---------------------------------------------------------------------------- runs

def next_turn(engine, saved: SavedPages, doc: list[int], history: int) -> dict:
    """Restore `saved`, prefill the rest of `doc` teacher-forced: logprobs and top-1 ids."""
    slot, cached = engine.open(doc, restore=saved)
    if cached != history:
        raise RuntimeError(f"restored {cached} tokens, expected {history}")
    lps, top1, _ = prefill(engine, slot, doc, history, targets=True)
    engine.close(slot, keep=False)
    return {"logprobs": lps[:-1], "top1": top1[:-1]}


def quality(out: dict, base: dict) -> dict:
    ppl, ppl0 = (math.exp(-np.mean(r["logprobs"])) for r in (out, base))
    return {"perplexity_change": ppl / ppl0 - 1,
            "top1_agreement": float(np.mean(np.equal(out["top1"], base["top1"])))}


def restored(saved: SavedPages, k: np.ndarray, v: np.ndarray) -> SavedPages:
    arrays = {"k": to_pages(k, PAGE).astype(np.float32),
              "v": to_pages(v, PAGE).astype(np.float32)}
    return SavedPages(saved.num_blocks, arrays, saved.hashes, exact_blocks=0)


def measure_doc(engine, cfg, doc: list[int], args) -> dict:
    """Every form's errors on one document, and the model's verdict on the best of each."""
    history = doc[:args.history]
    slot, _ = engine.open(history)
    prefill(engine, slot, history, 0, targets=False)
    saved = engine.save_pages(slot).fetch()
    engine.close(slot, keep=False)
    k4, v4 = (to_layers(np.asarray(saved.arrays[s], np.float32)) for s in ("k", "v"))
    layers, tokens, heads, d = k4.shape
    flat = {"k_post": k4.reshape(layers, tokens, -1), "v": v4.reshape(layers, tokens, -1),
            "k_pre": rope_keys(k4, cfg, -1).reshape(layers, tokens, -1)}
    base = next_turn(engine, saved, doc, args.history)
    rows: dict[str, dict] = {}
    for name in args.formats:
        arrays = convert_pages(saved.arrays, KV_FORMATS["auto"], KV_FORMATS[name], jnp.float32)
        back = convert_pages(arrays, KV_FORMATS[name], KV_FORMATS["auto"], jnp.float32)
        kq, vq = (to_layers(back[s]) for s in ("k", "v"))
        entry = SavedPages(saved.num_blocks, back, saved.hashes, exact_blocks=0)
        rows[name] = {"rate": format_rate(name, cfg, tokens),
                      "error": {"k": relative_error(k4, kq), "v": relative_error(v4, vq)},
                      **quality(next_turn(engine, entry, doc, args.history), base)}
    sizes = set(args.groups) | set(range(1, args.max_group + 1))
    specs = {side: spectra(x[:, args.sinks:], sizes) for side, x in flat.items()}
    features = heads * d
    candidates: dict[tuple, list] = {}
    for rate in args.rates:
        for bits in args.bits:
            for keys in ("k_post", "k_pre"):
                sides = {"k": flat[keys], "v": flat["v"]}
                sp = {"k": specs[keys], "v": specs["v"]}
                plans = {f"g{g}": {s: fixed_groups(layers, g) for s in sides}
                         for g in args.groups}
                plans["chosen"] = {s: chosen_groups(sp[s], layers, args.max_group, rate,
                                                    tokens - args.sinks, features, bits)
                                   for s in sides}
                for grouping, groups in plans.items():
                    out, info = shared_form(sides, groups, sp, rate, bits, args.sinks)
                    k, v = as_pool(out, keys, cfg, k4.shape)
                    score = relative_error(k4, k) + relative_error(v4, v)
                    candidates.setdefault((grouping, rate), []).append(
                        (score, keys, bits, groups))
    for (grouping, rate), options in tqdm(candidates.items(), desc="model runs", leave=False):
        options.sort(key=lambda o: o[0])
        runs = [options[0]]
        if grouping == "chosen":  # the best of the other key variant too
            runs += [next(o for o in options if o[1] != options[0][1])]
        for _, keys, bits, groups in runs:
            sides = {"k": flat[keys], "v": flat["v"]}
            sp = {"k": specs[keys], "v": specs["v"]}
            out, info = shared_form(sides, groups, sp, rate, bits, args.sinks)
            k, v = as_pool(out, keys, cfg, k4.shape)
            info["error"] = {"k": relative_error(k4, k), "v": relative_error(v4, v)}
            label = f"{grouping}:{keys.removeprefix('k_')}:{bits}b@{rate:g}"
            entry = restored(saved, k, v)
            rows[label] = {"rate": info["bytes"] / (4 * layers * tokens * features),
                           **info, **quality(next_turn(engine, entry, doc, args.history), base)}
    alignment = [float(np.mean(np.square(np.linalg.svd(
        token_space(specs["k_pre"][(i, 1)], flat["k_pre"][i], 32).T
        @ token_space(specs["k_pre"][(i + 1, 1)], flat["k_pre"][i + 1], 32),
        compute_uv=False)))) for i in range(layers - 1)]
    return {"rows": rows, "adjacent_key_alignment": alignment}


def token_space(spec: sb.Spectrum, x: np.ndarray, k: int) -> np.ndarray:
    """The layer's top-k principal directions in token space [T, k] (orthonormal columns)."""
    centered = (x - x.mean(axis=0)) / spec.norm[0]
    u = centered @ spec.vecs[:, :k]
    return u / np.linalg.norm(u, axis=0, keepdims=True)


def summary_label(label: str) -> str:
    """A row's label across documents: `<grouping>@<rate>` (the best bits and key variant of
    each document), `chosen:<keys>@<rate>` for both key variants of the chosen grouping, a
    format's name."""
    if ":" not in label:
        return label
    grouping, keys, rest = label.split(":")
    rate = rest.split("@")[1]
    return f"chosen:{keys}@{rate}" if grouping == "chosen" else f"{grouping}@{rate}"


def summarize(docs: dict[str, dict]) -> dict[str, dict]:
    """Per row: the mean over documents of rate, perplexity change and agreement, and each
    document's coefficient bits and key variant."""
    by: dict[str, list] = {}
    for doc in docs.values():
        for label, row in doc["rows"].items():
            by.setdefault(summary_label(label), []).append((label, row))
    out = {}
    for name, rows in sorted(by.items()):
        if len(rows) != len(docs):
            continue
        out[name] = {key: float(np.mean([r[key] for _, r in rows]))
                     for key in ("rate", "perplexity_change", "top1_agreement")}
        if ":" in rows[0][0] or "@" in name:
            out[name]["forms"] = [label for label, _ in rows]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--history", type=int, default=1536,
                    help="tokens of each document held as the restored history (a multiple "
                         "of the page size); the next turn is the rest of --doc-tokens")
    ap.add_argument("--doc-tokens", type=int, default=2048, help="tokens of each document")
    ap.add_argument("--docs", choices=("evaluation", "calibration"), default="evaluation")
    ap.add_argument("--seed", type=int, default=0, help="serve.py workload's seed (its chat)")
    ap.add_argument("--rates", default="0.1,0.2,0.3,0.45,0.6",
                    help="shared forms' total bytes over the entry's bf16 bytes")
    ap.add_argument("--groups", default="1,2,3,5", help="fixed group sizes (1: per layer)")
    ap.add_argument("--max-group", type=int, default=5,
                    help="largest group the per-conversation choice may form")
    ap.add_argument("--bits", default="16,8,4,2", help="coefficient bits tried (16: float16)")
    ap.add_argument("--sinks", type=int, default=4,
                    help="tokens at the history's start kept whole (float16) in the shared "
                         "forms: the attention sinks (0: none)")
    ap.add_argument("--formats", default="int8,k8v4,k4v2t,k2v4t,k4v2,int4",
                    help="jkv's KV formats on the frontier")
    add_out_argument(ap, "kv_frontier")
    args = ap.parse_args()
    if args.history % PAGE or not 0 < args.history < args.doc_tokens:
        ap.error(f"--history must be a positive multiple of {PAGE} below --doc-tokens")
    args.rates = [float(r) for r in args.rates.split(",")]
    args.groups = [int(g) for g in args.groups.split(",")]
    args.bits = [int(b) for b in args.bits.split(",")]
    args.formats = [f for f in args.formats.split(",") if f]

    cfg, params = load_params(None, jnp.float32)
    tokenizer = load_tokenizer(default_model_path())
    docs = documents(tokenizer, args.doc_tokens, args.docs)
    docs["serve_chat"] = serve_chat(tokenizer, args.doc_tokens, args.seed)
    engine = make_engine(cfg, params, args.doc_tokens + PAGE)
    measured = {name: measure_doc(engine, cfg, doc, args)
                for name, doc in tqdm(docs.items(), desc="documents", unit="doc")}
    rows = summarize(measured)
    print("\n| form | bytes / bf16 | ppl change | top-1 agreement |\n|---|---|---|---|")
    for label, r in sorted(rows.items(), key=lambda kv: kv[1]["rate"]):
        print(f"| {label} | {r['rate']:.3f} | {100 * r['perplexity_change']:+.2f}% | "
              f"{r['top1_agreement']:.3f} |")
    result = {"device": jax.devices()[0].device_kind, "jax": jax.__version__,
              "documents": args.docs, "history": args.history, "doc_tokens": args.doc_tokens,
              "block": BLOCK, "sinks": args.sinks, "docs": measured, "rows": rows}
    write_results(args.out, "kv_frontier", result, args)


if __name__ == "__main__":
    main()
