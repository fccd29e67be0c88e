"""One persistent KV tier written by several stores at once through tensorstore's OCDBT
coordinator (`StoreConfig.store_coordinator`): each finds what the others wrote and forgets
what they deleted, entries written concurrently all read back whole, a host-tier entry is
copied to the shared tier, and with the coordinator gone writes fail as counted misses while
reads go on."""

from __future__ import annotations

import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import tensorstore as ts
from test_store import PAGE, blocks, chain, store

COORDINATOR = """
import tensorstore as ts, time
srv = ts.ocdbt.DistributedCoordinatorServer({"bind_addresses": ["127.0.0.1:0"]})
print(srv.port, flush=True)
time.sleep(600)
"""
LEASE_S = 10  # tensorstore's default lease on the coordinator's b-tree nodes


@pytest.fixture
def coordinator():
    srv = ts.ocdbt.DistributedCoordinatorServer({"bind_addresses": ["127.0.0.1:0"]})
    yield f"127.0.0.1:{srv.port}"
    del srv


def shared(tmp_path, address, **kw):
    return store(tmp_path, store_coordinator=address, **kw)


def test_each_store_finds_what_the_other_wrote_and_forgets_what_it_deleted(tmp_path,
                                                                            coordinator):
    rng = np.random.default_rng()
    a = shared(tmp_path, coordinator, host_cache_bytes=0)
    b = shared(tmp_path, coordinator, host_cache_bytes=0)
    tokens = rng.integers(0, 1000, 6 * PAGE).tolist()
    hashes, data = chain(tokens), blocks(6, rng)
    assert a.save(4, data, hashes)
    a.flush()
    b.refresh()
    hit = b.lookup(hashes)
    assert hit is not None and (hit.blocks, hit.tier) == (4, "disk")
    arrays, got, *_ = b.load(hit)
    assert got == hashes[:4]
    for f in data:
        np.testing.assert_array_equal(arrays[f], data[f][:4])
    # b goes on with the conversation: only its new blocks, continuing a's entry
    assert b.tail_start(hashes) == 4
    assert b.save(6, {f: x[4:] for f, x in data.items()}, hashes, start=4)
    b.flush()
    a.refresh()
    hit = a.lookup(hashes)
    assert hit.blocks == 6
    arrays, *_ = a.load(hit)
    for f in data:
        np.testing.assert_array_equal(arrays[f], data[f])
    a.clear()  # a deletes the root entry, and with it b's tail
    b.refresh()
    assert b.lookup(hashes) is None and b.snapshot()["entries"]["disk"] == 0
    a.close()
    b.close()


