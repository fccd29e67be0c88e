"""Which layout a sequence's KV takes: block pages, or per-head tiered rows for a token
policy (`TierPolicy`). The one place that tells them apart; callers hold a `Layout`."""

from __future__ import annotations

from jkv.kv.block_pages import BlockPages
from jkv.kv.kv_state import KVState
from jkv.kv.layout import Layout
from jkv.kv.tier_step import TierPolicy
from jkv.kv.tiered_rows import TieredRows


def layout_class(tiers: TierPolicy | None) -> type[BlockPages] | type[TieredRows]:
    """The layout a pool under `tiers` (None: no token policy) uses."""
    return BlockPages if tiers is None else TieredRows


def make_layout(state: KVState, tiers: TierPolicy | None, max_model_len: int,
                **shared: object) -> Layout:
    """The layout over `state`; `shared`: the settings every layout takes."""
    if tiers is None:
        return BlockPages(state, **shared)
    return TieredRows(state, policy=tiers, max_model_len=max_model_len, **shared)


__all__ = ["Layout", "TierPolicy", "layout_class", "make_layout"]
