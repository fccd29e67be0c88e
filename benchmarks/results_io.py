"""Writing a benchmark's results: one JSON (with the run's date and platform) and one SVG."""

from __future__ import annotations

import argparse
import datetime
import json
import platform
from pathlib import Path


def write_results(out: Path, stem: str, result: dict, svg: str | None,
                  args: argparse.Namespace, over: Path | None = None) -> Path:
    """Write `out`/<stem>-<date>.json (result + date, platform and the arguments, `out`
    left out) and the SVG beside it (if any); print where and return the JSON's path. A
    result already there is kept: the new one is <stem>-<date>-2 (or the first free number).
    `over`, a path this run wrote before, is replaced instead (a run that writes what it has
    so far, so a time limit cuts it short without losing what finished)."""
    date = datetime.date.today().isoformat()
    result = {**result, "date": date, "platform": platform.platform(),
              "args": {k: v for k, v in vars(args).items() if k != "out"}}
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    name, n = f"{stem}-{date}", 1
    while over is None and ((out / f"{name}.json").exists() or (out / f"{name}.svg").exists()):
        n += 1
        name = f"{stem}-{date}-{n}"
    path = Path(over) if over is not None else out / f"{name}.json"
    path.write_text(json.dumps(result, indent=2) + "\n")
    if svg is None:
        print(f"wrote {path}")
        return path
    path.with_suffix(".svg").write_text(svg)
    print(f"wrote {path} and {path.with_suffix('.svg')}")
    return path


def svg_legend(colors: dict[str, str], x: float, top: float) -> list[str]:
    """SVG elements of a legend: a colored square and its label per entry, one per line."""
    out = []
    for i, (label, color) in enumerate(colors.items()):
        y = top + 10 + i * 18
        out.append(f'<rect x="{x}" y="{y - 10}" width="12" height="12" fill="{color}"/>'
                   f'<text x="{x + 18}" y="{y}">{label}</text>')
    return out
