"""Token sampling: greedy, top-k, top-p and the sampled distribution."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jkv.engine.sampling import SamplingParams, sample, token_logprobs


def _batch(logits, n, temperature=1.0, top_p=1.0, top_k=0, seed=None):
    seed = np.random.SeedSequence().entropy % (2**31) if seed is None else seed
    keys = jax.random.split(jax.random.PRNGKey(seed), n)
    rows = jnp.broadcast_to(jnp.asarray(logits, jnp.float32), (n, len(logits)))
    full = lambda v, dt: jnp.full((n,), v, dt)  # noqa: E731
    return np.asarray(sample(rows, keys, full(temperature, jnp.float32),
                             full(top_p, jnp.float32), full(top_k, jnp.int32)))


def test_greedy_is_argmax():
    logits = np.random.default_rng().normal(size=50)
    assert (_batch(logits, 4, temperature=0.0) == logits.argmax()).all()


def test_top_k_one_and_tiny_top_p_are_greedy():
    logits = np.random.default_rng().normal(size=50)
    assert (_batch(logits, 64, top_k=1) == logits.argmax()).all()
    assert (_batch(logits, 64, top_p=1e-6) == logits.argmax()).all()


def test_top_k_restricts_support():
    logits = np.random.default_rng().normal(size=20)
    allowed = set(np.argsort(-logits)[:3].tolist())
    assert set(_batch(logits, 2000, top_k=3).tolist()) <= allowed


def test_sampled_frequencies_follow_softmax():
    logits = np.array([2.0, 1.0, 0.5, 0.0, -1.0, -3.0])
    temperature = 0.7
    draws = _batch(logits, 20000, temperature=temperature)
    p = np.exp(logits / temperature)
    p /= p.sum()
    freq = np.bincount(draws, minlength=len(logits)) / len(draws)
    # 5 standard errors of a binomial proportion: fails for a wrong temperature or order
    se = np.sqrt(p * (1 - p) / len(draws))
    assert (np.abs(freq - p) < 5 * se + 1e-4).all(), (freq, p)


def test_top_p_keeps_the_smallest_nucleus():
    logits = np.log(np.array([0.5, 0.3, 0.15, 0.05]))
    draws = _batch(logits, 4000, top_p=0.7)  # nucleus {0, 1}: 0.5 < 0.7 <= 0.8
    assert set(draws.tolist()) == {0, 1}


@pytest.mark.parametrize("field,value", [("max_tokens", 0), ("temperature", -1.0),
                                         ("top_p", 0.0), ("top_p", 1.5), ("top_k", -2),
                                         ("stop", [""]), ("seed", "x")])
def test_sampling_params_reject_bad_values_naming_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_token_logprobs_match_a_numpy_log_softmax():
    rng = np.random.default_rng()
    logits = rng.normal(size=(3, 300)).astype(np.float32) * 4
    tokens = rng.integers(0, 300, 3)
    chosen, top_ids, top_lp = token_logprobs(jnp.asarray(logits), jnp.asarray(tokens), k=5)
    ref = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1,
                                                                           keepdims=True)) \
        - logits.max(-1, keepdims=True)
    np.testing.assert_allclose(np.asarray(chosen), ref[np.arange(3), tokens], atol=1e-5)
    order = np.argsort(-ref, axis=-1)[:, :5]
    np.testing.assert_array_equal(np.asarray(top_ids), order)
    np.testing.assert_allclose(np.asarray(top_lp), np.take_along_axis(ref, order, -1),
                               atol=1e-5)


def test_logprobs_count_is_checked():
    with pytest.raises(ValueError, match="logprobs"):
        SamplingParams(logprobs=21)
    assert SamplingParams(logprobs=0).logprobs == 0


def test_a_row_that_does_not_filter_draws_the_same_token_in_any_batch():
    """Rows without top-k/top-p skip the vocabulary sort; beside a row that filters they
    still draw from their own key over the whole vocabulary, as they do alone."""
    rng = np.random.default_rng()
    logits = jnp.asarray(rng.normal(size=(6, 300)), jnp.float32)
    keys = jax.random.split(jax.random.PRNGKey(int(rng.integers(1 << 30))), 6)
    temperature = jnp.asarray([1.0, 0.7, 0.0, 1.0, 1.3, 1.0], jnp.float32)
    ones, off = jnp.ones(6, jnp.float32), jnp.zeros(6, jnp.int32)
    alone = np.asarray(sample(logits, keys, temperature, ones, off))
    top_k = off.at[3].set(5)  # row 3 filters: the batch takes the sorted path
    mixed = np.asarray(sample(logits, keys, temperature, ones, top_k))
    assert (np.delete(mixed, 3) == np.delete(alone, 3)).all()
    assert mixed[2] == int(logits[2].argmax())  # greedy rows stay greedy
    assert int(mixed[3]) in set(np.argsort(-np.asarray(logits[3]))[:5].tolist())


def test_top_logprobs_are_found_only_when_a_row_wants_them():
    rng = np.random.default_rng()
    logits = jnp.asarray(rng.normal(size=(3, 300)), jnp.float32)
    tokens = jnp.asarray(rng.integers(0, 300, 3))
    chosen, ids, lps = token_logprobs(logits, tokens, k=4)
    none = token_logprobs(logits, tokens, k=4, want_top=jnp.zeros(3, bool))
    some = token_logprobs(logits, tokens, k=4, want_top=jnp.asarray([False, True, False]))
    np.testing.assert_array_equal(none[0], chosen)
    assert not np.asarray(none[1]).any() and not np.asarray(none[2]).any()
    np.testing.assert_array_equal(some[1], ids)
    np.testing.assert_array_equal(some[2], lps)
