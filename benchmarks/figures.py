"""One figure per benchmark, drawn with matplotlib from its results (a list: one row of panels
per result, e.g. a CPU run and a GPU run of the same benchmark). FIGURES maps a benchmark
(its script's name) to its drawing; plots.py picks one and saves it."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:  # matplotlib is imported when a figure is drawn (the `bench` extra)
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

COLORS = ["#4477aa", "#cc3311", "#228833", "#aa3377", "#ccbb44", "#66ccee", "#ee7733",
          "#777777", "#009988", "#000000", "#bbbbbb"]


def machine(r: dict) -> str:
    """Where a result ran: the accelerator, or the CPU (its model where the run recorded it);
    for a simulation, whose costs it modeled."""
    if r.get("modeled"):
        return f"modeled at {r['costs']}'s costs"
    if "device" not in r:
        return "simulated" if "trace" in r else "served and simulated"
    return (r.get("cpu") or "CPU") if r["device"] == "cpu" else r["device"]


def log_scale(ax: Axes, axis: str = "y") -> None:
    """A log axis labelled in plain numbers (1, 10, 0.1), not powers of ten."""
    from matplotlib.ticker import FormatStrFormatter, NullFormatter

    getattr(ax, f"set_{axis}scale")("log")
    scale = getattr(ax, f"{axis}axis")
    scale.set_major_formatter(FormatStrFormatter("%g"))
    scale.set_minor_formatter(NullFormatter())


def number(v: float) -> str:
    """A bar's value label: three significant digits, whole numbers from 1000 up."""
    return f"{v:.0f}" if abs(v) >= 1000 else f"{v:.3g}"


def grid(results: list[dict], cols: int, size=(4.6, 3.3)) -> tuple[Figure, np.ndarray]:
    """A figure with one row of `cols` panels per result, each row titled by its machine."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(size[0] * cols, size[1] * len(results)), layout="constrained")
    axes = fig.subplots(len(results), cols, squeeze=False)
    for r, row in zip(results, axes, strict=True):
        row[0].set_title(f"{machine(r)}, {r.get('date', '')}", loc="left", fontsize=9)
    return fig, axes


def bars(ax: Axes, groups: list[str], series: dict[str, list], ylabel: str,
         log: bool = False, values: bool = False) -> None:
    """Grouped bars: a group per entry of `groups`, a bar per series (None: no bar)."""
    width = 0.8 / max(len(series), 1)
    for i, (name, ys) in enumerate(series.items()):
        xs = [j + (i - (len(series) - 1) / 2) * width for j, y in enumerate(ys) if y is not None]
        drawn = ax.bar(xs, [y for y in ys if y is not None], width * 0.95, label=name,
                       color=COLORS[i % len(COLORS)])
        if values:
            ax.bar_label(drawn, fmt=number, fontsize=7)
    ax.set_xticks(range(len(groups)), groups, fontsize=8)
    ax.set_ylabel(ylabel)
    if log:
        log_scale(ax)
    ax.legend(fontsize=7)


def named_points(ax: Axes, points: dict[str, tuple[float, float]],
                 family: Callable[[str], str]) -> None:
    """A labelled point per name, colored by its family (one legend entry per family)."""
    colors: dict[str, str] = {}
    for name, (x, y) in points.items():
        fam = family(name)
        new = fam not in colors
        color = colors.setdefault(fam, COLORS[len(colors) % len(COLORS)])
        ax.scatter([x], [y], color=color, s=22, label=fam if new else None, zorder=3)
        ax.annotate(name, (x, y), textcoords="offset points", xytext=(4, 3), fontsize=6)
    ax.legend(fontsize=7)


def decode_attention(results: list[dict]) -> Figure:
    """Decode attention: each implementation's speed over jkv's bf16 pages, per shape."""
    fig, axes = grid(results, 1, size=(9.0, 3.4))
    for r, (ax,) in zip(results, axes, strict=True):
        def label(row: dict) -> str:
            name = row["impl"].removesuffix(f" {row.get('dequant')}")
            if row.get("dequant") and not name.endswith("bf16"):
                name += f", {row['dequant']} dequant"
            return name + (", adjacent pages" if row.get("table") == "contiguous" else "")
        shapes = sorted({(row["batch"], row["context"]) for row in r["results"]})
        base = {(row["batch"], row["context"]): row["seconds"] for row in r["results"]
                if row["impl"] == "jkv bf16" and row.get("table") != "contiguous"}
        speed = {(row["batch"], row["context"], label(row)): base[row["batch"], row["context"]]
                 / row["seconds"] for row in r["results"]}
        names = list(dict.fromkeys(label(row) for row in r["results"]))
        bars(ax, [f"batch {b} x {c // 1024}K" for b, c in shapes],
             {n: [speed.get((b, c, n)) for b, c in shapes] for n in names},
             "speed over jkv bf16 pages (x)")
        ax.axhline(1.0, color="#999", lw=0.8)
        ax.legend(fontsize=7, ncol=4, loc="upper center", bbox_to_anchor=(0.5, -0.1))
    return fig


def kv_fidelity(results: list[dict]) -> Figure:
    """KV bytes per token against the next tokens' perplexity change, per configuration."""
    fig, axes = grid(results, 1, size=(7.5, 4.6))
    for r, (ax,) in zip(results, axes, strict=True):
        points = {name: (row["bytes_vs_bf16"], 100 * row["perplexity_change"])
                  for name, row in r["rows"].items() if name != "none:auto"}
        named_points(ax, points, lambda name: name.split(":")[0])
        ax.axhline(0.0, color="#999", lw=0.8)
        ax.set_xlabel("KV bytes per token / bf16 pages")
        ax.set_ylabel("perplexity change (%)")
    return fig


