"""store_sim's compression dimension (AdaptCache, figure 2 in spirit): the same trace through
fixed-method LRU stores and AdaptCache's policy, each job's TTFT and answer quality.

A job's TTFT is its history's load (the entry's bytes at its tier's read rate, plus, with
`--decode-backend`, converting a compressed form back at the profile's decode rate for that
backend; without it decoding is free, as a GPU's dequantization nearly is) or, on a miss
or where that is faster, its recompute (history tokens at the prefill rate: the engine's
restore planner picks the faster), plus its own new tokens' prefill. Its
quality is the profile's quality of the form it was read from (1 for a full or recomputed
history), for its session's kind of content (drawn once per session from the profile's
kinds); a session whose history was read lossy carries that quality into its later turns
until a miss recomputes it (the pool keeps the approximate values it was given, and saves
them again). Stores:

- `lru`: CachedAttention's LRU over full (bf16) entries;
- `<method>@<rate>-lru`: every entry saved in that one form (KIVI, StreamingLLM, each
  quantized format: every point of the profile), LRU;
- `adaptcache@<alpha>`: `jkv.policies.adaptcache.AdaptPlacement` choosing form and tier per entry.
"""

from __future__ import annotations

from collections import deque

import numpy as np

from jkv.policies.adaptcache import AdaptPlacement, Tier
from jkv.store import Placement
from jkv.store.adapt_profile import Profile


def stores(profile: Profile, alphas: list[float]) -> list[tuple[str, tuple]]:
    out: list[tuple[str, tuple]] = [("lru", ("fixed", None, 1.0))]
    for method, points in profile.methods.items():
        out += [(f"{method}@{p.rate:.2f}-lru", ("fixed", method, p.rate)) for p in points]
    out += [(f"adaptcache@{a:g}", ("adapt", a)) for a in alphas]
    return out


def replay(events: list[tuple], store: tuple, host: int, disk: int, profile: Profile,
           kinds: dict, per_token: int, args) -> dict:
    """One store over the trace: mean TTFT, mean quality, hits per tier."""
    read = {"host": args.host_read_gbps * 1e9, "disk": args.disk_read_gbps * 1e9}
    decode = decode_rates(profile, args.decode_backend)
    prefill_s = 1.0 / args.prefill_tokens_per_s
    method = None
    if store[0] == "adapt":
        p = AdaptPlacement([Tier("host", host, read["host"]), Tier("disk", disk, read["disk"])],
                           alpha=store[1], quality_floor=args.quality_floor,
                           half_life=(None if args.half_life == "auto"
                                      else float(args.half_life)), decode_bps=decode)
    else:
        p = Placement("lru", host, disk)
        method, rate = store[1], store[2]
        quality = {k: 1.0 for k in profile.kinds} if method is None else next(
            pt.quality for pt in profile.methods[method] if pt.rate == rate)
    history: dict[int, int] = {}  # session -> tokens saved
    carry: dict[int, float] = {}  # session -> the quality its pool values carry
    queue: deque[int] = deque()
    ttft, quality_seen = [], []
    hits = {"host": 0, "disk": 0, "miss": 0}
    for event in events:
        kind, now, s = event[:3]
        if kind == "arrive":
            queue.append(s)
        elif kind == "start":
            queue.popleft()
            h, q, delay = history.get(s, 0), carry.get(s, 1.0), 0.0
            if h:
                if store[0] == "adapt":
                    got = p.access(s, now)
                    tier, form = (None, None) if got is None else got
                    size, fq = (0, 1.0) if form is None else (form.size, form.quality)
                    method = None if form is None else form.method
                else:
                    tier = p.access(s)
                    size = p.size(s)
                    fq = quality[kinds[s]]
                load = 0.0 if tier is None else size / read[tier] + (
                    size / decode[method] if method in decode else 0.0)
                if tier is not None and load >= h * prefill_s:
                    tier = None  # recomputed: the faster way, at full quality
                hits[tier or "miss"] += 1
                if tier is None:
                    delay, q = h * prefill_s, 1.0
                else:
                    delay, q = load, min(q, fq)
            carry[s] = q
            ttft.append(delay + event[3] * prefill_s)
            quality_seen.append(q)
        else:
            tokens = event[3] // per_token
            history[s] = tokens
            if store[0] == "adapt":
                p.hint(set(queue))
                p.put(s, profile.forms(event[3], kinds[s]), tokens * prefill_s, now)
            else:
                p.put(s, round(event[3] * rate), queue)
    reused = hits["host"] + hits["disk"] + hits["miss"]
    return {"mean_ttft_s": float(np.mean(ttft)), "mean_quality": float(np.mean(quality_seen)),
            "host_hit_rate": hits["host"] / max(reused, 1),
            "disk_hit_rate": hits["disk"] / max(reused, 1), **hits}


