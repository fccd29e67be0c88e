"""A stored entry moved between forms (`Engine.convert_stored`): KV formats (`kv.kv_forms`),
and the shared-layer form `krul@<rate>`, made as the Krul policy plans it from the entry's own
KV and read back by its reconstruction (`kv.shared_form`)."""

from __future__ import annotations

from collections.abc import Callable

import jax
import numpy as np

from jkv.kv import shared_form
from jkv.kv.format import KVFormat
from jkv.kv.kv_forms import convert_pages
from jkv.kv.shared_form import FormRefused, parse_form
from jkv.pallas_kernels.shared_reconstruct import shared_reconstruct
from jkv.policies import krul


def rebuild(codes: jax.Array, scale: jax.Array, zero: jax.Array, basis: jax.Array,
            mean: jax.Array) -> jax.Array:
    """A group of layers' KV from the shared form: the Pallas kernel on a GPU, XLA elsewhere."""
    if jax.default_backend() == "gpu":
        return shared_reconstruct(codes, scale, zero, basis, mean, block=shared_form.BLOCK)
    return shared_form.rebuild_xla(codes, scale, zero, basis, mean)


def convert_stored(arrays: dict, src: str, dst: str, dtype, *, rotate: Callable, heads: int,
                   page: int) -> dict[str, np.ndarray]:
    """An entry's arrays in form `src` as arrays of form `dst` (16-bit sides in `dtype`).
    `rotate(keys [L, T, H, D], shift [L, T])`: the model's key rotation. FormRefused where
    the shared form would keep the entry poorly; ValueError for arrays not of `src`."""
    if (rate := parse_form(dst)) is not None:
        sides = shared_form.dense_sides(arrays, KVFormat.parse(src), rotate)
        chosen = krul.choose(sides, rate)
        if chosen is None:
            raise FormRefused(f"the shared form at rate {rate:g} would keep this entry's "
                              f"{sides['k'].shape[1]} tokens beyond the error allowed")
        plan, _, spectra = chosen
        return shared_form.encode(sides, plan, heads, spectra)
    if parse_form(src) is not None:
        return shared_form.decode(arrays, KVFormat.parse(dst), dtype, rotate, page, rebuild)
    return convert_pages(arrays, KVFormat.parse(src), KVFormat.parse(dst), dtype)
