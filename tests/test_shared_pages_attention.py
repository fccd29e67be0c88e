"""Attention over shared-layer pages: the Pallas kernel (interpret mode) and the XLA path
against the jnp reference on fresh random inputs, a stored group's pages aliased in each of
its layers' tables giving that layer's attention over the store's reconstruction, the softmax
state merging with the rest of a context, and the kernel's CUDA lowering."""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jkv.attention.shared_pages import shared_pages_attention_xla
from jkv.kv import allocator as alloc
from jkv.kv import shared_form as sf
from jkv.kv import shared_pages as sp
from jkv.kv.quant import pack
from jkv.models.rope import apply_rope, inv_frequencies
from jkv.pallas_kernels.shared_pages_attention import (
    dense_history,
    shared_pages_attention,
    shared_pages_attention_reference,
)
from jkv.pallas_kernels.softmax_state import merge_softmax_states, normalize_softmax_state

INTERPRET = jax.default_backend() == "cpu"  # on a GPU the same tests compile the kernel


def pool(rng, pages: int, page: int, rank: int, bits: int) -> sp.CoefficientPages:
    width = sp.page_width(rank, bits)
    if bits == 16:
        return sp.CoefficientPages(
            codes=jnp.asarray(rng.standard_normal((pages, page, width)), jnp.float16),
            scale=jnp.ones((pages, width), jnp.float16),
            zero=jnp.zeros((pages, width), jnp.float16), bits=16)
    codes = rng.integers(0, 1 << bits, (pages, page, width))
    return sp.CoefficientPages(
        codes=pack(jnp.asarray(codes, jnp.uint8), bits),
        scale=jnp.asarray(rng.random((pages, width)) * 0.3, jnp.float16),
        zero=jnp.asarray(rng.standard_normal((pages, width)), jnp.float16), bits=bits)


def bases(rng, b: int, k: sp.CoefficientPages, v: sp.CoefficientPages,
          features: int) -> sp.LayerBases:
    def basis(width):
        return jnp.asarray(rng.standard_normal((b, width, features)) / np.sqrt(width),
                           jnp.float16)
    return sp.LayerBases(k_basis=basis(k.width),
                         k_mean=jnp.asarray(rng.standard_normal((b, features)), jnp.float32),
                         v_basis=basis(v.width),
                         v_mean=jnp.asarray(rng.standard_normal((b, features)), jnp.float32))


def case(rng, *, b=2, c=1, hkv=2, g=3, d=32, page=16, w=4, k_bits=8, v_bits=4,
         k_rank=20, v_rank=40, dtype=jnp.float32):
    """Random operands: pools of 3 * b * w + 1 pages, distinct pages per row (keys and
    values on different pages), lengths from 1 token to the whole table."""
    n = 3 * b * w + 1
    k, v = pool(rng, n, page, k_rank, k_bits), pool(rng, n, page, v_rank, v_bits)
    ids = rng.permutation(np.arange(1, n))
    k_table = jnp.asarray(ids[:b * w].reshape(b, w), jnp.int32)
    v_table = jnp.asarray(ids[b * w:2 * b * w].reshape(b, w), jnp.int32)
    lengths = jnp.asarray(rng.integers(1, w * page + 1, b), jnp.int32)
    first = jnp.asarray(rng.integers(0, 3000, b), jnp.int32)
    q = jnp.asarray(rng.standard_normal((b, c, hkv * g, d)), dtype)
    inv = jnp.asarray(inv_frequencies(d, 10000.0))
    return q, k, v, bases(rng, b, k, v, hkv * d), k_table, v_table, lengths, first, inv


def rel(a, b) -> float:
    a, b = jnp.asarray(a, jnp.float32), jnp.asarray(b, jnp.float32)
    return float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b))


# decode (c = 1) and a prefill chunk's rows (c > 1); GQA groups 1, 3, 4; every code width;
# 4-bit keys of two byte columns at rank_block 16 (the rank walked over columns and shifts)
CASES = [dict(), dict(c=5, k_bits=16, v_bits=8, g=1), dict(k_bits=4, v_bits=2, g=4, w=2),
         dict(c=3, hkv=1, d=64, page=64, w=2, k_rank=100, v_rank=7),
         dict(k_bits=4, k_rank=40, v_bits=4, v_rank=40)]


