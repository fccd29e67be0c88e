"""The offline profile AdaptCache's policy reads: for each compression method, the answer
quality kept at each measured rate, per kind of content (AdaptCache's estimator, section 2).

Written by `benchmarks/adapt_profile.py` from the fidelity harness's results (quality: the
teacher-forced top-1 agreement with the uncompressed KV on documents of each kind; rate: the
method's bytes over bf16 pages' bytes for the same tokens). JSON:

    {"model": "smollm2-135m", "metric": "top1_agreement", "kinds": ["prose", "code", "chat"],
     "methods": {"streaming": [{"rate": 0.17, "quality": {"prose": 0.85, ...}}, ...],
                 "k4v2t": [{"rate": 0.22, "quality": {...}, "family": "quantized"}], ...}}

A point's family (default: its method) names the forms made from any larger one of the
family at the quality measured from the full KV (`jkv.policies.adaptcache.Form`). Optional
`"decode_bps": {"cpu": {"k4v2t": 4.1e8, ...}}`: per JAX backend, the stored bytes per
second an entry of each method is converted back into a model-dtype pool at (the decode
cost of the paper's estimator; `adapt_profile.py --decode` measures it), what the store
assumes until it has measured its own. `Profile.default()`:
the one shipped for the embedded model (SmolLM2-135M), used when none is given (for a
token-tier engine's rows, whose methods are row forms `<way>@<keep>` with rates against the
row as kept: `Profile.default(whole_rows=True)`, from `benchmarks/adapt_rows.py`).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

from jkv.policies.adaptcache import Form
from jkv.policies.stored_forms import parse_row_form


@dataclass(frozen=True)
class Point:
    """A method measured at `rate` (its bytes over bf16 pages'): quality per kind."""

    rate: float
    quality: Mapping[str, float]
    family: str = ""


@dataclass(frozen=True)
class Profile:
    model: str
    metric: str
    kinds: tuple[str, ...]
    methods: Mapping[str, tuple[Point, ...]]
    decode_bps: Mapping[str, Mapping[str, float]] = field(default_factory=dict)

    @classmethod
    def from_json(cls, data: Mapping) -> Profile:
        """Validate and build; a ValueError names the field that is wrong."""
        for name in ("model", "metric", "kinds", "methods"):
            if name not in data:
                raise ValueError(f"profile: missing field {name!r}")
        kinds = tuple(data["kinds"])
        if not kinds or not all(isinstance(k, str) for k in kinds):
            raise ValueError("profile: kinds must be a non-empty list of names")
        methods: dict[str, tuple[Point, ...]] = {}
        if not isinstance(data["methods"], Mapping):
            raise ValueError("profile: methods must map each method to its points")
        for method, points in dict(data["methods"]).items():
            if method == "full":
                raise ValueError("profile: methods: 'full' is the uncompressed form's name")
            if not isinstance(points, list) or not points:
                raise ValueError(f"profile: methods.{method} must be a non-empty list")
            out = []
            for i, p in enumerate(points):
                where = f"profile: methods.{method}[{i}]"
                rate = p.get("rate")
                if not isinstance(rate, (int, float)) or not 0 < rate < 1:
                    raise ValueError(f"{where}.rate must be in (0, 1), got {rate!r}")
                quality = dict(p.get("quality", {}))
                if set(quality) != set(kinds):
                    raise ValueError(f"{where}.quality must give every kind {list(kinds)}")
                if not all(0 <= q <= 1 for q in quality.values()):
                    raise ValueError(f"{where}.quality values must be in [0, 1]")
                family = p.get("family", "")
                if not isinstance(family, str):
                    raise ValueError(f"{where}.family must be a name")
                out.append(Point(float(rate), quality, family))
            methods[method] = tuple(sorted(out, key=lambda p: -p.rate))
        decode: dict[str, dict[str, float]] = {}
        decode_bps = data.get("decode_bps", {})
        if not isinstance(decode_bps, Mapping) or not all(
                isinstance(r, Mapping) for r in decode_bps.values()):
            raise ValueError("profile: decode_bps must map backends to {method: rate}")
        for backend, rates in decode_bps.items():
            decode[backend] = {}
            for method, bps in dict(rates).items():
                where = f"profile: decode_bps.{backend}.{method}"
                if method not in methods:
                    raise ValueError(f"{where}: not a method of the profile")
                if not isinstance(bps, int | float) or isinstance(bps, bool) or not bps > 0:
                    raise ValueError(f"{where} must be a number > 0, got {bps!r}")
                decode[backend][method] = float(bps)
        return cls(str(data["model"]), str(data["metric"]), kinds, methods, decode)

    @classmethod
    def load(cls, path: str | Path) -> Profile:
        try:
            data = json.loads(Path(path).read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise ValueError(f"profile {path}: {e}") from e
        return cls.from_json(data)

    @classmethod
    def default(cls, whole_rows: bool = False) -> Profile:
        """The profile shipped with jkv: SmolLM2-135M's (the embedded model), measured by
        `benchmarks/adapt_profile.py`; another model's qualities differ (measure its own).
        `whole_rows`: the one for a token-tier engine's stored rows, whose methods are row forms
        (`benchmarks/adapt_rows.py`, measured under kv_policy leankv: for h2o and streaming
        rows an estimate; measure theirs with `--policy`)."""
        name = "smollm2-135m-rows.json" if whole_rows else "smollm2-135m.json"
        text = resources.files("jkv.store").joinpath(f"profiles/{name}").read_text()
        return cls.from_json(json.loads(text))

    def to_json(self) -> dict:
        return {"model": self.model, "metric": self.metric, "kinds": list(self.kinds),
                "methods": {m: [{"rate": p.rate, "quality": dict(p.quality),
                                 **({"family": p.family} if p.family else {})}
                                for p in points] for m, points in self.methods.items()},
                **({"decode_bps": {b: dict(r) for b, r in self.decode_bps.items()}}
                   if self.decode_bps else {})}

    def forms(self, bf16_bytes: int, kind: str | None = None,
              methods: tuple[str, ...] | None = None,
              full_bytes: int | None = None) -> list[Form]:
        """An entry whose tokens take `bf16_bytes` in bf16 pages (`full_bytes`, default the
        same, in its own uncompressed form) of `kind` content (None: the mean over kinds):
        the full form first, then each of `methods` (default: all) at each measured rate."""
        if kind is not None and kind not in self.kinds:
            raise ValueError(f"kind must be one of {list(self.kinds)}, got {kind!r}")
        out = [Form("full", 1.0, bf16_bytes if full_bytes is None else full_bytes, 1.0)]
        for method in self.methods if methods is None else methods:
            if method not in self.methods:
                raise ValueError(f"method must be one of {list(self.methods)}, got {method!r}")
            for p in self.methods[method]:
                q = (p.quality[kind] if kind is not None
                     else sum(p.quality.values()) / len(p.quality))
                row = parse_row_form(method)  # a whole row's: it keeps a share of tokens
                out.append(Form(method, p.rate, round(bf16_bytes * p.rate), q, p.family,
                                None if row is None else row[1]))
        return out
