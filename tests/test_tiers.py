"""Entry tiers: capacities are enforced, the persistent tier's index comes back from what is
stored, and damaged stored bytes never come back as an intact entry."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jkv.store import stored_names, tiers
from jkv.store.codec import ALIGN, CorruptEntry, EntryInfo, decode, encode
from jkv.store.host_tier import HostTier
from jkv.store.tiers import PersistentTier, TierFull


@settings(max_examples=100, deadline=None)
@given(st.integers(0, 500), st.lists(st.tuples(st.sampled_from("abcdef"), st.integers(0, 200),
                                               st.booleans()), max_size=40))
def test_host_tier_never_exceeds_its_capacity(capacity, ops):
    tier = HostTier(capacity)
    model: dict[str, int] = {}
    for key, size, delete in ops:
        if delete:
            tier.delete(key)
            model.pop(key, None)
        elif sum(model.values()) - model.get(key, 0) + size > capacity:
            with pytest.raises(TierFull):
                tier.put(key, b"x" * size)
        else:
            tier.put(key, b"x" * size)
            model[key] = size
        assert tier.bytes_used == sum(model.values()) <= capacity
        assert sorted(tier.keys()) == sorted(model)


def test_long_entries_are_stored_in_parts_and_read_back_whole_and_aligned(tmp_path,
                                                                         monkeypatch):
    monkeypatch.setattr(stored_names, "PART", 1000)
    rng = np.random.default_rng()
    tier = PersistentTier(tmp_path, 1 << 20)
    stored = {}
    for size in (1, 999, 1000, 1001, 4321):
        stored[f"e{size}"] = rng.integers(0, 256, size, dtype=np.uint8).tobytes()
        tier.put(f"e{size}", stored[f"e{size}"], b"meta")
    names = sorted(n.decode() for n in tier._kv.list().result())
    assert [n for n in names if n.startswith("e4321@")] == [
        "e4321@4321", "e4321@4321.1", "e4321@4321.2", "e4321@4321.3", "e4321@4321.4",
        "e4321@4321.meta"]
    # an entry one of whose values is gone is not an entry
    tier._kv.delete_range(tiers.ts.KvStore.KeyRange("e1001@1001.1", "e1001@1001.1\0")).result()
    del stored["e1001"]
    for again in (tier, PersistentTier(tmp_path, 1 << 20)):
        if again is not tier:
            assert sorted(again.keys()) == sorted(stored)
            assert again.foreign == ["e1001@1001", "e1001@1001.meta"]
            assert again.bytes_used == sum(map(len, stored.values()))
        for key, data in stored.items():
            got = again.get(key)
            assert bytes(got) == data and got.readonly
            assert np.frombuffer(got, np.uint8).ctypes.data % ALIGN == 0
    assert again.get("absent") is None
    again.delete("e4321")  # every value and the meta record
    assert not [n for n in again._kv.list().result() if n.startswith(b"e4321@")]


def test_persistent_tier_index_is_rebuilt_on_open(tmp_path):
    tier = PersistentTier(tmp_path, 10_000)
    tier.put("a", b"1" * 100)
    tier.put("b", b"2" * 50)
    tier.put("a", b"3" * 300)  # replaced: one entry, the new size
    (tmp_path / "notes.txt").write_text("not an entry")
    again = PersistentTier(tmp_path, 10_000)
    assert sorted(again.keys()) == ["a", "b"] and again.bytes_used == 350
    assert again.get("a") == b"3" * 300 and again.size("b") == 50 and again.get("c") is None
    again.delete("b")
    assert PersistentTier(tmp_path, 10_000).keys() == ["a"]
    with pytest.raises(TierFull, match="capacity"):
        again.put("c", b"4" * 9_701)
    with pytest.raises(ValueError, match="keys"):
        again.put("a/b", b"")


def test_flipped_bytes_in_stored_files_never_decode(tmp_path):
    info = EntryInfo("m", "auto", 16, 32, "k")
    rng = np.random.default_rng()
    data = encode(info, {"k": rng.standard_normal((2, 32, 64)).astype(np.float32)})
    PersistentTier(tmp_path, 10**7).put("k", data)
    holders = [p for p in (tmp_path / "d").iterdir() if data in p.read_bytes()]
    assert len(holders) == 1  # OCDBT keeps the value's bytes as they are
    raw = bytearray(holders[0].read_bytes())
    start = raw.find(data)
    for i in start + rng.choice(len(data), 3, replace=False):  # damage the entry itself
        raw[i] ^= int(rng.integers(1, 256))
    holders[0].write_bytes(bytes(raw))
    got = PersistentTier(tmp_path, 10**7).get("k")
    assert got != data
    if got is not None:  # the store read it back damaged: the codec must refuse it
        with pytest.raises(CorruptEntry):
            decode(got)


def test_bad_arguments_raise_value_errors(tmp_path):
    with pytest.raises(ValueError, match="capacity"):
        HostTier(-1)
    with pytest.raises(ValueError, match="capacity"):
        PersistentTier(tmp_path, -1)


@pytest.fixture
def s3_spec(tmp_path, monkeypatch):
    """A bucket on a local S3-compatible server (moto) on 127.0.0.1."""
    boto3 = pytest.importorskip("boto3")
    server = pytest.importorskip("moto.server")
    credentials = tmp_path / "aws-credentials"
    credentials.write_text("[default]\naws_access_key_id = test\naws_secret_access_key = test\n")
    for name, value in (("AWS_ACCESS_KEY_ID", "test"), ("AWS_SECRET_ACCESS_KEY", "test"),
                        ("AWS_REGION", "us-east-1"), ("AWS_SHARED_CREDENTIALS_FILE",
                                                      str(credentials)),
                        ("AWS_CONFIG_FILE", str(credentials))):
        monkeypatch.setenv(name, value)
    moto = server.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    moto.start()
    host, port = moto.get_host_and_port()
    url = f"http://{host}:{port}"
    boto3.client("s3", endpoint_url=url, region_name="us-east-1").create_bucket(
        Bucket="jkv-store")
    yield {"driver": "s3", "bucket": "jkv-store", "path": "kv/", "endpoint": url,
           "aws_region": "us-east-1"}
    moto.stop()


def test_persistent_tier_on_s3(s3_spec):
    tier = PersistentTier(s3_spec, 10_000)
    tier.put("a", b"1" * 100)
    tier.put("b", b"2" * 20)
    tier.put("a", b"3" * 30)
    again = PersistentTier(s3_spec, 10_000)
    assert sorted(again.keys()) == ["a", "b"] and again.bytes_used == 50
    assert again.get("a") == b"3" * 30
    again.delete("a")
    assert PersistentTier(s3_spec, 10_000).keys() == ["b"]
