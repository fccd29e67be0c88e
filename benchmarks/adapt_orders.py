"""Does a real serving run order KV stores as the simulator does? (AdaptCache, issue 16)

Reads `benchmarks/serve.py` results (settings run on the real model, with `--reference` a
full-precision setting whose answers the others are compared with) and a `store_sim.py
--profile --trace serve` result (the same stores on the same workload, one capacity
setting), and
compares every pair of stores the two have in common: on mean TTFT and on quality (the
simulator's profile quality; the real run's words matched before the first difference from
the reference answer). A pair counts only where the simulator separates it (TTFT apart by
more than --ttft-tolerance of the larger, quality by more than --quality-tolerance); it
agrees when the real run orders it the same way, is a tie when the real difference is within
two standard errors, and differs otherwise (the exit status is 1 then).

Stores are matched by name: a real setting `X` is the simulator's `X`, `X@<rate>-lru`, or
for `k2v2` (KIVI's 2-bit keys and values) `kivi@<rate>-lru`; `--names real=sim,...` adds
pairs by hand.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import numpy as np
from harness import add_out_argument, write_results

ALIASES = {"k2v2": "kivi"}  # a jkv KV format -> the profile's name of its method


def match(real: list[str], sim: list[str], extra: dict[str, str]) -> dict[str, str]:
    """Real setting name -> the simulator's store of the same policy."""
    out = {}
    for name in real:
        if name in extra:
            out[name] = extra[name]
            continue
        stem = ALIASES.get(name, name)
        found = [s for s in sim if s == stem or (s.startswith(stem + "@")
                                                  and s.endswith("-lru"))]
        if len(found) == 1:
            out[name] = found[0]
    return out


