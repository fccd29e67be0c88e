"""The persistent tier on a real filesystem: its budget fitted to the space there, a full disk
that recovers (eviction, compaction, one retry), a damaged manifest moved aside, and an entry
promoted to host memory that a dying process does not lose."""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from test_store import PAGE, blocks, chain, entry_bytes, store

from jkv.config import StoreConfig
from jkv.store import disk_room
from jkv.store.ocdbt_files import footprint
from jkv.store.store import KVStore
from jkv.store.tiers import PersistentTier


def disk_store(path, free_space=None, **kw) -> KVStore:
    kw = {"host_cache_bytes": 0, "disk_cache_bytes": 1 << 40, **kw}
    return KVStore(StoreConfig(store_dir=str(path), **kw), model="m", kv_format="auto",
                   page_size=PAGE, free_space=free_space)


def test_the_disk_budget_is_never_above_the_free_space_found(tmp_path):
    tier = PersistentTier(tmp_path / "a", 1 << 60)
    assert 0 < tier.capacity <= shutil.disk_usage(tmp_path).free
    rng = np.random.default_rng()
    s = disk_store(tmp_path / "b", free_space=lambda: 3 * 40 * entry_bytes(1))
    assert s.snapshot()["capacity_bytes"]["disk"] == 40 * entry_bytes(1)
    for _ in range(30):  # 60 blocks' worth
        s.save(2, blocks(2, rng), chain(rng.integers(0, 1000, 2 * PAGE).tolist()))
    s.flush()
    snap = s.snapshot()
    assert snap["bytes"]["disk"] <= 40 * entry_bytes(1) and snap["evictions"] > 0
    s.close()


def test_deleted_entries_bytes_go_back_to_the_filesystem(tmp_path):
    """OCDBT keeps a deleted entry's bytes; the tier compacts, so its files stay within a
    few times its budget however many entries come and go, and every entry left reads."""
    rng = np.random.default_rng()
    budget = 10 * entry_bytes(4)
    s = disk_store(tmp_path, disk_cache_bytes=budget)
    runs = [chain(rng.integers(0, 1000, 4 * PAGE).tolist()) for _ in range(60)]
    for hashes in runs:
        s.save(4, blocks(4, rng), hashes)
        s.flush()
        assert footprint(tmp_path) <= 3 * budget
    snap = s.snapshot()
    assert snap["compactions"] >= 2 and snap["entries"]["disk"] >= 9
    assert all(s.load(s.lookup(h)) is not None for h in runs[-9:])
    s.close()
    again = disk_store(tmp_path, disk_cache_bytes=budget)
    assert again.snapshot()["entries"]["disk"] == snap["entries"]["disk"]
    again.close()


