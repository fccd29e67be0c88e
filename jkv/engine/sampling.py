"""Token sampling on the device (greedy, temperature, top-k, top-p, one PRNG key per row) and
each position's logprob of a target token (prompt logprobs)."""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from jkv.config import ModelConfig
from jkv.models.family import ModelFamily

MAX_LOGPROBS = 20  # most alternatives a request may ask for (OpenAI's top_logprobs limit)


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens and when to stop (vLLM's names and defaults)."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None  # None: none; n: the sampled token's and the n most likely
    # None: none; n: every prompt token's logprob (but the first's) and the n most likely
    # there, computed through chunked prefill (the prompt is not read from the prefix cache)
    prompt_logprobs: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not 0.0 <= self.temperature <= 100.0:
            raise ValueError(f"temperature must be in [0, 100], got {self.temperature!r}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or not -1 <= self.top_k < 1 << 31:
            raise ValueError(f"top_k must be -1 (off), 0 (off) or a positive integer below "
                             f"2**31, got {self.top_k!r}")
        if self.seed is not None and not isinstance(self.seed, int):
            raise ValueError(f"seed must be an integer or None, got {self.seed!r}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool)
                                      or not 0 <= value <= MAX_LOGPROBS):
                raise ValueError(f"{name} must be None or an integer in [0, {MAX_LOGPROBS}], "
                                 f"got {value!r}")
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", [self.stop])
        if self.stop is not None and not all(isinstance(s, str) and s for s in self.stop):
            raise ValueError(f"stop must be a non-empty string or a list of them, "
                             f"got {self.stop!r}")


def sample(logits: jax.Array, keys: jax.Array, temperature: jax.Array, top_p: jax.Array,
           top_k: jax.Array) -> jax.Array:
    """Pick one token per row of logits [B, V].

    temperature [B] (0 = greedy), top_p [B] in (0, 1], top_k [B] (<= 0 = whole vocabulary),
    keys [B, 2] uint32 PRNG keys. Returns int32 [B]. Only a batch with a row that filters
    (top_p < 1 or top_k > 0) sorts the vocabulary (a sort of [B, V] costs more than the
    rest of a CPU decode step); a row that does not filter draws the same token whatever
    else is in its batch.
    """
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    t = jnp.where(temperature > 0, temperature, 1.0)[:, None]
    filters = (temperature > 0) & ((top_p < 1.0) | (top_k > 0))

    def plain(_):  # the whole vocabulary: one categorical draw per row, no sort
        return jax.vmap(jax.random.categorical)(keys, logits / t).astype(jnp.int32)

    def filtered(_):
        vocab = logits.shape[-1]
        order = jnp.argsort(-logits, axis=-1)
        vals = jnp.take_along_axis(logits, order, axis=-1) / t
        rank = jnp.arange(vocab)[None, :]
        keep = rank < jnp.where(top_k > 0, top_k, vocab)[:, None]
        probs = jax.nn.softmax(jnp.where(keep, vals, -jnp.inf), axis=-1)
        keep &= (jnp.cumsum(probs, axis=-1) - probs) < top_p[:, None]
        choice = jax.vmap(jax.random.categorical)(keys, jnp.where(keep, vals, -jnp.inf))
        picked = jnp.take_along_axis(order, choice[:, None], axis=-1)[:, 0].astype(jnp.int32)
        return jnp.where(filters, picked, plain(None))

    branch = jnp.where(filters.any(), 2, jnp.where((temperature > 0).any(), 1, 0))
    drawn = jax.lax.switch(branch, (lambda _: greedy, plain, filtered), None)
    return jnp.where(temperature > 0, drawn, greedy)


def token_logprobs(logits: jax.Array, tokens: jax.Array, k: int = MAX_LOGPROBS,
                   want_top: jax.Array | None = None) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Log-probabilities under the model's distribution (before temperature and top-k/p,
    as vLLM reports them): of `tokens` [B], and the `k` most likely tokens' ids and values.
    With `want_top` [B] bool the top k are found only when some row wants them (zeros
    otherwise): a top-k of the vocabulary is a sort on CPU."""
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    chosen = jnp.take_along_axis(logp, tokens[:, None], axis=-1)[:, 0]

    def top(_):
        lp, ids = jax.lax.top_k(logp, k)
        return ids.astype(jnp.int32), lp

    def none(_):
        b = logits.shape[0]
        return jnp.zeros((b, k), jnp.int32), jnp.zeros((b, k), jnp.float32)

    if want_top is None:
        return chosen, *top(None)
    return chosen, *jax.lax.cond(want_top.any(), top, none, None)


def position_logprobs(params, x, targets, *, family: ModelFamily, cfg: ModelConfig):
    """Every position's logprob of its target token [B, T] (targets -1: 0.0) and its most
    likely tokens' ids and logprobs [B, T, MAX_LOGPROBS], a block of positions at a time."""
    b, t, d = x.shape
    h = family.final_norm(params, cfg, x)
    block = min(t, 64)
    blocks = h.reshape(b, t // block, block, d).swapaxes(0, 1)
    tgt = targets.reshape(b, t // block, block).swapaxes(0, 1)

    def one(args):
        hb, tb = args
        logits = family.logits(params, hb.reshape(b * block, d))
        chosen, ids, lps = token_logprobs(logits, jnp.maximum(tb.reshape(-1), 0))
        return (jnp.where(tb.reshape(-1) >= 0, chosen, 0.0).reshape(b, block),
                ids.reshape(b, block, -1), lps.reshape(b, block, -1))

    out = jax.lax.map(one, (blocks, tgt))
    return tuple(o.swapaxes(0, 1).reshape(b, t, *o.shape[3:]) for o in out)


def counter_key(seed: int, count: int) -> np.ndarray:
    """The PRNG key of the `count`-th request without a seed of an engine seeded `seed`."""
    return np.asarray(jax.random.fold_in(jax.random.PRNGKey(seed), count), np.uint32)


def seed_key(seed: int) -> np.ndarray:
    """A request's PRNG key from its seed: threefry's seeding of a 64-bit seed, for any int."""
    s = seed % (1 << 64)
    return np.array([s >> 32, s & 0xFFFFFFFF], np.uint32)
