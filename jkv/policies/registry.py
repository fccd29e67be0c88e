"""What a KV technique is to jkv: a `KVPolicy`, registered by name (`kv_policy=...`,
`--kv-policy`). A policy decides; the KV cache manager and its layout carry the decisions out.

A policy on block pages (none, kivi) picks how pages are stored. A token policy (leankv,
streaming, h2o, snapkv) runs on the tiered-rows layout: `fates` is its pure decision, called
after every prompt chunk and every `kv_placement_interval` decode steps with each row's tokens
as `jkv.kv.tier_step.Placing` shows them (positions, significance, which left the recent
window), and returns each token's fate (kept high, moved low, pruned). Its `knobs` name the
`CacheConfig` fields it reads (handed to `fates` as float32 `knobs`, in order). Its
`form_merit`, if any, is what it offers on save: smaller stored forms of a row
(`jkv.policies.stored_forms`) that keep the tokens it rates highest.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import jax
import jax.numpy as jnp

from jkv.kv.format import KVFormat
from jkv.kv.row_forms import Merit
from jkv.kv.tier_step import Placing, TierPolicy
from jkv.kv.token_tiers import KEEP, PRUNE

Fates = Callable[[Placing, jax.Array], tuple[jax.Array, jax.Array]]


class PolicySettings(Protocol):
    """The settings a policy reads (`jkv.config.CacheConfig`'s)."""

    kv_policy: str
    kv_format: KVFormat
    kv_recent_window: int
    kv_placement_interval: int
    kv_sink_tokens: int


def _accepts_any(cache: PolicySettings) -> None:
    """No setting refused."""


@dataclass(frozen=True)
class KVPolicy:
    """One technique: its name and help, the format it defaults to, the settings it refuses
    (`check` raises a ValueError naming them) and, for a token policy, its `fates`."""

    name: str
    summary: str  # one phrase for `--help` and the docs
    fates: Fates | None = None  # None: block pages, every token kept
    knobs: tuple[str, ...] = ()
    default_format: str | None = None  # for kv_format "auto"
    # decides at the prompt's end: significance from the prompt's last `kv_recent_window`
    # queries only (their sum, not every query's that saw a token), and the placement after
    # a prompt chunk may prune any of the row's older tokens at once
    decides_at_prompt_end: bool = False
    check: Callable[[PolicySettings], None] = field(default=_accepts_any, compare=False)
    # on save: the smaller forms `<name>@<keep>` of a stored token-tier row it offers a store
    # (AdaptCache), each head keeping its tokens of highest merit; None: it offers none
    form_merit: Merit | None = field(default=None, compare=False)

    @property
    def token_tiers(self) -> bool:
        """Whether it runs on the tiered-rows layout (decides single tokens' fates)."""
        return self.fates is not None

    def tier_policy(self, cache: PolicySettings) -> TierPolicy | None:
        """What the tiered-rows layout runs for it under `cache` (None: block pages)."""
        if self.fates is None:
            return None
        return TierPolicy(
            name=self.name, fates=self.fates, recent_window=cache.kv_recent_window,
            interval=cache.kv_placement_interval,
            knobs=tuple(float(getattr(cache, k)) for k in self.knobs),
            observation_window=cache.kv_recent_window if self.decides_at_prompt_end else 0,
            whole_row_moves=self.decides_at_prompt_end,
            sinks=cache.kv_sink_tokens)


def needs_single_tokens(cache: PolicySettings) -> None:
    """A pruning policy moves single tokens: the model dtype or per-token key scales."""
    f = cache.kv_format
    if f.quantized and not f.token_keys:
        raise ValueError(f"CacheConfig.kv_format {f.name!r} cannot hold {cache.kv_policy}'s "
                         "tokens: pruning moves single tokens, which needs the model dtype or "
                         "per-token key scales (k8v4t, ...)")


def keep_top(score: jax.Array, pos: jax.Array, among: jax.Array,
             budget: jax.Array) -> jax.Array:
    """Fates for one tier's slots [..., C]: of `among`, the `budget` [..., 1] with the highest
    `score` are kept (ties: the earlier position), the others pruned; the rest kept."""
    key = jnp.where(among, score, -jnp.inf)
    order = jnp.lexsort((pos, -key), axis=-1)
    rank = jnp.argsort(order, axis=-1)  # how many of the row beat each token
    return jnp.where(among & (rank >= budget), PRUNE, KEEP)


def share_of(n: jax.Array, ratio: jax.Array) -> jax.Array:
    """ceil(ratio * n) as int32: the tokens a share of n keeps."""
    return jnp.ceil(ratio * n.astype(jnp.float32)).astype(jnp.int32)