def test_a_full_disk_evicts_retries_once_and_saves_resume(tmp_path, monkeypatch, caplog):
    """A simulated disk of `size` bytes (the tier's files plus what else is on it): its free
    space is what the probe says, and a write past it fails as tensorstore says ENOSPC.
    Another user fills it: a save fails once, is retried in the room eviction and a
    compaction made, and saves go on; a save that cannot be stored even then is dropped."""
    rng = np.random.default_rng()
    one = entry_bytes(4)
    disk = {"size": 60 * one, "other": 0}

    def free() -> int:
        return max(0, disk["size"] - disk["other"] - footprint(tmp_path))

    commit = PersistentTier._commit

    def failing_commit(self, key, name, data, meta):
        if len(data) > free():
            raise ValueError("RESOURCE_EXHAUSTED: Failed writing: No space left on device "
                             "[os_error_code='28']")
        commit(self, key, name, data, meta)

    monkeypatch.setattr(PersistentTier, "_commit", failing_commit)
    s = disk_store(tmp_path, free_space=free)
    runs = [chain(rng.integers(0, 1000, 4 * PAGE).tolist()) for _ in range(40)]
    for hashes in runs[:20]:
        s.save(4, blocks(4, rng), hashes)
        s.flush()
    before = s.snapshot()
    assert before["entries"]["disk"] >= 15 and before["disk_full"] == 0
    disk["other"] = disk["size"] - footprint(tmp_path) - one // 2  # the disk fills
    with caplog.at_level(logging.WARNING, logger="jkv.store.store"):
        for hashes in runs[20:]:
            s.save(4, blocks(4, rng), hashes)
            s.flush()
    snap = s.snapshot()
    assert snap["disk_full"] >= 1 and snap["save_retries"] >= 1
    assert snap["capacity_bytes"]["disk"] < before["capacity_bytes"]["disk"]
    assert snap["evictions"] > before["evictions"] and snap["save_failures"] == 0
    found = [h for h in runs[20:] if s.lookup(h) is not None]
    assert runs[-1] in found and all(s.load(s.lookup(h)) is not None for h in found)
    full = [r for r in caplog.records if "disk is full" in r.getMessage()]
    assert len(full) == 1 and not any(r.exc_info for r in caplog.records)  # one line, no trace
    disk["other"] = disk["size"]  # nothing left at all: dropped and counted
    s.save(4, blocks(4, rng), chain(rng.integers(0, 1000, 4 * PAGE).tolist()))
    s.flush()
    assert s.snapshot()["saves_dropped"] == snap["saves_dropped"] + 1
    low = s.snapshot()["capacity_bytes"]["disk"]
    disk["other"] = 0  # the other user's file goes: the budget comes back, saves reach the disk
    monkeypatch.setattr(disk_room, "RECHECK_S", 0.0)
    again = [chain(rng.integers(0, 1000, 4 * PAGE).tolist()) for _ in range(3)]
    for hashes in again:
        s.save(4, blocks(4, rng), hashes)
        s.flush()
    assert s.snapshot()["capacity_bytes"]["disk"] >= before["capacity_bytes"]["disk"] > low
    assert all(s.lookup(h) is not None for h in again)
    s.close()


def test_a_disk_that_refuses_writes_is_one_warning_and_counted(tmp_path, monkeypatch, caplog):
    rng = np.random.default_rng()
    refuse = {"on": True}
    commit = PersistentTier._commit

    def refusing_commit(self, *args):
        if refuse["on"]:
            raise ValueError("PERMISSION_DENIED: Failed to open: Permission denied")
        commit(self, *args)

    monkeypatch.setattr(PersistentTier, "_commit", refusing_commit)
    s = disk_store(tmp_path)
    runs = [chain(rng.integers(0, 1000, 2 * PAGE).tolist()) for _ in range(4)]
    with caplog.at_level(logging.WARNING, logger="jkv.store.store"):
        for hashes in runs[:3]:
            s.save(2, blocks(2, rng), hashes)
            s.flush()
    assert s.snapshot()["save_failures"] == 3 and s.snapshot()["disk_full"] == 0
    assert len(caplog.records) == 1 and caplog.records[0].exc_info is None
    refuse["on"] = False  # writable again: saves go on
    s.save(2, blocks(2, rng), runs[3])
    s.flush()
    assert s.lookup(runs[3]) is not None and s.lookup(runs[0]) is None
    s.close()


_FILL = textwrap.dedent("""
    import json, logging, os, shutil, sys
    import numpy as np
    sys.path.insert(0, {tests!r})
    from test_store import PAGE, blocks
    from jkv.config import StoreConfig
    from jkv.store.ocdbt_files import footprint
    from jkv.store.store import KVStore

    logging.basicConfig(level=logging.WARNING)
    root = {root!r}
    rng = np.random.default_rng(0)
    s = KVStore(StoreConfig(store_dir=root + "/kv", host_cache_bytes=0), model="m",
                kv_format="auto", page_size=PAGE)
    out = {{"capacity": [s.disk.capacity], "footprint": []}}

    def save(n):
        runs = []
        for _ in range(n):
            runs.append([rng.bytes(16) for _ in range(24)])
            s.save(24, blocks(24, rng), runs[-1])
            s.flush()
            out["footprint"].append(footprint(s.disk.path))
        out["capacity"].append(s.disk.capacity)
        out["found"] = [s.lookup(h) is not None and s.load(s.lookup(h)) is not None
                        for h in runs]
        out[f"snap{{len(out['capacity']) - 1}}"] = s.snapshot()

    save(60)
    with open(root + "/filler", "wb") as f:  # another user takes all but 50 KB
        f.write(bytes(shutil.disk_usage(root).free - 50_000))
    save(15)
    os.remove(root + "/filler")
    save(20)
    s.close()
    print(json.dumps(out, default=str))
""")


