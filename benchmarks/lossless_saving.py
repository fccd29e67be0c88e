"""How much Krul's lossless saving leaves out of stored entries, at the rates restore.py
measured: the front of each layer a split restore would recompute (the planner's share,
`planned_split`, laid out as the engine's pyramid), as a share of the entry's bytes.

    python benchmarks/lossless_saving.py benchmarks/results/restore/restore-*.json

An entry keeps only what the split restore loads (`jkv.store.fronts`); the share is the one
restore planning computes from the engine's and the store's measured rates (a CPU's runs
plan none: there a split only interpolates). Writes
benchmarks/results/lossless_saving/lossless_saving-<date>.json.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from harness import add_out_argument, write_results

from jkv.config import PRESETS
from jkv.engine.saved_pages import pyramid, split_chunk

PAGE = 16  # restore.py's page size


def rows_of(path: Path) -> list[dict]:
    """Per history length of one restore.py result: the blocks each layer leaves out and
    their share of the entry's bytes."""
    result = json.loads(path.read_text())
    preset = result["args"].get("preset")
    layers = PRESETS[preset].num_layers if preset else 30  # the default model: SmolLM2
    chunk = split_chunk(result["args"]["prefill_chunk"], PAGE)
    out = []
    for r in result["rows"]:
        blocks = r["history_tokens"] // PAGE
        share = r.get("planned_split") or 0.0
        front = pyramid(0, blocks, layers, share, chunk) if share else None
        left = 0.0 if front is None else float(front.sum()) / (blocks * layers)
        out.append({"source": path.name, "device": result.get("device"),
                    "model": result.get("model"), "history_tokens": r["history_tokens"],
                    "planned_split": share, "share_left_out": left,
                    "bytes_left_out": int(r["entry_bytes"] * left),
                    "entry_bytes": r["entry_bytes"]})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("results", nargs="+", type=Path, help="restore.py result JSONs")
    add_out_argument(ap, "lossless_saving")
    args = ap.parse_args()
    rows = [row for path in args.results for row in rows_of(path)]
    print(f"{'device':14} {'model':10} {'tokens':>7} {'planned r':>9} {'left out':>9} "
          f"{'MB left out':>11}")
    for r in rows:
        print(f"{str(r['device']):14} {str(r['model']):10} {r['history_tokens']:>7} "
              f"{r['planned_split']:>9.3f} {r['share_left_out']:>8.1%} "
              f"{r['bytes_left_out'] / 1e6:>11.1f}")
    write_results(args.out, "lossless_saving", {"rows": rows}, args)


if __name__ == "__main__":
    main()
