"""Cross-layer shared bases (`jkv.kv.shared_basis`): the fit, the quantized coefficients, the
grouping and the rank allocation against brute force and planted subspaces."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jkv.kv import shared_basis as sb


def planted(rng, groups, tokens=96, features=12, rank=3, noise=1e-3):
    """Layers [L, T, F] where each group of `groups` (sizes) shares a rank-`rank` token
    subspace: x_l = C_g M_l + mean_l (+ noise)."""
    out = []
    for size in groups:
        c = rng.standard_normal((tokens, rank))
        for _ in range(size):
            m = rng.standard_normal((rank, features))
            out.append(c @ m + rng.standard_normal(features) * 3
                       + noise * rng.standard_normal((tokens, features)))
    return np.stack(out).astype(np.float32)


def rel(x, y):
    c = x - x.mean(axis=1, keepdims=True)
    return float(np.sum(np.square(x - y)) / np.sum(np.square(c)))


def test_full_rank_in_float16_is_exact_to_its_precision():
    rng = np.random.default_rng()
    x = rng.standard_normal((3, 40, 8)).astype(np.float32) * 2 + 5
    form = sb.fit(x, 24, 16, 16)
    assert rel(x, sb.reconstruct(form, 16)) < 1e-5


def test_a_shared_subspace_is_kept_by_one_basis_and_not_by_per_layer_ranks_of_its_bytes():
    rng = np.random.default_rng()
    x = planted(rng, [3])
    shared = sb.fit(x, 3, 16, 32)
    assert rel(x, sb.reconstruct(shared, 32)) < 1e-4
    assert sb.truncation_error(sb.spectrum(x), 3) < 1e-4
    # one rank per layer holds the same number of coefficients: far worse
    alone = [rel(x[i:i + 1], sb.reconstruct(sb.fit(x[i:i + 1], 1, 16, 32), 32))
             for i in range(3)]
    assert min(alone) > 0.05


def test_truncation_error_is_the_fits_relative_error_per_layer_summed():
    rng = np.random.default_rng()
    x = rng.standard_normal((2, 64, 10)).astype(np.float32) * np.array([[[1.0]], [[7.0]]])
    spec = sb.spectrum(x)
    y = sb.reconstruct(sb.fit(x, 6, 16, 64, spec), 64)
    measured = sum(rel(x[i:i + 1], y[i:i + 1]) for i in range(2))
    assert measured == pytest.approx(sb.truncation_error(spec, 6), rel=1e-2)


@pytest.mark.parametrize("bits", [8, 4, 2])
def test_quantized_coefficients_are_within_half_a_step(bits):
    rng = np.random.default_rng()
    c = rng.standard_normal((70, 5)) * np.array([10.0, 3.0, 1.0, 0.1, 0.0])
    codes, scale, zero = sb.quantize_columns(c, bits, 16)
    assert codes.shape == (70, 5) and scale.shape == (5, 5) and codes.max() < (1 << bits)
    rows = np.arange(70) // 16
    back = codes * scale.astype(np.float32)[rows] + zero.astype(np.float32)[rows]
    step = scale.astype(np.float32)[rows]
    # float16 scale and zero: half a step plus their rounding over the block's range
    assert np.all(np.abs(back - c) <= step / 2 + 2e-3 * np.abs(c).max(axis=0) + 1e-6)


def compositions(n, most):
    if n == 0:
        yield []
        return
    for size in range(1, min(most, n) + 1):
        for rest in compositions(n - size, most):
            yield [size, *rest]


@settings(max_examples=60, deadline=None)
@given(layers=st.integers(1, 7), most=st.integers(1, 4), seed=st.integers(0, 2**31))
def test_choose_groups_is_the_least_cost_partition(layers, most, seed):
    rng = np.random.default_rng(seed)
    cost = {(s, g): float(rng.random() * g) for g in range(1, most + 1)
            for s in range(layers - g + 1)}
    groups = sb.choose_groups(cost, layers, most)
    assert [s for s, _ in groups] == list(itertools.accumulate([0] + [g for _, g in groups]))[:-1]
    assert sum(g for _, g in groups) == layers and max(g for _, g in groups) <= most
    best = min(sum(cost[(sum(c[:i]), g)] for i, g in enumerate(c))
               for c in compositions(layers, most))
    assert sum(cost[grp] for grp in groups) == pytest.approx(best)


def test_per_conversation_groups_find_the_planted_subspaces():
    rng = np.random.default_rng()
    x = planted(rng, [3, 2, 3], tokens=400, rank=2)
    specs = {(s, g): sb.spectrum(x[s:s + g]) for g in (1, 2, 3) for s in range(9 - g)}
    # a layer alone affords one rank per side at this rate; two or three layers of one
    # subspace afford its two, across a boundary the four needed do not fit
    cost = sb.grouping_costs(specs, 600 / (400 * 12 * 2), 400, 12, 8, 32)
    assert sb.choose_groups(cost, 8, 3) == [(0, 3), (3, 2), (5, 3)]


def test_rank_within_is_the_most_that_fits():
    for budget in range(0, 3000, 37):
        r = sb.rank_within(budget, 100, 2, 6, 4, 16)
        assert r == 0 or sb.side_bytes(100, 2, 6, r, 4, 16) <= budget
        assert r == 12 or sb.side_bytes(100, 2, 6, r + 1, 4, 16) > budget


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**31), budget=st.integers(0, 40_000))
def test_ranks_fit_the_budget_and_no_further_rank_would(seed, budget):
    rng = np.random.default_rng(seed)
    specs = [sb.spectrum(rng.standard_normal((g, 50, 6))) for g in (1, 2, 3)]
    ranks = sb.allocate_ranks(specs, 50, 6, 4, 16, budget)
    cost = [sb.side_bytes(50, len(s.norm), 6, r, 4, 16) for s, r in zip(specs, ranks, strict=True)]
    floor = sum(sb.side_bytes(50, len(s.norm), 6, 0, 4, 16) for s in specs)
    assert sum(cost) <= max(budget, floor)
    for i, s in enumerate(specs):
        more = sb.side_bytes(50, len(s.norm), 6, ranks[i] + 1, 4, 16) - cost[i]
        assert ranks[i] == len(s.energy) or sum(cost) + more > budget


def test_ranks_go_where_they_remove_the_most_error():
    rng = np.random.default_rng()
    low = sb.spectrum(planted(rng, [1], rank=1, noise=1e-4))  # one direction holds it all
    high = sb.spectrum(rng.standard_normal((1, 96, 12)))
    step = sb.side_bytes(96, 1, 12, 1, 8, 32) - sb.side_bytes(96, 1, 12, 0, 8, 32)
    floor = 2 * sb.side_bytes(96, 1, 12, 0, 8, 32)
    ranks = sb.allocate_ranks([low, high], 96, 12, 8, 32, floor + 6 * step)
    assert ranks[0] == 1 and ranks[1] == 5


def test_a_rank_of_equal_energy_goes_to_the_group_whose_rank_costs_fewer_bytes():
    def spec(g, energy):
        e = np.asarray(energy + [0.0] * (g * 4 - len(energy)))
        return sb.Spectrum(np.zeros((g, 4), np.float32), np.ones(g, np.float32),
                           np.eye(g * 4), e)
    big, small = spec(3, [1.0, 0.5]), spec(1, [1.0, 0.5])
    floor = sb.side_bytes(64, 3, 4, 0, 8, 16) + sb.side_bytes(64, 1, 4, 0, 8, 16)
    one = sb.side_bytes(64, 3, 4, 1, 8, 16) - sb.side_bytes(64, 3, 4, 0, 8, 16)
    assert sb.allocate_ranks([big, small], 64, 4, 8, 16, floor + one) == [0, 1]


def test_group_spectra_are_each_groups_own_spectrum():
    """From cross products computed once per layer pair: the same energies and fits."""
    rng = np.random.default_rng()
    x = (rng.standard_normal((5, 80, 6)) * rng.random((5, 1, 6)) * 5 + rng.standard_normal(
        (5, 1, 6))).astype(np.float32)
    groups = [(0, 1), (1, 3), (2, 2), (0, 5)]
    spectra = sb.GroupSpectra(x)
    values = {grp: spectra(grp) for grp in groups}
    full = {grp: spectra(grp, vectors=True) for grp in groups}
    for s, g in groups:
        own = sb.spectrum(x[s:s + g])
        assert values[(s, g)].vecs is None
        assert np.allclose(values[(s, g)].energy, own.energy, atol=1e-9)
        assert np.allclose(full[(s, g)].norm, own.norm) and np.allclose(full[(s, g)].mean,
                                                                        own.mean)
        mine, theirs = (sb.reconstruct(sb.fit(x[s:s + g], 3, 16, 16, spec), 16)
                        for spec in (full[(s, g)], own))
        assert np.allclose(mine, theirs, atol=1e-2 * np.abs(theirs).max())
