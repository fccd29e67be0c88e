"""Krul's split restore, its recomputed part: layer l recomputes the restored blocks before
its edge (`saved_pages.pyramid`), the deeper layers loading the rest.

It runs layer-major: the blocks up to layer 0's edge (the furthest) are embedded in
prefill-chunk calls, then each layer runs every call that starts before its own edge, its
weights taken once for all of them, so a split makes about as many calls as the layers times
the chunks they recompute. A call crossing an edge computes a little past it; the loads,
written after, put the stored KV there. A call no layer runs any more is let go."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from jkv.engine.runner import ModelRunner, Row
from jkv.engine.sampling import SamplingParams
from jkv.kv.manager import KVCacheManager


def recompute_split(runner: ModelRunner, cache: KVCacheManager, slot: int,
                    token_ids: Sequence[int], first: int, loaded_from: np.ndarray,
                    chunk: int) -> tuple[set, float]:
    """Dispatch blocks [first, loaded_from[l]) of `slot`'s prompt through each layer l (the
    edges never grow with depth). Returns the call shapes used and the tokens recomputed,
    counted per layer (a layer's share of a token: 1 / layers)."""
    ps = cache.page_size
    lo, hi = first * ps, int(loaded_from[0]) * ps
    key, sampling = np.zeros(2, np.uint32), SamplingParams()
    calls, shapes = [], set()
    for a in range(lo, hi, chunk):
        batch = runner.batch([Row(slot, token_ids[a:min(hi, a + chunk)], sampling, key)], [a])
        shapes.add(batch.shape)
        calls.append([a, *runner.embed(batch)])

    def through_layers(pool, filling, pages, _tiers):
        for index, edge in enumerate(loaded_from):
            calls[:] = [call for call in calls if call[0] < int(edge) * ps]  # (edges never grow)
            if not calls:
                break
            weights = runner.layer_weights(index)
            for call in calls:
                call[1], pool, filling, _ = runner.layer(index, pool, filling, pages, call[1],
                                                         call[2], weights=weights)
        return None, pool, filling, None

    cache.run_model(through_layers)
    return shapes, float(np.sum(loaded_from - first)) * ps / len(loaded_from)


__all__ = ["recompute_split"]