def test_a_full_tmpfs_recovers(tmp_path):
    """The real thing: an 8 MiB tmpfs (mounted in a user and mount namespace) that the store
    churns through, then another file fills; saves fail once, the store evicts and compacts
    and saves resume, and once the file goes the budget comes back."""
    mount = tmp_path / "disk"
    mount.mkdir()
    script = _FILL.format(tests=os.path.dirname(__file__), root=str(mount))
    cmd = ["unshare", "-rm", "sh", "-c",
           f"mount -t tmpfs -o size=8m tmpfs {mount} && exec {sys.executable} -c \"$0\"",
           script]
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    except FileNotFoundError:
        pytest.skip("no unshare here")
    if p.returncode and "mount" in p.stderr and "Traceback" not in p.stderr:
        pytest.skip(f"cannot mount a tmpfs here: {p.stderr.strip()}")
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)
    budget = out["capacity"][0]
    assert budget <= (8 << 20) // 3  # fitted to the filesystem, not the 64 GiB configured
    assert max(out["footprint"]) <= 2 * budget + (1 << 20)  # compacted as it churned
    churned, filled, freed = out["snap1"], out["snap2"], out["snap3"]
    assert churned["disk_full"] == 0 and churned["compactions"] >= 1
    assert filled["disk_full"] >= 1 and filled["saves"] > churned["saves"]
    assert out["capacity"][2] < budget and freed["saves"] - filled["saves"] == 20
    assert out["capacity"][3] > out["capacity"][2] and all(out["found"][-5:])
    assert p.stderr.count("disk is full") == filled["disk_full"] and "Traceback" not in p.stderr


