"""The figures of the cluster benchmarks: cluster.py's routers over host tier sizes, and
cluster_sim.py's 8 to 64 simulated replicas (plots.py adds FIGURES to figures.FIGURES)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np
from figures import COLORS, grid, log_scale

if TYPE_CHECKING:
    from matplotlib.figure import Figure


def cluster(results: list[dict]) -> Figure:
    """Against each replica's host tier size, a line per router: prefix hit tokens, and the
    KV-aware router's over each other router's. One panel pair for all `results` (runs of one
    workload at different sizes); a size run twice keeps its later run."""
    fig, [[hits, ratio]] = grid(results[:1], 2)
    runs = {(x["router"], x["replicas"], x["host_cache_bytes"] / 2**20): x["prefix_hit_tokens"]
            for r in results for x in r["rows"]
            if "error" not in x and x.get("host_cache_bytes")}
    kv = {size: hit for (router, n, size), hit in runs.items() if router == "kv" and n > 1}
    for i, (router, n) in enumerate(dict.fromkeys((r, n) for r, n, _ in runs)):
        name = f"{router}, {n} replica{'s' if n > 1 else ''}"
        mine = sorted((size, hit) for (r, m, size), hit in runs.items() if (r, m) == (router, n))
        hits.plot(*zip(*mine, strict=True), marker="o", markersize=3,
                  color=COLORS[i % len(COLORS)], label=name)
        shares = [(size, kv[size] / hit) for size, hit in mine if size in kv]
        if router != "kv" and shares:
            ratio.plot(*zip(*shares, strict=True), marker="o", markersize=3,
                       color=COLORS[i % len(COLORS)], label=f"kv / {name}")
    hits.set_ylabel("prefix hit tokens")
    ratio.set_ylabel("kv's hit tokens / the router's")
    ratio.axhline(1.0, color="#999", lw=0.8)
    for ax in (hits, ratio):
        ax.set_xlabel("host tier per replica (MiB)")
        ax.legend(fontsize=7)
    return fig


def cluster_sim(results: list[dict]) -> Figure:
    """Against the number of replicas, a line per router (solid: the shared tier, dashed:
    private disks): history tokens not recomputed, those from the device, TTFT p99, and the
    shared tier's read bandwidth and coordinator utilisation."""
    fig, axes = grid(results, 4, size=(3.9, 3.2))
    panels = (("history tokens hit (share)", lambda x: 1 - x["hit_share"]["recomputed"]),
              ("history tokens from the device", lambda x: x["hit_share"]["device"]),
              ("TTFT p99 (s)", lambda x: x["ttft_p99_s"]),
              ("shared tier: read bandwidth used", lambda x: x["store_read_utilisation"]))
    for r, row in zip(results, axes, strict=True):
        routers = list(dict.fromkeys(x["router"] for x in r["rows"]))
        for ax, (label, value) in zip(row, panels, strict=True):
            for i, router in enumerate(routers):
                for store, style in (("shared", "-"), ("private", "--")):
                    if label.startswith("shared") and store == "private":
                        continue
                    pts = sorted((x["replicas"], value(x)) for x in r["rows"]
                                 if x["router"] == router and x["store"] == store)
                    if pts:
                        ax.plot(*zip(*pts, strict=True), style, marker="o", markersize=3,
                                color=COLORS[i % len(COLORS)], label=f"{router}, {store}")
            ax.set_ylabel(label)
        coordinator: dict[int, list[float]] = {}
        for x in r["rows"]:
            if "coordinator_utilisation" in x:
                coordinator.setdefault(x["replicas"], []).append(x["coordinator_utilisation"])
        pts = sorted((n, float(np.mean(u))) for n, u in coordinator.items())
        if pts:
            row[3].plot(*zip(*pts, strict=True), ":", marker="s", markersize=3, color="#000",
                        label="coordinator (commits asked / its rate)")
        row[3].axhline(1.0, color="#999", lw=0.8)
        log_scale(row[2])
        replicas = sorted({x["replicas"] for x in r["rows"]})
        for ax in row:
            ax.set_xscale("log", base=2)
            ax.set_xticks(replicas, [str(n) for n in replicas])
            ax.set_xlabel("replicas")
        row[0].legend(fontsize=6)
        row[3].legend(fontsize=6)
    return fig


FIGURES: dict[str, Callable[[list[dict]], Figure]] = {"cluster": cluster,
                                                      "cluster_sim": cluster_sim}
POOLED = {"cluster"}  # figures drawing all their results in one row, not a row each
