"""The store's host-memory tier: entry bytes (`jkv.store.codec`) under string keys in this
process's memory, counted against a capacity (`TierFull` past it). Each process has its own,
even where several share one persistent tier."""

from __future__ import annotations

from jkv.store.codec import aligned
from jkv.store.stored_names import check_key
from jkv.store.tiers import TierFull


class HostTier:
    """Entries in host memory, at most `capacity` bytes of them, kept read-only and 64-byte
    aligned (`codec.aligned`: no copy of what `encode_aligned` made; a CPU backend then
    takes a restore's arrays as they are)."""

    name = "host"

    def __init__(self, capacity: int) -> None:
        if capacity < 0:
            raise ValueError(f"host capacity must be >= 0 bytes, got {capacity}")
        self.capacity = capacity
        self._data: dict[str, memoryview] = {}
        self._meta: dict[str, bytes] = {}
        self.bytes_used = 0

    def __contains__(self, key: str) -> bool:
        return key in self._data

    def keys(self) -> list[str]:
        return list(self._data)

    def size(self, key: str) -> int:
        return len(self._data[key])

    def put(self, key: str, data: bytes | memoryview, meta: bytes = b"") -> None:
        check_key(key)
        old = len(self._data[key]) if key in self._data else 0
        if self.bytes_used - old + len(data) > self.capacity:
            raise TierFull(f"host tier: {len(data)} more bytes would exceed its capacity of "
                           f"{self.capacity} ({self.bytes_used} used)")
        self._data[key], self._meta[key] = aligned(data), bytes(meta)
        self.bytes_used += len(data) - old

    def get(self, key: str) -> memoryview | None:
        return self._data.get(key)

    def meta(self, key: str) -> bytes | None:
        return self._meta.get(key)

    def delete(self, key: str) -> None:
        data = self._data.pop(key, None)
        self._meta.pop(key, None)
        if data is not None:
            self.bytes_used -= len(data)
