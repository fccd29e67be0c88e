"""Where device KV state lives: one device, or a tensor-parallel mesh split by KV head.

With `tensor_parallel` N > 1 the engine runs over a one-axis `Mesh` of the first N devices
(axis `TP_AXIS`). Each device holds the KV of its group of num_kv_heads / N KV heads: the
filling pages split along their KV-head axis, and the pool along its page axis, N equal
parts, since the allocator gives each group's heads pages only from its own part
(`allocator.init_free(groups=)`). Free list, page tables and the other bookkeeping are
replicated. N = 1 is no mesh at all: everything sits on the default device, as it did
before tensor parallelism.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec, Sharding

TP_AXIS = "tp"  # the mesh axis the KV heads (and the weights with them) are split along

try:  # a JAX with jax.shard_map (0.10, 0.11)
    from jax import shard_map as _shard_map

    def shard_map(f: Callable, mesh: Mesh, in_specs: Any, out_specs: Any) -> Callable:
        """`f` run on each device's shards (no replication checks: kernels inside)."""
        return _shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs,
                          check_vma=False)
except ImportError:  # an older JAX: the experimental one
    from jax.experimental.shard_map import shard_map as _old_shard_map

    def shard_map(f: Callable, mesh: Mesh, in_specs: Any, out_specs: Any) -> Callable:
        """`f` run on each device's shards (no replication checks: kernels inside)."""
        return _old_shard_map(f, mesh, in_specs, out_specs, check_rep=False)


def make_mesh(tensor_parallel: int, num_kv_heads: int) -> Mesh | None:
    """The mesh of the first `tensor_parallel` devices (None for 1); ValueError naming
    `tensor_parallel` when it does not divide the KV heads or exceeds the devices."""
    n = tensor_parallel
    if n == 1:
        return None
    if num_kv_heads % n:
        raise ValueError(f"EngineConfig.tensor_parallel={n} must divide the model's "
                         f"{num_kv_heads} KV heads")
    devices = jax.devices()
    if n > len(devices):
        raise ValueError(f"EngineConfig.tensor_parallel={n} exceeds the {len(devices)} "
                         f"{jax.default_backend()} device(s) available")
    return Mesh(np.array(devices[:n]), (TP_AXIS,))


def split(mesh: Mesh, axis: int) -> NamedSharding:
    """Arrays split along `axis` over the mesh."""
    return NamedSharding(mesh, PartitionSpec(*[None] * axis, TP_AXIS))


@dataclass(frozen=True)
class KVPlacement:
    """Where the manager puts each kind of device KV array (see the module docstring)."""

    mesh: Mesh | None = None

    @property
    def groups(self) -> int:
        """KV-head groups: one per device of the mesh."""
        return 1 if self.mesh is None else self.mesh.size

    @property
    def replicated(self) -> jax.Device | Sharding:
        """Bookkeeping arrays (free list, tables, counts): whole on every device."""
        return jax.devices()[0] if self.mesh is None else NamedSharding(self.mesh,
                                                                        PartitionSpec())

    @property
    def pages(self) -> jax.Device | Sharding:
        """Arrays indexed by page id [P, ...] (the pool, token metadata)."""
        return jax.devices()[0] if self.mesh is None else split(self.mesh, 0)

    def heads(self, axis: int) -> jax.Device | Sharding:
        """Arrays with a KV-head axis at `axis` (the filling pages)."""
        return jax.devices()[0] if self.mesh is None else split(self.mesh, axis)

    def make(self, build: Callable[[], Any], where: jax.Device | Sharding) -> Any:
        """`build()`'s arrays put `where`; on a mesh built there in parts, never whole on
        one device (a pool for a model spread over devices may not fit one)."""
        if self.mesh is None:
            return jax.device_put(build(), where)
        return jax.jit(build, out_shardings=where)()

    @property
    def join_copies(self) -> bool:
        """Whether host pages on their way in are joined into one leading axis even where
        that takes a host copy (`transfer.flat_run`): on a CPU that copy is the only one,
        and on a mesh the joined axis is what the devices split; a GPU's device copy lays a
        strided run out itself."""
        return self.mesh is not None or jax.default_backend() == "cpu"

    def put(self, pages: Any) -> Any:
        """Host pages on their way into the pool (a restore): uncommitted on the default
        device without a mesh; on a mesh split like the pool along their leading axis (or
        whole on every device where that does not divide)."""
        if self.mesh is None:
            return jax.device_put(pages)
        n = self.mesh.size
        whole = any(np.shape(x)[0] % n for x in jax.tree.leaves(pages))
        return jax.device_put(pages, self.replicated if whole else self.pages)
