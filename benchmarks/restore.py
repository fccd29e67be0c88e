"""Time to first token of a follow-up turn: its history restored from a store tier against
recomputed, side by side in one run on the same engine and inputs.

    python benchmarks/restore.py                       # SmolLM2 (embedded), 1K/2K/4K histories
    python benchmarks/restore.py --lengths 2048 --kv-format k8v4 --repeats 5

For each history length: a first engine prefills the history and saves its full pages
(`Engine.save_pages`), encoded as a store entry (`jkv.store.codec`) into the host tier and
into a persistent tier (tensorstore OCDBT in a temporary directory). Then, on one engine with
prefix caching off, the follow-up prompt (history + --new-tokens) is timed to its first token
three ways: recomputing the whole prompt; reading the entry from the host tier, decoding it,
writing the pages and prefilling the new tokens; the same from the persistent tier. Each is
run once untimed first (compilation), then --repeats times; the median is reported.

Prints a table and writes benchmarks/results/restore-<device>-<date>.json and an SVG.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

import numpy as np
from results_io import svg_legend, write_results
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from jkv.config import CacheConfig, KVFormat  # noqa: E402
from jkv.engine import Engine, Row, SavedPages  # noqa: E402
from jkv.models.params_cache import load_params  # noqa: E402
from jkv.sampling import SamplingParams  # noqa: E402
from jkv.store.codec import EntryInfo, decode, encode  # noqa: E402
from jkv.store.tiers import HostTier, PersistentTier  # noqa: E402

GREEDY = SamplingParams(max_tokens=1, temperature=0)


def first_token(eng: Engine, prompt: list[int], restore: SavedPages | None = None) -> int:
    """Open, prefill what is not held, return the first sampled token; closes the slot."""
    slot, cached = eng.open(prompt, restore=restore)
    key = eng.request_key(0)
    while cached < len(prompt):
        chunk = prompt[cached: cached + eng.prefill_chunk]
        (s,), _ = eng.step([Row(slot, chunk, GREEDY, key, 0)], [])
        cached += len(chunk)
    eng.close(slot)
    return s.token


def to_entry(saved: SavedPages, model: str, kv_format: str, page_size: int) -> bytes:
    hashes = np.frombuffer(b"".join(saved.hashes), np.uint8).reshape(saved.num_blocks, -1)
    info = EntryInfo(model, kv_format, page_size, saved.num_blocks * page_size,
                     saved.hashes[-1].hex())
    return encode(info, {**saved.arrays, "block_hashes": hashes})


def from_entry(data: bytes, model: str, kv_format: str) -> SavedPages:
    _, arrays = decode(data, model=model, kv_format=kv_format)
    arrays = dict(arrays)
    hashes = [row.tobytes() for row in arrays.pop("block_hashes")]
    return SavedPages(len(hashes), arrays, hashes)


def restored(eng: Engine, prompt: list[int], tier, name: str, model: str,
             kv_format: str) -> int:
    """First token of `prompt` with its history read from `tier`, decoded and restored."""
    return first_token(eng, prompt, restore=from_entry(tier.get(name), model, kv_format))


def svg_bars(rows: list[dict], title: str) -> str:
    colors = {"recompute": "#d62728", "host": "#1f77b4", "disk": "#ff7f0e"}
    w, h, left, bottom, top, bar = 120 + 150 * len(rows), 320, 60, 50, 40, 34
    peak = max(r[f"{k}_ms"] for r in rows for k in colors)
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" '
           'font-family="sans-serif" font-size="12">',
           f'<text x="{w / 2}" y="20" text-anchor="middle" font-size="14">{title}</text>']
    scale = (h - bottom - top) / peak
    for frac in (0, 0.25, 0.5, 0.75, 1.0):
        y = h - bottom - frac * peak * scale
        out.append(f'<line x1="{left}" x2="{w - 100}" y1="{y}" y2="{y}" stroke="#ddd"/>'
                   f'<text x="{left - 6}" y="{y + 4}" text-anchor="end">'
                   f'{frac * peak:.0f} ms</text>')
    for g, r in enumerate(rows):
        x0 = left + 15 + g * 150
        for i, k in enumerate(colors):
            v = r[f"{k}_ms"] * scale
            out.append(f'<rect x="{x0 + i * (bar + 4)}" y="{h - bottom - v}" width="{bar}" '
                       f'height="{v}" fill="{colors[k]}"/>')
        out.append(f'<text x="{x0 + 55}" y="{h - bottom + 16}" text-anchor="middle">'
                   f'{r["history_tokens"]} tokens</text>')
    out += svg_legend(colors, w - 90, top)
    out.append("</svg>")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--model", default=None,
                    help="a .gguf file or HF model directory; default: embedded SmolLM2")
    ap.add_argument("--lengths", default="1024,2048,4096", help="history lengths in tokens")
    ap.add_argument("--new-tokens", type=int, default=84,
                    help="tokens of the follow-up message (ShareGPT's mean user turn)")
    ap.add_argument("--kv-format", default="auto", help="KV format of the pages and entries")
    ap.add_argument("--prefill-chunk", type=int, default=512, help="engine prefill chunk")
    ap.add_argument("--repeats", type=int, default=3, help="timed runs per setting")
    ap.add_argument("--seed", type=int, default=0, help="seed of the random token ids")
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results",
                    help="directory for the JSON and SVG results")
    args = ap.parse_args()
    lengths = [int(x) for x in args.lengths.split(",")]
    cfg, params = load_params(args.model, jnp.bfloat16 if jax.default_backend() != "cpu"
                              else jnp.float32)
    fmt = KVFormat.parse(args.kv_format)
    max_len = max(lengths) + args.new_tokens + 16

    def make_engine(**kw) -> Engine:
        return Engine(cfg, params, cache=CacheConfig(page_size=16, kv_cache_bytes=2_000_000_000,
                                                     kv_format=fmt),
                      max_model_len=max_len, max_num_seqs=2, prefill_chunk=args.prefill_chunk,
                      **kw)

    rng = np.random.default_rng(args.seed)
    timed = make_engine(enable_prefix_caching=False)
    model_id = f"{args.model}|{cfg}"
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        host, disk = HostTier(2**34), PersistentTier(tmp, 2**40)
        for length in tqdm(lengths, desc="history lengths"):
            history = rng.integers(0, cfg.vocab_size, length).tolist()
            follow_up = history + rng.integers(0, cfg.vocab_size, args.new_tokens).tolist()
            saver = make_engine()
            slot, _ = saver.open(history)
            key = saver.request_key(0)
            for i in range(0, length, args.prefill_chunk):
                saver.step([Row(slot, history[i: i + args.prefill_chunk], GREEDY, key, 0)], [])
            saved = saver.save_pages(slot)
            t0 = time.perf_counter()
            data = to_entry(saved, model_id, fmt.name, 16)
            encode_ms = (time.perf_counter() - t0) * 1e3
            name = f"h{length}"
            host.put(name, data)
            disk.put(name, data)
            del saver

            runs = {"recompute": partial(first_token, timed, follow_up),
                    "host": partial(restored, timed, follow_up, host, name, model_id, fmt.name),
                    "disk": partial(restored, timed, follow_up, disk, name, model_id, fmt.name)}
            times, tokens = {}, {}
            for k, fn in runs.items():
                tokens[k] = fn()  # compiles this path's shapes
                samples = []
                for _ in range(args.repeats):
                    t0 = time.perf_counter()
                    fn()
                    samples.append((time.perf_counter() - t0) * 1e3)
                times[k] = float(np.median(samples))
            rows.append({"history_tokens": length, "entry_bytes": len(data),
                         "encode_ms": encode_ms,
                         **{f"{k}_ms": v for k, v in times.items()},
                         "speedup_host": times["recompute"] / times["host"],
                         "speedup_disk": times["recompute"] / times["disk"],
                         "same_first_token": len(set(tokens.values())) == 1})
    print(f"{'history':>8}{'entry MB':>10}{'recompute':>11}{'host':>9}{'disk':>9}"
          f"{'host x':>8}{'disk x':>8}  same token")
    for r in rows:
        print(f"{r['history_tokens']:>8}{r['entry_bytes'] / 1e6:>10.1f}"
              f"{r['recompute_ms']:>9.0f}ms{r['host_ms']:>7.0f}ms{r['disk_ms']:>7.0f}ms"
              f"{r['speedup_host']:>8.1f}{r['speedup_disk']:>8.1f}  {r['same_first_token']}")
    device = jax.devices()[0]
    tag = "cpu" if device.platform == "cpu" else device.device_kind.replace(" ", "_").lower()
    svg = svg_bars(rows, f"TTFT of a follow-up (+{args.new_tokens} tokens), "
                         f"{args.kv_format} KV, median of {args.repeats}")
    write_results(args.out, f"restore-{tag}", {"benchmark": "restore",
                                               "device": device.device_kind,
                                               "jax": jax.__version__, "rows": rows}, svg, args)

if __name__ == "__main__":
    main()