def kv_budget(results: list[dict]) -> Figure:
    """At one KV budget: sequences running at once and decode tokens/s, per configuration."""
    fig, axes = grid(results, 2)
    for r, (left, right) in zip(results, axes, strict=True):
        names = list(r["rows"])
        bars(left, names, {"mean sequences": [r["rows"][n]["mean_sequences"] for n in names]},
             "sequences running (mean)", values=True)
        bars(right, names, {"decode tok/s": [r["rows"][n]["decode_tokens_per_s"]
                                             for n in names]}, "decode tokens/s", values=True)
    return fig


def tier_cost(results: list[dict]) -> Figure:
    """Decode step time per batch without tiers and under leankv, its tiering share marked."""
    fig, axes = grid(results, 1, size=(6.0, 3.4))
    for r, (ax,) in zip(results, axes, strict=True):
        rows = r["rows"]
        bars(ax, [f"batch {row['batch']}" for row in rows],
             {"none (k8v4t)": [row["none_k8v4t"]["decode_step_ms"] for row in rows],
              "leankv": [row["leankv"]["decode_step_ms"] for row in rows],
              "leankv's tiering": [row["leankv"]["tiering_ms"] for row in rows]},
             "ms per decode step", values=True)
    return fig


def layer_offload(results: list[dict]) -> Figure:
    """With layers' KV on the host: a decode step and a prefill over the resident ones."""
    fig, axes = grid(results, 1, size=(7.0, 3.4))
    for r, (ax,) in zip(results, axes, strict=True):
        rows = [row for row in r["rows"] if row["resident"] < r["layers"]
                and row.get("pinned", True)]
        bars(ax, [f"{row['length'] // 1024}K, {row['resident']}/{r['layers']} resident"
                  for row in rows],
             {"decode step": [row["decode_vs_resident"] for row in rows],
              "prefill, chunked": [row["prefill_vs_resident"] for row in rows],
              "prefill, layer-major": [row.get("layer_major_vs_resident") for row in rows]},
             "time over all layers resident (x)", values=True)
        ax.axhline(1.0, color="#999", lw=0.8)
    return fig


def restore(results: list[dict]) -> Figure:
    """A follow-up turn's TTFT: its history recomputed or restored (host, disk, layer-wise)."""
    fig, axes = grid(results, 1, size=(6.0, 3.4))
    for r, (ax,) in zip(results, axes, strict=True):
        rows = r["rows"]
        bars(ax, [f"{row['history_tokens']} tokens" for row in rows],
             {k: [row[f"{k}_ms"] for row in rows]
              for k in ("recompute", "host", "disk", "layerwise")},
             "TTFT (ms)", log=True, values=True)
    return fig