@pytest.mark.parametrize("damage", ["truncated", "zstd frame", "checksum"])
def test_a_damaged_manifest_is_moved_aside_and_the_store_starts_empty(tmp_path, damage,
                                                                      caplog):
    rng = np.random.default_rng()
    path = tmp_path / "kv"
    s = disk_store(path)
    runs = [chain(rng.integers(0, 1000, 2 * PAGE).tolist()) for _ in range(3)]
    for hashes in runs:
        s.save(2, blocks(2, rng), hashes)
    s.close()
    manifest = (path / "manifest.ocdbt").read_bytes()
    data = {p.name: p.read_bytes() for p in (path / "d").iterdir()}
    bad = bytearray(manifest)
    if damage == "truncated":
        bad = bad[:len(bad) // 2]
    else:
        bad[20 if damage == "zstd frame" else len(bad) - 3] ^= 0xFF
    (path / "manifest.ocdbt").write_bytes(bytes(bad))
    with caplog.at_level(logging.WARNING, logger="jkv.store.tiers"):
        again = disk_store(path)
    aside = again.disk.set_aside_to
    assert again.disk.damaged and again.snapshot()["disk_resets"] == 1
    assert aside.parent == tmp_path and aside.name.startswith("kv.damaged-")
    assert str(aside) in caplog.text
    assert (aside / "manifest.ocdbt").read_bytes() == bytes(bad)  # the old bytes, kept
    assert {p.name: p.read_bytes() for p in (aside / "d").iterdir()} == data
    assert all(again.lookup(h) is None for h in runs)
    again.save(2, blocks(2, rng), runs[0])  # and the new store works
    again.close()
    reopened = disk_store(path)
    assert not reopened.disk.damaged and reopened.load(reopened.lookup(runs[0])) is not None
    reopened.close()


def test_data_files_cut_short_set_the_store_aside(tmp_path):
    """A kill or a full disk can leave OCDBT's data files shorter than its b-tree says
    (tensorstore: OUT_OF_RANGE, not DATA_LOSS): opening sets the store aside and starts
    empty, as for a damaged manifest, instead of refusing to start."""
    rng = np.random.default_rng()
    path = tmp_path / "kv"
    s = disk_store(path)
    runs = [chain(rng.integers(0, 1000, 2 * PAGE).tolist()) for _ in range(4)]
    for hashes in runs:
        s.save(2, blocks(2, rng), hashes)
    s.close()
    for p in (path / "d").iterdir():
        with open(p, "r+b") as f:
            f.truncate(p.stat().st_size // 2)
    again = disk_store(path)
    assert again.disk.damaged and again.snapshot()["disk_resets"] == 1
    assert all(again.lookup(h) is None for h in runs)
    again.close()


def test_a_promoted_entry_keeps_its_disk_copy_until_the_host_gives_it_back(tmp_path):
    """An entry the scheduler-aware policy promotes from disk to host memory (its request is
    next) keeps its disk copy: a process that dies with it in host memory leaves it on disk
    (here: the store opened again without the first being closed). Going back down, the
    copy on disk is the entry again, not written a second time."""
    rng = np.random.default_rng()
    one = entry_bytes(2)
    s = store(tmp_path, host_cache_bytes=one + one // 2, disk_cache_bytes=1 << 24)
    (a, da), (b, db) = ((chain(rng.integers(0, 1000, 2 * PAGE).tolist()), blocks(2, rng))
                        for _ in range(2))
    for hashes, data in ((a, da), (b, db)):
        s.save(2, data, hashes)
        s.flush()
    assert s.lookup(a).tier == "disk" and s.lookup(b).tier == "host"
    s.hint([a[-1].hex()])  # a's request is next: promoted, b offloaded for it
    s.flush()
    assert s.lookup(a).tier == "host" and s.snapshot()["prefetches"] == 1
    dead = store(tmp_path, host_cache_bytes=0, disk_cache_bytes=1 << 24)  # s "died"
    for hashes, data in ((a, da), (b, db)):
        hit = dead.lookup(hashes)
        assert hit is not None and hit.tier == "disk"
        np.testing.assert_array_equal(dead.load(hit).arrays["k"], data["k"])
    dead.close()
    offloads = s.snapshot()["offloads"]
    s.hint([b[-1].hex()])  # now b's: a goes back down, onto its own copy
    s.flush()
    assert s.lookup(a).tier == "disk" and not s.disk.is_spare(a[-1].hex())
    assert s.snapshot()["offloads"] == offloads + 1
    np.testing.assert_array_equal(s.load(s.lookup(a)).arrays["v"], da["v"])
    s.close()


@pytest.mark.parametrize("killed", ["copying", "moving files", "removing old files"])
def test_a_compaction_killed_midway_leaves_a_store_that_opens_whole(tmp_path, killed):
    """A compaction's steps stopped where a kill would stop them: before the new manifest
    is renamed in the old database stands, after it the new one; either way every entry
    reads, and what the stopped compaction left is gone after the next one."""
    from jkv.store import ocdbt_files as files

    rng = np.random.default_rng()
    s = disk_store(tmp_path)
    runs = [chain(rng.integers(0, 1000, 2 * PAGE).tolist()) for _ in range(6)]
    for hashes in runs:
        s.save(2, blocks(2, rng), hashes)
    s.flush()
    for hashes in runs[:3]:  # deleted: their bytes stay until a compaction
        s.writer.delete(hashes[-1].hex())
    names, kv = s.disk._stored(), s.disk._kv
    s.close()
    nxt = files.copy_live(tmp_path, kv, names)
    if killed != "copying":
        for f in (nxt / "d").iterdir():
            os.rename(f, tmp_path / "d" / f.name)
    if killed == "removing old files":
        os.replace(nxt / "manifest.ocdbt", tmp_path / "manifest.ocdbt")
    again = disk_store(tmp_path)
    assert not (tmp_path / files.NEXT).exists() and not again.disk.damaged
    assert all(again.lookup(h) is None for h in runs[:3])
    assert all(again.load(again.lookup(h)) is not None for h in runs[3:])
    before = footprint(tmp_path)
    assert again.disk.compact() and footprint(tmp_path) < before
    assert all(again.load(again.lookup(h)) is not None for h in runs[3:])
    again.close()
