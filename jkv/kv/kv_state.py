"""The device KV state every layout shares, and the read-only view the manager gives of it.

`KVState` is written only by the KV cache manager (`manager.py`) and the layout it composes
(`layouts.py`, with a layout's moves out of the pool; `tests/test_kv_owner.py` lists them
all); everything else reads it through their read-only properties (`read_only`), so the
host's count of free pages and the device's free list change together, in one place.
"""

from __future__ import annotations


class KVState:
    """The pool (`KVPages`), the pages being filled beside it, the device free list and page
    tables, the host mirror of the free count, the tokens each slot holds, and the layers
    each slot holds on the host (slot -> {layer: its host copy})."""

    def __init__(self) -> None:
        self.pool = self.filling = self.free = self.tables = None
        self.free_pages = 0
        self.slot_tokens: list[list[int]] = []
        self.offloaded: dict[int, dict[int, object]] = {}


def read_only(holder: str, name: str, doc: str) -> property:
    """A property reading `self.<holder>.<name>`, with no setter (assigning raises)."""
    return property(lambda self: getattr(getattr(self, holder), name), doc=doc)
