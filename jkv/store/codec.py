"""The bytes of one stored KV entry, and their validation.

An entry is a run of full pages of one request (per layer, in its KV format, exactly as the
pool holds them: keys rotated to positions 0..n-1, moved by `jkv.kv.rebase` when a
truncated conversation reuses them at other positions) as named arrays, with a header saying
what it is (model fingerprint, KV format, page size, token count) and a checksum over every
byte.
Decoding checks everything (magic, version, lengths, checksum, header fields, array table)
before returning an array, so a torn or corrupt file is a `CorruptEntry`, never data.

Layout: MAGIC | u16 version | u16 0 | u32 header length | header (JSON, padded with spaces so
the payload starts on a 64-byte boundary) | payload (each array at a 64-byte boundary,
zero-padded between) | checksum of everything before it: the 32-byte BLAKE2b of the CRC-32s
of its 4 MiB chunks (version 2; version 1 hashed every byte with BLAKE2b, on one core the
longest part of a host-tier restore). CRC-32 detects every burst of up to 32 flipped bits
and any other damage but for 2^-32; the chunks are summed on threads (zlib releases the
GIL), so a long entry checks in a small part of that time.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import struct
import threading
import zlib
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import wait as futures_wait
from dataclasses import asdict, dataclass

import ml_dtypes
import numpy as np

from jkv.store.priority import lower_thread_priority

MAGIC = b"JKVE"
VERSION = 2
ALIGN = 64
_PREFIX = struct.Struct("<4sHHI")
_DIGEST = 32
DTYPES = {name: np.dtype(t) for name, t in (
    ("uint8", np.uint8), ("int8", np.int8), ("int32", np.int32), ("uint32", np.uint32),
    ("float16", np.float16), ("float32", np.float32), ("bfloat16", ml_dtypes.bfloat16))}
_CHUNK = 4 << 20
_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


class CorruptEntry(ValueError):
    """The bytes are not a whole, intact entry (torn write, flipped bits, foreign file)."""


class EntryMismatch(ValueError):
    """An intact entry of another model, KV format or page size: not usable here."""


@dataclass(frozen=True)
class EntryInfo:
    """What an entry holds: `num_tokens` tokens (whole pages of `page_size`) of the model
    fingerprinted `model`, stored in KV format `kv_format`; `key` names it (hex)."""

    model: str
    kv_format: str
    page_size: int
    num_tokens: int
    key: str = ""

    def __post_init__(self) -> None:
        for name in ("model", "kv_format", "key"):
            if not isinstance(getattr(self, name), str):
                raise ValueError(f"EntryInfo.{name} must be a str")
        for name in ("page_size", "num_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"EntryInfo.{name} must be an int >= 0, got {value!r}")


def _executor() -> ThreadPoolExecutor:
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(min(8, os.cpu_count() or 1), "jkv-checksum",
                                       initializer=lower_thread_priority)
        return _pool


def _forget_executor() -> None:  # a forked child has the pool but not its threads
    global _pool, _pool_lock
    _pool, _pool_lock = None, threading.Lock()  # nor a lock another thread held


os.register_at_fork(after_in_child=_forget_executor)


def checksum(data: bytes | bytearray | memoryview) -> bytes:
    """The entry checksum of `data`: BLAKE2b-256 of its 4 MiB chunks' CRC-32s, summed on
    threads. Every view taken is released before returning (a bytearray can grow again),
    and only after every thread reading one is done, whatever interrupts the wait."""
    with memoryview(data) as whole, whole.cast("B") as view:
        chunks = [view[i:i + _CHUNK] for i in range(0, len(view), _CHUNK)] or [view[:0]]
        futures = []
        try:
            if len(chunks) > 1:
                # at interpreter exit (a finalizer saving) no new work starts: summed here
                with contextlib.suppress(RuntimeError):
                    pool = _executor()
                    for c in chunks:
                        futures.append(pool.submit(zlib.crc32, c))
            crcs = ([f.result() for f in futures] if len(futures) == len(chunks)
                    else [zlib.crc32(c) for c in chunks])
        finally:
            futures_wait(futures)
            for c in chunks:
                c.release()
    return hashlib.blake2b(struct.pack(f"<{len(crcs)}I", *crcs), digest_size=_DIGEST).digest()


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def aligned_buffer(size: int) -> np.ndarray:
    """`size` writable bytes starting on an `ALIGN`-byte boundary."""
    buf = np.empty(size + ALIGN, np.uint8)
    skip = -buf.ctypes.data % ALIGN
    return buf[skip:skip + size]


def _address(data: memoryview) -> int:
    return np.frombuffer(data, np.uint8).ctypes.data if len(data) else 0


def aligned(data: bytes | bytearray | memoryview) -> memoryview:
    """`data` as read-only bytes starting on an `ALIGN`-byte boundary (itself when it is
    already, else a copy), so the arrays `decode` views in it are aligned too. On CPU,
    `jax.device_put` takes such an array without copying it, where an unaligned one is copied
    by the restoring step, on the serving loop's thread: copied here, on the store's
    reader, instead. A GPU's host-to-device copy gains nothing from it."""
    view = memoryview(data).cast("B")
    if view.readonly and not _address(view) % ALIGN:
        return view
    out = aligned_buffer(len(view))
    out[:] = np.frombuffer(view, np.uint8)
    out.flags.writeable = False
    return memoryview(out)


