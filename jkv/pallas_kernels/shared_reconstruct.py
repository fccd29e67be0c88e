"""Shared-basis reconstruction (Pallas, Triton lowering): a group of layers' keys or values
rebuilt from the shared-layer form, the coefficients dequantized inside the kernel.

One program per (block of `block` tokens, the rows one scale and zero point cover; block of
`block_n` features): the codes [block, R] are dequantized with that block's scale and zero
[1, R] into float32, multiplied by the basis tile [R, block_n] and the features' means added.
The rank R is padded to a power of two of at least 16 with zero codes, scales and zero points
(which add nothing), tokens to whole blocks and features to whole tiles; the padding is cut off
on return. Float16 coefficients (16-bit forms) come with scales of one and zero points of zero.
The dot runs at the backend's default float32 precision (TF32 on recent NVIDIA GPUs): the
coefficients it multiplies carry 4 or 8 bits.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pl_triton


def _kernel(codes_ref, scale_ref, zero_ref, basis_ref, mean_ref, out_ref):
    # codes_ref: [block, R] uint8 codes (or float16 coefficients)
    # scale_ref, zero_ref: [1, R] float16: the block's dequantization
    # basis_ref: [R, block_n] float16; mean_ref: [1, block_n] float32
    # out_ref: [block, block_n] float32
    coefs = (codes_ref[...].astype(jnp.float32) * scale_ref[...].astype(jnp.float32)
             + zero_ref[...].astype(jnp.float32))
    out_ref[...] = jnp.dot(coefs, basis_ref[...].astype(jnp.float32),
                           preferred_element_type=jnp.float32) + mean_ref[...]


def _pow2(n: int, least: int) -> int:
    return max(least, 1 << max(0, (n - 1).bit_length()))


def _check(codes, scale, zero, basis, mean, block: int) -> None:
    t, r = codes.shape
    n = -(-t // block)
    if scale.shape != (n, r) or zero.shape != (n, r):
        raise ValueError(f"scale and zero must be [{n}, {r}] for codes {codes.shape} in "
                         f"blocks of {block}, got {scale.shape} and {zero.shape}")
    if basis.ndim != 2 or basis.shape[0] != r:
        raise ValueError(f"basis must be [{r}, N], got {basis.shape}")
    if mean.shape != (basis.shape[1],):
        raise ValueError(f"mean must be [{basis.shape[1]}], got {mean.shape}")
    if block & (block - 1):
        raise ValueError(f"block must be a power of two, got {block}")


@functools.partial(jax.jit, static_argnames=("block", "block_n", "num_warps", "interpret"))
def shared_reconstruct(
    codes: jax.Array,  # [T, R] uint8 codes (or float16 coefficients)
    scale: jax.Array,  # [ceil(T / block), R] float16
    zero: jax.Array,  # [ceil(T / block), R] float16
    basis: jax.Array,  # [R, N] float16: the group's layers side by side
    mean: jax.Array,  # [N] float32
    *,
    block: int = 64,
    block_n: int = 64,
    num_warps: int = 4,
    interpret: bool = False,
) -> jax.Array:
    """The group's KV [T, N] float32: (codes * scale + zero) @ basis + mean, each token's
    scale and zero those of its block of `block` tokens."""
    _check(codes, scale, zero, basis, mean, block)
    t, r = codes.shape
    n = basis.shape[1]
    rp, bn = _pow2(r, 16), min(block_n, _pow2(n, 16))
    tp, np_ = -(-t // block) * block, -(-n // bn) * bn
    codes = jnp.pad(codes, ((0, tp - t), (0, rp - r)))
    scale, zero = (jnp.pad(x, ((0, 0), (0, rp - r))) for x in (scale, zero))
    basis = jnp.pad(basis, ((0, rp - r), (0, np_ - n)))
    mean = jnp.pad(mean.astype(jnp.float32), (0, np_ - n))[None]
    out = pl.pallas_call(
        _kernel,
        grid=(tp // block, np_ // bn),
        in_specs=[pl.BlockSpec((block, rp), lambda i, j: (i, 0)),
                  pl.BlockSpec((1, rp), lambda i, j: (i, 0)),
                  pl.BlockSpec((1, rp), lambda i, j: (i, 0)),
                  pl.BlockSpec((rp, bn), lambda i, j: (0, j)),
                  pl.BlockSpec((1, bn), lambda i, j: (0, j))],
        out_specs=pl.BlockSpec((block, bn), lambda i, j: (i, j)),
        out_shape=jax.ShapeDtypeStruct((tp, np_), jnp.float32),
        compiler_params=pl_triton.CompilerParams(num_warps=num_warps, num_stages=2),
        interpret=interpret,
        name="jkv_shared_reconstruct",
    )(codes, scale, zero, basis, mean)
    return out[:t, :n]


def shared_reconstruct_reference(codes: jax.Array, scale: jax.Array, zero: jax.Array,
                                 basis: jax.Array, mean: jax.Array,
                                 block: int = 64) -> jax.Array:
    """The same in plain jnp, each token's scale gathered by its block."""
    _check(codes, scale, zero, basis, mean, block)
    rows = jnp.arange(codes.shape[0]) // block
    coefs = (codes.astype(jnp.float32) * scale[rows].astype(jnp.float32)
             + zero[rows].astype(jnp.float32))
    return coefs @ basis.astype(jnp.float32) + mean.astype(jnp.float32)
