"""The KV store without a model: entries found by any leading run of block hashes, capacities
held under load, the index rebuilt from disk, corrupt entries counted and dropped, a store
killed mid-save reopened and used."""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

from jkv.config import StoreConfig
from jkv.store.store import KVStore

PAGE = 8
ENTRY_FIELDS = {"k": ((2, 2, PAGE, 16), np.float32), "v": ((2, 2, PAGE, 16), np.float32)}


def chain(tokens: list[int], seed: bytes = b"m") -> list[bytes]:
    """Chained block hashes the way the engine makes them (any chain does for the store)."""
    out, prev = [], hashlib.blake2b(seed, digest_size=16).digest()
    for i in range(len(tokens) // PAGE):
        prev = hashlib.blake2b(prev + np.asarray(tokens[i * PAGE:(i + 1) * PAGE],
                                                 np.int64).tobytes(), digest_size=16).digest()
        out.append(prev)
    return out


def blocks(n: int, rng: np.random.Generator) -> dict[str, np.ndarray]:
    return {f: rng.standard_normal((n, *shape)).astype(dt)
            for f, (shape, dt) in ENTRY_FIELDS.items()}


def store(tmp_path=None, model: str = "m", max_pending_bytes: int = 1 << 30, **kw) -> KVStore:
    cfg = StoreConfig(store_dir=None if tmp_path is None else str(tmp_path), **kw)
    return KVStore(cfg, model=model, kv_format="auto", page_size=PAGE,
                   max_pending_bytes=max_pending_bytes)


def entry_bytes(n: int) -> int:
    """The encoded size of an n-block entry (the codec adds a header and a checksum)."""
    s = store(host_cache_bytes=1 << 30)
    tokens = list(range(n * PAGE))
    s.save(n, blocks(n, np.random.default_rng(0)), chain(tokens))
    s.flush()
    size = s.snapshot()["bytes"]["host"]
    s.close()
    return size


def test_any_leading_run_of_an_entry_is_found_and_a_longer_one_replaces_it():
    rng = np.random.default_rng()
    s = store(host_cache_bytes=1 << 24)
    tokens = rng.integers(0, 1000, 6 * PAGE).tolist()
    hashes, data = chain(tokens), blocks(6, rng)
    assert s.save(4, data, hashes)  # the first turn: 4 blocks
    s.flush()
    assert not s.save(3, data, hashes)  # nothing new
    hit = s.lookup(hashes)
    assert hit is not None and hit.blocks == 4 and hit.tier == "host"
    arrays, got, *_ = s.load(hit)
    assert got == hashes[:4]
    for f in data:
        np.testing.assert_array_equal(arrays[f], data[f][:4])
    # a prompt that leaves the history after block 2 takes 2 blocks
    branch = tokens[: 2 * PAGE] + [t + 1 for t in tokens[2 * PAGE:]]
    assert s.lookup(chain(branch)).blocks == 2
    assert s.lookup(chain([t + 1 for t in tokens])) is None
    s.save(6, data, hashes)  # the next turn: the longer run replaces the shorter one
    s.flush()
    snap = s.snapshot()
    assert snap["entries"] == {"host": 1, "disk": 0} and snap["superseded"] == 1
    hit = s.lookup(hashes)
    assert hit.blocks == 6
    np.testing.assert_array_equal(s.load(hit)[0]["v"], data["v"])
    s.close()


def test_tiered_rows_are_found_whole_only_and_replace_nothing():
    """A tiered row (saved with `rows`: its arrays are pages, not blocks) is used whole or
    not at all, so a longer row of the same conversation neither replaces a shorter one nor
    is a shorter one refused beside it."""
    rng = np.random.default_rng()
    s = store(host_cache_bytes=1 << 24)
    tokens = rng.integers(0, 1000, 6 * PAGE).tolist()
    hashes = chain(tokens)
    assert s.save(5, blocks(9, rng), hashes[:5], rows=9)  # 9 pages for 5 blocks of tokens
    s.flush()
    assert s.save(3, blocks(2, rng), hashes[:3], rows=2)  # inside a longer row: still saved
    s.flush()
    assert s.snapshot()["entries"]["host"] == 2 and s.snapshot()["superseded"] == 0
    for n, rows in ((3, 2), (5, 9)):
        hit = s.lookup(hashes[:n] + chain(tokens[:n * PAGE] + [7] * PAGE)[n:], whole=True)
        assert hit is not None and hit.blocks == n
        arrays, got, *_ = s.load(hit)
        assert got == hashes[:n] and all(len(x) == rows for x in arrays.values())
    assert s.lookup(hashes[:4], whole=True).blocks == 3  # the longest whole row
    assert s.lookup(hashes[:2], whole=True) is None
    assert s.lookup(hashes[:4]).blocks == 4  # block lookups would use it in part
    s.close()


@pytest.mark.parametrize("policy", ["lru", "fifo", "scheduler"])
def test_capacities_hold_under_many_conversations(tmp_path, policy):
    rng = np.random.default_rng()
    one = entry_bytes(1)
    host_cap, disk_cap = 7 * one, 20 * one
    s = store(tmp_path, host_cache_bytes=host_cap, disk_cache_bytes=disk_cap,
              eviction_policy=policy)
    convs = [rng.integers(0, 1000, 4 * PAGE).tolist() for _ in range(30)]
    for _ in range(60):
        c = convs[int(rng.integers(len(convs)))]
        n = int(rng.integers(1, 5))
        s.save(n, blocks(n, rng), chain(c))
        s.hint([h.hex() for h in (chain(convs[i])[-1] for i in rng.integers(0, 30, 3))])
        s.flush()
        snap = s.snapshot()
        assert s.host.bytes_used == snap["bytes"]["host"] <= host_cap
        # (the disk also keeps spare copies of entries promoted to the host tier)
        assert s.disk.bytes_used - s.disk.spare_bytes == snap["bytes"]["disk"]
        assert s.disk.bytes_used <= disk_cap
    assert snap["evictions"] > 0 and snap["offloads"] > 0
    # everything indexed loads intact, from whichever tier holds it
    for c in convs:
        hit = s.lookup(chain(c))
        if hit is not None:
            assert s.load(hit) is not None
    assert s.snapshot()["corrupt_entries"] == 0
    s.close()


def test_index_is_rebuilt_from_disk_and_close_keeps_the_host_tier(tmp_path):
    rng = np.random.default_rng()
    s = store(tmp_path, host_cache_bytes=1 << 24)
    a, b = (rng.integers(0, 1000, 3 * PAGE).tolist() for _ in range(2))
    da, db = blocks(3, rng), blocks(2, rng)
    s.save(3, da, chain(a), session="chat-a")
    s.save(2, db, chain(b))
    s.flush()
    assert s.snapshot()["entries"] == {"host": 2, "disk": 0}
    s.close()  # the host tier moves to disk
    again = store(tmp_path, host_cache_bytes=1 << 24)
    assert again.snapshot()["entries"] == {"host": 0, "disk": 2}
    hit = again.lookup(chain(a))
    assert hit.tier == "disk" and hit.blocks == 3
    np.testing.assert_array_equal(again.load(hit)[0]["k"], da["k"])
    assert again.lookup(chain(b)).blocks == 2
    again.close()
    # another model's store directory: entries counted against the capacity, never matched
    other = store(tmp_path, model="another", host_cache_bytes=0)
    assert other.lookup(chain(a)) is None
    assert other.snapshot()["entries"]["disk"] == 2
    other.close()


def test_prefetch_moves_queued_entries_to_the_host_tier(tmp_path):
    rng = np.random.default_rng()
    one = entry_bytes(2)
    s = store(tmp_path, host_cache_bytes=3 * one, disk_cache_bytes=100 * one)
    convs = [rng.integers(0, 1000, 2 * PAGE).tolist() for _ in range(8)]
    for c in convs:
        s.save(2, blocks(2, rng), chain(c))
    s.flush()
    first = chain(convs[0])
    assert s.lookup(first).tier == "disk"  # the oldest went to disk
    s.hint([first[-1].hex()])
    s.flush()
    assert s.lookup(first).tier == "host" and s.snapshot()["prefetches"] == 1
    assert s.host.bytes_used <= 3 * one
    s.close()


def test_corrupt_entries_are_misses_counted_and_deleted(tmp_path):
    rng = np.random.default_rng()
    s = store(host_cache_bytes=1 << 24)
    tokens = rng.integers(0, 1000, 2 * PAGE).tolist()
    s.save(2, blocks(2, rng), chain(tokens))
    s.flush()
    hit = s.lookup(chain(tokens))
    raw = bytearray(s.host.get(hit.key))
    raw[len(raw) // 2] ^= 0x10  # one flipped bit in host memory
    s.host._data[hit.key] = bytes(raw)
    assert s.load(hit) is None
    s.flush()
    assert s.snapshot()["corrupt_entries"] == 1 and s.lookup(chain(tokens)) is None
    assert s.host.bytes_used == 0
    s.close()

    # on disk: damage every data file of the OCDBT database
    d = store(tmp_path, host_cache_bytes=0)
    d.save(2, blocks(2, rng), chain(tokens))
    d.flush()
    d.close()
    for path in (tmp_path / "d").iterdir():
        raw = bytearray(path.read_bytes())
        for i in rng.choice(len(raw), 8, replace=False):
            raw[i] ^= 0xFF
        path.write_bytes(bytes(raw))
    again = store(tmp_path, host_cache_bytes=0)  # opening a damaged store never raises
    hit = again.lookup(chain(tokens))
    if hit is not None:  # the index survived: the entry itself must be refused
        assert again.load(hit) is None
        assert again.snapshot()["corrupt_entries"] == 1
    else:  # or the b-tree did not: the database was dropped and started empty, counted
        assert again.snapshot()["disk_resets"] == again.disk.damaged
    again.close()


def _bad_magic(data: bytes) -> bytes:  # every OCDBT b-tree node's magic number
    return data.replace(bytes.fromhex("0cdb20de"), b"\xf3\xdb\x20\xde")


def _bad_frame(data: bytes) -> bytes:  # a byte inside each node's compressed frame
    out = bytearray(data)
    at = data.find(bytes.fromhex("0cdb20de"))
    while at >= 0:
        out[at + 14] ^= 0xFF
        at = data.find(bytes.fromhex("0cdb20de"), at + 1)
    return bytes(out)


@pytest.mark.parametrize("damage", [_bad_magic, _bad_frame])
def test_a_database_that_cannot_be_listed_starts_empty_and_is_counted(tmp_path, damage):
    rng = np.random.default_rng()
    tokens = rng.integers(0, 1000, 2 * PAGE).tolist()
    d = store(tmp_path, host_cache_bytes=0)
    d.save(2, blocks(2, rng), chain(tokens))
    d.flush()
    d.close()
    (tmp_path / "keep.txt").write_text("not the store's")
    for path in (tmp_path / "d").iterdir():
        path.write_bytes(damage(path.read_bytes()))
    again = store(tmp_path, host_cache_bytes=0)
    assert again.disk.damaged and again.snapshot()["disk_resets"] == 1
    assert again.lookup(chain(tokens)) is None
    again.save(2, blocks(2, rng), chain(tokens))  # and it works again
    again.flush()
    hit = again.lookup(chain(tokens))
    assert hit is not None and hit.tier == "disk" and again.load(hit) is not None
    again.close()
    assert (tmp_path / "keep.txt").read_text() == "not the store's"
    reopened = store(tmp_path, host_cache_bytes=0)
    assert not reopened.disk.damaged and reopened.lookup(chain(tokens)) is not None
    reopened.close()


def test_a_meta_record_that_lies_is_caught_by_the_entry(tmp_path):
    rng = np.random.default_rng()
    s = store(tmp_path, host_cache_bytes=0)
    a, b = (rng.integers(0, 1000, 2 * PAGE).tolist() for _ in range(2))
    s.save(2, blocks(2, rng), chain(a))
    s.flush()
    key = chain(a)[-1].hex()
    data, meta = s.disk.get(key), s.disk.meta(key)
    head = meta.split(b"\n", 1)[0]
    s.disk.put(key, data, head + b"\n" + chain(b)[0] + chain(a)[1])  # block 0 is b's
    s.close()
    again = store(tmp_path, host_cache_bytes=0)
    hit = again.lookup(chain(b[:PAGE] + a[PAGE:]))
    assert hit is not None and again.load(hit) is None
    assert again.snapshot()["corrupt_entries"] == 1
    again.close()


_WRITER = textwrap.dedent("""
    import sys
    import numpy as np
    sys.path.insert(0, {tests!r})
    from test_store import blocks, chain, store
    s = store({path!r}, host_cache_bytes=0)
    rng = np.random.default_rng()
    print("ready", flush=True)
    for i in range(10_000):
        tokens = rng.integers(0, 1000, 16 * 8).tolist()
        s.save(16, blocks(16, rng), chain(tokens))
        s.flush()
""")


def test_a_store_killed_mid_save_opens_and_serves(tmp_path):
    rng = np.random.default_rng()
    script = _WRITER.format(tests=os.path.dirname(__file__), path=str(tmp_path))
    for delay in rng.uniform(0.05, 0.6, 3):
        p = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE)
        assert p.stdout.readline().strip() == b"ready"
        time.sleep(delay)
        p.send_signal(signal.SIGKILL)
        p.wait(30)
        s = store(tmp_path, host_cache_bytes=0)
        entries = s.snapshot()["entries"]["disk"]
        for key in s.disk.keys():  # every entry that made it is whole
            hashes = s.index.entries[key].hashes
            hit = s.lookup(hashes)
            assert hit is not None and hit.blocks == len(hashes)
            assert s.load(hit) is not None
        tokens = rng.integers(0, 1000, 2 * PAGE).tolist()
        s.save(2, blocks(2, rng), chain(tokens))  # and the store takes new ones
        s.flush()
        assert s.snapshot()["entries"]["disk"] == entries + 1
        assert s.snapshot()["corrupt_entries"] == 0
        s.close()


def test_bad_configuration_is_a_value_error(tmp_path):
    with pytest.raises(ValueError, match="host_cache_bytes"):
        StoreConfig(host_cache_bytes=-1)
    with pytest.raises(ValueError, match="eviction_policy"):
        StoreConfig(eviction_policy="random")
    with pytest.raises(ValueError, match="not both"):
        StoreConfig(store_dir=str(tmp_path), store_spec="s3://b/")
    with pytest.raises(ValueError, match="needs"):
        store(host_cache_bytes=0)


def test_an_entry_larger_than_every_tier_is_a_counted_drop_and_keeps_the_shorter_run():
    rng = np.random.default_rng()
    s = store(host_cache_bytes=entry_bytes(2) + 64)
    tokens = rng.integers(0, 1000, 4 * PAGE).tolist()
    hashes, data = chain(tokens), blocks(4, rng)
    assert s.save(2, data, hashes)
    s.flush()
    assert s.save(4, data, hashes)  # queued; the writer finds it fits no tier
    s.flush()
    assert s.snapshot()["saves_dropped"] == 1
    hit = s.lookup(hashes)
    assert hit is not None and hit.blocks == 2
    s.close()


def assert_read_ahead(s: KVStore, hit, hashes: list[bytes], data: dict) -> None:
    """Once the reader is done, `hit`'s read is ready and gives `hashes` and `data` from
    the host tier."""
    s.wait_reads(5.0)
    assert s.read_ahead(hit)
    (arrays, got, exact, *_), tier = s.take(hit)
    assert exact is None  # stored in the pool's own format
    assert got == hashes and tier == "host"
    for f in data:
        np.testing.assert_array_equal(arrays[f], data[f])


def test_saves_past_the_pending_budget_are_dropped_and_counted():
    rng = np.random.default_rng()
    s = store(host_cache_bytes=1 << 24, max_pending_bytes=0)
    tokens = rng.integers(0, 1000, 2 * PAGE).tolist()
    assert not s.save(2, blocks(2, rng), chain(tokens))
    assert s.snapshot()["saves_dropped"] == 1 and s.lookup(chain(tokens)) is None
    s.close()
    assert not s.save(2, blocks(2, rng), chain(tokens))  # closed: nothing queued


def test_reads_ahead_run_on_the_reader_and_are_taken_without_waiting():
    import threading

    rng = np.random.default_rng()
    s = store(host_cache_bytes=1 << 24, max_pending_bytes=entry_bytes(4) + 1)
    tokens = rng.integers(0, 1000, 8 * PAGE).tolist()
    hashes, data = chain(tokens), blocks(4, rng)
    other = chain(rng.integers(0, 1000, 4 * PAGE).tolist())
    for h in (hashes, other):  # (one at a time: the pending budget holds one entry)
        s.save(4, data, h)
        s.flush()
    hit = s.lookup(hashes)
    assert s.take(hit) is None  # nothing read ahead: a miss, no wait
    release = threading.Event()
    get = s.host.get
    s.host.get = lambda key: release.wait() and get(key)  # the tier hangs until released
    assert not s.read_ahead(hit)  # under way
    assert not s.read_ahead(s.lookup(other))  # no room for a second entry's bytes yet
    assert not s.read_ahead(hit) and s.take(hit) is None  # still not ready: never waits
    assert not s.read_ahead(hit)  # taken (and dropped): read again
    release.set()
    assert_read_ahead(s, hit, hashes[:4], data)
    assert s.read_ahead(s.lookup(other)) is False  # room again: started
    s.drop_reads([])  # its request left the queue
    assert s.take(s.lookup(other)) is None
    s.host.get = lambda key: (_ for _ in ()).throw(OSError("gone"))  # a failing tier
    s.read_ahead(hit)
    s.wait_reads(5.0)
    assert s.take(hit) is None and s.snapshot()["read_failures"] == 1
    s.close()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread niceness: Linux")
def test_the_stores_threads_run_below_the_serving_loop():
    import threading

    from jkv.store.codec import checksum

    s = store(host_cache_bytes=1 << 24)
    checksum(bytes(9 << 20))  # three chunks: summed on the checksum threads
    mine = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    names = ("jkv-store-reader", "jkv-store-writer", "jkv-checksum")
    deadline = time.monotonic() + 5.0
    while True:  # (a thread lowers itself as it starts)
        nice = {t.name: os.getpriority(os.PRIO_PROCESS, t.native_id)
                for t in threading.enumerate() if t.name.startswith(names) and t.is_alive()}
        if {n.split("_")[0] for n in nice} >= set(names) and min(nice.values()) > mine:
            break
        assert time.monotonic() < deadline, (mine, nice)
        time.sleep(0.01)
    s.close()


@pytest.mark.parametrize("whole", [False, True])
def test_a_save_not_yet_written_is_found_and_its_read_waits_for_the_write(whole):
    """A preempted request readmitted before its save is written still finds it: `lookup`
    sees the queued save, and its read ahead is ready once the writer is done."""
    import threading

    rng = np.random.default_rng()
    s = store(host_cache_bytes=1 << 24)
    tokens = rng.integers(0, 1000, 6 * PAGE).tolist()
    hashes, data = chain(tokens), blocks(4, rng)
    release = threading.Event()
    s._submit(release.wait)  # the writer is busy with an earlier job
    assert s.save(4, data, hashes, rows=4 if whole else None)
    hit = s.lookup(hashes, whole=whole)
    assert hit is not None and hit.blocks == 4 and hit.tier == "host"
    if not whole:  # any leading run of it, as of a written entry
        assert s.lookup(hashes[:2]).blocks == 2
    else:
        assert s.lookup(hashes[:3], whole=True) is None
    assert s.lookup(chain([t + 1 for t in tokens]), whole=whole) is None
    assert not s.read_ahead(hit)
    s.wait_reads(0.2)
    assert not s.read_ahead(hit)  # its read waits for the write
    release.set()
    assert_read_ahead(s, hit, hashes[:4], data)
    s.close()


def test_a_queued_tail_of_a_queued_entry_is_found_with_its_chain():
    """A request saved as its blocks fill while the writer is behind: its tail continues a
    save that is queued too, and a lookup finds both (as unconverted: their forms are
    chosen as they are written)."""
    import threading

    rng = np.random.default_rng()
    s = store(host_cache_bytes=1 << 24)
    hashes, data = chain(rng.integers(0, 1000, 8 * PAGE).tolist()), blocks(8, rng)
    release = threading.Event()
    s._submit(release.wait)
    assert s.save(4, {f: x[:4] for f, x in data.items()}, hashes)
    assert s.save(8, {f: x[4:] for f, x in data.items()}, hashes, start=4)
    hit = s.lookup(hashes)
    assert (hit.key, hit.blocks, hit.converted) == (hashes[-1].hex(), 8, ())
    s.read_ahead(hit)  # (waits for the writes)
    release.set()
    assert_read_ahead(s, hit, hashes, data)
    s.close()


def test_tail_entries_continue_a_run_and_are_read_along_their_chain(tmp_path):
    """A request saved as its blocks fill: a root entry, then tails holding only the blocks
    since the last save; any leading run is found and read across the chain, the chain
    survives a reopening, and losing a link loses what continues it (never a wrong block)."""
    rng = np.random.default_rng()
    s = store(tmp_path, host_cache_bytes=1 << 24)
    tokens = rng.integers(0, 1000, 10 * PAGE).tolist()
    hashes, data = chain(tokens), blocks(10, rng)
    part = {f: x[4:8] for f, x in data.items()}
    assert s.save(4, data, hashes)
    assert s.tail_start(hashes) == 4  # queued, not yet written: a tail may follow it
    assert s.save(8, part, hashes, start=4)
    assert s.tail_start(hashes) == 8
    assert not s.save(8, part, hashes, start=4)  # nothing new
    other = chain(rng.integers(0, 1000, 10 * PAGE).tolist())
    assert not s.save(10, part, other, start=8)  # no entry ends before it: refused
    assert s.save(10, {f: x[8:] for f, x in data.items()}, hashes, start=8)
    s.flush()
    assert s.snapshot()["entries"]["host"] == 3 and s.snapshot()["superseded"] == 0

    def read(store_, n_tokens: int, want_blocks: int) -> None:
        hit = store_.lookup(chain(tokens[:n_tokens]))
        assert hit is not None and hit.blocks == want_blocks
        arrays, got, *_ = store_.load(hit)
        assert got == hashes[:want_blocks]
        for f in data:
            np.testing.assert_array_equal(arrays[f], data[f][:want_blocks], err_msg=f)

    read(s, 10 * PAGE, 10)
    read(s, 6 * PAGE + 3, 6)  # a run ending inside the middle entry
    read(s, 3 * PAGE, 3)
    # a root save of the whole run replaces nothing that a tail continues
    assert not s.save(10, data, hashes)
    s.close()  # to disk, and the index rebuilt from the meta records
    again = store(tmp_path, host_cache_bytes=1 << 24)
    read(again, 10 * PAGE, 10)
    # the middle link damaged: a miss, counted, and the blocks after it are gone too
    middle = hashes[7].hex()
    raw = bytearray(again.disk.get(middle))
    raw[len(raw) // 2] ^= 0x10
    again.disk.put(middle, bytes(raw), again.disk.meta(middle))
    assert again.load(again.lookup(hashes)) is None
    again.flush()
    assert again.snapshot()["corrupt_entries"] == 1
    assert again.lookup(hashes).blocks == 4 and again.tail_start(hashes) == 4
    read(again, 10 * PAGE, 4)
    again.save(8, part, hashes, start=4)
    again.flush()
    again.close()
    # a tail whose parent is gone from disk is dropped when the store opens
    store_dir = store(tmp_path, host_cache_bytes=0)
    assert store_dir.lookup(hashes).blocks == 8
    store_dir.disk.delete(hashes[3].hex())
    store_dir.close()
    last = store(tmp_path, host_cache_bytes=0)
    assert last.lookup(hashes) is None and last.snapshot()["entries"]["disk"] == 0
    last.close()


def test_a_tail_keeps_its_chain_and_one_whose_parent_went_is_a_miss():
    """Making room for a tail never gives up the entries it continues; a queued tail whose
    parent went meanwhile is found by no lookup, and is dropped when the writer gets to it."""
    import threading

    rng = np.random.default_rng()
    one = entry_bytes(4)
    s = store(host_cache_bytes=int(2.5 * one), eviction_policy="lru")
    x, y = (rng.integers(0, 1000, 8 * PAGE).tolist() for _ in range(2))
    hx, dx = chain(x), blocks(8, rng)
    s.save(4, dx, hx)
    s.save(4, blocks(4, rng), chain(y))
    s.flush()  # x's root is the least recently used: a root save would evict it
    assert s.save(8, {f: a[4:] for f, a in dx.items()}, hx, start=4)
    s.flush()
    hit = s.lookup(hx)
    assert hit is not None and hit.blocks == 8 and s.lookup(chain(y)) is None
    np.testing.assert_array_equal(s.load(hit)[0]["k"], dx["k"])

    s.close()
    s = store(host_cache_bytes=1 << 24)
    s.save(4, dx, hx)
    z = rng.integers(0, 1000, 8 * PAGE).tolist()
    hz, dz = chain(z), blocks(8, rng)
    s.save(4, dz, hz)
    s.flush()
    release = threading.Event()
    s._submit(release.wait)  # the writer is busy
    assert s.save(8, {f: a[4:] for f, a in dz.items()}, hz, start=4)
    s.writer.delete(hz[3].hex())  # its parent goes (an eviction) while the tail waits
    assert s.lookup(hz) is None and s.tail_start(hz) == 0
    dropped = s.stats.saves_dropped
    release.set()
    s.flush()
    assert s.lookup(hz) is None and s.stats.saves_dropped == dropped + 1
    assert s.lookup(hx).blocks == 4  # the other conversation is untouched
    s.close()


def half(arrays, src: str, dst: str) -> dict[str, np.ndarray]:
    """A stand-in for the engine's KV format conversion: "half" is float16 pages."""
    return {f: np.asarray(x).astype(np.float16 if dst == "half" else np.float32)
            for f, x in arrays.items()}


class _DyingWrites:
    """A tier's key-value store whose writes in a transaction fail: the process dying in
    the middle of a put, before its commit."""

    def __init__(self, kv):
        self.kv = kv

    def with_transaction(self, txn):
        return _DyingWrites(self.kv.with_transaction(txn))

    def write(self, *args, **kwargs):
        raise OSError("killed")

    def __getattr__(self, name):
        return getattr(self.kv, name)


def test_a_recompression_killed_midway_leaves_the_old_entry(tmp_path, monkeypatch):
    rng = np.random.default_rng()
    tokens = rng.integers(0, 1000, 4 * PAGE).tolist()
    hashes, data = chain(tokens), blocks(4, rng)

    def opened() -> KVStore:
        return KVStore(StoreConfig(store_dir=str(tmp_path), host_cache_bytes=0,
                                   disk_cache_bytes=1 << 24),
                       model="m", kv_format="auto", page_size=PAGE, convert=half)

    s = opened()
    assert s.save(4, data, hashes)
    s.flush()
    hit = s.lookup(hashes)
    assert hit.tier == "disk"
    monkeypatch.setattr(s.disk, "_kv", _DyingWrites(s.disk._kv))
    assert not s.recompress(hit.key, "half")
    monkeypatch.undo()
    for _ in range(2):  # as it was, here and in the next process
        got = s.load(s.lookup(hashes))
        assert got.exact_blocks is None
        for f in data:
            np.testing.assert_array_equal(got.arrays[f], data[f])
        s.close()
        s = opened()
    used = s.snapshot()["bytes"]["disk"]
    assert s.recompress(hit.key, "half") and s.snapshot()["bytes"]["disk"] < used
    s.close()
    s = opened()  # the smaller form is what the next process finds
    got = s.load(s.lookup(hashes))
    assert got.exact_blocks == 0 and s.snapshot()["converted_loads"] == 1
    for f in data:
        np.testing.assert_array_equal(got.arrays[f], data[f].astype(np.float16))
    s.close()


def test_a_stored_forms_conversion_is_timed_apart_from_the_tiers_read(tmp_path):
    """Restore planning and AdaptCache weigh reading a tier and converting a stored form
    separately: a load's conversion is left out of the tier's read rate and measured per
    stored format (the first at a block count left out: it compiles), and a hit names the
    forms of its chain, also after a reopen (the entry's record keeps its form)."""
    pause = 0.2

    def slow_half(arrays, src, dst):
        if dst != "half":  # converting back into the pool's format
            time.sleep(pause)
        return half(arrays, src, dst)

    def opened() -> KVStore:
        return KVStore(StoreConfig(store_dir=str(tmp_path), host_cache_bytes=0,
                                   disk_cache_bytes=1 << 24),
                       model="m", kv_format="auto", page_size=PAGE, convert=slow_half)

    rng = np.random.default_rng()
    runs = [chain(rng.integers(0, 1000, 4 * PAGE).tolist()) for _ in range(2)]
    s = opened()
    for hashes in runs:
        assert s.save(4, blocks(4, rng), hashes)
    s.flush()
    assert s.lookup(runs[0]).converted == ()
    assert s.recompress(runs[0][-1].hex(), "half")
    s.close()
    s = opened()
    hit = s.lookup(runs[0])
    assert hit.converted == (("half", hit.entry_bytes),)
    assert s.lookup(runs[1]).converted == ()
    s.load(hit)
    assert s.snapshot()["convert_bytes_per_s"] == {}  # the first at its size compiles
    for _ in range(2):
        s.load(hit)
    assert s.snapshot()["converted_loads"] == 3
    convert = s.snapshot()["convert_bytes_per_s"]["half"]
    assert 0.5 * hit.entry_bytes / pause < convert < hit.entry_bytes / pause
    # the tier's rate is its reads' alone (a tiny entry's read takes far less than `pause`)
    assert s.read_bytes_per_s["disk"] > 4 * hit.entry_bytes / pause
    s.close()


def test_a_lossy_store_keeps_approximate_blocks_marked_and_an_exact_one_refuses_them(tmp_path):
    """Blocks whose KV is approximate (a history restored from a smaller form, and what was
    computed over it) are saved only to a store that keeps such KV, and restore marked
    approximate from the first of them, whatever form holds them, here and after a reopen."""
    import json

    rng = np.random.default_rng()
    tokens = rng.integers(0, 1000, 6 * PAGE).tolist()
    hashes, data = chain(tokens), blocks(6, rng)
    exact = store(host_cache_bytes=1 << 24)
    assert not exact.keeps_approximate
    with pytest.raises(ValueError, match="exact_blocks"):
        exact.save(6, data, hashes, exact_blocks=2)
    assert exact.save(6, data, hashes, exact_blocks=6)  # (no block past it: all exact)
    exact.close()
    profile = tmp_path / "profile.json"
    profile.write_text(json.dumps({
        "model": "m", "metric": "top1_agreement", "kinds": ["chat"],
        "methods": {"k4v2t": [{"rate": 0.22, "quality": {"chat": 0.9}, "family": "q"}]}}))

    def opened() -> KVStore:  # room for everything: every entry kept in its full form
        return KVStore(StoreConfig(store_dir=str(tmp_path / "kv"), host_cache_bytes=1 << 24,
                                   disk_cache_bytes=1 << 24, eviction_policy="adaptcache",
                                   adapt_profile=str(profile), adapt_alpha=100.0),
                       model="m", kv_format="auto", page_size=PAGE, convert=half)

    s = opened()
    assert s.keeps_approximate
    assert s.save(2, data, hashes)  # turn 1: exact
    # turn 2 restored block 1 on approximate: its new blocks are saved, approximate
    assert s.save(6, {f: x[2:] for f, x in data.items()}, hashes, start=2, exact_blocks=1)
    other = chain(rng.integers(0, 1000, 6 * PAGE).tolist())
    assert s.save(6, data, other, exact_blocks=4)  # a root entry approximate from block 4
    for _ in range(2):  # here, and reopened from the meta records
        s.flush()
        assert s.snapshot()["converted_loads"] == 0
        for run, n, approx in ((hashes, 6, 2), (hashes[:2], 2, None), (other, 6, 4),
                               (other[:4], 4, None), (other[:5], 5, 4)):
            got = s.load(s.lookup(run))
            assert len(got.hashes) == n and got.exact_blocks == approx, (n, approx)
            for f in data:
                np.testing.assert_array_equal(got.arrays[f], data[f][:n])
        s.close()
        s = opened()
    s.close()