def encode(info: EntryInfo, arrays: Mapping[str, np.ndarray]) -> bytes:
    """The entry's bytes: header, `arrays` (names and dtypes kept), checksum."""
    return bytes(encode_aligned(info, arrays))


def encode_aligned(info: EntryInfo, arrays: Mapping[str, np.ndarray]) -> memoryview:
    """`encode`'s bytes as a read-only view that starts on an `ALIGN`-byte boundary, built
    by numpy copies that let other threads run: a store's writer encoding a long entry as
    Python bytes held the GIL, and so stopped the serving loop, for tens of milliseconds."""
    table, offset = [], 0
    for name, a in arrays.items():
        a = np.asarray(a)
        dtype = next((k for k, v in DTYPES.items() if v == a.dtype), None)
        if not isinstance(name, str) or not name:
            raise ValueError(f"array names must be non-empty strings, got {name!r}")
        if dtype is None:
            raise ValueError(f"array {name!r}: dtype {a.dtype} is not one of {sorted(DTYPES)}")
        table.append({"name": name, "dtype": dtype, "shape": list(a.shape),
                      "offset": offset, "nbytes": a.nbytes})
        offset = _aligned(offset + a.nbytes)
    header = json.dumps({**asdict(info), "arrays": table}, separators=(",", ":")).encode()
    header += b" " * (_aligned(_PREFIX.size + len(header)) - _PREFIX.size - len(header))
    start = _PREFIX.size + len(header)
    body = start + offset
    out = aligned_buffer(body + _DIGEST)
    out[:start] = np.frombuffer(_PREFIX.pack(MAGIC, VERSION, 0, len(header)) + header,
                                np.uint8)
    end = start
    for entry, a in zip(table, arrays.values(), strict=True):
        at = start + entry["offset"]
        out[end:at] = 0  # padding to the array's boundary
        out[at:at + entry["nbytes"]] = np.ascontiguousarray(a).reshape(-1).view(np.uint8)
        end = at + entry["nbytes"]
    out[end:body] = 0
    out[body:] = np.frombuffer(checksum(memoryview(out)[:body]), np.uint8)
    out.flags.writeable = False
    return memoryview(out)


def decode(data: bytes, *, model: str | None = None, kv_format: str | None = None,
           page_size: int | None = None, align: bool = False
           ) -> tuple[EntryInfo, dict[str, np.ndarray]]:
    """Validate and read an entry (arrays are read-only views of `data`; with `align`, of
    `aligned(data)`, a copy unless it is aligned already). Raises `CorruptEntry` for
    anything but a whole, intact entry and `EntryMismatch` when it is intact but for another
    `model`, `kv_format` or `page_size` than the ones given."""
    data = aligned(data) if align else memoryview(data).cast("B")
    if len(data) < _PREFIX.size + _DIGEST:
        raise CorruptEntry(f"{len(data)} bytes is too short for an entry")
    magic, version, reserved, header_len = _PREFIX.unpack_from(data)
    if magic != MAGIC or reserved != 0:
        raise CorruptEntry("not a jkv entry (bad magic)")
    if version != VERSION:
        raise CorruptEntry(f"entry version {version}, this jkv reads {VERSION}")
    body = len(data) - _DIGEST
    if checksum(data[:body]) != bytes(data[body:]):
        raise CorruptEntry("checksum mismatch")
    start = _PREFIX.size + header_len
    if start > body or start % ALIGN:
        raise CorruptEntry(f"header length {header_len} does not fit the entry")
    try:
        header = json.loads(bytes(data[_PREFIX.size:start]))
        table = header.pop("arrays")
        info = EntryInfo(**header)
        arrays = {}
        end = 0
        for entry in table:
            name, dtype, shape = entry["name"], DTYPES[entry["dtype"]], entry["shape"]
            offset, nbytes = entry["offset"], entry["nbytes"]
            if (not isinstance(name, str) or name in arrays or offset != _aligned(end)
                    or not all(isinstance(n, int) and n >= 0 for n in shape)
                    or nbytes != math.prod(shape) * dtype.itemsize
                    or start + offset + nbytes > body):
                raise CorruptEntry(f"array {name!r}: inconsistent table entry {entry}")
            arrays[name] = np.frombuffer(data, dtype, math.prod(shape),
                                         start + offset).reshape(shape)
            end = offset + nbytes
        if start + _aligned(end) != body:
            raise CorruptEntry("payload length does not match the array table")
    except CorruptEntry:
        raise
    except (ValueError, KeyError, TypeError, AttributeError, RecursionError) as e:
        raise CorruptEntry(f"unreadable header: {e}") from None
    for name, want in (("model", model), ("kv_format", kv_format), ("page_size", page_size)):
        if want is not None and getattr(info, name) != want:
            raise EntryMismatch(f"entry {name} is {getattr(info, name)!r}, expected {want!r}")
    return info, arrays
