"""One owner of device KV state: the KV cache manager, with the layout it composes, alone
changes the pool, the free list, the page tables, the tier counts and their host mirrors.
Outside them they are read-only (an assignment raises), and no module outside them reaches
for their private state or mutates the containers their properties hand out."""

import ast
import pathlib

import jax.numpy as jnp
import pytest

from jkv.kv.format import KVFormat
from jkv.kv.manager import KVCacheManager
from jkv.kv.page_pool import page_bytes
from jkv.kv.tier_step import TierPolicy
from jkv.policies.leankv import leankv_fates

ROOT = pathlib.Path(__file__).resolve().parents[1] / "jkv"
OWNERS = {ROOT / "kv" / name for name in ("manager.py", "layouts.py", "block_pages.py",
                                           "tiered_rows.py", "row_moves.py")}
MANAGER_STATE = ("pool", "filling", "free", "tables", "free_pages", "offloaded", "slot_tokens")
LAYOUT_STATE = {"blocks": ("blocks",),
                "rows": ("meta", "counts", "entry_tables", "entry_counts", "high", "low")}
STATE = MANAGER_STATE + sum(LAYOUT_STATE.values(), ())
PRIVATE = ("_s", "_t", "_blocks", "_drops", "KVState")
# containers a property hands out: mutating one is a write too
CONTAINERS = ("offloaded", "slot_tokens", "high", "low")
MUTATORS = {"append", "extend", "pop", "popitem", "setdefault", "update", "clear", "insert",
            "remove", "fill", "put", "sort", "__setitem__"}


def manager(tiers: TierPolicy | None = None) -> KVCacheManager:
    one = page_bytes(KVFormat(), 4, 8, jnp.float32)
    return KVCacheManager(num_layers=2, num_kv_heads=2, head_dim=8, dtype=jnp.float32,
                          kv_format=KVFormat(), page_size=4, kv_cache_bytes=80 * one,
                          max_model_len=32, max_num_seqs=2, enable_prefix_caching=True,
                          device_cache_bytes=None, hash_seed=b"owner", tiers=tiers)


@pytest.mark.parametrize("tiers", [
    None, TierPolicy("leankv", leankv_fates, 8, knobs=(1.0, 0.1, 0.0))])
def test_an_outside_assignment_to_the_managers_state_raises(tiers):
    m = manager(tiers)
    owners = [(m, name) for name in MANAGER_STATE]
    owners += [(m.layout, name) for name in LAYOUT_STATE[m.layout.name]]
    for owner, name in owners:
        value = getattr(owner, name)
        with pytest.raises(AttributeError):
            setattr(owner, name, value)
    with pytest.raises(AttributeError):
        m.free_pages += 1


def _root_name(node: ast.AST) -> ast.AST:
    while isinstance(node, ast.Subscript | ast.Attribute | ast.Call):
        node = node.func if isinstance(node, ast.Call) else node.value
    return node


def _holds_container(node: ast.AST) -> bool:
    """Whether `node` is, or indexes into, an attribute named like a handed-out container
    (`x.offloaded`, `x.slot_tokens[s]`)."""
    while isinstance(node, ast.Subscript):
        node = node.value
    return isinstance(node, ast.Attribute) and node.attr in CONTAINERS


def outside_writes(source: str) -> list[str]:
    """Writes in `source` that only the manager and its layout may make: any use of their
    private state (`._s`, `._t`, `KVState`...), and assignments into or mutating calls on
    the containers their properties hand out."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and node.attr in PRIVATE:
            found.append(f"line {node.lineno}: .{node.attr}")
        if isinstance(node, ast.Name | ast.alias) and getattr(
                node, "id", getattr(node, "name", None)) in PRIVATE:
            found.append(f"line {node.lineno}: {PRIVATE}")
        targets = (node.targets if isinstance(node, ast.Assign) else
                   [node.target] if isinstance(node, ast.AugAssign | ast.AnnAssign) else [])
        for t in targets:
            for e in (t.elts if isinstance(t, ast.Tuple | ast.List) else [t]):
                if isinstance(e, ast.Subscript) and _holds_container(e.value):
                    found.append(f"line {e.lineno}: item assignment")
                if isinstance(e, ast.Attribute) and e.attr in STATE and not (
                        isinstance(e.value, ast.Name) and e.value.id == "self"):
                    found.append(f"line {e.lineno}: .{e.attr} assigned")
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and node.func.attr in MUTATORS and _holds_container(node.func.value)):
            found.append(f"line {node.lineno}: .{node.func.attr}()")
    return found


def test_no_module_but_the_manager_writes_its_state():
    bad = {str(f.relative_to(ROOT.parent)): w for f in sorted(ROOT.rglob("*.py"))
           if f not in OWNERS and f.name != "kv_state.py"
           and (w := outside_writes(f.read_text()))}
    assert not bad, f"device KV state written outside the manager: {bad}"


@pytest.mark.parametrize("planted", [
    "self.cache.free_pages += ahead",
    "c.free, c.tables = drop_layers(c.free, c.tables, slot, mask, first)",
    "c.offloaded.pop(slot, None)",
    "c.offloaded.setdefault(slot, {})[layer] = host",
    "c.slot_tokens[slot].append(token)",
    "self.cache.high[slot] = 0",
    "self.cache._s.pool = pool",
    "c.layout._t.meta = meta",
    "c.layout.meta = meta",
    "from jkv.kv.kv_state import KVState",
])
def test_the_check_finds_a_planted_outside_write(planted):
    assert outside_writes(f"def f(self, c):\n    {planted}\n")
