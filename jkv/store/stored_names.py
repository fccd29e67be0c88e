"""The names the persistent tier stores under (see `jkv.store.tiers`): an entry's values at
``<key>@<bytes>``, ``<key>@<bytes>.1``, ..., its meta record at ``<key>@<bytes>.meta``;
`read_listing` turns a database's listing back into entries (the tier's index when it opens).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Collection
from dataclasses import dataclass, field

PART = 8 << 20  # bytes per stored value (and per read) of an entry
NAME = re.compile(r"(?P<key>[0-9A-Za-z_.:-]+)@(?P<size>\d+)(?:(?P<meta>\.meta)|\.(?P<part>\d+))?")


def part_sizes(size: int) -> list[int]:
    """Bytes of each stored value of an entry of `size` bytes: its first at the entry's name,
    the others at name.1, name.2, ... (`PART` each, the last what remains)."""
    return [min(PART, size - a) for a in range(0, size, PART)] or [0]


def part_name(name: str, index: int) -> str:
    """The name of an entry's value `index` (its first at the entry's name)."""
    return name if index == 0 else f"{name}.{index}"


def check_key(key: str) -> str:
    """`key`, when an entry may be stored under it; ValueError otherwise."""
    if not isinstance(key, str) or not re.fullmatch(r"[0-9A-Za-z_.:-]+", key):
        raise ValueError(f"entry keys are non-empty [0-9A-Za-z_.:-] strings, got {key!r}")
    return key


@dataclass
class Listing:
    names: dict[str, str] = field(default_factory=dict)  # key -> stored name
    sizes: dict[str, int] = field(default_factory=dict)  # key -> bytes
    has_meta: set[str] = field(default_factory=set)  # stored names with a meta record beside
    bytes_used: int = 0
    foreign: list[str] = field(default_factory=list)  # names that are not entries (left alone)

    def drop_unrecorded(self, keep: Collection[str]) -> None:
        """Leave out the entries without a meta record, but those in `keep`: in a database
        several processes write, an entry's record is written last (it is still being
        written, or its writer died before it)."""
        for key, name in list(self.names.items()):
            if name not in self.has_meta and key not in keep:
                self.bytes_used -= self.sizes.pop(key)
                del self.names[key]


def read_listing(names: list[str], values_of: Callable[[int], int]) -> Listing:
    """The entries among a database's stored `names` (`values_of(size)`: how many values an
    entry of that size is stored as); an entry missing a value (or stored whole by an
    earlier jkv), or a value or meta record of no entry, is foreign."""
    out = Listing()
    parts: dict[str, int] = {}  # stored name -> its values beyond the first
    for n in names:
        m = NAME.fullmatch(n)
        if m is None:
            out.foreign.append(n)
        elif m["meta"]:
            out.has_meta.add(n[: -len(".meta")])
        elif m["part"]:
            owner = n[: -len(m["part"]) - 1]
            parts[owner] = parts.get(owner, 0) + 1
        else:
            out.names[m["key"]], out.sizes[m["key"]] = n, int(m["size"])
            out.bytes_used += int(m["size"])
    for key, name in list(out.names.items()):
        if parts.pop(name, 0) != values_of(out.sizes[key]) - 1:
            out.foreign.append(name)
            out.bytes_used -= out.sizes.pop(key)
            del out.names[key]
    out.foreign += [f"{n}.{i + 1}" for n, count in parts.items() for i in range(count)]
    # a meta record without its entry cannot be left by an atomic commit: not ours
    out.foreign += [f"{n}.meta" for n in out.has_meta - set(out.names.values())]
    return out