def serve(results: list[dict]) -> Figure:
    """Each setting's TTFT distribution over a multi-turn chat workload."""
    fig, axes = grid(results, 1, size=(6.0, 3.6))
    for r, (ax,) in zip(results, axes, strict=True):
        for i, (name, row) in enumerate(r["results"].items()):
            ttft = np.sort(row["ttft_all_s"])
            ax.step(ttft, np.arange(1, len(ttft) + 1) / len(ttft), where="post", label=name,
                    color=COLORS[i % len(COLORS)])
        log_scale(ax, "x")
        ax.set_xlabel("time to first token (s)")
        ax.set_ylabel("share of turns")
        ax.legend(fontsize=7)
    return fig


def serve_slo(results: list[dict]) -> Figure:
    """Per setting against the arrival rate: TTFT p99, TPOT p99 and the SLO miss rate."""
    fig, axes = grid(results, 3, size=(3.6, 3.2))
    panels = (("ttft_p99_s", "TTFT p99 (s)", 1), ("tpot_p99_s", "TPOT p99 (ms)", 1000),
              ("slo_violation_rate", "SLO misses (%)", 100))
    for r, row in zip(results, axes, strict=True):
        for ax, (key, label, scale) in zip(row, panels, strict=True):
            for i, (name, by_rate) in enumerate(r["results"].items()):
                pts = [(float(rate), v[key] * scale) for rate, v in by_rate.items()
                       if v.get(key) is not None]
                ax.plot(*zip(*pts, strict=True), marker="o", label=name,
                        color=COLORS[i % len(COLORS)])
            ax.set_xlabel("arrivals per second")
            ax.set_ylabel(label)
        row[0].legend(fontsize=7)
    return fig


def store_sim(results: list[dict]) -> Figure:
    """Hit rates per tier and eviction policy; or, for --profile runs, TTFT against quality
    per store (AdaptCache among fixed formats), a panel per capacity."""
    if results[0].get("mode") == "compression":
        caps = list(results[0]["results"])
        fig, axes = grid(results, len(caps), size=(5.0, 3.8))
        for r, row in zip(results, axes, strict=True):
            for ax, cap in zip(row, caps, strict=True):
                stores = r["results"][cap]
                named_points(ax, {n: (s["mean_ttft_s"], s["mean_quality"])
                                  for n, s in stores.items()}, store_family)
                ax.set_xlabel(f"{cap}: mean TTFT (s)")
                ax.set_ylabel("mean quality (top-1 agreement)")
        return fig
    fig, axes = grid(results, 1, size=(6.0, 3.4))
    for r, (ax,) in zip(results, axes, strict=True):
        groups = [(cap, policy) for cap, by in r["results"].items() for policy in by]
        host = [r["results"][c][p].get("host_hit_rate", r["results"][c][p].get("dram_hit_rate"))
                for c, p in groups]
        disk = [r["results"][c][p]["disk_hit_rate"] for c, p in groups]
        x = np.arange(len(groups))
        ax.bar(x, host, 0.7, label="host hits", color=COLORS[0])
        ax.bar(x, disk, 0.7, bottom=host, label="disk hits", color=COLORS[6])
        ax.set_xticks(x, [f"{p}\n{c}" for c, p in groups], fontsize=7)
        ax.set_ylabel("share of requests")
        ax.legend(fontsize=7)
    return fig


def store_family(name: str) -> str:
    """A store's color in a TTFT-quality figure: LRU over full precision, AdaptCache, the
    baselines (StreamingLLM's tokens, KIVI's format), other fixed formats."""
    for family in ("adaptcache", "streaming", "kivi", "k2v2"):
        if name.startswith(family):
            return {"k2v2": "kivi"}.get(family, family)
    return "lru, full precision" if name == "lru" else "lru, a fixed format"


def adapt_orders(results: list[dict]) -> Figure:
    """Stores served for real (TTFT, words matching full precision) beside the simulator's."""
    fig, axes = grid(results, 2)
    for r, (real, sim) in zip(results, axes, strict=True):
        named_points(real, {n: (r["real_mean_ttft_s"][n], r["real_prefix_agreement"][n])
                            for n in r["names"]}, store_family)
        real.errorbar([r["real_mean_ttft_s"][n] for n in r["names"]],
                      [r["real_prefix_agreement"][n] for n in r["names"]],
                      xerr=[r["real_ttft_standard_error_s"][n] for n in r["names"]],
                      fmt="none", ecolor="#999", lw=0.8)
        real.set_xlabel("served: mean TTFT (s)")
        real.set_ylabel("words matched before a difference")
        named_points(sim, {n: (r["sim_mean_ttft_s"][n], r["sim_quality"][n])
                           for n in r["names"]}, store_family)
        sim.set_xlabel("simulated: mean TTFT (s)")
        sim.set_ylabel("profile quality")
    return fig


