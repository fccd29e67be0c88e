"""Krul's shared-layer KV as a stored form (`kv_sharing="krul"`): which layers of a stored
conversation share a basis, and how many ranks each group keeps, chosen from its own KV.

A conversation's keys (rotated back by their place in the entry) and values are each split into
groups of adjacent layers, at most `max_group`, by the least truncation error at the form's
rate (dynamic programming over the groups' spectra: `shared_basis.choose_groups`); the entry's
byte budget (the rate times its bf16 bytes) is then spent on ranks greedily across every group
of both sides, up to the directions that hold less than `LEAST_ENERGY` of a layer's energy (a
conversation whose KV is of low rank is stored in fewer bytes), and the coefficients' bits are
whichever of `BITS` reconstructs this conversation's KV best. A plan whose mean relative error
per layer exceeds `max_error` is refused (None): the store then keeps the entry in the pool's
format, since a history that short, or that unlike a low-rank one, is not worth its quality.
Pure decisions on arrays; `jkv.kv.shared_form` carries them out.

An entry's first `SINKS` tokens are kept whole: where they are a conversation's first, they are
its attention sinks, whose small reconstruction error costs much (SmolLM2, prose, groups chosen
per conversation at rate 0.3: the next turn's perplexity +2.1% with them whole, +39.6%
without; `benchmarks/kv_frontier.py` and its `--sinks 0`).
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from jkv.kv import shared_basis as sb
from jkv.kv.shared_form import BLOCK, SIDES, Plan

BITS = (8, 4)  # coefficient bits tried
MAX_GROUP = 3  # layers one basis may serve
# mean relative squared error per layer above which the form is refused: the frontier's plans
# at rate 0.2 (quality still on par with k4v2t on SmolLM2) had errors near 0.04
# (benchmarks/kv_frontier.py); a plan far past them keeps too few ranks for its entry
MAX_ERROR = 0.05
LEAST_ENERGY = 1e-4  # a direction holding less of a layer's energy is not worth its bytes
SINKS = 4  # an entry's first tokens kept whole: attention sinks, whose small error costs much


def candidates(layers: int, max_group: int) -> list[tuple[int, int]]:
    """Every adjacent group (first layer, layers) of at most `max_group` of `layers`."""
    return [(s, g) for g in range(1, max_group + 1) for s in range(layers - g + 1)]


def plan_for(specs: Mapping[str, sb.GroupSpectra], shape: tuple[int, int, int], tokens: int,
             rate: float, bits: int, max_group: int, sinks: int
             ) -> tuple[Plan, dict[str, dict[tuple[int, int], sb.Spectrum]]]:
    """Groups per side by least truncation error at `rate` (`specs`: of the tokens after the
    `sinks`, `shape` theirs [L, T - sinks, F]), then ranks for what the budget leaves after
    the sinks; with the chosen groups' spectra (their directions) for the fit."""
    layers, rest, features = shape
    groups = {side: sb.choose_groups(sb.grouping_costs(
        {grp: specs[side](grp) for grp in candidates(layers, max_group)}, rate, rest,
        features, bits, BLOCK), layers, max_group) for side in SIDES}
    chosen = {side: {grp: specs[side](grp, vectors=True) for grp in groups[side]}
              for side in SIDES}
    order = [(side, grp) for side in SIDES for grp in groups[side]]
    budget = int(rate * len(SIDES) * layers * tokens * features * 2)
    budget -= len(SIDES) * layers * sinks * features * 2
    ranks = sb.allocate_ranks([chosen[side][grp] for side, grp in order], rest, features,
                              bits, BLOCK, budget, LEAST_ENERGY)
    per_side = {side: [r for (s, _), r in zip(order, ranks, strict=True) if s == side]
                for side in SIDES}
    return Plan(groups, per_side, bits, sinks), chosen


def plan_error(sides: Mapping[str, np.ndarray], plan: Plan,
               specs: Mapping[str, Mapping[tuple[int, int], sb.Spectrum]]) -> float:
    """Mean relative squared error per layer (each layer's centered energy) of `plan`'s
    reconstruction of `sides` [L, T, F] (the tokens after its sinks), quantization included;
    `specs`: the plan's groups' spectra."""
    errors = []
    for side in SIDES:
        x = sides[side]
        for (first, size), rank in zip(plan.groups[side], plan.ranks[side], strict=True):
            block = x[first:first + size]
            part = sb.fit(block, rank, plan.bits, BLOCK, specs[side][(first, size)])
            y = sb.reconstruct(part, BLOCK)
            centered = block - block.mean(axis=1, keepdims=True)
            errors += list(np.sum(np.square(block - y), axis=(1, 2))
                           / np.maximum(np.sum(np.square(centered), axis=(1, 2)), 1e-30))
    return float(np.mean(errors))


def choose(sides: Mapping[str, np.ndarray], rate: float, max_group: int = MAX_GROUP,
           max_error: float = MAX_ERROR
           ) -> tuple[Plan, float, dict[str, dict[tuple[int, int], sb.Spectrum]]] | None:
    """The plan of the shared form at `rate` for these sides [L, T, F] (keys rotated back),
    its error and its groups' spectra (what `shared_form.encode` fits with); None when no plan
    keeps the error within `max_error`."""
    layers, tokens, _ = sides["k"].shape
    max_group, sinks = min(max_group, layers), min(SINKS, tokens)
    rest = {side: sides[side][:, sinks:] for side in SIDES}
    specs = {side: sb.GroupSpectra(rest[side]) for side in SIDES}
    best = None
    for bits in BITS:
        plan, chosen = plan_for(specs, rest["k"].shape, tokens, rate, bits, max_group, sinks)
        err = plan_error(rest, plan, chosen)
        if np.isfinite(err) and (best is None or err < best[1]):
            best = (plan, err, chosen)
    return best if best is not None and best[1] <= max_error else None


__all__ = ["BITS", "MAX_ERROR", "MAX_GROUP", "candidates", "choose", "plan_error", "plan_for"]
