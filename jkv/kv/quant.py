"""KV page quantization (pure jnp): asymmetric integer codes, sub-byte codes packed in uint8.

Keys are quantized per channel over the tokens of a page (KIVI: pre-RoPE key outliers live in
a few channels); values per token over groups of channels. A code c stands for
`c * scale + zero`.

Packing of b-bit codes (b < 8) along the channel axis: with k = 8 // b codes per byte and
Dp = D // k, byte j of a token row holds channels j, j + Dp, ..., j + (k - 1) * Dp, the first
in the lowest bits. So unpacking "part" i (shift by b * i, mask) yields the contiguous channel
block [i * Dp, (i + 1) * Dp): kernels dot each part with the matching slice of q and never
interleave channels.

Scales and zero points are stored in `SCALE_DTYPE` (float16); statistics are computed in
float32 and the codes against the stored (rounded) scale and zero, so dequantizing with what
is stored loses nothing more than float32 scales would (measured in the tests).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from jkv.kv.format import SCALE_DTYPE


def codes_per_byte(bits: int) -> int:
    return 8 // bits if bits < 8 else 1


def pack(codes: jax.Array, bits: int) -> jax.Array:
    """uint8 codes [..., D] -> packed uint8 [..., D // (8 // bits)]."""
    k = codes_per_byte(bits)
    if k == 1:
        return codes.astype(jnp.uint8)
    d = codes.shape[-1]
    if d % k:
        raise ValueError(f"head_dim {d} is not a multiple of {k} codes per byte")
    parts = codes.astype(jnp.uint8).reshape(*codes.shape[:-1], k, d // k)
    out = jnp.zeros(parts.shape[:-2] + parts.shape[-1:], jnp.uint8)
    for i in range(k):
        out = out | (parts[..., i, :] << (bits * i))
    return out


def unpack(packed: jax.Array, bits: int) -> jax.Array:
    """Inverse of `pack`: packed uint8 [..., Dp] -> uint8 codes [..., Dp * (8 // bits)]."""
    k = codes_per_byte(bits)
    if k == 1:
        return packed
    # parts along a new axis, shifted by broadcasting: a concatenation would be a select per
    # element in a CPU fusion (it slows the xla backend's dequantization); shifted in
    # int32: the xla backend's decode attention over 4-bit pages runs faster on a CPU than
    # with uint8 shifts
    shifts = jnp.arange(0, 8, bits, dtype=jnp.int32)[:, None]  # [k, 1]: part i, bits * i
    parts = (packed.astype(jnp.int32)[..., None, :] >> shifts) & ((1 << bits) - 1)
    return parts.astype(jnp.uint8).reshape(*packed.shape[:-1], k * packed.shape[-1])


def as_stored(x: jax.Array) -> jax.Array:
    """float32 x rounded to the nearest float16 (`SCALE_DTYPE`; ties to even, subnormals
    and overflow as a conversion gives them), kept in float32: the value a scale or zero
    point has once stored.

    Not `x.astype(float16).astype(float32)`: XLA's GPU compiler drops that round trip where
    it allows excess precision (its SimplifyFPConversions pass), so codes were computed
    against unrounded scales and zero points while the rounded ones were stored (codes off
    by one, scales off by a float16 ulp). Integer operations on the bits and exact float32
    steps are not rewritten. Inside a Pallas kernel the plain round trip is used
    (`_round_trip`): Triton keeps it, and these operations slowed interpret mode."""
    x = x.astype(jnp.float32)
    ax = jnp.abs(x)
    mag = lax.bitcast_convert_type(ax, jnp.int32)
    # normal float16 range: keep 10 of float32's 23 mantissa bits, rounding half to even
    kept = (mag + (0xFFF + ((mag >> 13) & 1))) & ~0x1FFF
    kept = jnp.where(kept >= 0x47800000, 0x7F800000, kept)  # 65520 and above: infinity
    kept = jnp.where(mag >= 0x7F800000, mag, kept)  # inf and nan as they are
    normal = lax.bitcast_convert_type(kept, jnp.float32)
    # below float16's smallest normal (2**-14): multiples of 2**-24, counted exactly in
    # float32 (y < 1024) and rounded half to even by floor (XLA folds `(ax + c) - c`)
    y = ax * 2.0 ** 24
    f = jnp.floor(y)
    odd = f - 2.0 * jnp.floor(f * 0.5)
    up = (y - f > 0.5) | ((y - f == 0.5) & (odd == 1.0))
    tiny = (f + up.astype(jnp.float32)) * 2.0 ** -24
    r = jnp.where(ax < 2.0 ** -14, tiny, normal)
    return jnp.where(x < 0, -r, r)


def _round_trip(x: jax.Array) -> jax.Array:
    return x.astype(SCALE_DTYPE).astype(jnp.float32)


def quantize_codes(x: jax.Array, lo: jax.Array, hi: jax.Array, bits: int,
                   in_kernel: bool = False) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Codes of float32 x between lo and hi (broadcast against x), and the scale and zero
    point as stored (`SCALE_DTYPE`, shaped like lo).

    Shared with the quantize-and-write kernel, so both produce the same codes. The zero point
    is rounded down to the stored dtype (lo moved away from 0 by half its relative precision,
    then rounded to nearest): rounded to nearest, a zero far from 0 (a key channel at +-40
    with a small range) would clip the values below it by up to half its float16 ulp, many
    8-bit steps. Scale and zero are products, not sums of products or quotients: exact in
    XLA and in Triton (whose division is not IEEE, and which may fuse a multiply-add), so
    the stored values agree bit for bit. Codes are computed against the stored scale and
    zero. Rounds half up (floor(y + 0.5)): the Triton lowering has floor but no
    round-half-even. `in_kernel`: called inside a Pallas kernel (`as_stored`).
    """
    stored = _round_trip if in_kernel else as_stored
    levels = (1 << bits) - 1
    half_eps = float(jnp.finfo(SCALE_DTYPE).eps) / 2
    z = stored(lo * jnp.where(lo > 0, 1.0 - half_eps, 1.0 + half_eps))
    s = stored((hi - z) * (1.0 / levels))
    inv = jnp.where(s > 0, 1.0 / jnp.where(s > 0, s, 1.0), 0.0)
    codes = jnp.clip(jnp.floor((x - z) * inv + 0.5), 0, levels).astype(jnp.uint8)
    return codes, s.astype(SCALE_DTYPE), z.astype(SCALE_DTYPE)


# Four levels spread from a group's minimum to its maximum leave most values far from the
# middle two. For 2-bit codes two narrower ranges around the group's midpoint are tried as
# well and the one that reconstructs the group best is kept. Chosen by measurement (lower
# perplexity on calibration documents), see `benchmarks/kv_fidelity.py --docs calibration`;
# ratios down to 0.5 (near the least squared error on Gaussian values) did worse there.
CLIP_RATIOS = (0.9, 0.8)


def group_range(g: jax.Array, bits: int,
                in_kernel: bool = False) -> tuple[jax.Array, jax.Array]:
    """The range (lo, hi) [..., 1] that groups g float32 [..., group] are quantized over:
    min and max, or for 2-bit codes the best of those and the `CLIP_RATIOS` narrowings.
    Shared with the quantize-and-write kernel (`in_kernel`, as for `quantize_codes`)."""
    lo, hi = g.min(axis=-1, keepdims=True), g.max(axis=-1, keepdims=True)
    if bits > 2:
        return lo, hi
    stored = _round_trip if in_kernel else as_stored

    def error(a: jax.Array, b: jax.Array) -> jax.Array:
        codes, scale, zero = quantize_codes(g, a, b, bits, in_kernel)
        # (scale and zero are float16 values already: a dropped round trip changes nothing)
        y = codes.astype(jnp.float32) * scale.astype(jnp.float32) + zero.astype(jnp.float32)
        return ((y - g) * (y - g)).sum(axis=-1, keepdims=True)

    mid, half = (lo + hi) * 0.5, (hi - lo) * 0.5
    best = error(lo, hi)
    for f in CLIP_RATIOS:
        # the half-width rounded to SCALE_DTYPE before it is added: `mid - half * f` is a
        # multiply-add that one compiled program fuses and another does not, and the zero
        # point rounded from it then differed at float16 rounding ties (in 2 of 60 runs of
        # test_kv_write's k4v2 case compiled without LLVM's optimizations)
        w = stored(half * f)
        a, b = mid - w, mid + w
        err = error(a, b)
        better = err < best
        lo, hi, best = (jnp.where(better, a, lo), jnp.where(better, b, hi),
                        jnp.where(better, err, best))
    return lo, hi


def quantize_keys(x: jax.Array, bits: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Keys [..., page, D] -> (packed [..., page, Dp], scale [..., D], zero [..., D])."""
    xf = x.astype(jnp.float32)
    lo, hi = xf.min(axis=-2), xf.max(axis=-2)
    codes, scale, zero = quantize_codes(xf, lo[..., None, :], hi[..., None, :], bits)
    return pack(codes, bits), scale[..., 0, :], zero[..., 0, :]


def quantize_values(x: jax.Array, bits: int,
                    group: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Values [..., page, D] -> (packed [..., page, Dp], scale, zero [..., page, D // group])."""
    *lead, d = x.shape
    if d % group:
        raise ValueError(f"value group {group} does not divide head_dim {d}")
    xf = x.astype(jnp.float32).reshape(*lead, d // group, group)
    lo, hi = group_range(xf, bits)
    codes, scale, zero = quantize_codes(xf, lo, hi, bits)
    return pack(codes.reshape(*lead, d), bits), scale[..., 0], zero[..., 0]


def dequantize_keys(packed: jax.Array, scale: jax.Array, zero: jax.Array,
                    bits: int) -> jax.Array:
    """Inverse of `quantize_keys` up to rounding: float32 [..., page, D]."""
    codes = unpack(packed, bits).astype(jnp.float32)
    scale, zero = scale.astype(jnp.float32), zero.astype(jnp.float32)
    return codes * scale[..., None, :] + zero[..., None, :]


def dequantize_value_parts(packed: jax.Array, scale: jax.Array, zero: jax.Array,
                           bits: int) -> list[jax.Array]:
    """`dequantize_values` as its packed parts: float32 channel blocks [..., page, Dp], block
    i holding channels [i * Dp, (i + 1) * Dp), each shifted by a constant and never
    interleaved with the others (the same values, bit for bit)."""
    k, dp = codes_per_byte(bits), packed.shape[-1]
    groups = scale.shape[-1]
    group = dp * k // groups
    scale, zero = scale.astype(jnp.float32), zero.astype(jnp.float32)
    wide = packed.astype(jnp.int32) if k > 1 else packed
    parts = []
    for i in range(k):
        codes = ((wide >> (bits * i)) & ((1 << bits) - 1)) if k > 1 else wide
        codes = codes.astype(jnp.float32)
        if group >= dp:  # the block lies in one group
            g = i * dp // group
            parts.append(codes * scale[..., g:g + 1] + zero[..., g:g + 1])
            continue
        n = dp // group  # groups in the block
        codes = codes.reshape(*codes.shape[:-1], n, group)
        s, z = scale[..., i * n:(i + 1) * n, None], zero[..., i * n:(i + 1) * n, None]
        parts.append((codes * s + z).reshape(*codes.shape[:-2], dp))
    return parts


def dequantize_values(packed: jax.Array, scale: jax.Array, zero: jax.Array,
                      bits: int) -> jax.Array:
    """Inverse of `quantize_values` up to rounding: float32 [..., page, D]."""
    codes = unpack(packed, bits).astype(jnp.float32)
    *lead, d = codes.shape
    groups = scale.shape[-1]
    codes = codes.reshape(*lead, groups, d // groups)
    scale, zero = scale.astype(jnp.float32), zero.astype(jnp.float32)
    return (codes * scale[..., None] + zero[..., None]).reshape(*lead, d)
