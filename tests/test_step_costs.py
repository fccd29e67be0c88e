"""The step cost model the SLO checks weigh: parts of measured step times."""

from __future__ import annotations

import numpy as np
import pytest

from jkv.kv.buckets import bucket
from jkv.sched.step_costs import RIDGE, StepCosts, compilations, nonnegative_least_squares


def costs() -> StepCosts:
    return StepCosts(lambda n: bucket(n, 1, 2))  # rows padded to powers of two (CPU)


def test_a_step_of_decodes_is_learned_per_row_bucket():
    c = costs()
    assert c.decode(3) == 0.0  # nothing measured
    c.learn(0.010, 0, 1)
    c.learn(0.040, 0, 3)  # bucket 4
    assert c.decode(1) == pytest.approx(0.010)
    assert c.decode(4) == pytest.approx(0.040)  # 3 and 4 share their padded shape
    assert c.decode(2) == pytest.approx(0.040)  # not measured: 1 and 4 are as near; the larger
    assert c.decode(16) == pytest.approx(0.040)  # the nearest measured
    assert c.decode(0) == 0.0
    c.learn(0.020, 0, 4)
    assert 0.020 < c.decode(4) < 0.040  # an average, each sample moving it


def test_what_a_step_of_decodes_does_not_explain_goes_to_the_prefill():
    c = costs()
    c.learn(0.010, 0, 2)  # two decodes alone: 10 ms
    c.offload_layer_s = 0.010  # (as fitted: below)
    c.learn(0.010 + 0.040 + 0.032, 16, 2, brings=4)  # 4 layers and 16 prefill tokens on top
    assert c.prefill_row_s + 16 * c.prefill_token_s == pytest.approx(0.032)
    assert c.decode(2) == pytest.approx(0.010)  # steps that did more: not decode samples
    c.learn(0.032, 16, 0)  # a prefill alone
    assert c.prefill_row_s + 16 * c.prefill_token_s == pytest.approx(0.032)


def test_a_prefill_row_and_its_tokens_are_told_apart():
    # served, a chunk leaves a short tail (the decodes take their tokens of the step's
    # budget): a call of 2 tokens costs its dispatches and padding, no token's share of them
    rng = np.random.default_rng()
    c = costs()
    for _ in range(300):
        rows = int(rng.integers(1, 3))
        tokens = int(rng.choice([2, 8, 16, 500, 508, 512, 1000])) * rows
        c.learn((0.045 * rows + 0.0022 * tokens) * (1 + 0.03 * rng.standard_normal()),
                tokens, 0, prefill_rows=rows)
    assert c.prefill_row_s == pytest.approx(0.045, rel=0.2)
    assert c.prefill_token_s == pytest.approx(0.0022, rel=0.05)
    assert c.prefill_row_s + 1024 * c.prefill_token_s == pytest.approx(0.045 + 0.0022 * 1024,
                                                                rel=0.05)


def truth(rows: int, context: int, brings: int) -> float:
    """A CPU-like step: 20 ms, 6 ms a padded row, 4 ms a 1K tokens of context, 0.5 ms a
    layer brought in."""
    return 0.020 + 0.006 * bucket(rows, 1, 2) + 0.004 * context / 1000 + 0.0005 * brings


def test_layers_are_not_learned_before_their_decodes_are():
    c = costs()
    c.learn(0.050, 0, 8, brings=4)  # what part is the decodes' is not known yet
    assert c.offload_layer_s == 0.0 and c.decode(8) == 0.0