def pairs(real: dict[str, float], error: dict[str, float], sim: dict[str, float],
          tolerance: float, relative: bool) -> list[dict]:
    """Every pair the simulator separates: "agrees" when the real run orders it alike,
    "tie" when the real difference is within two standard errors (`error`, each store's),
    "differs" when the real run orders it the other way beyond them."""
    out = []
    for a, b in itertools.combinations(sorted(real), 2):
        gap = abs(sim[a] - sim[b])
        if gap <= tolerance * (max(abs(sim[a]), abs(sim[b])) if relative else 1.0):
            continue
        lo, hi = (a, b) if sim[a] < sim[b] else (b, a)
        noise = 2 * float(np.hypot(error[lo], error[hi]))
        verdict = ("tie" if abs(real[hi] - real[lo]) <= noise
                   else "agrees" if real[lo] < real[hi] else "differs")
        out.append({"lower": lo, "higher": hi, "sim": [sim[lo], sim[hi]],
                    "real": [real[lo], real[hi]], "real_noise": noise, "verdict": verdict})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--serve", type=Path, nargs="+", required=True,
                    help="benchmarks/serve.py result JSONs (each run with --reference, on the "
                         "same workload): their settings together, a later file's replacing an "
                         "earlier one's of the same name")
    ap.add_argument("--sim", type=Path, required=True,
                    help="a benchmarks/store_sim.py --profile result JSON")
    ap.add_argument("--capacity", help="the simulator's capacity setting to compare (default: "
                                       "its only one)")
    ap.add_argument("--names", default="",
                    help="more real=sim name pairs, comma-separated")
    ap.add_argument("--ttft-tolerance", type=float, default=0.15,
                    help="TTFTs closer than this share of the larger are a tie")
    ap.add_argument("--quality-tolerance", type=float, default=0.005,
                    help="qualities closer than this are a tie")
    add_out_argument(ap, "adapt_orders")
    args = ap.parse_args()

    sim = json.loads(args.sim.read_text())
    caps = list(sim.get("results", {}))
    if sim.get("mode") != "compression" or not caps:
        ap.error("--sim: not a store_sim.py --profile result")
    cap = args.capacity or (caps[0] if len(caps) == 1 else None)
    if cap not in caps:
        ap.error(f"--capacity: one of {caps}")
    runs, workloads = {}, []
    for path in args.serve:
        serve = json.loads(path.read_text())
        reference = serve.get("args", {}).get("reference")
        if reference is None:
            ap.error(f"--serve {path}: run without --reference: no answers' fidelity")
        runs |= {n: r for n, r in serve["results"].items() if n != reference}
        workloads.append(serve["workload"])
    if any(w != workloads[0] for w in workloads):
        ap.error("--serve: the runs' workloads differ")
    extra = dict(p.split("=", 1) for p in args.names.split(",") if p)
    names = match(list(runs), list(sim["results"][cap]), extra)
    if len(names) < 2:
        ap.error(f"fewer than two stores in common (real {list(runs)}, simulated "
                 f"{list(sim['results'][cap])})")
    real_ttft = {n: float(np.mean(runs[n]["ttft_all_s"])) for n in names}
    real_q = {n: runs[n]["fidelity"]["prefix_agreement"] for n in names}
    # standard errors: of a mean TTFT from its turns; of a mean share in [0, 1] at most
    # sqrt(m (1 - m) / n) (a share's variance is largest when every turn is 0 or 1)
    ttft_se = {n: float(np.std(runs[n]["ttft_all_s"]) / np.sqrt(len(runs[n]["ttft_all_s"])))
               for n in names}
    q_se = {n: float(np.sqrt(real_q[n] * (1 - real_q[n])
                             / runs[n]["fidelity"]["turns_compared"])) for n in names}
    sims = sim["results"][cap]
    sim_ttft = {n: sims[s]["mean_ttft_s"] for n, s in names.items()}
    sim_q = {n: sims[s]["mean_quality"] for n, s in names.items()}

    print(f"{'store':<18}{'simulated as':<22}{'TTFT sim':>10}{'TTFT real':>11}"
          f"{'quality sim':>13}{'words matched':>15}{'identical':>11}")
    for n, s in names.items():
        f = runs[n]["fidelity"]
        print(f"{n:<18}{s:<22}{sim_ttft[n]:>9.3f}s{real_ttft[n]:>10.3f}s{sim_q[n]:>13.4f}"
              f"{f['prefix_agreement']:>15.1%}{f['identical_answers']:>11.1%}")
    # (the real TTFT is lower for more hits; lower is "first" on both axes alike)
    by = {"ttft": pairs(real_ttft, ttft_se, sim_ttft, args.ttft_tolerance, True),
          "quality": pairs(real_q, q_se, sim_q, args.quality_tolerance, False)}
    count = {"agrees": 0, "tie": 0, "differs": 0}
    for axis, ps in by.items():
        got = {v: sum(p["verdict"] == v for p in ps) for v in count}
        count = {v: count[v] + got[v] for v in count}
        print(f"{axis}: of the {len(ps)} pairs the simulator separates, the real run orders "
              f"{got['agrees']} alike, {got['differs']} the other way, and ties {got['tie']} "
              "(within two standard errors)")
        for p in ps:
            if p["verdict"] != "agrees":
                print(f"  {p['verdict']}: {p['lower']} < {p['higher']} simulated "
                      f"({p['sim'][0]:.4g} vs {p['sim'][1]:.4g}), real {p['real'][0]:.4g} "
                      f"vs {p['real'][1]:.4g} (noise {p['real_noise']:.2g})")
    print("orders agree" if count["differs"] == count["tie"] == 0 else
          f"orders agree on {count['agrees']} pairs, differ on {count['differs']}, "
          f"{count['tie']} tied in the real run")
    write_results(args.out, "adapt_orders", {
        "serve": [str(p) for p in args.serve], "sim": str(args.sim), "capacity": cap,
        "names": names, "real_mean_ttft_s": real_ttft, "real_prefix_agreement": real_q,
        "real_ttft_standard_error_s": ttft_se, "real_quality_standard_error": q_se,
        "sim_mean_ttft_s": sim_ttft, "sim_quality": sim_q, "pairs": by, "counts": count},
        args)
    sys.exit(1 if count["differs"] else 0)


if __name__ == "__main__":
    main()