def test_entries_written_at_once_by_two_stores_all_read_back_whole(tmp_path, coordinator):
    stores = [shared(tmp_path, coordinator, host_cache_bytes=0) for _ in range(2)]
    saved = {}

    def write(s, seed):
        rng = np.random.default_rng(seed)
        for _ in range(15):
            n = int(rng.integers(1, 5))
            hashes, data = chain(rng.integers(0, 1000, n * PAGE).tolist()), blocks(n, rng)
            assert s.save(n, data, hashes)
            saved[hashes[-1]] = (hashes, data)
        s.flush()

    threads = [threading.Thread(target=write, args=(s, i)) for i, s in enumerate(stores)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    fresh = shared(tmp_path, coordinator, host_cache_bytes=0)  # a third, opened after
    for s in (*stores, fresh):
        s.refresh()
        assert s.snapshot()["entries"]["disk"] == len(saved) == 30
        for hashes, data in saved.values():
            hit = s.lookup(hashes)
            arrays, *_ = s.load(hit)
            for f in data:
                np.testing.assert_array_equal(arrays[f], data[f])
        assert s.snapshot()["corrupt_entries"] == 0
        s.close()


def test_a_host_tier_entry_is_written_through_to_the_shared_tier(tmp_path, coordinator):
    rng = np.random.default_rng()
    a = shared(tmp_path, coordinator, host_cache_bytes=1 << 24)
    b = shared(tmp_path, coordinator, host_cache_bytes=1 << 24)
    hashes, data = chain(rng.integers(0, 1000, 3 * PAGE).tolist()), blocks(3, rng)
    a.save(3, data, hashes)
    a.flush()
    assert a.lookup(hashes).tier == "host"  # a reads its own copy from memory
    assert a.snapshot()["written_through"] == 1
    b.refresh()
    hit = b.lookup(hashes)
    assert hit.tier == "disk"
    arrays, *_ = b.load(hit)
    np.testing.assert_array_equal(arrays["k"], data["k"])
    a.close()
    b.close()


def test_with_the_coordinator_gone_writes_are_counted_misses_and_reads_go_on(tmp_path):
    proc = subprocess.Popen([sys.executable, "-c", COORDINATOR], stdout=subprocess.PIPE,
                            text=True)
    try:
        address = f"127.0.0.1:{int(proc.stdout.readline())}"
        rng = np.random.default_rng()
        a = shared(tmp_path, address, host_cache_bytes=1 << 24)
        kept, data = chain(rng.integers(0, 1000, 2 * PAGE).tolist()), blocks(2, rng)
        a.save(2, data, kept)
        a.flush()
        b = shared(tmp_path, address, host_cache_bytes=0)
        proc.kill()
        proc.wait()
        time.sleep(LEASE_S + 1)
        lost = chain(rng.integers(0, 1000, 2 * PAGE).tolist())
        b.save(2, blocks(2, rng), lost)  # disk only: the save fails
        a.save(2, blocks(2, rng), lost)  # host: kept here, its shared copy fails
        a.flush()
        b.flush()
        snap_a, snap_b = a.snapshot(), b.snapshot()
        assert snap_b["save_failures"] + snap_b["saves_dropped"] == 1
        assert snap_b["entries"]["disk"] == 1 and b.lookup(lost) is None
        assert snap_a["write_through_failures"] == 1 and a.lookup(lost).tier == "host"
        arrays, *_ = b.load(b.lookup(kept))  # reads go on
        np.testing.assert_array_equal(arrays["v"], data["v"])
        b.refresh()
        assert b.lookup(kept) is not None
        a.close()
        b.close()
    finally:
        proc.kill()


def test_store_coordinator_needs_a_persistent_tier_and_an_address():
    from jkv.config import StoreConfig
    with pytest.raises(ValueError, match="store_coordinator"):
        StoreConfig(store_coordinator="127.0.0.1:1234")
    with pytest.raises(ValueError, match="store_coordinator"):
        StoreConfig(store_dir="/tmp/x", store_coordinator="not an address")


def test_a_conversation_goes_on_on_the_other_replica_from_the_shared_tier(tmp_path,
                                                                          coordinator):
    """Two serving loops (replicas), each with its own host tier, one shared persistent
    tier: each turn of two chats goes to the replica that did not serve the last, restores
    the history from the shared tier and gives the tokens a store-less run gives."""
    import jax.numpy as jnp

    from jkv.config import CacheConfig, EngineConfig, ModelConfig, StoreConfig
    from jkv.engine.engine import Engine
    from jkv.engine.sampling import SamplingParams
    from jkv.models.loaders import random_params
    from jkv.sched.scheduler import Request, Scheduler, generate_all
    from jkv.store.store import KVStore

    cfg = ModelConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_layers=2,
                      num_heads=4, num_kv_heads=2, head_dim=32, rope_theta=10000.0)
    params = random_params(cfg, seed=3, dtype=jnp.float32)

    def engine():
        return Engine(cfg, params, cache=CacheConfig(page_size=8, kv_cache_bytes=4_000_000),
                      config=EngineConfig(max_model_len=256, max_num_seqs=2,
                                          prefill_chunk=32, enable_prefix_caching=False))

    def replica():
        eng = engine()
        return Scheduler(eng, store=KVStore(
            StoreConfig(host_cache_bytes=1 << 24, store_dir=str(tmp_path),
                        store_coordinator=coordinator),
            model=eng.fingerprint, kv_format=eng.kv_format, page_size=eng.page_size))

    def ask(sched, prompts):
        reqs = [Request(list(p), SamplingParams(max_tokens=6, temperature=0)) for p in prompts]
        generate_all(sched, reqs)
        return [r.output for r in reqs]

    rng = np.random.default_rng()
    replicas, alone = [replica(), replica()], Scheduler(engine())
    chats = [rng.integers(0, 512, int(n)).tolist() for n in (40, 60)]
    for turn in range(3):
        here = replicas[turn % 2]
        here.store.refresh()  # (done each second anyway)
        before = here.snapshot()["prefix_hit_tokens"]["disk"]
        got = ask(here, chats)
        assert got == ask(alone, chats)
        if turn:
            assert here.snapshot()["prefix_hit_tokens"]["disk"] > before
        here.store.flush()
        chats = [c + out + rng.integers(0, 512, 5).tolist()
                 for c, out in zip(chats, got, strict=True)]
    for sched in replicas:
        assert sched.store.snapshot()["corrupt_entries"] == 0
        sched.store.close()
