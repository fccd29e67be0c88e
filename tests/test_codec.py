"""Stored entries: what is encoded decodes exactly; any damage is a CorruptEntry, never data."""

from __future__ import annotations

import json
import struct

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jkv.store.codec import (
    ALIGN,
    CorruptEntry,
    EntryInfo,
    EntryMismatch,
    aligned,
    checksum,
    decode,
    encode,
)

INFO = EntryInfo(model="smollm2|cfg", kv_format="k8v4", page_size=16, num_tokens=64,
                 key="ab12")


def arrays(rng) -> dict[str, np.ndarray]:
    return {
        "k.0": rng.integers(0, 256, (3, 4, 16, 64), dtype=np.uint8),
        "k_scale.0": rng.random((3, 4, 64), dtype=np.float32),
        "v.0": rng.standard_normal((3, 4, 16, 64)).astype(ml_dtypes.bfloat16),
        "odd": rng.integers(-5, 5, (7,), dtype=np.int32),
        "empty": np.zeros((0, 3), np.float16),
    }


def entry() -> tuple[bytes, dict[str, np.ndarray]]:
    a = arrays(np.random.default_rng())
    return encode(INFO, a), a


def test_round_trip_keeps_every_array_and_field():
    data, a = entry()
    info, got = decode(data, model=INFO.model, kv_format="k8v4", page_size=16)
    assert info == INFO and list(got) == list(a)
    base = np.frombuffer(data, np.uint8).ctypes.data
    for name in a:
        assert got[name].dtype == a[name].dtype and got[name].shape == a[name].shape
        np.testing.assert_array_equal(got[name], a[name])
        if got[name].size:  # every array starts on a 64-byte boundary of the entry
            assert (got[name].ctypes.data - base) % ALIGN == 0


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_any_flipped_byte_is_corrupt(draw):
    data, _ = entry()
    i = draw.draw(st.integers(0, len(data) - 1))
    flip = draw.draw(st.integers(1, 255))
    bad = bytearray(data)
    bad[i] ^= flip
    with pytest.raises(CorruptEntry):
        decode(bytes(bad))


@settings(max_examples=100, deadline=None)
@given(st.data())
def test_truncated_or_extended_entries_are_corrupt(draw):
    data, _ = entry()
    cut = draw.draw(st.integers(0, len(data) - 1))
    with pytest.raises(CorruptEntry):
        decode(data[:cut])
    with pytest.raises(CorruptEntry):
        decode(data + draw.draw(st.binary(min_size=1, max_size=64)))


def reforge(data: bytes, edit) -> bytes:
    """Rewrite the header with `edit` and recompute the checksum: damage a checksum
    cannot see, which the header checks must."""
    header_len = struct.unpack_from("<I", data, 8)[0]
    header = json.loads(data[12:12 + header_len])
    edit(header)
    new = json.dumps(header, separators=(",", ":")).encode()
    new += b" " * (-(12 + len(new)) % ALIGN)  # the payload stays on a 64-byte boundary
    body = data[:8] + struct.pack("<I", len(new)) + new + data[12 + header_len:-32]
    return body + checksum(body)


@pytest.mark.parametrize("edit", [
    lambda h: h["arrays"][0].update(nbytes=h["arrays"][0]["nbytes"] - 1),
    lambda h: h["arrays"][1].update(offset=h["arrays"][1]["offset"] + ALIGN),
    lambda h: h["arrays"][0].update(shape=[3, 4, 16, 65]),
    lambda h: h["arrays"][0].update(dtype="float64"),
    lambda h: h["arrays"][2].update(name="k.0"),
    lambda h: h.update(arrays=h["arrays"][:3]),  # bytes the table no longer covers
    lambda h: h.update(num_tokens=-1),
    lambda h: h.update(extra=1),
    lambda h: h.pop("model"),
])
def test_a_consistent_checksum_over_an_inconsistent_header_is_still_corrupt(edit):
    data, _ = entry()
    decode(reforge(data, lambda h: None))  # the reforging itself keeps a good entry good
    with pytest.raises(CorruptEntry):
        decode(reforge(data, edit))


def test_an_intact_entry_of_another_model_or_format_is_a_mismatch():
    data, _ = entry()
    for kw in ({"model": "other"}, {"kv_format": "auto"}, {"page_size": 8}):
        with pytest.raises(EntryMismatch, match=next(iter(kw))):
            decode(data, **kw)


def test_bad_input_to_encode_raises_value_errors():
    with pytest.raises(ValueError, match="dtype"):
        encode(INFO, {"x": np.zeros(3, np.float64)})
    with pytest.raises(ValueError, match="names"):
        encode(INFO, {"": np.zeros(3, np.float32)})
    with pytest.raises(ValueError, match="num_tokens"):
        EntryInfo("m", "auto", 16, -1)


def test_entries_of_several_checksum_chunks_round_trip_and_catch_damage_in_any_chunk():
    rng = np.random.default_rng()
    big = {"k.0": rng.integers(0, 256, (3, 5 << 20), dtype=np.uint8)}  # 15 MiB: 4 chunks
    data = encode(INFO, big)
    np.testing.assert_array_equal(decode(data)[1]["k.0"], big["k.0"])
    for i in rng.integers(0, len(data), 4):
        bad = bytearray(data)
        bad[i] ^= 1 << int(rng.integers(0, 8))
        with pytest.raises(CorruptEntry):
            decode(bytes(bad))


def test_an_entry_of_another_codec_version_is_refused_by_name():
    data, _ = entry()
    old = bytearray(data)
    struct.pack_into("<H", old, 4, 1)  # version 1 hashed every byte with BLAKE2b
    with pytest.raises(CorruptEntry, match="version 1"):
        decode(bytes(old))


def test_decode_with_align_reads_every_array_from_a_64_byte_boundary():
    data, a = entry()
    for skip in (0, 1, 16, 48):  # the same entry at addresses of every alignment
        buf = bytearray(skip + len(data))
        buf[skip:] = data
        view = memoryview(buf)[skip:]
        _, got = decode(view, align=True)
        for name in a:
            np.testing.assert_array_equal(got[name], a[name])
            assert got[name].ctypes.data % ALIGN == 0 or not got[name].size
            assert not got[name].flags.writeable
    again = aligned(data)
    address = np.frombuffer(again, np.uint8).ctypes.data
    assert address % ALIGN == 0
    # aligned and read-only already: not copied again
    assert np.frombuffer(aligned(again), np.uint8).ctypes.data == address
