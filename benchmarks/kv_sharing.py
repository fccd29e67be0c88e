"""Cross-layer KV sharing of an idle conversation (Krul) on SmolLM2: bytes kept and fidelity.

    python benchmarks/kv_sharing.py [--history 1536] [--ratios 0.2,0.4,0.6]
                                    [--gammas 0.5] [--retain 0.1] [--docs calibration]

Krul's setting (section 8.1): a conversation's history is compressed while it is idle and the
next turn continues from it. For each document of kv_fidelity.py (prose, code, a long chat):
  1. its first `--history` tokens are prefilled by the engine and their pages saved (as the
     store would keep them);
  2. the history's attention patterns, from an explicit forward over the same tokens (every
     `--stride`-th query row kept): each layer's mass on the first and last 10% of the tokens
     and the Euclidean distance between every two layers' patterns (per query head, averaged);
  3. per setting, the layer pairs: `krul` (Algorithm 1: I-R layers at `gamma`, closest pairs
     first, until `ratio` of the layers share) and `deepest` (adjacent pairs from the last
     layer down, the same ratio: the fixed strategy);
  4. the pairs' keys and values merged MiniCache-style (`jkv.kv.layer_sharing`: one SLERP
     direction, a magnitude per layer, the `retain` farthest-apart vectors kept whole),
     expanded back and restored into a fresh slot; the rest of the document (the next turn)
     is prefilled with each position's logprob, then 64 tokens generated greedily.
Against the unmerged restore (bit-exact): perplexity change of the next turn, its
teacher-forced top-1 agreement, free greedy agreement. Bytes: what the idle conversation's
entry holds per token in `--bytes-format`, shared pages once plus float16 magnitudes and
the retained vectors (with an index), over the same entry unshared.
Writes benchmarks/results/kv_sharing/kv_sharing-<date>.json and its plot, and prints a table.
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

from jkv.config import CacheConfig, EngineConfig  # noqa: E402
from jkv.engine.engine import Engine  # noqa: E402
from jkv.engine.runner import Row  # noqa: E402
from jkv.engine.sampling import SamplingParams  # noqa: E402
from jkv.engine.saved_pages import SavedPages  # noqa: E402
from jkv.kv.format import KV_FORMATS  # noqa: E402
from jkv.kv.layer_sharing import (  # noqa: E402
    deepest_pairs,
    edge_mass,
    expand,
    ir_layers,
    merge_pair,
    select_pairs,
)
from jkv.models import load_params  # noqa: E402
from jkv.models.llama import mlp, positional_tables, project_qkv, rms_norm  # noqa: E402
from jkv.models.loaders import default_model_path  # noqa: E402
from jkv.models.tokenizer import load_tokenizer  # noqa: E402

PAGE, CHUNK, NEW_TOKENS = 16, 256, 64


# ---------------------------------------------------------------------------- attention

def _layer_probs(w, x, rope, cfg, stride):
    """One layer over hidden states x [T, D] with explicit causal attention: (x after it,
    its keys [T, Hkv, Dh] rotated, softmax weights [Hq, T // stride, T] of every
    stride-th query, edge mass)."""
    t = x.shape[0]
    q, k, v = (a[0] for a in project_qkv(w, cfg, x[None], rope))  # the model's own projections
    g = cfg.num_heads // cfg.num_kv_heads
    kq, vq = jnp.repeat(k, g, axis=1), jnp.repeat(v, g, axis=1)
    scores = jnp.einsum("qhd,khd->hqk", q, kq) / math.sqrt(cfg.head_dim)
    causal = jnp.arange(t)[:, None] >= jnp.arange(t)[None, :]
    probs = jax.nn.softmax(jnp.where(causal, scores, -jnp.inf), axis=-1)
    attn = jnp.einsum("hqk,khd->qhd", probs, vq).reshape(t, -1)
    x = x + attn @ w["wo"]
    x = x + mlp(rms_norm(x, w["mlp_norm"], cfg.rms_norm_eps), w["w_gate_up"], w["w_down"])
    return x, k, probs[:, ::stride].astype(jnp.float16), edge_mass(probs, t)


def attention_patterns(params, cfg, tokens: list[int], stride: int):
    """Per layer: edge mass [L], keys [L, T, Hkv, Dh]; distance [L, L] between layers'
    attention (per query head's flattened weights, averaged over heads)."""
    layer = jax.jit(_layer_probs, static_argnames=("cfg", "stride"))
    ids = jnp.asarray(tokens)
    x = params["embed"][ids]
    rope = positional_tables(cfg, jnp.arange(len(tokens))[None])
    mass, keys, probs = [], [], []
    for i in range(cfg.num_layers):
        w = {name: a[i] for name, a in params["layers"].items()}
        x, k, p, m = layer(w, x, rope, cfg=cfg, stride=stride)
        mass.append(float(m))
        keys.append(np.asarray(k))
        probs.append(p.reshape(cfg.num_heads, -1))
    flat = jnp.stack(probs)  # [L, Hq, N] float16
    sq = jnp.sum(jnp.square(flat.astype(jnp.float32)), axis=-1)  # [L, Hq]
    gram = jnp.stack([jnp.einsum("hn,lhn->lh", flat[i].astype(jnp.float32),
                                 flat.astype(jnp.float32)) for i in range(len(probs))])
    d2 = sq[:, None, :] + sq[None, :, :] - 2 * gram  # [L, L, Hq]
    distance = np.asarray(jnp.mean(jnp.sqrt(jnp.maximum(d2, 0.0)), axis=-1))
    return np.array(mass), np.stack(keys), distance


# ---------------------------------------------------------------------------- engine runs

def make_engine(cfg, params, max_len: int, kv_format: str = "auto") -> Engine:
    cache = CacheConfig(page_size=PAGE, kv_cache_bytes=256 << 20, kv_format=kv_format)
    return Engine(cfg, params, cache=cache, config=EngineConfig(
        max_model_len=max_len, max_num_seqs=1, prefill_chunk=CHUNK, attention_backend="xla",
        enable_prefix_caching=False))


def prefill(engine: Engine, slot: int, tokens: list[int], start: int, targets: bool):
    """Feed tokens[start:] in chunks; returns (per position from `start`: logprob of the next
    token and the top-1 id, the token sampled after the last one)."""
    greedy = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    key = engine.request_key(0)
    lps, top1, sampled = [], [], None
    for a in range(start, len(tokens), CHUNK):
        chunk = tokens[a:a + CHUNK]
        tgt = list(tokens[a + 1:a + 1 + len(chunk)]) + [-1] * (
            len(chunk) - len(tokens[a + 1:a + 1 + len(chunk)])) if targets else None
        (sampled,), _ = engine.step([Row(slot, chunk, greedy, key, 0, tgt)], [])
        if targets:
            lps += [float(x) for x in sampled.positions[0]]
            top1 += [int(x[0]) for x in sampled.positions[1]]
    return lps, top1, sampled.token


def continue_turn(engine: Engine, saved: SavedPages, doc: list[int], history: int) -> dict:
    """Restore `saved` for the document's first `history` tokens, prefill the rest with
    logprobs, generate greedily."""
    slot, cached = engine.open(doc, restore=saved)
    if cached != history:
        raise RuntimeError(f"restored {cached} tokens, expected {history}")
    lps, top1, token = prefill(engine, slot, doc, history, targets=True)
    greedy = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    key, out = engine.request_key(0), [token]
    for i in range(1, NEW_TOKENS):
        _, (s,) = engine.step([], [Row(slot, [out[-1]], greedy, key, i)])
        out.append(s.token)
    engine.close(slot, keep=False)
    # the last position predicts nothing: the turn's predictions are positions [0, n - 1)
    return {"logprobs": lps[:-1], "top1": top1[:-1], "greedy": out}


def shared_entry(saved: SavedPages, pairs, t: float, retain: float) -> tuple[SavedPages, dict]:
    """`saved` (a float pool's blocks [n, L, Hkv, page, D]) with each pair's keys and values
    merged and expanded back; and the fraction of vectors retained per side."""
    arrays = {f: np.array(x) for f, x in saved.arrays.items()}
    kept = {"k": [], "v": []}
    for side in ("k", "v"):
        x = arrays[side]
        for i, j in pairs:
            m = merge_pair(jnp.asarray(x[:, i]), jnp.asarray(x[:, j]), t=t, retain=retain)
            x[:, i], x[:, j] = np.asarray(expand(m, "a")), np.asarray(expand(m, "b"))
            kept[side].append(float(jnp.mean(m.retained)))
    return SavedPages(saved.num_blocks, arrays, saved.hashes, exact_blocks=0), kept


def entry_bytes(fmt_name: str, cfg, pairs: int, retained: dict) -> float:
    """Bytes per token of an idle conversation's entry in format `fmt_name`, with `pairs`
    layer pairs sharing: a shared vector once, float16 magnitudes for both layers, retained
    vectors whole again for the second layer with a 2-byte index."""
    fmt = KV_FORMATS[fmt_name]
    d, heads, layers = cfg.head_dim, cfg.num_kv_heads, cfg.num_layers
    # bytes of one (token, head) vector per side, its scales included (key scales per page
    # channel spread over the page's tokens)
    def side(bits: int, per_token_scales: bool) -> float:
        if bits == 16:
            return 2.0 * d
        scales = 4.0 * d / fmt.group if per_token_scales else 4.0 * d / PAGE
        return d * bits / 8 + scales
    k, v = side(fmt.k_bits, fmt.token_keys), side(fmt.v_bits, True)
    full = layers * heads * (k + v)
    if not pairs:
        return full
    saved = 0.0
    for vec, kept in ((k, np.mean(retained["k"])), (v, np.mean(retained["v"]))):
        saved += heads * pairs * (vec - 2 * 2.0 - kept * (vec + 2.0))
    return full - saved


# ---------------------------------------------------------------------------- main

def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--history", type=int, default=1536,
                    help="tokens of each document held as the idle conversation (a multiple "
                         "of the page size); the next turn is the rest of --doc-tokens")
    ap.add_argument("--doc-tokens", type=int, default=2048, help="tokens of each document")
    ap.add_argument("--ratios", default="0.2,0.4,0.6",
                    help="fractions of the layers that share (Krul's r_l), comma-separated")
    ap.add_argument("--gammas", default="0.5",
                    help="Krul's gamma: layers with less edge mass never share")
    ap.add_argument("--retain", default="0.1",
                    help="fractions of vectors kept whole (MiniCache's retention)")
    ap.add_argument("--t", type=float, default=0.5, help="SLERP position between the layers")
    ap.add_argument("--stride", type=int, default=4,
                    help="every stride-th query's attention goes into the distances")
    ap.add_argument("--bytes-format", default="bf16", choices=sorted(KV_FORMATS),
                    help="the KV format the entry's bytes are counted in")
    ap.add_argument("--docs", choices=("evaluation", "calibration"), default="evaluation")
    add_out_argument(ap, "kv_sharing")
    args = ap.parse_args()
    if args.history % PAGE or not 0 < args.history < args.doc_tokens:
        ap.error(f"--history must be a positive multiple of {PAGE} below --doc-tokens")

    cfg, params = load_params(None, jnp.float32)
    tokenizer = load_tokenizer(default_model_path())
    docs = documents(tokenizer, args.doc_tokens, args.docs)
    engine = make_engine(cfg, params, args.doc_tokens + NEW_TOKENS + PAGE)
    ratios = [float(r) for r in args.ratios.split(",")]
    gammas = [float(g) for g in args.gammas.split(",")]
    retains = [float(r) for r in args.retain.split(",")]

    rows: dict[str, dict] = {}
    patterns = {}
    for name, doc in tqdm(docs.items(), desc="documents", unit="doc"):
        history = doc[:args.history]
        slot, _ = engine.open(history)
        prefill(engine, slot, history, 0, targets=False)
        saved = engine.save_pages(slot)
        engine.close(slot, keep=False)
        mass, keys, distance = attention_patterns(params, cfg, history, args.stride)
        # the explicit forward must be the engine's: its keys against the saved pages
        pool_keys = np.moveaxis(np.asarray(saved.arrays["k"]), (0, 3), (1, 2)).reshape(
            cfg.num_layers, -1, cfg.num_kv_heads, cfg.head_dim)
        err = float(np.max(np.abs(pool_keys - keys)))
        if err > 1e-2:
            raise RuntimeError(f"the explicit forward's keys differ from the pool's by {err}")
        patterns[name] = {"edge_mass": mass.round(4).tolist(),
                          "distance": distance.round(4).tolist()}
        base = continue_turn(engine, saved, doc, args.history)
        settings = [("none", [], 0.0)]
        for r in ratios:
            for retain in retains:
                for g in gammas:
                    settings.append((f"krul:{g}:{r}:{retain}",
                                     select_pairs(distance, ir_layers(mass, g), r), retain))
                settings.append((f"deepest:{r}:{retain}", deepest_pairs(cfg.num_layers, r),
                                 retain))
        for label, pairs, retain in tqdm(settings, desc=name, unit="setting", leave=False):
            entry, kept = shared_entry(saved, pairs, args.t, retain)
            out = continue_turn(engine, entry, doc, args.history)
            ppl = math.exp(-np.mean(out["logprobs"]))
            ppl0 = math.exp(-np.mean(base["logprobs"]))
            same = [a == b for a, b in zip(out["greedy"], base["greedy"], strict=True)]
            row = rows.setdefault(label, {"docs": {}})
            row["docs"][name] = {
                "pairs": [list(p) for p in pairs],
                "bytes_ratio": entry_bytes(args.bytes_format, cfg, 0, kept)
                / entry_bytes(args.bytes_format, cfg, len(pairs), kept),
                "retained": {s: float(np.mean(v)) if v else 0.0 for s, v in kept.items()},
                "perplexity_change": ppl / ppl0 - 1,
                "top1_agreement": float(np.mean(np.equal(out["top1"], base["top1"]))),
                "greedy_agreement": float(np.mean(same)),
                "first_difference": same.index(False) if False in same else len(same)}
    for row in rows.values():
        for key in ("bytes_ratio", "perplexity_change", "top1_agreement", "greedy_agreement"):
            row[key] = float(np.mean([d[key] for d in row["docs"].values()]))

    print(f"\n| setting (policy:gamma:ratio:retain) | bytes saved x ({args.bytes_format}) | "
          "ppl change | top-1 | greedy |")
    print("|---|---|---|---|---|")
    for label, r in rows.items():
        print(f"| {label} | {r['bytes_ratio']:.3f} | {100 * r['perplexity_change']:+.2f}% | "
              f"{r['top1_agreement']:.3f} | {r['greedy_agreement']:.3f} |")
    result = {"device": jax.devices()[0].device_kind, "jax": jax.__version__,
              "documents": args.docs, "history": args.history, "doc_tokens": args.doc_tokens,
              "t": args.t, "stride": args.stride, "bytes_format": args.bytes_format,
              "patterns": patterns, "rows": rows}
    write_results(args.out, "kv_sharing", result, args)


if __name__ == "__main__":
    main()
