"""The benchmarks' shared harness: where a script's results go (`--out`), the results JSON
(the run's date, machine and versions beside what it measured) and its plot.

Every script writes into `benchmarks/results/<script>/` by default; `python
benchmarks/plots.py` draws any of those JSONs again, and the figures docs/results.md shows.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

from plots import RESULTS, draw, kind


def add_out_argument(ap: argparse.ArgumentParser, benchmark: str) -> None:
    """`--out DIR`, by default benchmarks/results/<benchmark>/ (the script's own folder)."""
    ap.add_argument("--out", type=Path, default=RESULTS / benchmark,
                    help=f"directory for the results (default: benchmarks/results/{benchmark})")


def cpu_model() -> str:
    """The CPU's model name as `lscpu` gives it (the part decides CPU timings: ISA, cache)."""
    try:
        text = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        text = ""
    for line in text.splitlines():
        if line.startswith("Model name:"):
            return line.split(":", 1)[1].strip()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def environment() -> dict:
    """Date, machine and versions of this run. JAX's version and device only where the
    script imported JAX (a client of a server has the server's device in its result)."""
    env = {"date": datetime.date.today().isoformat(),
           "time": datetime.datetime.now().isoformat(timespec="seconds"),
           "platform": platform.platform(), "python": platform.python_version(),
           "cpu": cpu_model(), "cpu_count": os.cpu_count()}
    jax = sys.modules.get("jax")
    if jax is not None:
        env |= {"jax": jax.__version__, "backend": jax.default_backend(),
                "device": jax.devices()[0].device_kind}
    return env


def write_results(out: Path, stem: str, result: dict, args: argparse.Namespace | None,
                  over: Path | None = None) -> Path:
    """Write `out`/<stem>-<date>.json: the result over the run's environment, with the
    arguments (`out` left out) and `benchmark` (by default the stem up to its first '-');
    then its plot beside it where plots.py has one for it. A result already there is kept:
    the new one is <stem>-<date>-2 (or the first free number). `over`, a path this run wrote
    before, is replaced instead (a run that writes what it has so far, so a time limit cuts
    it short without losing what finished). Prints where and returns the JSON's path."""
    env = environment()
    result = {"benchmark": stem.split("-")[0], **env, **result, "date": env["date"]}
    if args is not None:
        result["args"] = {k: v for k, v in vars(args).items() if k != "out"}
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    name, n = f"{stem}-{env['date']}", 1
    while over is None and (out / f"{name}.json").exists():
        n += 1
        name = f"{stem}-{env['date']}-{n}"
    path = Path(over) if over is not None else out / f"{name}.json"
    path.write_text(json.dumps(result, indent=2, default=str) + "\n")  # paths as text
    print(f"wrote {path}")
    plot_beside(path, result)
    return path


def plot_beside(path: Path, result: dict) -> None:
    """The result's figure as <path>.svg, where plots.py draws its benchmark. Without
    matplotlib (the `bench` extra), or if the figure fails on a partial result, a line says
    so: the measurement goes on (a run writing after each step must not stop for a plot)."""
    if kind(path, result) is None:
        return
    try:
        svg = draw([path], path.with_suffix(".svg"))
    except Exception as e:  # any plotting error: the JSON is written already
        hint = "pip install -e '.[bench]'" if isinstance(e, ImportError) else repr(e)
        print(f"no plot ({hint}); draw it later with: python benchmarks/plots.py {path}")
        return
    print(f"wrote {svg}")
