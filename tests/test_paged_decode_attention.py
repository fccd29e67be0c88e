"""Paged decode attention kernel against its references, on fresh random inputs every run.

On CPU the kernel runs in interpret mode; on a GPU the same tests compile it with Triton.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from covering import rotated_cover

from jkv.kv.format import KV_FORMATS, KVFormat
from jkv.kv.pages import KVPages
from jkv.kv.quant import quantize_keys, quantize_values
from jkv.pallas_kernels.paged_decode_attention import (
    DEQUANT,
    dequantized_rows,
    paged_decode_attention,
    paged_decode_attention_reference,
)
from jkv.pallas_kernels.softmax_state import merge_softmax_states, normalize_softmax_state

INTERPRET = jax.default_backend() == "cpu"
# (k_bits, v_bits, token_keys) of every named format
FORMATS = sorted({(f.k_bits, f.v_bits, f.token_keys) for f in KV_FORMATS.values()},
                 reverse=True)
PAIRS = sorted({(k, v) for k, v, _ in FORMATS}, reverse=True)
# A covering design that keeps the suite's time in bounds: each per-channel format over three
# of the shapes, rotated so that every shape meets two or three formats (a format's arithmetic
# and a shape's tiling fail apart); per-token key scales (the values' arithmetic on the key
# side) over one.
SHAPES = [(gqa, d) for gqa in (1, 3, 4, 8) for d in (64, 128)]
FORMAT_SHAPES = rotated_cover([f for f in FORMATS if not f[2]], SHAPES, 3, stride=3)
FORMAT_SHAPES += [(*f, 3, 128) for f in FORMATS if f[2]]
FORMAT_DTYPES = [(*f, dt) for f in FORMATS
                 for dt in ([jnp.bfloat16, jnp.float32] if not f[2] else [jnp.bfloat16])]
# float16 dequantization everywhere; float32's only where it differs (16-bit q, quantized)
LOWERING_CASES = [(*f, "f16") for f in FORMAT_DTYPES] + [
    (*f, "f32") for f in FORMAT_DTYPES if f[3] == jnp.bfloat16 and f[:2] != (16, 16)]
PAGE, GROUP = 8, 32


def make_case(rng, *, b, hkv, gqa, d, width, lengths, k_bits, v_bits, dtype=jnp.float32,
              token_keys=False):
    """Random q and a pool whose pages are shuffled across rows. Pages the kernel must not
    read (the null page 0, pages wholly past a row's length) are poisoned."""
    pool = b * hkv * width + 1
    q = jnp.asarray(rng.normal(size=(b, hkv * gqa, d)), dtype)
    k = rng.normal(size=(pool, PAGE, d)) * (1 + 4 * (rng.random(d) < 0.1))  # outlier channels
    v = rng.normal(size=(pool, PAGE, d))
    table = 1 + rng.permutation(pool - 1).reshape(b, hkv, width)
    unread = [0] + [p for row, n in zip(table.reshape(b * hkv, width),
                                        np.asarray(lengths).reshape(-1), strict=True)
                    for p in row[-(-n // PAGE):]]
    k[unread], v[unread] = 1e4, -1e4
    pages = KVPages.from_dense(jnp.asarray(k, dtype), jnp.asarray(v, dtype),
                               KVFormat(k_bits, v_bits, GROUP, token_keys))
    return q, pages, jnp.asarray(table, jnp.int32), jnp.asarray(lengths, jnp.int32)


def float64_reference(q, pages, table, lengths):
    """Attention in float64 (numpy) over the very same dequantized pages."""
    kd, vd = dequantized_rows(pages, table)
    kd, vd = np.asarray(kd, np.float64), np.asarray(vd, np.float64)
    b, hq, d = q.shape
    hkv = table.shape[1]
    qg = np.asarray(q, np.float64).reshape(b, hkv, hq // hkv, d) / np.sqrt(d)
    s = np.einsum("bhgd,bhsd->bhgs", qg, kd)
    s = np.where(np.arange(kd.shape[2]) < np.asarray(lengths)[:, :, None, None], s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    return np.einsum("bhgs,bhsd->bhgd", p, vd).reshape(b, hq, d)


def rel_err(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


@pytest.mark.parametrize("k_bits,v_bits,token_keys,gqa,d", FORMAT_SHAPES)
def test_kernel_matches_float64_reference(k_bits, v_bits, token_keys, gqa, d):
    rng = np.random.default_rng()
    width = 8  # pages per row: 64 tokens
    # ragged: a single token, exact page multiples, partial pages, a full row
    lengths = [[1, 2 * PAGE], [width * PAGE, 1 + int(rng.integers(1, width * PAGE - 1))]]
    q, pages, table, lengths = make_case(rng, b=2, hkv=2, gqa=gqa, d=d, width=width,
                                         lengths=lengths, k_bits=k_bits, v_bits=v_bits,
                                         token_keys=token_keys)
    want = float64_reference(q, pages, table, lengths)
    ref = paged_decode_attention_reference(q, pages, table, lengths)
    assert rel_err(ref, want) < 1e-5
    for splits, ppb in ((1, 2), (4, 2), (2, 4)):  # unsplit and split-K
        run = functools.partial(paged_decode_attention, k_splits=splits, pages_per_block=ppb,
                                interpret=INTERPRET)
        out = run(q, pages, table, lengths)
        assert out.shape == q.shape and out.dtype == q.dtype
        assert np.isfinite(np.asarray(out)).all()
        err = rel_err(out, want)
        assert err < 1e-5, f"k{k_bits}v{v_bits} gqa={gqa} d={d} splits={splits}: {err:.2e}"


def test_scales_are_separate_from_pages():
    """A second layer reading the same pages through its own scales (cross-layer sharing)."""
    rng = np.random.default_rng()
    q, pages, table, lengths = make_case(rng, b=1, hkv=2, gqa=4, d=64, width=4,
                                         lengths=[[20, 32]], k_bits=4, v_bits=2)
    def scaled(a):
        return (a * rng.uniform(0.5, 2.0, a.shape)).astype(a.dtype)

    other = pages.replace(k_scale=scaled(pages.k_scale), k_zero=scaled(pages.k_zero),
                          v_scale=scaled(pages.v_scale), v_zero=scaled(pages.v_zero))
    run = functools.partial(paged_decode_attention, pages_per_block=2, interpret=INTERPRET)
    mine, theirs = run(q, pages, table, lengths), run(q, other, table, lengths)
    assert rel_err(theirs, float64_reference(q, other, table, lengths)) < 1e-5
    assert rel_err(mine, theirs) > 1e-3


def test_bf16_pages():
    rng = np.random.default_rng()
    q, pages, table, lengths = make_case(rng, b=2, hkv=2, gqa=4, d=64, width=4,
                                         lengths=[[5, 32], [17, 1]], k_bits=16, v_bits=16,
                                         dtype=jnp.bfloat16)
    out = paged_decode_attention(q, pages, table, lengths, pages_per_block=2,
                                 interpret=INTERPRET)
    assert out.dtype == jnp.bfloat16
    assert rel_err(out, float64_reference(q, pages, table, lengths)) < 2e-2


def test_float32_queries_over_bf16_pages():
    """kv_format bf16 under a float32 model: bfloat16 pages read upcast, as near the float64
    attention over the very same pages as float32 pages are."""
    rng = np.random.default_rng()
    q, pages, table, lengths = make_case(rng, b=2, hkv=2, gqa=4, d=64, width=4,
                                         lengths=[[5, 32], [17, 1]], k_bits=16, v_bits=16)
    pages = KVPages.from_dense(*pages.dense(), KV_FORMATS["bf16"])
    assert pages.k.dtype == pages.v.dtype == jnp.bfloat16
    out = paged_decode_attention(q, pages, table, lengths, pages_per_block=2,
                                 interpret=INTERPRET)
    assert out.dtype == jnp.float32
    assert rel_err(out, float64_reference(q, pages, table, lengths)) < 1e-5


@pytest.mark.parametrize("k_bits,v_bits", PAIRS)
def test_quantization_error_per_format(k_bits, v_bits):
    """Reported, and ordered: fewer bits never reconstruct better."""
    rng = np.random.default_rng()
    x = jnp.asarray(rng.normal(size=(64, PAGE, 64)), jnp.float32)
    from jkv.kv.quant import dequantize_keys, dequantize_values

    errs = {}
    for bits in (8, 4, 2):
        errs[("k", bits)] = rel_err(dequantize_keys(*quantize_keys(x, bits), bits), x)
        errs[("v", bits)] = rel_err(dequantize_values(*quantize_values(x, bits, GROUP), bits), x)
    ek = errs[("k", k_bits)] if k_bits < 16 else 0.0
    ev = errs[("v", v_bits)] if v_bits < 16 else 0.0
    print(f"k{k_bits}v{v_bits}: key relative error {ek:.3e}, value relative error {ev:.3e}")
    for kind in "kv":
        assert errs[(kind, 8)] < errs[(kind, 4)] < errs[(kind, 2)] < 0.5


def test_bad_shapes_raise_value_errors():
    rng = np.random.default_rng()
    q, pages, table, lengths = make_case(rng, b=1, hkv=2, gqa=2, d=64, width=4,
                                         lengths=[[4, 4]], k_bits=8, v_bits=8)
    with pytest.raises(ValueError, match="k_scale"):
        paged_decode_attention(q, KVPages(pages.k, pages.v, kv_format=pages.kv_format), table,
                               lengths, interpret=True)
    with pytest.raises(ValueError, match="multiple of k_splits"):
        paged_decode_attention(q, pages, table, lengths, k_splits=3, interpret=True)
    with pytest.raises(ValueError, match="head_dim"):
        paged_decode_attention(q, pages.replace(kv_format=KVFormat(4, 8, GROUP)), table,
                               lengths, interpret=True)
    low = pages.replace(k=pages.k[:, :3], v=pages.v[:, :3], v_scale=pages.v_scale[:, :3],
                        v_zero=pages.v_zero[:, :3])
    with pytest.raises(ValueError, match="low tier's page size 3"):
        paged_decode_attention(q, pages, table, lengths, low_tier=low, low_lengths=lengths,
                               interpret=True)


# 16-bit queries: every quantized format, each way of dequantizing
HALF_CASES = [(*f, dq) for f in FORMATS if f[:2] != (16, 16) for dq in DEQUANT]


@pytest.mark.parametrize("k_bits,v_bits,token_keys,dequant", HALF_CASES)
def test_bf16_queries_over_quantized_pages(k_bits, v_bits, token_keys, dequant):
    """bf16 q: the dots run in 16 bits (float16 codes and scales with dequant="f16", float32
    dequantization cast to bf16 with "f32"), output in bf16: within bf16's rounding of the
    float64 attention over the same dequantized pages (measured about 1.5e-3 for f16 and
    2.2e-3 for f32; one wrong group scale costs far more)."""
    rng = np.random.default_rng()
    q, pages, table, lengths = make_case(rng, b=2, hkv=2, gqa=4, d=128, width=8,
                                         lengths=[[1, 2 * PAGE], [64, 30]], k_bits=k_bits,
                                         v_bits=v_bits, dtype=jnp.bfloat16,
                                         token_keys=token_keys)
    want = float64_reference(q, pages, table, lengths)
    out = paged_decode_attention(q, pages, table, lengths, k_splits=2, pages_per_block=2,
                                 dequant=dequant, interpret=INTERPRET)
    assert out.dtype == jnp.bfloat16
    assert rel_err(out, want) < 4e-3


@pytest.mark.parametrize("k_bits,v_bits,token_keys,dtype,dequant", LOWERING_CASES)
def test_lowers_for_cuda_with_triton(k_bits, v_bits, token_keys, dtype, dequant):
    """Runs the Pallas-to-Triton lowering on any machine, so lowering errors fail CI here."""
    rng = np.random.default_rng()
    q, pages, table, lengths = make_case(rng, b=2, hkv=2, gqa=4, d=128, width=8,
                                         lengths=[[1, 9], [64, 30]], k_bits=k_bits,
                                         v_bits=v_bits, dtype=dtype, token_keys=token_keys)
    q = q.astype(dtype)
    run = functools.partial(paged_decode_attention, k_splits=2, pages_per_block=4,
                            dequant=dequant)
    lowered = jax.jit(run).trace(q, pages, table, lengths).lower(lowering_platforms=("cuda",))
    assert "__gpu$xla.gpu.triton" in lowered.as_text()


def test_cuda_lowering_catches_triton_errors():
    """The route above really lowers: a non-power-of-two block is refused."""
    rng = np.random.default_rng()
    q, pages, table, lengths = make_case(rng, b=1, hkv=1, gqa=4, d=64, width=6,
                                         lengths=[[9]], k_bits=16, v_bits=16)
    run = functools.partial(paged_decode_attention, pages_per_block=3)
    with pytest.raises(Exception, match="power of 2"):
        jax.jit(run).trace(q, pages, table, lengths).lower(lowering_platforms=("cuda",))


def make_tier(rng, num_pages, d, k_bits, v_bits, dtype=jnp.float32, token_keys=False):
    """A pool of random pages in one format; page 0 (the null page) is poisoned."""
    k = rng.normal(size=(num_pages, PAGE, d)) * (1 + 4 * (rng.random(d) < 0.1))
    v = rng.normal(size=(num_pages, PAGE, d))
    k[0], v[0] = 1e4, -1e4
    return KVPages.from_dense(jnp.asarray(k, dtype), jnp.asarray(v, dtype),
                              KVFormat(k_bits, v_bits, GROUP, token_keys))


# (high, low) formats: separate pools with pages of one size, and LeanKV's pair, the low
# tier being the high pool's own pages read at half the bits with twice the tokens
TIER_PAIRS = [((16, 16), (8, 4)), ((8, 8), (4, 2)), ((8, 4), (4, 2)), ((4, 4), (8, 8)),
              ((8, 4), "halved"), ((4, 8), "halved")]


def tier_case(rng, hi, lo, lens, d, width):
    """Tables [B, Hkv, W] holding lens[..., 0] high tokens from the left and lens[..., 1] low
    ones from the right, and the two tiers (low None when `lo` is None)."""
    b, hkv = lens.shape[:2]
    halved = lo == "halved"
    pool = b * hkv * width + 1
    high = make_tier(rng, pool, d, *hi, token_keys=halved)
    low = (high.as_format(high.kv_format.halved()) if halved
           else None if lo is None else make_tier(rng, pool, d, *lo))
    page_lo = PAGE if low is None else low.page_size
    tables = np.zeros((b, hkv, width), np.int32)
    ids = iter(1 + rng.permutation(pool - 1))  # one id space: halved tiers share the pool
    for i in range(b):
        for h in range(hkv):
            nh, nl = -(-lens[i, h, 0] // PAGE), -(-lens[i, h, 1] // page_lo)
            assert nh + nl <= width
            tables[i, h, :nh] = [next(ids) for _ in range(nh)]
            tables[i, h, width - nl:] = [next(ids) for _ in range(nl)][::-1]
    return high, low, tables


def float64_two_tiers(q, high, low, table, lens):
    """Attention in float64 over both tiers dequantized, the low one read right to left."""
    b, hq, d = q.shape
    hkv = table.shape[1]
    kh, vh = dequantized_rows(high, table)
    kl, vl = dequantized_rows(low, table[..., ::-1])
    k = np.concatenate([kh, kl], axis=2).astype(np.float64)
    v = np.concatenate([vh, vl], axis=2).astype(np.float64)
    mask = np.concatenate([np.arange(kh.shape[2]) < lens[..., :1],
                           np.arange(kl.shape[2]) < lens[..., 1:]], axis=-1)
    qg = np.asarray(q, np.float64).reshape(b, hkv, hq // hkv, d) / np.sqrt(d)
    s = np.where(mask[:, :, None], np.einsum("bhgd,bhsd->bhgs", qg, k), -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    return np.einsum("bhgs,bhsd->bhgd", p / p.sum(-1, keepdims=True), v).reshape(b, -1, d)


# every pair at one shape, LeanKV's halved pairs at a second
@pytest.mark.parametrize("hi,lo,gqa,d", [(*p, 3, 64) for p in TIER_PAIRS]
                         + [(*p, 4, 128) for p in TIER_PAIRS if p[1] == "halved"])
def test_two_tiers_in_one_row(hi, lo, gqa, d):
    """High-precision pages from the left of each row, low-precision ones from the right."""
    rng = np.random.default_rng()
    b, hkv, width = 2, 2, 8
    per_lo = 2 * PAGE if lo == "halved" else PAGE
    # (high tokens, low tokens) per row: empty low tier, single tokens, exact multiples,
    # partial pages, a row filled from both ends
    lens = np.array([[[1, 0], [2 * PAGE, 3 * per_lo]],
                     [[13, 1], [4 * PAGE, 4 * per_lo]]])
    high, low, tables = tier_case(rng, hi, lo, lens, d, width)
    q = jnp.asarray(rng.normal(size=(b, hkv * gqa, d)), jnp.float32)
    table, hl, ll = jnp.asarray(tables), jnp.asarray(lens[..., 0]), jnp.asarray(lens[..., 1])
    want = float64_two_tiers(q, high, low, table, lens)
    tier_args = dict(low_tier=low, low_lengths=ll)
    ref = paged_decode_attention_reference(q, high, table, hl, **tier_args)
    assert rel_err(ref, want) < 1e-5
    for splits, ppb in ((1, 2), (4, 2), (1, 8)):
        out = paged_decode_attention(q, high, table, hl, k_splits=splits, pages_per_block=ppb,
                                     interpret=INTERPRET, **tier_args)
        err = rel_err(out, want)
        assert err < 1e-5, f"{hi}+{lo} splits={splits} ppb={ppb}: {err:.2e}"


def test_groups_narrower_than_a_dot_keep_the_float32_path():
    """Values in groups of 8 channels: float16 parts would be 8 wide, below the 16 a GPU
    dot needs, so dequant="f16" runs the float32 path (the same output, bit for bit)."""
    rng = np.random.default_rng()
    q, _, table, lengths = make_case(rng, b=1, hkv=2, gqa=4, d=64, width=4,
                                     lengths=[[20, 32]], k_bits=8, v_bits=4,
                                     dtype=jnp.bfloat16)
    kv = jnp.asarray(rng.normal(size=(2, 9, PAGE, 64)), jnp.bfloat16)
    pages = KVPages.from_dense(kv[0], kv[1], KVFormat(8, 4, 8))
    run = functools.partial(paged_decode_attention, q, pages, table, lengths,
                            pages_per_block=2, interpret=INTERPRET)
    np.testing.assert_array_equal(np.asarray(run(dequant="f16"), np.float32),
                                  np.asarray(run(dequant="f32"), np.float32))
    assert rel_err(run(), float64_reference(q, pages, table, lengths)) < 4e-3


@pytest.mark.parametrize("hi,lo", [((8, 4), (4, 2)), ((4, 8), "halved")])
def test_two_tiers_with_float16_dequantization(hi, lo):
    """LeanKV's pair and two separate pools, bf16 q, dequantized in float16: the parts
    follow the finer of the two tiers' groups."""
    rng = np.random.default_rng()
    b, hkv, gqa, d, width = 2, 2, 4, 128, 8
    per_lo = 2 * PAGE if lo == "halved" else PAGE
    lens = np.array([[[1, 0], [2 * PAGE, 3 * per_lo]], [[13, 1], [4 * PAGE, 4 * per_lo]]])
    high, low, tables = tier_case(rng, hi, lo, lens, d, width)
    q = jnp.asarray(rng.normal(size=(b, hkv * gqa, d)), jnp.bfloat16)
    table, hl, ll = jnp.asarray(tables), jnp.asarray(lens[..., 0]), jnp.asarray(lens[..., 1])
    out = paged_decode_attention(q, high, table, hl, k_splits=2, pages_per_block=2,
                                 low_tier=low, low_lengths=ll, dequant="f16",
                                 interpret=INTERPRET)
    assert rel_err(out, float64_two_tiers(q, high, low, table, lens)) < 4e-3


def test_softmax_states_merge_to_the_whole():
    """Attention over a row equals the merge of attention over its two halves."""
    rng = np.random.default_rng()
    q, pages, table, lengths = make_case(rng, b=2, hkv=2, gqa=4, d=64, width=8,
                                         lengths=[[64, 40], [33, 64]], k_bits=8, v_bits=4)
    run = functools.partial(paged_decode_attention, pages_per_block=2, interpret=INTERPRET)
    whole = run(q, pages, table, lengths)
    first = run(q, pages, table[..., :4], jnp.minimum(lengths, 4 * PAGE),
                return_softmax_state=True)
    second = run(q, pages, table[..., 4:], jnp.maximum(lengths - 4 * PAGE, 0),
                 return_softmax_state=True)
    states = (jnp.stack(x) for x in zip(first, second, strict=True))
    o, denom, _ = merge_softmax_states(*states, axis=0)
    assert rel_err(normalize_softmax_state(o, denom), whole) < 1e-5


def test_two_tiers_lower_for_cuda_with_triton():
    rng = np.random.default_rng()
    high, low = make_tier(rng, 9, 128, 8, 8), make_tier(rng, 9, 128, 4, 2)
    q = jnp.asarray(rng.normal(size=(2, 8, 128)), jnp.bfloat16)
    table = jnp.asarray(rng.integers(1, 9, (2, 2, 8)), jnp.int32)
    hl, ll = jnp.full((2, 2), 20, jnp.int32), jnp.full((2, 2), 9, jnp.int32)
    run = functools.partial(paged_decode_attention, k_splits=2, pages_per_block=2,
                            low_tier=low, low_lengths=ll)
    lowered = jax.jit(run).trace(q, high, table, hl).lower(lowering_platforms=("cuda",))
    assert "__gpu$xla.gpu.triton" in lowered.as_text()


def float64_significance(q, tiers, table, lens):
    """Max over each KV head's query heads of the attention every key gets, in float64, in
    each tier's slot order: (high, low or None); `lens` [B, Hkv, 2] (high, low tokens)."""
    high, low = tiers
    b, hq, d = q.shape
    hkv = table.shape[1]
    kh, _ = dequantized_rows(high, table)
    ks, masks = [np.asarray(kh, np.float64)], [np.arange(kh.shape[2]) < lens[..., :1]]
    if low is not None:
        kl, _ = dequantized_rows(low, table[..., ::-1])
        ks.append(np.asarray(kl, np.float64))
        masks.append(np.arange(kl.shape[2]) < lens[..., 1:])
    k, mask = np.concatenate(ks, axis=2), np.concatenate(masks, axis=-1)
    qg = np.asarray(q, np.float64).reshape(b, hkv, hq // hkv, d) / np.sqrt(d)
    s = np.where(mask[:, :, None], np.einsum("bhgd,bhsd->bhgs", qg, k), -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    sig = (p / p.sum(-1, keepdims=True)).max(axis=2)
    n = kh.shape[2]
    return sig[..., :n], (sig[..., n:] if low is not None else None)


def max_diff(got, want) -> float:
    """Largest difference of a significance (an array, or a (high, low) pair) from float64."""
    got = got if isinstance(got, tuple) else (got, None)
    return max(np.abs(np.asarray(g) - w).max() for g, w in zip(got, want, strict=True)
               if w is not None)


@pytest.mark.parametrize("hi,lo", [((16, 16), None), ((8, 4), None), ((8, 4), (4, 2)),
                                   ((8, 4), "halved")])
def test_significance_is_each_keys_attention_in_slot_order(hi, lo):
    """The kernel's significance (written in the same pass as the output) against float64
    and the reference, over one or two tiers and any number of splits; slots that hold
    no token are 0, and the output is unchanged by asking for it."""
    rng = np.random.default_rng()
    b, hkv, gqa, d, width = 2, 2, 3, 64, 8
    per_lo = 2 * PAGE if lo == "halved" else PAGE
    lens = np.array([[[1, 0], [2 * PAGE, 3 * per_lo]], [[13, 9], [4 * PAGE + 5, 0]]])
    if lo is None:
        lens[..., 1] = 0
    high, low, tables = tier_case(rng, hi, lo, lens, d, width)
    q = jnp.asarray(rng.normal(size=(b, hkv * gqa, d)) * 2, jnp.float32)
    table, hl, ll = jnp.asarray(tables), jnp.asarray(lens[..., 0]), jnp.asarray(lens[..., 1])
    tier_args = {} if low is None else dict(low_tier=low, low_lengths=ll)

    want = float64_significance(q, (high, low), tables, lens)
    held = sum(int((w > 0).sum()) for w in want if w is not None)
    assert held == lens.sum()  # every held token gets some attention, nothing else
    _, ref = paged_decode_attention_reference(q, high, table, hl, return_significance=True,
                                              **tier_args)
    assert max_diff(ref, want) < 1e-5
    for splits, ppb in ((1, 2), (4, 2)):
        run = functools.partial(paged_decode_attention, q, high, table, hl, k_splits=splits,
                                pages_per_block=ppb, interpret=INTERPRET, **tier_args)
        out, sig = run(return_significance=True)
        assert max_diff(sig, want) < 1e-5, f"splits={splits} ppb={ppb}"
        np.testing.assert_array_equal(np.asarray(out), np.asarray(run()))
        (_, denom, _), per_head = run(return_significance=True, return_softmax_state=True)
        per_head = per_head if isinstance(per_head, tuple) else (per_head,)
        p = tuple(np.asarray(x) / np.asarray(denom)[..., None] for x in per_head)
        p = tuple(x.reshape(b, hkv, gqa, -1).max(axis=2) for x in p)  # the caller normalises
        assert max_diff(p if low is not None else p[0], want) < 1e-5


def test_significance_lowers_for_cuda_with_triton():
    rng = np.random.default_rng()
    high = make_tier(rng, 9, 128, 8, 4, token_keys=True)
    low = high.as_format(high.kv_format.halved())
    q = jnp.asarray(rng.normal(size=(2, 8, 128)), jnp.bfloat16)
    table = jnp.asarray(rng.integers(1, 9, (2, 2, 8)), jnp.int32)
    hl, ll = jnp.full((2, 2), 20, jnp.int32), jnp.full((2, 2), 9, jnp.int32)
    run = functools.partial(paged_decode_attention, k_splits=2, pages_per_block=2,
                            low_tier=low, low_lengths=ll, return_significance=True,
                            dequant="f16")
    lowered = jax.jit(run).trace(q, high, table, hl).lower(lowering_platforms=("cuda",))
    assert "__gpu$xla.gpu.triton" in lowered.as_text()
