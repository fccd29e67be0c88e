"""AdaptCache's offline quality profile, from the fidelity harness's measurements.

    python benchmarks/kv_fidelity.py                       # measure (SmolLM2, ~1 h on a CPU)
    python benchmarks/adapt_profile.py benchmarks/results/kv_fidelity-2026-11-26.json

Each configuration of the fidelity run becomes a point of a compression method: `none:<format>`
is the method <format> (quantized pages) and `kivi` KIVI, all of the family "quantized"
(requantized from a finer format they keep their own quality); `streaming:<window>` is
StreamingLLM's token dropping. Only methods a store can apply to an entry it holds, without
the model, are profiled: LeanKV's tiers and H2O choose tokens by attention scores, which a
stored entry does not keep. Rate: the configuration's KV bytes over bf16 pages' (the
harness's `bytes_vs_bf16`; a store holding bf16 entries keeps that fraction of their bytes);
quality: its teacher-forced top-1 agreement with the uncompressed run (`none:auto`) on each
document kind (prose, code, chat). Writes the profile
(`jkv.store.adapt_profile.Profile`) to benchmarks/results/adapt_profile-<model>-<date>.json.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from results_io import write_results  # noqa: E402

from jkv.store.adapt_profile import Profile  # noqa: E402

FULL = "none:auto"
NEEDS_SCORES = ("leankv", "h2o")


def method_of(config: str) -> str:
    """The compression method a fidelity configuration measures."""
    parts = [p for p in config.split(":") if "=" not in p]
    return parts[1] if parts[0] == "none" else parts[0]


def build(fidelity: dict, model: str) -> Profile:
    rows = fidelity["rows"]
    if FULL not in rows:
        raise SystemExit(f"the fidelity run has no {FULL!r} row to take rates against")
    kinds = sorted(rows[FULL]["docs"])
    methods: dict[str, list[dict]] = {}
    for config, row in rows.items():
        method = method_of(config)
        if (config == FULL or row["bytes_vs_bf16"] >= 1 or method in NEEDS_SCORES
                or config.endswith("-unrotated")):
            continue  # (not smaller than bf16; not made without the model; a control)
        quality = {k: row["docs"][k]["top1_agreement"] for k in kinds}
        methods.setdefault(method, []).append(
            {"rate": row["bytes_vs_bf16"], "quality": quality, "config": config,
             **({"family": "quantized"} if method != "streaming" else {})})
    return Profile.from_json({"model": model, "metric": "top1_agreement", "kinds": kinds,
                              "methods": methods})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("fidelity", help="a kv_fidelity-<date>.json result")
    ap.add_argument("--model", default="smollm2-135m",
                    help="the model the fidelity run measured (named in the profile)")
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results",
                    help="directory for the profile JSON")
    args = ap.parse_args()
    profile = build(json.loads(Path(args.fidelity).read_text()), args.model)
    print(f"{'method':<22}{'rate':>7}  " + "".join(f"{k:>8}" for k in profile.kinds))
    for method, points in profile.methods.items():
        for p in points:
            print(f"{method:<22}{p.rate:>7.3f}  "
                  + "".join(f"{p.quality[k]:>8.3f}" for k in profile.kinds))
    write_results(args.out, f"adapt_profile-{args.model}",
                  {"benchmark": "adapt_profile", "source": Path(args.fidelity).name,
                   **profile.to_json()}, None, args)


if __name__ == "__main__":
    main()
