"""Plots of benchmark results, drawn from the committed JSON (matplotlib: the `bench` extra).

    python benchmarks/plots.py                      # every figure docs/results.md shows
    python benchmarks/plots.py RESULT.json [...]    # one figure of these results (one
                                                    # benchmark), beside the first; --out FILE

A benchmark's figure is FIGURES[<its script's name>] (figures.py's and figures_cluster.py's):
the JSON's `benchmark`, else the folder it sits in (benchmarks/results/<script>/). Several
results make one row of panels each (a CPU run above a GPU run), except in a POOLED figure,
which draws them all in one. SVGs are written without a date, so the same JSON draws the
same file.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import figures  # noqa: E402
import figures_cluster  # noqa: E402

FIGURES = {**figures.FIGURES, **figures_cluster.FIGURES}
POOLED = figures_cluster.POOLED  # (the others: a row of panels per result)

RESULTS = Path(__file__).resolve().parent / "results"  # a folder per script (harness.py)
DOCS = Path(__file__).resolve().parents[1] / "docs" / "results"

# docs/results/<file>: the results (under benchmarks/results/) it is drawn from
DOC_FIGURES: dict[str, tuple[str, ...]] = {
    "kv_fidelity.svg": ("kv_fidelity/kv_fidelity-2026-11-26.json",),
    "kv_budget.svg": ("kv_budget/kv_budget-cpu-2026-11-27-2.json",
                      "kv_budget/kv_budget-nvidia_h200-llama3-8b-2026-11-26.json"),
    "tier_cost.svg": ("tier_cost/tier_cost-cpu-2026-11-27-2.json",
                      "tier_cost/tier_cost-nvidia_h200-llama3-8b-2026-11-26.json"),
    "adaptcache_documents.svg": (
        "store_sim/store_sim-adaptcache-documents-2026-11-29-half-life-auto.json",),
    "adapt_orders.svg": ("adapt_orders/adapt_orders-2026-11-29-defaults.json",),
    "layer_offload.svg": ("layer_offload/layer_offload-cpu-2026-11-27-layer-major.json",
                          "layer_offload/layer_offload-nvidia_h200-llama3-8b-2026-11-28.json"),
    "serve_slo.svg": ("serve_slo/serve_slo-cpu-2026-11-29-decode-heavy-24-seed2-rows.json",
                      "serve_slo/serve_slo-nvidia_h200-llama3-8b-2026-12-04.json"),
    "serve_replay.svg": ("serve_replay/serve_replay-cpu-smollm2-f32-2026-11-28-4-64req.json",
                         "serve_replay/serve_replay-h200-llama3-8b-2026-11-28-2.json"),
    "restore.svg": ("restore/restore-cpu-2026-11-27.json",
                    "restore/restore-nvidia_h200-llama3-8b-2026-12-04.json"),
    "store_sim.svg": ("store_sim/store_sim-2026-11-23.json",),
    "serve_store.svg": ("serve/serve-cpu-2026-11-27-store.json",),
    "serve_prefix.svg": ("serve/serve-nvidia_h100_80gb_hbm3-2026-11-23.json",
                         "serve/serve-cpu-2026-11-24.json"),
    "decode_attention.svg": (
        "decode_attention/decode_attention-sweep-NVIDIA_H200-2026-11-27-dequant.json",),
    "cpu_throughput.svg": ("cpu_throughput/cpu_throughput-2026-11-24-2.json",
                           "cpu_throughput/cpu_throughput-2026-11-28-avx2.json"),
    "kv_sharing.svg": ("kv_sharing/kv_sharing-2026-11-27.json",),
    "kv_frontier.svg": ("kv_frontier/kv_frontier-2026-12-03.json",),
    "cluster.svg": ("cluster/cluster-cpu-2026-12-03-host-sweep.json",
                    "cluster/cluster-cpu-2026-12-04-host-64mib.json",
                    "cluster/cluster-cpu-2026-12-04-kv-host-96-128mib.json",
                    "cluster/cluster-cpu-2026-12-04-pow2-prefix-host-96mib.json",
                    "cluster/cluster-cpu-2026-12-04-kv-common-prefix-64-96mib.json",
                    "cluster/cluster-cpu-2026-12-04-kv-common-prefix-128mib.json"),
    "cluster_sim.svg": ("cluster_sim/cluster_sim-2026-12-04.json",),
}


def kind(path: Path, result: dict) -> str | None:
    """The benchmark whose figure draws this result, or None where there is none."""
    for name in (result.get("benchmark", ""), Path(path).parent.name, Path(path).name):
        if name.split("-")[0] in FIGURES:
            return name.split("-")[0]
    return None


def figure(paths: list[Path]):
    """The matplotlib Figure of the results at `paths` (all of one benchmark)."""
    results = [json.loads(Path(p).read_text()) for p in paths]
    kinds = {kind(p, r) for p, r in zip(paths, results, strict=True)}
    if len(kinds) != 1 or None in kinds:
        raise ValueError(f"paths: need results of one benchmark with a figure "
                         f"({sorted(FIGURES)}), got {sorted(map(str, kinds))}")
    return FIGURES[kinds.pop()](results)


def draw(paths: list[Path], target: Path) -> Path:
    """One figure of the results at `paths` (all of one benchmark), saved at `target`."""
    import matplotlib

    fig = figure(paths)
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    with matplotlib.rc_context({"svg.hashsalt": "jkv", "svg.fonttype": "none"}):
        fig.savefig(target, metadata={"Date": None} if target.suffix == ".svg" else None)
    return target


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("results", nargs="*", type=Path,
                    help="result JSONs of one benchmark (none: every figure of the docs)")
    ap.add_argument("--out", type=Path,
                    help="where the figure goes (.svg or .png; default: beside the first "
                         "JSON; without results: the docs' folder)")
    args = ap.parse_args()
    if args.results:
        print(f"wrote {draw(args.results, args.out or args.results[0].with_suffix('.svg'))}")
        return
    for name, paths in DOC_FIGURES.items():
        print(f"wrote {draw([RESULTS / p for p in paths], (args.out or DOCS) / name)}")


if __name__ == "__main__":
    main()
