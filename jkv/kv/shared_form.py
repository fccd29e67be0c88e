"""A stored entry in the shared-layer form (`krul@<rate>`): per group of adjacent layers and
side, one basis and quantized per-token coefficients (`jkv.kv.shared_basis`).

Keys are fitted without their rotary rotation: each key is rotated back by its place in the
entry (t = 0..T-1), which leaves the entry's first position's rotation on every key alike (an
orthogonal map the basis absorbs), and rotated forward again when the entry is read, so the
restored key is at its position whatever the entry's offset in the conversation. Which groups
and ranks are kept is the Krul policy's `Plan` (`jkv.policies.krul`); this module carries it
out and reads it back. Entry arrays:

    layout        int32 [groups, 5]: side (0 keys, 1 values), first layer, layers, rank, bits
    shape         int32 [4]: layers, tokens, KV heads, head dim
    sinks.k, sinks.v   float16 [L, S, F]: the first S tokens whole (attention sinks)
    g<i>.mean     float16 [G, F]           g<i>.basis  float16 [r, G * F]
    g<i>.codes    uint8 [T - S, r * bits / 8] (float16 [T - S, r] at 16 bits)
    g<i>.scale, g<i>.zero  float16 [ceil((T - S) / BLOCK), r] (quantized coefficients only)
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jkv.kv import shared_basis as sb
from jkv.kv.buckets import bucket
from jkv.kv.format import KVFormat
from jkv.kv.pages import KVPages
from jkv.kv.quant import pack
from jkv.kv.rotation import rotate as basis_rotate

FORM = "krul"
BLOCK = 64  # tokens per coefficient scale and zero point
SIDES = ("k", "v")
Rotate = Callable[[jax.Array, jax.Array], jax.Array]  # keys [L, T, H, D], shift [L, T]
# a group's KV [T', N] from (codes [T', r], scale, zero [T' / BLOCK, r], basis [r, N], mean [N])
Rebuild = Callable[..., jax.Array]


class FormRefused(ValueError):
    """The shared form would keep this entry poorly (the policy's plan was refused): the store
    keeps it in the pool's format."""


class Plan(NamedTuple):
    """What a shared form keeps: the entry's first `sinks` tokens whole (float16), and for
    the rest per side its adjacent groups (first layer, layers), each group's rank, and the
    coefficients' bits."""

    groups: Mapping[str, list[tuple[int, int]]]
    ranks: Mapping[str, list[int]]
    bits: int
    sinks: int = 0


def parse_form(name: str) -> float | None:
    """The rate (bytes over the entry's bf16 bytes) of a shared form's name `krul@<rate>`,
    None for any other name."""
    way, at, rate = name.partition("@")
    if way != FORM or not at:
        return None
    try:
        value = float(rate)
    except ValueError:
        return None
    return value if math.isfinite(value) and 0 < value < 1 else None


def form_name(rate: float) -> str:
    """The shared form's name at `rate` (`parse_form`'s inverse)."""
    return f"{FORM}@{rate:g}"


def dense_sides(arrays: Mapping[str, np.ndarray], src: KVFormat,
                rotate: Rotate) -> dict[str, np.ndarray]:
    """An entry's pages [n, L, H, page, ...] of format `src` as float32 sides [L, T, H * D],
    keys rotated back by their place in the entry."""
    pages = KVPages.from_arrays(src, {name: jnp.asarray(x) for name, x in arrays.items()})
    k, v = pages.dense()
    if src.rotated:
        k, v = basis_rotate(k), basis_rotate(v)
    n, layers, heads, page, d = k.shape
    k, v = (jnp.moveaxis(x, (0, 3), (1, 2)).reshape(layers, n * page, heads, d)
            for x in (k, v))
    shift = -jnp.broadcast_to(jnp.arange(n * page), (layers, n * page))
    k = rotate(k, shift)
    return {"k": np.asarray(k, np.float32).reshape(layers, n * page, heads * d),
            "v": np.asarray(v, np.float32).reshape(layers, n * page, heads * d)}


def encode(sides: Mapping[str, np.ndarray], plan: Plan, heads: int,
           spectra: Mapping[str, Mapping[tuple[int, int], sb.Spectrum]] | None = None
           ) -> dict[str, np.ndarray]:
    """The entry arrays of `sides` [L, T, F] kept as `plan` says (`spectra`: its groups',
    of the tokens after the sinks, where the plan computed them already)."""
    layers, tokens, features = sides["k"].shape
    out: dict[str, np.ndarray] = {f"sinks.{side}": sides[side][:, :plan.sinks].astype(np.float16)
                                  for side in SIDES}
    layout = []
    for s, side in enumerate(SIDES):
        for (first, size), rank in zip(plan.groups[side], plan.ranks[side], strict=True):
            i = len(layout)
            spec = None if spectra is None else spectra[side][(first, size)]
            part = sb.fit(sides[side][first:first + size, plan.sinks:], rank, plan.bits,
                          BLOCK, spec)
            out[f"g{i}.mean"], out[f"g{i}.basis"] = part.mean, part.basis
            out[f"g{i}.codes"] = (part.codes if plan.bits == 16 else
                                  np.asarray(pack(jnp.asarray(_even(part.codes, plan.bits)),
                                                  plan.bits)))
            if plan.bits < 16:
                out[f"g{i}.scale"], out[f"g{i}.zero"] = part.scale, part.zero
            layout.append((s, first, size, rank, plan.bits))
    out["layout"] = np.asarray(layout, np.int32).reshape(-1, 5)
    out["shape"] = np.asarray([layers, tokens, heads, features // heads], np.int32)
    return out


def _even(codes: np.ndarray, bits: int) -> np.ndarray:
    """Codes [T, r] padded with zero columns to whole bytes of `bits`-bit codes."""
    per = 8 // bits
    pad = -codes.shape[1] % per
    return np.pad(codes, ((0, 0), (0, pad))) if pad else codes


def reconstruct(arrays: Mapping[str, np.ndarray],
                rebuild: Rebuild | None = None) -> dict[str, np.ndarray]:
    """The sides [L, T, F] float32 an entry in the shared form holds (keys still rotated back
    by their place in the entry): one call of `rebuild` per group (default `rebuild_xla`; the
    engine passes the Pallas kernel on a GPU) on operands padded to powers of two, so few
    shapes compile. ValueError when the arrays are not such an entry."""
    try:
        layers, tokens, heads, d = (int(x) for x in arrays["shape"])
        out = {side: np.full((layers, tokens, heads * d), np.nan, np.float32) for side in SIDES}
        for side in SIDES:
            sinks = np.asarray(arrays[f"sinks.{side}"], np.float32)  # [L, S, F]
            out[side][:, :sinks.shape[1]] = sinks
        for i, (s, first, size, rank, bits) in enumerate(np.asarray(arrays["layout"])):
            t, operands = group_operands(arrays, i, int(rank), int(bits))
            group = np.asarray((rebuild or rebuild_xla)(*operands))[:t]  # [T', G * F]
            out[SIDES[s]][first:first + size, tokens - t:] = np.moveaxis(
                group.reshape(t, size, heads * d), 1, 0)
    except (KeyError, ValueError, TypeError, IndexError) as e:
        raise ValueError(f"arrays are not an entry in the shared form: {e}") from e
    if any(np.isnan(x).any() for x in out.values()):
        raise ValueError("arrays are not an entry in the shared form: a layer is missing")
    return out


def group_operands(arrays: Mapping[str, np.ndarray], i: int, rank: int,
                   bits: int) -> tuple[int, tuple[np.ndarray, ...]]:
    """Group i's tokens T' and its (codes [T', r], scale, zero [T' / BLOCK, r], basis [r, N],
    mean [N]) on the host, tokens padded to a power of two of blocks and the rank to a power
    of two (zero codes, scales and zero points: nothing added)."""
    codes = np.asarray(arrays[f"g{i}.codes"])
    t, n = codes.shape[0], -(-codes.shape[0] // BLOCK)
    if bits == 16:
        scale, zero = np.ones((n, rank), np.float16), np.zeros((n, rank), np.float16)
    else:
        per, mask = 8 // bits, (1 << bits) - 1
        codes = np.concatenate([(codes >> (bits * j)) & mask for j in range(per)],
                               axis=1)[:, :rank]  # `quant.unpack`'s order
        scale, zero = np.asarray(arrays[f"g{i}.scale"]), np.asarray(arrays[f"g{i}.zero"])
    blocks, r = bucket(n), bucket(rank)
    codes = np.pad(codes, ((0, blocks * BLOCK - t), (0, r - rank)))
    scale, zero = (np.pad(x, ((0, blocks - n), (0, r - rank))) for x in (scale, zero))
    basis = np.pad(np.asarray(arrays[f"g{i}.basis"]), ((0, r - rank), (0, 0)))
    mean = np.asarray(arrays[f"g{i}.mean"], np.float32).reshape(-1)
    return t, (codes, scale, zero, basis, mean)


@jax.jit
def rebuild_xla(codes: jax.Array, scale: jax.Array, zero: jax.Array, basis: jax.Array,
                mean: jax.Array) -> jax.Array:
    """A group's KV in XLA: each block's scale and zero repeated over its tokens."""
    t = codes.shape[0]
    s = jnp.repeat(scale.astype(jnp.float32), BLOCK, axis=0)[:t]
    z = jnp.repeat(zero.astype(jnp.float32), BLOCK, axis=0)[:t]
    return (codes.astype(jnp.float32) * s + z) @ basis.astype(jnp.float32) + mean


def decode(arrays: Mapping[str, np.ndarray], dst: KVFormat, dtype,
           rotate: Rotate, page: int, rebuild: Rebuild | None = None) -> dict[str, np.ndarray]:
    """An entry in the shared form as pages [T // page, L, H, page, ...] of format `dst`
    (16-bit sides in `dtype`), keys rotated to their places."""
    sides = reconstruct(arrays, rebuild)
    heads, tokens = int(arrays["shape"][2]), int(arrays["shape"][1])
    n = tokens // page  # padded to a power of two of pages: few compiled shapes
    k, v = (np.pad(sides[s], ((0, 0), (0, (bucket(n) - n) * page), (0, 0))) for s in SIDES)
    pages = _pages(k, v, heads=heads, page=page, dst=dst, dtype=jnp.dtype(dtype), rotate=rotate)
    return {name: np.asarray(x)[:n] for name, x in jax.device_get(pages.arrays()).items()}


@partial(jax.jit, static_argnames=("heads", "page", "dst", "dtype", "rotate"))
def _pages(k: jax.Array, v: jax.Array, *, heads: int, page: int, dst: KVFormat, dtype,
           rotate: Rotate) -> KVPages:
    layers, tokens, f = k.shape
    k, v = (x.reshape(layers, tokens, heads, f // heads) for x in (k, v))
    k = rotate(k, jnp.broadcast_to(jnp.arange(tokens), (layers, tokens)))
    k, v = (jnp.moveaxis(x.reshape(layers, tokens // page, page, heads, f // heads), (1, 2),
                         (0, 3)) for x in (k, v))
    if dst.rotated:
        k, v = basis_rotate(k), basis_rotate(v)
    return KVPages.from_dense(k, v, dst, dtype)


def shared_groups(arrays: Mapping[str, np.ndarray]) -> int:
    """Groups of more than one layer in an entry in the shared form."""
    return int(np.sum(np.asarray(arrays["layout"])[:, 2] > 1))


__all__ = ["BLOCK", "FORM", "FormRefused", "Plan", "decode", "dense_sides", "encode",
           "form_name", "group_operands", "parse_form", "rebuild_xla", "reconstruct",
           "shared_groups"]
