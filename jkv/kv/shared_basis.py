"""Cross-layer shared bases (xKV): a group of adjacent layers' keys or values kept as one basis
and per-token coefficients that the group shares.

Token vectors of adjacent layers may be unrelated while the token-space subspaces they span
align, so a group of G layers' KV side by side, [T, G * F] (F = KV heads x head dim), has a
low-rank approximation whose coefficients [T, r] (each token's coordinates) serve every layer
of the group and whose basis [r, G * F] holds each layer's own slice. Before the fit each
layer's block is centered (its feature means kept) and scaled to unit Frobenius norm, so every
layer's relative error counts alike; the scale is folded back into the basis. Coefficients are
quantized per (block of tokens, column), as page keys are per (page, channel); the basis and
means stay float16.

Which layers group and how many ranks each group keeps are chosen from the conversation's own
KV (Krul's adaptivity): `choose_groups` partitions the layers into adjacent groups of at most
`max_group` by dynamic programming over the groups' truncation errors, and `allocate_ranks`
spends a byte budget greedily on the ranks that remove the most error per byte, across all
groups and both sides.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import NamedTuple

import numpy as np

FLOAT16 = np.dtype(np.float16)


class Spectrum(NamedTuple):
    """A group's principal directions: what a fit at any rank reads."""

    mean: np.ndarray    # [G, F] float32: each layer's feature means
    norm: np.ndarray    # [G] float32: each centered layer block's Frobenius norm
    vecs: np.ndarray | None  # [G * F, G * F] float64: directions by descending energy
    energy: np.ndarray  # [G * F] float64: each direction's share of the G unit-norm blocks


class SharedSide(NamedTuple):
    """One side (keys or values) of one group of layers in the shared form."""

    mean: np.ndarray   # [G, F] float16
    basis: np.ndarray  # [r, G * F] float16: each layer's slice scaled by that layer's norm
    codes: np.ndarray  # [T, r] uint8 codes, or float16 coefficients when bits == 16
    scale: np.ndarray  # [ceil(T / block), r] float16 (empty when bits == 16)
    zero: np.ndarray   # [ceil(T / block), r] float16 (empty when bits == 16)


def spectrum(x: np.ndarray) -> Spectrum:
    """The principal directions of a group's blocks x [G, T, F] (`GroupSpectra` of the whole)."""
    return GroupSpectra(x)((0, len(x)), vectors=True)


class GroupSpectra:
    """The spectra of adjacent groups of layers x [L, T, F], as `spectrum` gives them, from
    each layer pair's cross products computed once and kept, as are the spectra asked for
    (energies alone, `vectors` False: cheaper, for choosing groups)."""

    def __init__(self, x: np.ndarray) -> None:
        x = np.asarray(x, np.float64)
        self.mean = x.mean(axis=1)
        centered = x - self.mean[:, None]
        norm = np.sqrt(np.sum(np.square(centered), axis=(1, 2)))
        self.norm = np.where(norm > 0, norm, 1.0)
        self.z = centered / self.norm[:, None, None]
        self._cross: dict[tuple[int, int], np.ndarray] = {}
        self._spectra: dict[tuple[int, int, bool], Spectrum] = {}

    def __call__(self, group: tuple[int, int], vectors: bool = False) -> Spectrum:
        s, g = group
        if (s, g, vectors) in self._spectra:
            return self._spectra[(s, g, vectors)]
        gram = np.block([[self._block(a, b) for b in range(s, s + g)] for a in range(s, s + g)])
        if vectors:
            energy, vecs = np.linalg.eigh(gram)
            order = np.argsort(energy)[::-1]
            energy, vecs = energy[order], vecs[:, order]
        else:
            energy, vecs = np.linalg.eigvalsh(gram)[::-1], None
        spec = Spectrum(self.mean[s:s + g].astype(np.float32),
                        self.norm[s:s + g].astype(np.float32), vecs, np.maximum(energy, 0.0))
        self._spectra[(s, g, vectors)] = spec
        return spec

    def _block(self, a: int, b: int) -> np.ndarray:
        if a > b:
            return self._block(b, a).T
        if (a, b) not in self._cross:
            self._cross[(a, b)] = self.z[a].T @ self.z[b]
        return self._cross[(a, b)]


def truncation_error(spec: Spectrum, rank: int) -> float:
    """Sum over the group's layers of each layer's relative squared error at `rank` (before
    the coefficients are quantized)."""
    return float(np.sum(spec.energy[rank:]))


