"""`KVPages`: the arrays of a KV format's pages, the one place their layout is written.

A side (keys or values) kept at 16 bits is one array in model dtype (bfloat16 in a
`bfloat16` format, cast as it is written, upcast where attention reads it); a quantized side is
packed uint8 codes with a scale and a zero point array beside them (`kv_quant`), keys per
(page, channel) or, in a `token_keys` format, per (token, group of channels) like values.
Every array has the same leading shape before its per-page dims: the pool is [P, page, ...],
pages gathered out of it [blocks, layers, KV heads, page, ...]. Page 0 of a pool is the null
page: empty table entries point at it, so reads of it are masked and writes to it are dropped
(or garbage). A format with per-token scales on both sides can move single tokens
(`take_tokens`, `put_tokens`), and its pages can be read as a halved format's pages of twice
the tokens (`as_format`: LeanKV's low tier in the same bytes).

Kernels pass a KVPages to `pallas_call` as its present arrays in one fixed order
(`operands`, read back by `from_operands`); the store keeps them as named arrays (`arrays`,
`from_arrays`). Nothing else in jkv spells the six names.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jkv.kv.format import SCALE_DTYPE, KVFormat
from jkv.kv.quant import (
    codes_per_byte,
    dequantize_keys,
    dequantize_value_parts,
    dequantize_values,
    quantize_keys,
    quantize_values,
)

NULL_PAGE = 0
_ORDER = ("k", "k_scale", "k_zero", "v", "v_scale", "v_zero")  # kernel operand order


def _bits(kv_format: KVFormat, name: str) -> int:
    return kv_format.k_bits if name.startswith("k") else kv_format.v_bits


def _is_stat(name: str) -> bool:
    """A scale or zero point array (not codes or model-dtype pages)."""
    return name not in ("k", "v")


def _names(kv_format: KVFormat) -> list[str]:
    """The arrays a format has, in operand order: scales and zeros only on quantized sides."""
    return [n for n in _ORDER if not _is_stat(n) or _bits(kv_format, n) < 16]


def _per_token(kv_format: KVFormat, name: str) -> bool:
    """Whether side `name` has a scale per (token, group) rather than per (page, channel)."""
    return name.startswith("v") or kv_format.token_keys


def _layout(kv_format: KVFormat, page_size: int, head_dim: int) -> dict[str, tuple[int, ...]]:
    """Per-page shape of each array the format has, in operand order; ValueError when
    head_dim does not pack into bytes or split into groups."""
    group = min(kv_format.group, head_dim)
    for side in ("k", "v"):
        bits = _bits(kv_format, side)
        per = codes_per_byte(bits) if bits < 16 else 1
        if head_dim % per:
            raise ValueError(f"head_dim {head_dim} is not a multiple of {per} codes per byte "
                             f"at {side}_bits={bits}")
        if bits < 16 and _per_token(kv_format, side):
            dp = head_dim // codes_per_byte(bits)  # channels of one packed part
            if head_dim % group or (dp % group and group % dp):
                raise ValueError(f"group {group} does not divide head_dim {head_dim} (or the "
                                 f"{dp} channels of one packed part at {side}_bits={bits})")
    shapes = {}
    for name in _names(kv_format):
        bits = _bits(kv_format, name)
        if not _is_stat(name):
            shapes[name] = (page_size, head_dim // (codes_per_byte(bits) if bits < 16 else 1))
        elif _per_token(kv_format, name):
            shapes[name] = (page_size, head_dim // group)
        else:
            shapes[name] = (head_dim,)
    return shapes


def _dtype(kv_format: KVFormat, name: str, dtype):
    """The dtype array `name` is stored in, for model dtype `dtype`."""
    if _is_stat(name):
        return SCALE_DTYPE
    return kv_format.float_dtype(dtype) if _bits(kv_format, name) == 16 else jnp.dtype(jnp.uint8)


@struct.dataclass
class KVPages:
    """Pages of one KV format (see the module docstring); a pytree whose format is static.
    Scales and zero points are None on a side kept in model dtype."""

    k: jax.Array  # [..., page, D // (8 // k_bits)] uint8 codes, or [..., page, D] model dtype
    v: jax.Array  # [..., page, D // (8 // v_bits)] uint8 codes, or [..., page, D] model dtype
    k_scale: jax.Array | None = None  # SCALE_DTYPE [..., D]: per (page, channel), or
    k_zero: jax.Array | None = None  # [..., page, D // group] with token_keys
    v_scale: jax.Array | None = None  # SCALE_DTYPE [..., page, D // group]: per (token, group)
    v_zero: jax.Array | None = None  # SCALE_DTYPE [..., page, D // group]
    kv_format: KVFormat = struct.field(pytree_node=False, default=KVFormat())

    # ------------------------------------------------------------------ building

    @classmethod
    def zeros(cls, num_pages: int, page_size: int, head_dim: int, dtype,
              kv_format: KVFormat) -> KVPages:
        """An empty pool of `num_pages` pages, 16-bit sides in model dtype `dtype` (or
        bfloat16: `KVFormat.float_dtype`);
        ValueError when the format cannot lay out head_dim channels."""
        if page_size <= 0:
            raise ValueError(f"page_size must be positive, got {page_size}")
        return cls(**{name: jnp.zeros((num_pages, *shape), _dtype(kv_format, name, dtype))
                      for name, shape in _layout(kv_format, page_size, head_dim).items()},
                   kv_format=kv_format)

    @classmethod
    def from_dense(cls, k: jax.Array, v: jax.Array, kv_format: KVFormat,
                   dtype=None) -> KVPages:
        """Whole pages of keys and values k, v [..., page, D] in `kv_format`: quantized sides
        as `kv_quant` quantizes them, 16-bit sides cast to `dtype` (None: kept as they are),
        or to bfloat16 in a `bfloat16` format."""
        dtype = jnp.bfloat16 if kv_format.bfloat16 else dtype
        out = {"k": k, "v": v} if dtype is None else {"k": k.astype(dtype), "v": v.astype(dtype)}
        group = min(kv_format.group, v.shape[-1])
        if kv_format.k_bits < 16:
            out["k"], out["k_scale"], out["k_zero"] = (
                quantize_values(k, kv_format.k_bits, group) if kv_format.token_keys
                else quantize_keys(k, kv_format.k_bits))
        if kv_format.v_bits < 16:
            out["v"], out["v_scale"], out["v_zero"] = quantize_values(v, kv_format.v_bits,
                                                                      group)
        return cls(**out, kv_format=kv_format)

    @classmethod
    def from_arrays(cls, kv_format: KVFormat, arrays: Mapping[str, jax.Array]) -> KVPages:
        """Named arrays, as `arrays()` gives them (the store keeps them so), as KVPages;
        ValueError when the names are not the format's."""
        want = _names(kv_format)
        if sorted(arrays) != sorted(want):
            raise ValueError(f"the pages carry {sorted(arrays)}, format {kv_format.name} "
                             f"needs {sorted(want)}")
        return cls(**arrays, kv_format=kv_format)

    @classmethod
    def from_operands(cls, kv_format: KVFormat, operands: list) -> KVPages:
        """Inverse of `operands`: pops this format's arrays (or kernel refs) off the front
        of `operands`, so several KVPages can share one list."""
        return cls(**{name: operands.pop(0) for name in _names(kv_format)},
                   kv_format=kv_format)

    # ------------------------------------------------------------------ reading

    def arrays(self) -> dict[str, jax.Array]:
        """The present arrays by name: what the store saves."""
        return {name: getattr(self, name) for name in _ORDER if getattr(self, name) is not None}

    def operands(self) -> list[jax.Array]:
        """The present arrays in kernel operand order (`from_operands` reads them back)."""
        return list(self.arrays().values())

    @property
    def page_size(self) -> int:
        return self.k.shape[-2]

    @property
    def head_dim(self) -> int:
        bits = self.kv_format.k_bits
        return self.k.shape[-1] * (codes_per_byte(bits) if bits < 16 else 1)

    @property
    def group(self) -> int:
        """Channels per value scale: the format's group, capped at head_dim."""
        return min(self.kv_format.group, self.head_dim)

    @property
    def dtype(self) -> np.dtype | None:
        """The dtype of a side kept at 16 bits; None when both sides are quantized."""
        fmt = self.kv_format
        return self.k.dtype if fmt.k_bits == 16 else self.v.dtype if fmt.v_bits == 16 else None

    @property
    def num_pages(self) -> int:
        """Pages held: the product of the leading shape."""
        return math.prod(self.k.shape[:-2])

    @property
    def nbytes(self) -> int:
        return sum(x.nbytes for x in self.arrays().values())

    def dense(self) -> tuple[jax.Array, jax.Array]:
        """Keys and values dequantized (or cast) to float32 [..., page, D]."""
        fmt = self.kv_format
        k, v = self.k.astype(jnp.float32), self.v.astype(jnp.float32)
        if fmt.k_bits < 16:
            k = (dequantize_values if fmt.token_keys else dequantize_keys)(
                self.k, self.k_scale, self.k_zero, fmt.k_bits)
        if fmt.v_bits < 16:
            v = dequantize_values(self.v, self.v_scale, self.v_zero, fmt.v_bits)
        return k, v

    def value_parts(self) -> list[jax.Array]:
        """Values as float32 channel blocks [..., page, D // parts], one per packed part
        (`kv_quant.dequantize_value_parts`; a single block unless codes share bytes)."""
        if self.kv_format.v_bits == 16:
            return [self.v.astype(jnp.float32)]
        return dequantize_value_parts(self.v, self.v_scale, self.v_zero, self.kv_format.v_bits)

    # ------------------------------------------------------------------ moving pages

    def take(self, ids: jax.Array) -> KVPages:
        """Pages `ids` (any shape) of a pool: leading shape ids.shape, bits as stored."""
        return jax.tree.map(lambda x: x[ids], self)

    def layer(self, index: int) -> KVPages:
        """One layer of gathered pages [blocks, layers, ...]: [blocks, ...]."""
        return jax.tree.map(lambda x: x[:, index], self)

    def put(self, ids: jax.Array, pages: KVPages) -> KVPages:
        """This pool with `pages` (leading shape ids.shape) written at page ids `ids`; null
        ids (0, padding) are dropped. ValueError naming the array that does not fit."""
        if pages.kv_format != self.kv_format:
            raise ValueError(f"pages in format {pages.kv_format} cannot go into a pool in "
                             f"{self.kv_format}")
        dest = jnp.where(ids > NULL_PAGE, ids, self.k.shape[0]).reshape(-1)
        out = {}
        for name, old in self.arrays().items():
            new, want = getattr(pages, name), ids.shape + old.shape[1:]
            if new.shape != want or new.dtype != old.dtype:
                raise ValueError(f"pages.{name} is {new.dtype}{list(new.shape)}, expected "
                                 f"{old.dtype}{list(want)}")
            out[name] = old.at[dest].set(new.reshape(-1, *old.shape[1:]), mode="drop")
        return self.replace(**out)

    def take_tokens(self, ids: jax.Array, offsets: jax.Array) -> KVPages:
        """Token `offsets` of pages `ids` (same shape) of a pool, each as a page of one token:
        leading shape ids.shape. Needs per-token scales on every quantized side."""
        self._check_per_token()
        return jax.tree.map(lambda x: x[ids, offsets][..., None, :], self)

    def put_tokens(self, ids: jax.Array, offsets: jax.Array, tokens: KVPages,
                   where: jax.Array) -> KVPages:
        """This pool with one-token pages `tokens` (leading shape ids.shape) written at
        (ids, offsets) where `where` is set."""
        self._check_per_token()
        if tokens.kv_format != self.kv_format:
            raise ValueError(f"tokens in format {tokens.kv_format} cannot go into a pool in "
                             f"{self.kv_format}")
        dest = jnp.where(where, ids, self.k.shape[0]).reshape(-1)
        offs = offsets.reshape(-1)

        def put(old: jax.Array, new: jax.Array) -> jax.Array:
            return old.at[dest, offs].set(new.reshape(-1, *old.shape[2:]), mode="drop")

        return jax.tree.map(put, self, tokens)

    def as_format(self, kv_format: KVFormat) -> KVPages:
        """The same bytes read as pages of `kv_format` (a LeanKV low tier: `halved()`, twice
        the tokens per page; and back). ValueError unless each array's bytes per page match."""
        fmt = self.kv_format
        if kv_format == fmt:
            return self
        head_dim, lead = self.head_dim, self.k.shape[:-2]
        ratio = self.k.shape[-1] * self.k.dtype.itemsize * codes_per_byte(kv_format.k_bits) \
            / head_dim
        page = self.page_size * ratio
        mine = _layout(fmt, self.page_size, head_dim)
        if page != int(page) or not kv_format.quantized or not fmt.quantized:
            raise ValueError(f"pages in {fmt.name} cannot be read as {kv_format.name}")
        theirs = _layout(kv_format, int(page), head_dim)
        dt = {n: getattr(self, n).dtype for n in mine}
        if list(mine) != list(theirs) or any(
                math.prod(mine[n]) * dt[n].itemsize
                != math.prod(theirs[n]) * jnp.dtype(_dtype(kv_format, n, dt[n])).itemsize
                for n in mine):
            raise ValueError(f"pages in {fmt.name} cannot be read as {kv_format.name}: the "
                             "arrays' bytes per page differ")
        return KVPages(**{n: getattr(self, n).reshape(*lead, *theirs[n]) for n in theirs},
                       kv_format=kv_format)

    def _check_per_token(self) -> None:
        fmt = self.kv_format
        if fmt.page_keys:
            raise ValueError(f"tokens of {fmt.name} pages cannot move alone: its keys are "
                             "scaled per page")

    # ------------------------------------------------------------------ checks

    def check(self, head_dim: int, name: str = "pages") -> None:
        """ValueError unless these are a pool [P, page, ...] in this format's layout for
        `head_dim` channels: kernels index the arrays blindly, so a mismatch would read or
        write out of place."""
        fmt = self.kv_format
        if self.k.ndim != 3:
            raise ValueError(f"{name}.k {list(self.k.shape)} is not a pool [P, page, ...]")
        lead, page = self.k.shape[:-2], self.k.shape[-2]
        layout = _layout(fmt, page, head_dim)
        for field in _ORDER:
            x = getattr(self, field)
            if (x is None) != (field not in layout):
                side = field[0]
                raise ValueError(f"{name}.{side}_scale and {name}.{side}_zero are required "
                                 f"exactly when {side}_bits < 16")
            if x is None:
                continue
            want = (*lead, *layout[field])
            dt = _dtype(fmt, field, x.dtype)  # a 16-bit side: any model dtype (or bfloat16)
            if x.shape != want or x.dtype != dt:
                raise ValueError(f"{name}.{field} is {x.dtype}{list(x.shape)}; head_dim "
                                 f"{head_dim} at {_bits(fmt, field)} bits needs "
                                 f"{dt}{list(want)}")

    def check_saved(self, arrays: Mapping[str, np.ndarray | jax.Array],
                    lead: tuple[int, ...], min_rows: int) -> None:
        """ValueError unless saved named arrays [rows >= min_rows, *lead, per-page dims] are
        this pool's format and dtypes (the store's entries are checked before a restore
        takes any page)."""
        pages = KVPages.from_arrays(self.kv_format, arrays)
        for name, x in pages.arrays().items():
            pool = getattr(self, name)
            want = (*lead, *pool.shape[1:])
            if x.dtype != pool.dtype or tuple(x.shape[1:]) != want or x.shape[0] < min_rows:
                raise ValueError(f"saved pages[{name!r}] are {x.dtype}{list(x.shape)}, this "
                                 f"pool needs {pool.dtype}[>={min_rows}, "
                                 f"{', '.join(map(str, want))}]")
