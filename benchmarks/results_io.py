"""Writing a benchmark's results: one JSON (with the run's date and platform) and one SVG."""

from __future__ import annotations

import argparse
import datetime
import json
import platform
from pathlib import Path


def write_results(out: Path, stem: str, result: dict, svg: str,
                  args: argparse.Namespace) -> None:
    """Write `out`/<stem>-<date>.json (result + date, platform and the arguments, `out`
    left out) and the SVG beside it; print where."""
    date = datetime.date.today().isoformat()
    result = {**result, "date": date, "platform": platform.platform(),
              "args": {k: v for k, v in vars(args).items() if k != "out"}}
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{stem}-{date}.json"
    path.write_text(json.dumps(result, indent=2) + "\n")
    (out / f"{stem}-{date}.svg").write_text(svg)
    print(f"wrote {path} and {path.with_suffix('.svg')}")
