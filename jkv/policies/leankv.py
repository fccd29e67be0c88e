"""LeanKV (Zhang et al.): each (layer, KV head) keeps its significant tokens in a high tier,
the others in a low tier at half the bits, and prunes the least significant (Algorithm 1).

A token's significance is the attention it received, averaged over the queries that saw it
(`token_tiers.read_rows`' means). As it leaves the recent window it is placed against the
thresholds alpha_high / i and alpha_low / i (i: its 1-based position, the uniform share of a
prompt query); in the generation phase against alpha / n, and each token that stays high or
joins the low tier pushes the least significant old token of its tier down. The first
`kv_sink_tokens` stay high (attention sinks, whose 1/i threshold they would never meet).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from jkv.kv.tier_step import Placing
from jkv.kv.token_tiers import KEEP, LOW, PRUNE, TierCounts, TokenMeta, read_rows
from jkv.policies.registry import KVPolicy, PolicySettings


def place(meta: TokenMeta, pages: jax.Array, counts: TierCounts, n_prev: jax.Array,
          n: jax.Array, *, page: int, recent: int, alpha_high: jax.Array,
          alpha_low: jax.Array, sinks: jax.Array | int = 0,
          max_tokens: int | None = None) -> tuple[jax.Array, jax.Array]:
    """Algorithm 1's prompt phase: the fate (KEEP, LOW, PRUNE) of each high slot [..., W *
    page] (and KEEP for each low slot [..., W * 2 * page]) of rows whose sequences grew from
    n_prev to n tokens ([...], broadcast against the rows) by a prompt chunk.

    The candidates are the high tokens that left the recent window, positions in
    [n_prev - recent, n - recent). Each candidate i (1-based position) is placed by its mean
    attention: high above alpha_high / i, low above alpha_low / i, pruned below. Tokens at
    positions below `sinks` are never candidates (attention sinks stay high; 0, the paper's
    rule, by default)."""
    rows = read_rows(meta, pages, counts, n_prev, n, page=page, recent=recent, sinks=sinks,
                     max_tokens=max_tokens)
    hi_mean, hi_pos, cand = rows["hi_mean"], rows["hi_pos"], rows["cand"]
    i = (hi_pos + 1).astype(jnp.float32)
    fate = jnp.where(hi_mean >= alpha_high / i, KEEP,
                     jnp.where(hi_mean >= alpha_low / i, LOW, PRUNE))
    return jnp.where(cand, fate, KEEP), jnp.full(rows["lo_pos"].shape, KEEP)


def place_generation(meta: TokenMeta, pages: jax.Array, counts: TierCounts, n_prev: jax.Array,
                     n: jax.Array, *, page: int, recent: int, alpha_high: jax.Array,
                     alpha_low: jax.Array, max_moves: int, sinks: jax.Array | int = 0,
                     max_tokens: int | None = None) -> tuple[jax.Array, jax.Array]:
    """Algorithm 1's generation phase for rows that grew from n_prev to n tokens by decode
    steps (at most `max_moves`), as `place`'s fates. Each candidate (as in `place`) is placed
    against alpha / n: high, low or pruned. For each one that stays high the least
    significant old high token goes down if it is below alpha_high / n (to the low tier, or
    pruned below alpha_low / n); for each one that joins the low tier the least significant
    low token is pruned if below alpha_low / n. With every mean as of n this is the
    algorithm run once per candidate: a victim is never a candidate (one that stays is above
    alpha_high / n, one that leaves is placed already) and a token joining the low tier is
    never below alpha_low / n, so the victims are the lowest of fixed sets. Placing the
    tokens of several steps in one call is the engine's amortization
    (`kv_placement_interval`); one step's is the paper's."""
    with jax.named_scope("read_rows"):
        rows = read_rows(meta, pages, counts, n_prev, n, page=page, recent=recent,
                         sinks=sinks, max_tokens=max_tokens)
    hi_mean, hi_pos, cand = rows["hi_mean"], rows["hi_pos"], rows["cand"]
    lo_mean, lo_pos = rows["lo_mean"], rows["lo_pos"]
    nf = rows["n"].astype(jnp.float32)[..., None]
    t_high, t_low = alpha_high / nf, alpha_low / nf
    fate = jnp.where(hi_mean >= t_high, KEEP, jnp.where(hi_mean >= t_low, LOW, PRUNE))
    stay = (cand & (fate == KEEP)).sum(-1, dtype=jnp.int32)
    join = (cand & (fate == LOW)).sum(-1, dtype=jnp.int32)
    k = min(max_moves, hi_mean.shape[-1])
    # (alpha_low above alpha_high, which the config refuses: a victim below t_low is pruned)
    going = hi_mean < jnp.maximum(t_high, t_low)
    with jax.named_scope("lowest"):
        high_victim = _lowest(hi_mean, hi_pos, rows["old"] & ~cand & going, stay, k)
        low_victim = _lowest(lo_mean, lo_pos, rows["lo_held"] & (lo_mean < t_low), join, k)
    fate_hi = jnp.where(cand, fate, jnp.where(high_victim, jnp.where(
        hi_mean < t_low, PRUNE, LOW), KEEP))
    return fate_hi, jnp.where(low_victim, PRUNE, KEEP)


def _lowest(mean: jax.Array, pos: jax.Array, among: jax.Array, count: jax.Array,
            k: int) -> jax.Array:
    """Mask of the `count` [...] (at most k, static) entries of `among` [..., C] with the
    lowest mean, ties to the earliest position; all of `among` when it has fewer."""
    neg = jnp.where(among, -mean, -jnp.inf)  # top_k's largest: the lowest means
    top = lax.top_k(neg, k)[0]
    at = jnp.clip(count - 1, 0, k - 1)[..., None]
    cut = jnp.where(count[..., None] > 0, jnp.take_along_axis(top, at, -1), jnp.inf)  # -mean
    below = among & (neg > cut)
    tied = among & (neg == cut)
    need = count - below.sum(-1, dtype=jnp.int32)  # of the tied, the earliest

    def earliest() -> jax.Array:
        # positions as float32 (exact below 2**24): a float top_k is XLA's TopK, an integer
        # one a full sort of the row on CPU (most of a placement's time)
        at_pos = pos.astype(jnp.float32)
        first = -lax.top_k(-jnp.where(tied, at_pos, jnp.inf), k)[0]
        last = jnp.take_along_axis(first, jnp.clip(need - 1, 0, k - 1)[..., None], -1)
        return tied & (at_pos <= last) & (need > 0)[..., None]

    # a second top_k only when some row has more tokens at its cut than it takes (means
    # are rarely equal): without one, every tied token goes
    more = ((tied.sum(-1, dtype=jnp.int32) > need) & (need > 0)).any()
    return below | lax.cond(more, earliest, lambda: tied & (need > 0)[..., None])


def leankv_fates(x: Placing, knobs: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Algorithm 1's prompt phase for a prompt chunk, its generation phase for decode steps;
    knobs: alpha_high, alpha_low, sink tokens."""
    where = dict(page=x.page, recent=x.recent, max_tokens=x.max_tokens, sinks=knobs[2],
                 alpha_high=knobs[0], alpha_low=knobs[1])
    if x.generation:
        return place_generation(x.meta, x.pages, x.counts, x.n_prev, x.n,
                                max_moves=x.max_moves, **where)
    return place(x.meta, x.pages, x.counts, x.n_prev, x.n, **where)


def _halvable(cache: PolicySettings) -> None:
    """The high tier's format must have a low tier at half the bits."""
    try:
        cache.kv_format.halved()
    except ValueError as e:
        raise ValueError(f"CacheConfig.kv_format {cache.kv_format.name!r} cannot be leankv's "
                         f"high tier: {e} (use k8v4t, or k4v8t)") from None


POLICY = KVPolicy(
    name="leankv",
    summary="each (layer, KV head) keeps significant tokens in a high tier (`kv_format`, "
            "default k8v4t), others in a low tier at half the bits (k4v2t), prunes the least "
            "significant, and holds only the pages its tiers fill (LeanKV)",
    fates=leankv_fates, knobs=("kv_alpha_high", "kv_alpha_low", "kv_sink_tokens"),
    default_format="k8v4t", check=_halvable)
