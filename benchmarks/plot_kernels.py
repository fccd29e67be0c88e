"""Plot a `benchmarks/kernels.py` result as an SVG (no plotting library needed).

    python benchmarks/plot_kernels.py benchmarks/results/kernels-<device>-<date>.json

One group of bars per (batch, context), one bar per implementation: KV bytes read per second
as a fraction of the device-to-device copy bandwidth measured in the same run. Writes the SVG
next to the JSON.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

COLORS = ["#4e79a7", "#f28e2b", "#e15759", "#76b7b2", "#59a14f", "#edc948", "#b07aa1",
          "#ff9da7", "#9c755f", "#bab0ac"]


def label(row: dict) -> str:
    """The bar's name: the impl, and the page-table layout where a sweep timed it adjacent."""
    return row["impl"] + (" (adjacent pages)" if row.get("table") == "contiguous"
                          and row["impl"].startswith("jkv") else "")


def svg(result: dict) -> str:
    rows = result["results"]
    cases = sorted({(r["batch"], r["context"]) for r in rows})
    impls = list(dict.fromkeys(label(r) for r in rows))
    value = {(r["batch"], r["context"], label(r)): r["fraction_of_copy"] for r in rows}
    top = max(1.0, max(value.values()))
    bar, gap, left, height, base = 10, 16, 60, 260, 300
    width = left + len(cases) * (len(impls) * bar + gap) + 180
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{base + 70}" '
           'font-family="sans-serif" font-size="11">',
           f'<text x="{left}" y="16" font-size="13">decode attention: KV bytes/s as a fraction '
           f'of copy bandwidth ({result["copy_bytes_per_s"] / 1e9:.0f} GB/s), '
           f'{result["device"]}, jax {result["jax"]}, {result["date"]}</text>']
    for tick in range(0, int(top * 4) + 1):
        f = tick / 4
        y = base - f / top * height
        out.append(f'<line x1="{left}" x2="{width - 180}" y1="{y:.1f}" y2="{y:.1f}" '
                   'stroke="#ddd"/>')
        out.append(f'<text x="{left - 6}" y="{y + 4:.1f}" text-anchor="end">{f:.2f}</text>')
    for c, (b, ctx) in enumerate(cases):
        x0 = left + c * (len(impls) * bar + gap) + gap / 2
        for i, impl in enumerate(impls):
            v = value.get((b, ctx, impl))
            if v is None:
                continue
            h = v / top * height
            out.append(f'<rect x="{x0 + i * bar:.1f}" y="{base - h:.1f}" width="{bar - 1}" '
                       f'height="{h:.1f}" fill="{COLORS[i % len(COLORS)]}"><title>{impl} '
                       f'B={b} ctx={ctx}: {v:.3f}</title></rect>')
        out.append(f'<text x="{x0 + len(impls) * bar / 2:.1f}" y="{base + 14}" '
                   f'text-anchor="middle">B{b}</text>')
        out.append(f'<text x="{x0 + len(impls) * bar / 2:.1f}" y="{base + 28}" '
                   f'text-anchor="middle">{ctx // 1024 or ctx}{"K" if ctx >= 1024 else ""}'
                   '</text>')
    for i, impl in enumerate(impls):
        y = 40 + i * 16
        out.append(f'<rect x="{width - 170}" y="{y - 9}" width="10" height="10" '
                   f'fill="{COLORS[i % len(COLORS)]}"/>')
        out.append(f'<text x="{width - 155}" y="{y}">{impl}</text>')
    out.append("</svg>")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("result", help="a JSON written by benchmarks/kernels.py")
    args = ap.parse_args()
    path = Path(args.result)
    out = path.with_suffix(".svg")
    out.write_text(svg(json.loads(path.read_text())))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
