"""The shared-basis reconstruction kernel against its jnp reference on fresh random inputs
(interpret mode), the engine's XLA path against the same, and the kernel's CUDA lowering."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jkv.kv.shared_form import rebuild_xla
from jkv.pallas_kernels.shared_reconstruct import (
    shared_reconstruct,
    shared_reconstruct_reference,
)

# (tokens, rank, features, bits): ranks and features off powers of two, tokens off blocks
CASES = [(64, 16, 64, 8), (100, 37, 96, 8), (130, 5, 192, 4), (64, 200, 576, 16),
         (1, 3, 32, 2)]

INTERPRET = jax.default_backend() == "cpu"  # on a GPU the same tests compile the kernel


def inputs(rng, t, r, n, bits, block=64):
    nb = -(-t // block)
    if bits == 16:
        codes = jnp.asarray(rng.standard_normal((t, r)), jnp.float16)
        scale, zero = jnp.ones((nb, r), jnp.float16), jnp.zeros((nb, r), jnp.float16)
    else:
        codes = jnp.asarray(rng.integers(0, 1 << bits, (t, r)), jnp.uint8)
        scale = jnp.asarray(rng.random((nb, r)) * 0.1, jnp.float16)
        zero = jnp.asarray(rng.standard_normal((nb, r)), jnp.float16)
    basis = jnp.asarray(rng.standard_normal((r, n)) / np.sqrt(r), jnp.float16)
    mean = jnp.asarray(rng.standard_normal(n) * 3, jnp.float32)
    return codes, scale, zero, basis, mean


def rel(a, b):
    return float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b))


@pytest.mark.parametrize("t,r,n,bits", CASES)
def test_the_kernel_is_its_reference(t, r, n, bits):
    args = inputs(np.random.default_rng(), t, r, n, bits)
    out = shared_reconstruct(*args, interpret=INTERPRET)
    want = shared_reconstruct_reference(*args)
    assert out.shape == (t, n) and rel(out, want) < 1e-5


@pytest.mark.parametrize("t,r,n,bits", CASES)
def test_the_xla_path_is_the_reference(t, r, n, bits):
    args = inputs(np.random.default_rng(), t, r, n, bits)
    assert rel(rebuild_xla(*args), shared_reconstruct_reference(*args)) < 1e-5


def test_shapes_that_do_not_fit_are_a_value_error():
    codes, scale, zero, basis, mean = inputs(np.random.default_rng(), 100, 8, 32, 8)
    with pytest.raises(ValueError, match="scale and zero"):
        shared_reconstruct(codes, scale[:1], zero[:1], basis, mean, interpret=INTERPRET)
    with pytest.raises(ValueError, match="mean"):
        shared_reconstruct(codes, scale, zero, basis, mean[:5], interpret=INTERPRET)


@pytest.mark.parametrize("t,r,n,bits", CASES[:3])
def test_lowers_for_cuda_with_triton(t, r, n, bits):
    args = inputs(np.random.default_rng(), t, r, n, bits)
    text = jax.jit(shared_reconstruct).trace(*args).lower(
        lowering_platforms=("cuda",)).as_text()
    assert "__gpu$xla.gpu.triton" in text and "jkv_shared_reconstruct" in text
