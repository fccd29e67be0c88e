"""No technique: every token's KV kept, in `kv_format`, on block pages."""

from __future__ import annotations

from jkv.policies.registry import KVPolicy

POLICY = KVPolicy(name="none", summary="every token in `kv_format`")