def test_layers_are_told_apart_from_the_rows_and_context_they_come_with():
    # steps of growing contexts, rows coming and going, layers brought in by some: the
    # layers' share is fitted apart from the rows' and the context's (set against the
    # nearest step without layers, 2 rows more and 1K tokens more context read as 8 ms a
    # layer where a layer takes 0.5)
    rng = np.random.default_rng(0)
    c = costs()
    for i in range(400):
        rows = int(rng.integers(1, 9))
        context = int(rows * (300 + 2 * i + rng.integers(0, 300)))
        brings = 0 if rows <= 2 else int(rng.integers(1, 40))  # 4 and 8 rows: never without
        c.learn(truth(rows, context, brings) * (1 + 0.02 * rng.standard_normal()), 0, rows,
                brings, context)
        if i < 3:
            assert c.offload_layer_s == 0.0  # too few steps with layers to tell yet
    assert c.offload_layer_s == pytest.approx(0.0005, rel=0.2)
    # a row bucket never measured without layers brought in: the fit's estimate at the
    # recent context a row, never below a smaller bucket's measure
    assert c.by_rows.keys() == {1, 2}
    assert c.decode(8) == pytest.approx(truth(8, 8 * 1100, 0), rel=0.2)
    assert c.decode(8) > c.decode(4) > c.decode(2)


def test_the_fit_stays_bounded_where_no_step_varies_a_part():
    # a long-running server that never brings a layer in: that part stays 0 and the others
    # finite (recursive, its uncertainty grew without bound as older steps faded)
    c = costs()
    for i in range(3000):
        c.learn(truth(1 + i % 4, 500 + i, 0), 0, 1 + i % 4, 0, 500 + i)
    assert np.isfinite(c._fit).all() and (c._fit >= 0).all()
    assert c.offload_layer_s == 0.0 and np.isfinite(c.decode(8)) and c.decode(8) > 0


@pytest.mark.parametrize("seed", range(3))
def test_the_fit_does_not_diverge_over_a_long_run_of_phases(seed):
    # a serving run's shape: stretches of steps at one row count, context growing a token a
    # row each step, layers brought in by some stretches (their cost growing with the
    # context, which the fit does not model). Fitted recursively, the fit lost its footing
    # after a few thousand such steps (a layer read as seconds) and the SLO checks with it
    rng = np.random.default_rng(seed)
    c = costs()

    def cost(rows: int, context: int, brings: int) -> float:
        return truth(rows, context, 0) + brings * (0.0004 + 0.13e-6 * context / rows)

    worst_layer = worst_step = 0.0
    for phase in range(60):
        rows = int(rng.integers(1, 5))
        brings = 0 if rows < 3 or rng.random() < 0.5 else int(rng.integers(10, 30))
        context = rows * int(rng.integers(500, 1100))
        for _ in range(int(rng.integers(30, 200))):
            c.learn(cost(rows, context, brings), 0, rows, brings, context)
            context += rows
            assert (c._fit >= 0).all()  # every part of a step costs time
            if phase >= 10:  # (once stretches with and without layers have been seen)
                worst_layer = max(worst_layer, c.offload_layer_s)
                worst_step = max(worst_step, c.decode(8))
    assert worst_layer < 0.0015  # 0.4 ms + 0.13 us a token of context
    assert worst_step < 0.3  # 8 rows at ~1K tokens each: ~0.1 s


def test_nonnegative_least_squares_matches_scipy():
    from scipy.optimize import nnls

    rng = np.random.default_rng(0)
    for _ in range(50):
        x = rng.standard_normal((30, 4)) * rng.uniform(0.1, 10, 4)
        y = rng.standard_normal(30)
        # the same problem with the ridge written as rows of its own
        ridged = np.vstack([x, np.sqrt(RIDGE) * np.eye(4)])
        want, _ = nnls(ridged, np.concatenate([y, np.zeros(4)]))
        got = nonnegative_least_squares(x.T @ x, x.T @ y)
        np.testing.assert_allclose(got, want, atol=1e-8)


def test_compilations_count_new_shapes_not_cached_calls():
    import jax
    import jax.numpy as jnp

    f = jax.jit(lambda x: x * 3 + 1)
    x, y = jnp.ones(5), jnp.ones(6)
    before = compilations()
    f(x)
    assert compilations() > before
    cached = compilations()
    f(x)
    assert compilations() == cached
    f(y)
    assert compilations() > cached
