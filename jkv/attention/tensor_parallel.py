"""A layer's `attend` over a tensor-parallel mesh: each device appends and attends over its
own KV heads (`jkv.kv.sharding`), the Pallas kernels or the xla path inside `shard_map`.

q, k, v and the rows' filling pages come split by KV head (the weights made them so), the
pool and the token metadata by page: a device's part holds exactly its heads' pages (the
allocator's groups), so a global page id g * part + i is page i of device g's part and the
null page 0 is every part's 0. Nothing crosses devices here; the all-reduce after o_proj is
XLA's, outside.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
from jax.sharding import PartitionSpec

from jkv.kv.sharding import TP_AXIS, shard_map

LayerKV = Any  # jkv.attention.layer_kv.LayerKV (which imports this module)

_BY_HEAD = PartitionSpec(None, TP_AXIS)  # [B, Hkv, ...]
_BY_PAGE = PartitionSpec(TP_AXIS)  # [P, ...]
_QKV = PartitionSpec(None, None, TP_AXIS)  # [B, T, H, D]


def _specs(kv: LayerKV) -> LayerKV:
    """How each array of a layer's KV is split (a tree of specs shaped like `kv`)."""
    tiers = kv.tiers
    if tiers is not None:
        tiers = tiers.replace(meta=jax.tree.map(lambda _: _BY_PAGE, tiers.meta),
                              score=_BY_HEAD, high=_BY_HEAD, low=_BY_HEAD,
                              observe_from=None if tiers.observe_from is None
                              else PartitionSpec())
    return kv.replace(pool=jax.tree.map(lambda _: _BY_PAGE, kv.pool), fill_k=_BY_HEAD,
                      fill_v=_BY_HEAD, pages=_BY_HEAD, tiers=tiers)


def split_by_heads(attend: Callable, q: jax.Array, k: jax.Array, v: jax.Array, kv: LayerKV,
                   positions: jax.Array, valid: jax.Array, sm_scale: float,
                   backend: str) -> tuple[jax.Array, LayerKV]:
    """`attend(q, k, v, kv, positions, valid, sm_scale, backend)` run on each device of
    `kv.mesh` over its KV heads and its part of the pool; the same results as one device."""
    mesh, local = kv.mesh, kv.replace(mesh=None)
    specs = _specs(local)

    def on_device(q, k, v, kv, positions, valid):
        part = kv.pool.k.shape[0]  # pages of this device's part
        return attend(q, k, v, kv.replace(pages=kv.pages % part), positions, valid,
                      sm_scale, backend)

    out, new = shard_map(on_device, mesh, in_specs=(_QKV, _QKV, _QKV, specs, PartitionSpec(),
                                                    PartitionSpec()),
                         out_specs=(_QKV, specs))(q, k, v, local, positions, valid)
    return out, new.replace(pages=kv.pages, mesh=mesh)