def cpu_throughput(results: list[dict]) -> Figure:
    """jkv against transformers on one CPU: prefill seconds per length, decode tokens/s."""
    fig, axes = grid(results, 2)
    for r, (left, right) in zip(results, axes, strict=True):
        prefill = [row for row in r["rows"] if row["row"].startswith("prefill")]
        decode = [row for row in r["rows"] if row["row"].startswith("decode")]
        bars(left, [row["row"].split(" ")[1] + " tokens" for row in prefill],
             {e: [row[e] for row in prefill] for e in ("jkv", "transformers")},
             "prefill (s)", values=True)
        bars(right, [row["row"].split("(")[0].removeprefix("decode, ") for row in decode],
             {e: [row[e] for row in decode] for e in ("jkv", "transformers")},
             "decode tokens/s", values=True)
    return fig


def kv_sharing(results: list[dict]) -> Figure:
    """Cross-layer sharing of an idle conversation: bytes saved against perplexity change."""
    fig, axes = grid(results, 1, size=(6.5, 4.0))
    for r, (ax,) in zip(results, axes, strict=True):
        named_points(ax, {n: (row["bytes_ratio"], 100 * row["perplexity_change"])
                          for n, row in r["rows"].items() if n != "none"},
                     lambda n: n.split(":")[0])
        ax.set_xlabel("entry bytes unshared / shared")
        ax.set_ylabel("next turn's perplexity change (%)")
    return fig


def frontier_label(family: str) -> str:
    """`g1` -> per-layer low rank, `g3` -> groups of 3, `chosen:pre` -> chosen per
    conversation (pre-RoPE keys)."""
    if family == "g1":
        return "low rank per layer"
    if family.startswith("g"):
        return f"shared bases, groups of {family[1:]}"
    keys = family.split(":")[1]
    return f"shared bases, groups chosen per conversation ({keys}-RoPE keys)"


def kv_frontier(results: list[dict]) -> Figure:
    """Shared bases against quantized formats: bytes over bf16 pages against the next turn's
    perplexity change (log; below 0.01% drawn at 0.01%), a line per grouping."""
    fig, axes = grid(results, 1, size=(7.0, 4.6))
    for r, (ax,) in zip(results, axes, strict=True):
        lines: dict[str, list] = {}
        for name, row in r["rows"].items():
            if "@" in name:
                lines.setdefault(name.split("@")[0], []).append(
                    (row["rate"], max(100 * row["perplexity_change"], 0.01)))
        for i, (family, points) in enumerate(sorted(lines.items())):
            ax.plot(*zip(*sorted(points), strict=True), marker="o", markersize=3,
                    color=COLORS[(i + 1) % len(COLORS)], label=frontier_label(family))
        for name, row in r["rows"].items():
            if "@" not in name:
                x, y = row["rate"], max(100 * row["perplexity_change"], 0.01)
                ax.scatter([x], [y], color=COLORS[0], marker="s", s=24, zorder=3)
                ax.annotate(name, (x, y), textcoords="offset points", xytext=(4, 3), fontsize=7)
        log_scale(ax)
        ax.set_xlabel("stored bytes / bf16 pages' bytes (squares: jkv's KV formats)")
        ax.set_ylabel("next turn's perplexity change (%)")
        ax.legend(fontsize=7)
    return fig


FIGURES: dict[str, Callable[[list[dict]], Figure]] = {
    "decode_attention": decode_attention, "kv_fidelity": kv_fidelity, "kv_budget": kv_budget,
    "tier_cost": tier_cost, "layer_offload": layer_offload, "restore": restore,
    "serve": serve, "serve_slo": serve_slo, "serve_replay": serve_slo, "store_sim": store_sim,
    "adapt_orders": adapt_orders, "cpu_throughput": cpu_throughput, "kv_sharing": kv_sharing,
    "kv_frontier": kv_frontier}