def side_bytes(tokens: int, group: int, features: int, rank: int, bits: int,
               block: int) -> int:
    """Bytes of one group-side in the shared form: coefficients (with their scales and zero
    points per block of tokens when quantized), the basis and the means."""
    if rank == 0:
        return group * features * FLOAT16.itemsize
    coefs = -(-tokens * rank * bits // 8)
    if bits < 16:
        coefs += 2 * FLOAT16.itemsize * rank * -(-tokens // block)
    return coefs + (rank + 1) * group * features * FLOAT16.itemsize


def rank_within(budget: float, tokens: int, group: int, features: int, bits: int,
                block: int) -> int:
    """The most ranks a group-side holds in `budget` bytes (0 when even its means do not
    fit: they are kept whatever the budget)."""
    base = side_bytes(tokens, group, features, 0, bits, block)
    per_rank = side_bytes(tokens, group, features, 1, bits, block) - base
    return int(min(group * features, max(0.0, budget - base) // per_rank))


def grouping_costs(spectra: Mapping[tuple[int, int], Spectrum], rate: float, tokens: int,
                   features: int, bits: int, block: int) -> dict[tuple[int, int], float]:
    """Each candidate group's truncation error when it spends `rate` of its bf16 bytes
    (`choose_groups`' costs: a group of G layers gets G layers' budget)."""
    return {(s, g): truncation_error(spec, rank_within(rate * tokens * g * features * 2,
                                                       tokens, g, features, bits, block))
            for (s, g), spec in spectra.items()}


def fit(x: np.ndarray, rank: int, bits: int, block: int,
        spec: Spectrum | None = None) -> SharedSide:
    """The shared form of a group's blocks x [G, T, F] at `rank`, coefficients in `bits`
    (16: float16; else 8, 4 or 2) quantized per (`block` tokens, column)."""
    if bits not in (16, 8, 4, 2):
        raise ValueError(f"coefficient bits must be one of 16, 8, 4, 2, got {bits}")
    x = np.asarray(x, np.float32)
    g, t, f = x.shape
    if not 0 <= rank <= g * f:
        raise ValueError(f"rank must be in [0, {g * f}], got {rank}")
    spec = spectrum(x) if spec is None or spec.vecs is None else spec
    directions = spec.vecs[:, :rank]  # [G * F, r]
    centered = (x - spec.mean[:, None]) / spec.norm[:, None, None]
    coefs = np.moveaxis(centered, 0, 1).reshape(t, g * f) @ directions  # [T, r]
    basis = directions.T.reshape(rank, g, f) * spec.norm[None, :, None]
    basis = basis.reshape(rank, g * f).astype(FLOAT16)
    mean = spec.mean.astype(FLOAT16)
    if bits == 16:
        empty = np.zeros((0, rank), FLOAT16)
        return SharedSide(mean, basis, coefs.astype(FLOAT16), empty, empty)
    codes, scale, zero = quantize_columns(coefs, bits, block)
    return SharedSide(mean, basis, codes, scale, zero)


def quantize_columns(c: np.ndarray, bits: int, block: int
                     ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Codes [T, r] uint8 and float16 scale and zero [ceil(T / block), r] of c [T, r],
    asymmetric per (block of tokens, column), codes against the stored scale and zero."""
    t, r = c.shape
    n = -(-t // block)
    padded = np.concatenate([c, np.repeat(c[-1:], n * block - t, axis=0)]) if n * block > t else c
    blocks = padded.reshape(n, block, r)
    levels = (1 << bits) - 1
    zero = blocks.min(axis=1).astype(FLOAT16)
    scale = ((blocks.max(axis=1) - zero.astype(np.float32)) / levels).astype(FLOAT16)
    s, z = scale.astype(np.float32)[:, None], zero.astype(np.float32)[:, None]
    inv = np.where(s > 0, 1.0 / np.where(s > 0, s, 1.0), 0.0)
    codes = np.clip(np.floor((blocks - z) * inv + 0.5), 0, levels).astype(np.uint8)
    return codes.reshape(n * block, r)[:t], scale, zero


def coefficients(side: SharedSide, block: int) -> np.ndarray:
    """The side's coefficients [T, r] float32, dequantized."""
    if side.scale.shape[0] == 0:
        return side.codes.astype(np.float32)
    rows = np.arange(side.codes.shape[0]) // block
    return (side.codes.astype(np.float32) * side.scale.astype(np.float32)[rows]
            + side.zero.astype(np.float32)[rows])


def reconstruct(side: SharedSide, block: int) -> np.ndarray:
    """The group's blocks [G, T, F] float32 from its shared form."""
    g, f = side.mean.shape
    c = coefficients(side, block)
    flat = c @ side.basis.astype(np.float32)  # [T, G * F]
    x = np.moveaxis(flat.reshape(-1, g, f), 1, 0)
    return x + side.mean.astype(np.float32)[:, None]


def choose_groups(cost: Mapping[tuple[int, int], float], layers: int,
                  max_group: int) -> list[tuple[int, int]]:
    """Adjacent groups (start, size) covering layers [0, layers) with the least total cost,
    sizes at most `max_group`; cost[(start, size)] is the group's error at its budget. Ties
    go to the larger groups (fewer bases)."""
    best = [0.0] + [np.inf] * layers
    came: list[int] = [0] * (layers + 1)
    for end in range(1, layers + 1):
        for size in range(min(max_group, end), 0, -1):
            total = best[end - size] + cost[(end - size, size)]
            if total < best[end] - 1e-12:
                best[end], came[end] = total, size
    groups, end = [], layers
    while end:
        groups.append((end - came[end], came[end]))
        end -= came[end]
    return groups[::-1]


def allocate_ranks(spectra: Sequence[Spectrum], tokens: int, features: int, bits: int,
                   block: int, budget: int, least: float = 0.0) -> list[int]:
    """Ranks for groups with these spectra (any sides) whose bytes together stay within
    `budget`: each next rank goes to the group whose next direction removes the most error per
    byte it costs (energies fall with rank, so the greedy choice is the optimum of the
    relaxed problem); a direction holding less than `least` of a layer's energy is not kept
    (the budget is spent only where it buys quality). Every group holds its means."""
    sizes = [len(s.norm) for s in spectra]
    ranks = [0] * len(spectra)
    spent = sum(side_bytes(tokens, g, features, 0, bits, block) for g in sizes)
    step = [side_bytes(tokens, g, features, 1, bits, block)
            - side_bytes(tokens, g, features, 0, bits, block) for g in sizes]
    # a further rank also adds one block of scales per column only when quantized: the
    # per-rank cost is the same for every rank of a group
    while True:
        gains = [s.energy[r] / c if r < len(s.energy) and spent + c <= budget
                 and s.energy[r] > least else -1.0
                 for s, r, c in zip(spectra, ranks, step, strict=True)]
        i = int(np.argmax(gains))
        if gains[i] <= 0:
            return ranks
        ranks[i] += 1
        spent += step[i]