def decode_rates(profile: Profile, backend: str | None) -> dict[str, float]:
    """The profile's decode rates for `backend` by method; none without a backend."""
    if backend is None:
        return {}
    if backend not in profile.decode_bps:
        raise SystemExit(f"--decode-backend: the profile has decode rates for "
                         f"{sorted(profile.decode_bps)}, not {backend!r}")
    return dict(profile.decode_bps[backend])


def checks(rows: dict[str, dict]) -> dict:
    """The acceptance's two comparisons at one capacity: AdaptCache's best TTFT ratio over the
    fastest fixed-method LRU baseline (full entries, KIVI, StreamingLLM) of equal or better
    quality, and the same over every fixed form of the profile (jkv's own formats too: a
    stricter rival); and whether each StreamingLLM store is beaten on quality by an
    AdaptCache point of equal or lower TTFT."""
    adapt = {n: r for n, r in rows.items() if n.startswith("adaptcache")}
    fixed = {n: r for n, r in rows.items() if not n.startswith("adaptcache")}
    named = {n: r for n, r in fixed.items()
             if n == "lru" or n.startswith(("kivi@", "streaming@"))}
    streaming = {}
    for name, r in fixed.items():
        if name.startswith("streaming"):
            streaming[name] = any(a["mean_ttft_s"] <= r["mean_ttft_s"]
                                  and a["mean_quality"] > r["mean_quality"]
                                  for a in adapt.values())
    frontier = {n: frontier_ttft(fixed, r["mean_quality"]) / r["mean_ttft_s"]
                for n, r in adapt.items() if frontier_ttft(fixed, r["mean_quality"])}
    return {"best_ttft_ratio": _best_ratio(adapt, named),
            "best_ttft_ratio_any_format": _best_ratio(adapt, fixed),
            "ttft_ratio_to_fixed_frontier": frontier,
            "beats_streaming_on_quality": streaming}


def frontier_ttft(fixed: dict[str, dict], quality: float) -> float | None:
    """The fixed stores' mean TTFT at `quality`, on the line between the two stores of the
    TTFT-quality frontier around it (a mix of the two would come near it): a rival that is
    not a point of the profile's grid. None above the best quality."""
    points = sorted((r["mean_quality"], r["mean_ttft_s"]) for r in fixed.values())
    front: list[tuple[float, float]] = []  # quality up, TTFT up: each point worth having
    for q, t in reversed(points):
        if not front or t < front[-1][1]:
            front.append((q, t))
    front.reverse()
    if not front or quality > front[-1][0]:
        return None
    if quality <= front[0][0]:
        return front[0][1]
    for (q1, t1), (q2, t2) in zip(front, front[1:], strict=False):
        if q1 <= quality <= q2:
            return t1 + (t2 - t1) * (quality - q1) / (q2 - q1)
    return None


def _best_ratio(adapt: dict[str, dict], fixed: dict[str, dict]) -> dict | None:
    """The AdaptCache store with the highest TTFT ratio over the fastest of `fixed` whose
    quality is equal or better."""
    best = None
    for name, r in adapt.items():
        rivals = {n: f for n, f in fixed.items() if f["mean_quality"] >= r["mean_quality"]}
        if rivals:
            rival = min(rivals, key=lambda n: rivals[n]["mean_ttft_s"])
            ratio = rivals[rival]["mean_ttft_s"] / r["mean_ttft_s"]
            if best is None or ratio > best["ttft_ratio"]:
                best = {"adaptcache": name, "rival": rival, "ttft_ratio": ratio}
    return best