@pytest.mark.parametrize("kw", CASES)
@pytest.mark.parametrize("ppb,rank_block,splits", [(1, 64, 1), (1, 16, 2)])
def test_the_kernel_is_its_reference(kw, ppb, rank_block, splits):
    args = case(np.random.default_rng(), **kw)
    want = shared_pages_attention_reference(*args)
    got = shared_pages_attention(*args, pages_per_block=ppb, rank_block=rank_block,
                                 k_splits=splits, interpret=INTERPRET)
    assert got.shape == want.shape and rel(got, want) < 1e-5


@pytest.mark.parametrize("kw", CASES)
def test_the_xla_path_is_the_reference(kw):
    args = case(np.random.default_rng(), **kw)
    assert rel(shared_pages_attention_xla(*args), shared_pages_attention_reference(*args)) < 1e-5


def test_half_precision_queries_stay_close():
    args = case(np.random.default_rng(), dtype=jnp.bfloat16)
    want = shared_pages_attention_reference(*args)
    assert rel(shared_pages_attention(*args, interpret=INTERPRET), want) < 2e-2


def test_the_softmax_state_merges_with_the_rest_of_the_context():
    """The history's state merged with plain attention over other keys (the sinks, the
    pages written since) is attention over the history and those keys together."""
    rng = np.random.default_rng()
    q, k, v, layer, kt, vt, lengths, first, inv = case(rng, b=1, c=2, hkv=1, g=2)
    extra_k = jnp.asarray(rng.standard_normal((5, 1, 32)), jnp.float32)
    extra_v = jnp.asarray(rng.standard_normal((5, 1, 32)), jnp.float32)
    state = shared_pages_attention(q, k, v, layer, kt, vt, lengths, first, inv,
                                   return_softmax_state=True, interpret=INTERPRET)
    s = jnp.einsum("bchd,thd->bcht", q, jnp.broadcast_to(extra_k, (5, 2, 32))) / np.sqrt(32)
    m = s.max(-1)
    p = jnp.exp(s - m[..., None])
    extra = (jnp.einsum("bcht,td->bchd", p, extra_v[:, 0]), p.sum(-1), m)
    merged = normalize_softmax_state(*merge_softmax_states(
        *(jnp.stack([a, b]) for a, b in zip(state, extra, strict=True)), axis=0)[:2])
    n = int(lengths[0])
    keys, values = dense_history(k, v, layer, kt[0, :-(-n // 16)], vt[0, :-(-n // 16)],
                                 int(first[0]), inv)
    keys = jnp.concatenate([keys[:n], extra_k])[:, 0]
    values = jnp.concatenate([values[:n], extra_v])[:, 0]
    p = jax.nn.softmax(jnp.einsum("bchd,td->bcht", q, keys) / np.sqrt(32), axis=-1)
    assert rel(merged, jnp.einsum("bcht,td->bchd", p, values)) < 1e-5


def planted_group_entry(rng, layers=3, tokens=200, heads=2, d=32, rank=6):
    """Sides [L, T, H * D] whose layers share a rank-`rank` subspace, in the shared form
    with one key group and one value group of all `layers` layers (8-bit coefficients)."""
    c = rng.standard_normal((tokens, rank))
    sides = {s: np.stack([c @ rng.standard_normal((rank, heads * d)) + 0.3
                          for _ in range(layers)]).astype(np.float32) for s in sf.SIDES}
    plan = sf.Plan({"k": [(0, layers)], "v": [(0, layers)]}, {"k": [rank], "v": [rank]}, 8,
                   sinks=4)
    return sf.encode(sides, plan, heads)


@pytest.mark.parametrize("attend", ["pallas", "xla"])
def test_a_groups_aliased_pages_give_each_layers_attention_over_the_reconstruction(attend):
    """One set of key and one of value coefficient pages, reserved once and aliased in the
    tables of the group's 3 layers, read through each layer's slice of the bases: each
    layer's attention is the attention over the store's reconstruction of that layer's
    keys (rotated to their places after the sinks) and values."""
    rng = np.random.default_rng()
    layers, heads, d, width = 3, 2, 32, sp.page_width(6, 8)
    arrays = planted_group_entry(rng, layers, heads=heads, d=d)
    sides = sf.reconstruct(arrays)
    inv = jnp.asarray(inv_frequencies(d, 10000.0))
    tokens, pages = sp.pages_from_form(arrays, 0, width)
    _, v_pages = sp.pages_from_form(arrays, 1, width)
    k_pool = sp.CoefficientPages(codes=jnp.zeros((9,) + pages.codes.shape[1:], jnp.uint8),
                                 scale=jnp.zeros((9, width), jnp.float16),
                                 zero=jnp.zeros((9, width), jnp.float16), bits=8)
    v_pool = k_pool
    tables = {}
    for side in sf.SIDES:
        free, table, ok = sp.reserve_group(alloc.init_free(9, sp.PAGE),
                                           alloc.init_tables(1, layers, 1, 4), jnp.int32(0),
                                           jnp.ones(layers, bool), jnp.int32(tokens))
        assert bool(ok) and sp.pages_held(free) == -(-tokens // sp.PAGE)
        tables[side] = table
    k_ids = tables["k"].pages[0, 0, 0, :pages.codes.shape[0]]
    v_ids = tables["v"].pages[0, 0, 0, :pages.codes.shape[0]]
    k_pool, v_pool = k_pool.put(k_ids, pages), v_pool.put(v_ids, v_pages)
    q = jnp.asarray(rng.standard_normal((1, 2, heads * 2, d)), jnp.float32)
    first = 4 + 1000  # the entry at offset 1000 in its conversation, after 4 sinks
    run = (partial(shared_pages_attention, interpret=INTERPRET) if attend == "pallas"
           else shared_pages_attention_xla)
    for layer in range(layers):
        (kb, km), (vb, vm) = (sp.layer_basis(arrays, g, layer, width) for g in (0, 1))
        bases = sp.LayerBases(k_basis=jnp.asarray(kb)[None], k_mean=jnp.asarray(km)[None],
                              v_basis=jnp.asarray(vb)[None], v_mean=jnp.asarray(vm)[None])
        got = run(q, k_pool, v_pool, bases, tables["k"].pages[:, layer, 0],
                  tables["v"].pages[:, layer, 0], jnp.int32([tokens]), jnp.int32([first]), inv)
        keys = sides["k"][layer, 4:].reshape(1, tokens, heads, d)
        keys = apply_rope(jnp.asarray(keys), first + jnp.arange(tokens)[None], inv)[0]
        values = sides["v"][layer, 4:].reshape(tokens, heads, d)
        qg = q[0].reshape(2, heads, 2, d)
        p = jax.nn.softmax(jnp.einsum("chgd,thd->chgt", qg, keys) / np.sqrt(d), axis=-1)
        want = jnp.einsum("chgt,thd->chgd", p, values).reshape(1, 2, heads * 2, d)
        assert rel(got, want) < 1e-3, layer


def test_shapes_that_do_not_fit_are_a_value_error():
    q, k, v, layer, kt, vt, lengths, first, inv = case(np.random.default_rng())
    with pytest.raises(ValueError, match="v_table"):
        shared_pages_attention(q, k, v, layer, kt, vt[:1], lengths, first, inv, interpret=INTERPRET)
    with pytest.raises(ValueError, match="k_basis"):
        shared_pages_attention(q, k, v, layer.replace(k_basis=layer.k_basis[:, :3]), kt, vt,
                               lengths, first, inv, interpret=INTERPRET)
    with pytest.raises(ValueError, match="pages_per_block"):
        shared_pages_attention(q, k, v, layer, kt, vt, lengths, first, inv,
                               pages_per_block=3, interpret=INTERPRET)
    with pytest.raises(ValueError, match="k_splits"):
        shared_pages_attention(q, k, v, layer, kt, vt, lengths, first, inv,
                               k_splits=3, interpret=INTERPRET)


@pytest.mark.parametrize("bits,dtype", [((8, 4), jnp.bfloat16), ((16, 8), jnp.float16),
                                        ((4, 2), jnp.bfloat16), ((8, 8), jnp.float32)])
def test_lowers_for_cuda_with_triton(bits, dtype):
    args = case(np.random.default_rng(), c=2, page=64, w=2, k_bits=bits[0], v_bits=bits[1],
                dtype=dtype)
    text = jax.jit(partial(shared_pages_attention, pages_per_block=1, k_splits=2)).trace(
        *args).lower(
        lowering_platforms=("cuda",)).as_text()
    assert "triton" in text
