"""LayerKV's layer-wise offload: a sequence whose layers are partly or wholly held on the host
(from its prefill on, or pushed out mid-decode and fetched back) samples exactly what a
resident one samples, its saved pages are the same bytes, and the host count of free pages
matches the device's through any schedule of steps, offloads, fetches and closes."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jkv.config import CacheConfig, EngineConfig, ModelConfig
from jkv.engine.engine import Engine
from jkv.engine.runner import Row
from jkv.engine.sampling import SamplingParams
from jkv.kv.layer_offload import resident_layers
from jkv.models.loaders import random_params

TINY = ModelConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_layers=4,
                   num_heads=8, num_kv_heads=2, head_dim=64, rope_theta=10000.0)
PAGE_BYTES = 8 * 64 * 4 * 2  # one float32 page of 8 tokens, keys and values
CHUNK = 16
# sampled at temperature 1 with the top logprobs: any difference in the KV read shows
SAMPLING = SamplingParams(temperature=1.0, logprobs=3)


@pytest.fixture(scope="module")
def params():
    return random_params(TINY, seed=3, dtype=jnp.float32)


def engine(params, pages: int = 400, **kw) -> Engine:
    kw = {"max_model_len": 128, "max_num_seqs": 4, "prefill_chunk": CHUNK, **kw}
    return Engine(TINY, params, cache=CacheConfig(page_size=8, kv_cache_bytes=pages * PAGE_BYTES),
                  config=EngineConfig(**kw))


def counts_agree(eng: Engine) -> None:
    assert eng.cache.free_pages == int(eng.cache.free.num_free)


def run(eng: Engine, prompt: list[int], decode: int = 10, events=None, layer_major: int = 0,
        **open_kw):
    """Prefill `prompt` in chunks (`layer_major`: that many layers a step over all of it)
    and decode `decode` tokens; `events` {decode step: callable(slot)} run before that step.
    Returns (tokens, top logprobs, slot)."""
    events = events or {}
    slot, pos = eng.open(prompt, **open_kw)
    key = eng.request_key(0)
    tokens, lps = [], []
    for first in range(0, TINY.num_layers, layer_major or TINY.num_layers):
        if not layer_major:
            break
        last = min(first + layer_major, TINY.num_layers)
        (s,), _ = eng.step([Row(slot, prompt[pos:], SAMPLING, key, layer_span=(first, last))], [])
        assert (s is None) == (last < TINY.num_layers)
        counts_agree(eng)
    pos = len(prompt) if layer_major else pos
    while pos < len(prompt):
        (s,), _ = eng.step([Row(slot, prompt[pos:pos + CHUNK], SAMPLING, key)], [])
        pos += CHUNK
        counts_agree(eng)
    tokens.append(s.token)
    lps.append(s.top_logprobs)
    for i in range(decode):
        if i in events:
            events[i](slot)
            counts_agree(eng)
        _, (s,) = eng.step([], [Row(slot, [tokens[-1]], SAMPLING, key, len(tokens))])
        counts_agree(eng)
        tokens.append(s.token)
        lps.append(s.top_logprobs)
    return tokens, np.stack(lps), slot


def test_resident_layers_are_spread_over_the_depth():
    assert np.flatnonzero(resident_layers(8, 4)).tolist() == [1, 3, 5, 7]  # LayerKV's example
    for layers in (1, 4, 30):
        for keep in range(layers + 1):
            r = resident_layers(layers, keep)
            assert r.sum() == keep
            if keep:  # no gap between resident layers wider than the even spacing allows
                assert np.diff(np.r_[-1, np.flatnonzero(r)]).max() <= -(-layers // keep)
    for bad in (-1, 5):
        with pytest.raises(ValueError, match="keep"):
            resident_layers(4, bad)


def test_offloaded_layers_sample_what_resident_ones_do(params):
    rng = np.random.default_rng()
    prompt = rng.integers(0, 512, 45).tolist()
    ref_tokens, ref_lps, _ = run(engine(params), prompt)
    cases = {f"resident {r} from the prefill": lambda e, r=r: dict(resident=r)
             for r in (0, 1, 3)}
    cases["three layers out mid-decode, fetched later"] = lambda e: dict(events={
        3: lambda s: e.offload_layers(s, [0, 2, 3]), 7: e.fetch_layers})
    cases["one layer out mid-decode, never fetched"] = lambda e: dict(events={
        2: lambda s: e.offload_layers(s, [1])})
    for name, kw in cases.items():
        e = engine(params)
        tokens, lps, slot = run(e, prompt, **kw(e))
        assert tokens == ref_tokens, name
        np.testing.assert_array_equal(lps, ref_lps, err_msg=name)
        e.close(slot)
        counts_agree(e)
        assert e.cache.free_pages + e.cache.pages_cached == e.cache.total_pages, name


def test_a_layer_major_prefill_samples_what_resident_layers_do_and_brings_nothing_back(
        params):
    """A prompt with layers on the host fed a layer range a step over all its tokens gives
    the tokens and logprobs of the resident one, never brings an earlier chunk back from
    the host (chunk by chunk, every later chunk brings the earlier ones), and closing it
    mid-way frees every page it took."""
    rng = np.random.default_rng()
    prompt = rng.integers(0, 512, 45).tolist()
    ref_tokens, ref_lps, _ = run(engine(params), prompt)
    for resident, per_step in ((0, 1), (1, 3), (3, 2), (0, 4)):
        e = engine(params)
        tokens, lps, slot = run(e, prompt, layer_major=per_step, resident=resident)
        assert tokens == ref_tokens, (resident, per_step)
        np.testing.assert_array_equal(lps, ref_lps, err_msg=f"{resident} {per_step}")
        e.close(slot)
        counts_agree(e)
        assert e.cache.free_pages + e.cache.pages_cached == e.cache.total_pages
    brought = []
    for layer_major in (1, 0):  # the prefill alone, no layer resident
        e = engine(params)
        run(e, prompt, decode=0, resident=0, layer_major=layer_major)
        brought.append(e.layers.fetched_bytes)
    assert brought[0] == 0 < brought[1]
    for resident in (0, 2):  # closed (preempted) part way through its layers
        e = engine(params, enable_prefix_caching=False)
        slot, _ = e.open(prompt, resident=resident)
        (s,), _ = e.step([Row(slot, prompt, SAMPLING, e.request_key(0), layer_span=(0, 2))], [])
        assert s is None
        counts_agree(e)
        with pytest.raises(ValueError, match="none"):
            e.step([Row(slot, [], SAMPLING, e.request_key(0), layer_span=(2, 3))], [])
        with pytest.raises(ValueError, match="continues at layer 2"):
            e.step([Row(slot, prompt, SAMPLING, e.request_key(0), layer_span=(1, 3))], [])
        with pytest.raises(ValueError, match="tokens it started with"):
            e.step([Row(slot, prompt[1:], SAMPLING, e.request_key(0), layer_span=(2, 3))], [])
        with pytest.raises(ValueError, match="part way through"):
            e.fetch_layers(slot)
        with pytest.raises(ValueError, match="part way through"):
            e.offload_layers(slot, [1])
        e.close(slot, finished=False)
        counts_agree(e)
        assert e.cache.free_pages == e.cache.total_pages


def test_where_layers_are_not_views_a_layer_major_prefill_takes_their_weights_once(params):
    """On a GPU (no per-layer views of the stacked weights) a layer-major prefill copies each
    layer's weights out once for all the prompt's calls: the same samples as the resident
    prompt, and after warmup nothing compiles."""
    rng = np.random.default_rng()
    prompt = rng.integers(0, 512, 45).tolist()
    ref_tokens, ref_lps, _ = run(engine(params), prompt, decode=4)
    e = engine(params)
    e.runner.views = None  # as on a GPU
    for f in (e.runner._embed, e.runner._layer, e.runner._head, e.runner._take):
        f.clear_cache()  # (CPU views have the structure of a layer's own weights)
    taken = []
    layer_weights = e.runner.layer_weights
    e.runner.layer_weights = lambda i: taken.append(i) or layer_weights(i)
    e.warmup()
    compiled, taken[:] = e.num_compiles, []
    tokens, lps, _ = run(e, prompt, decode=4, layer_major=3, resident=1)
    assert tokens == ref_tokens
    np.testing.assert_array_equal(lps, ref_lps)
    assert taken == list(range(TINY.num_layers))  # once a layer, 3 calls of 16 tokens each
    assert e.num_compiles == compiled


def test_a_decoding_layer_is_staged_in_pinned_memory_until_its_blocks_change(params):
    """Decode steps bring an offloaded layer from its staged copy (pinned host memory; on
    CPU the device's), made at the second bring
    of the same blocks and dropped when a block fills (a page of 8 tokens), each layer after
    the first sent ahead while the one before it computes; without pinned memory
    (`staging` None) the numpy copy is brought, and both sample what the resident sequence
    does."""
    rng = np.random.default_rng()
    prompt = rng.integers(0, 512, 21).tolist()  # 2 full blocks, the third fills at step 3
    ref_tokens, ref_lps, _ = run(engine(params), prompt)
    for pinned in (True, False):
        e = engine(params)
        if not pinned:
            e.layers.staging = None
        assert e.layers.staging is not None or not pinned, "this backend has pinned memory"
        seen: list = []

        def look(slot, e=e, seen=seen):
            seen.append(e.cache.offloaded[slot][0].staged)

        events = dict.fromkeys(range(10), look)
        tokens, lps, slot = run(e, prompt, resident=1, events=events)
        assert tokens == ref_tokens and (lps == ref_lps).all(), pinned
        # layers 0-2 offloaded: 1 and 2 sent ahead in each of 2 prefill and 10 decode steps
        assert e.layers.prefetched == 2 * 12
        if not pinned:
            assert seen == [None] * 10
            continue
        # the prefill's last chunk brought 2 blocks, step 0 the same 2: staged there; step
        # 2 fills the third block (the 24th token) and sends it, so the copy is gone before
        # step 3, which brings 3 blocks for the first time, and step 4 stages them
        assert [i for i, x in enumerate(seen) if x is None] == [0, 3, 4]
        assert seen[1] is seen[2] and all(x is seen[5] for x in seen[5:])
        assert seen[5] is not seen[1]
        # staged in pinned host memory; on CPU in the device's own (the same RAM: no copy)
        want = "device" if jax.default_backend() == "cpu" else "pinned_host"
        assert seen[1].k.sharding.memory_kind == want


def test_offloaded_layers_keep_shared_blocks_save_and_restore_exactly(params):
    """A prompt that starts from prefix-cache blocks keeps those blocks in the pool for its
    offloaded layers; its saved pages are the resident sequence's bytes, and a restore
    into a slot with offloaded layers samples what recomputing does."""
    rng = np.random.default_rng()
    history = rng.integers(0, 512, 40).tolist()
    prompt = history + rng.integers(0, 512, 13).tolist()

    eng = engine(params)
    _, _, first = run(eng, history, decode=0)
    eng.close(first)  # its 5 full blocks go to the prefix cache
    resident_saved = ref = None
    for resident in (None, 1):
        hits = eng.stats.prefix_hit_tokens
        # (the first run's blocks are cached too when it closes: the history's only)
        tokens, lps, slot = run(eng, prompt, resident=resident, max_cached=40)
        assert eng.stats.prefix_hit_tokens - hits == 40
        ref = ref or (tokens, lps)
        assert tokens == ref[0] and (lps == ref[1]).all(), resident
        if resident is not None:
            assert eng.offloaded_layers(slot) == [0, 1, 2]
            assert eng.cache.pages_held(slot) == eng.cache.pages_to_grow(slot, 0) + (
                # one resident layer's 8 blocks, three offloaded layers' 5 shared blocks
                8 * 1 + 5 * 3) * TINY.num_kv_heads
        saved = eng.save_pages(slot)
        if resident_saved is None:
            resident_saved = saved
        else:  # the host copies fill in what the pool does not hold
            for f, x in saved.arrays.items():
                np.testing.assert_array_equal(x, resident_saved.arrays[f], err_msg=f)
        eng.close(slot)
        counts_agree(eng)

    # a restore into a slot that keeps one layer: the rest leave the pool as they are written
    ref = None
    for resident in (None, 1):
        fresh = engine(params, enable_prefix_caching=False)
        tokens, lps, slot = run(fresh, prompt, restore=resident_saved, resident=resident)
        assert fresh.stats.restored_tokens == 48
        ref = ref or (tokens, lps)
        assert tokens == ref[0] and (lps == ref[1]).all(), resident
        fresh.close(slot)
        counts_agree(fresh)
        assert fresh.cache.free_pages == fresh.cache.total_pages


def test_warmup_compiles_what_offloading_runs(params):
    """After `warmup` an offloaded prefill, decode, offload and fetch compile nothing."""
    from jkv.kv.layer_pages import bring_layer, copy_layer_out, drop_layers

    copies = (copy_layer_out, bring_layer, drop_layers)
    for f in copies:
        f.clear_cache()  # what earlier tests compiled must not hide a missing shape
    eng = engine(params)
    eng.warmup()
    compiled = [f._cache_size() for f in copies], eng.num_compiles
    rng = np.random.default_rng()
    run(eng, rng.integers(0, 512, 100).tolist(), decode=9, resident=1, events={
        2: eng.fetch_layers, 5: lambda s: eng.offload_layers(s, [0, 3])})
    _, _, slot = run(eng, rng.integers(0, 512, 90).tolist(), decode=3, resident=0,
                     layer_major=3)
    eng.close(slot)
    assert ([f._cache_size() for f in copies], eng.num_compiles) == compiled


def test_a_restore_beside_a_slot_with_offloaded_layers_takes_only_its_own_pages(params):
    """Reserving a restore's pages must not give another slot's offloaded layers theirs back
    (the host count would then exceed the device's, and the next step fail)."""
    rng = np.random.default_rng()
    history = rng.integers(0, 512, 40).tolist()
    first = engine(params, enable_prefix_caching=False)
    _, _, slot = run(first, history, decode=0)
    saved = first.save_pages(slot)
    eng = engine(params, enable_prefix_caching=False)
    tokens, _, other = run(eng, rng.integers(0, 512, 30).tolist(), decode=2, resident=1)
    restored, held = eng.open(history + [1, 2, 3], restore=saved)
    assert held == 40
    counts_agree(eng)
    eng.step([], [Row(other, tokens[-1:], SAMPLING, eng.request_key(0), len(tokens))])
    counts_agree(eng)
    for s in (other, restored):
        eng.close(s)
    assert eng.cache.free_pages == eng.cache.total_pages


def test_bad_offload_requests_are_value_errors(params):
    eng = engine(params)
    with pytest.raises(ValueError, match="keep"):
        eng.open([1, 2, 3], resident=5)
    slot, _ = eng.open([1, 2, 3])
    with pytest.raises(ValueError, match="layers"):
        eng.offload_layers(slot, [4])
    with pytest.raises(ValueError, match="open"):
        eng.offload_layers(slot + 1, [0])
    tiered = Engine(TINY, eng.params, cache=CacheConfig(page_size=8, kv_cache_bytes=400 * 1024,
                                                        kv_policy="leankv"),
                    config=EngineConfig(max_model_len=128, max_num_seqs=2, prefill_chunk=CHUNK))
    slot, _ = tiered.open(list(range(20)), resident=1)  # (its layers are tiered rows)
    row = Row(slot, list(range(20)), SamplingParams(max_tokens=1), tiered.request_key(0), 0,
              layer_span=(0, 1))
    with pytest.raises(ValueError, match="layer-major prefill needs block pages"):
        tiered.step([row], [])


# ---------------------------------------------------------------- random schedules

SLOTS = 3
step = st.tuples(st.just("step"), st.integers(1, 7))  # a bit mask of who takes part
op = st.one_of(
    # (who, prompt length, resident layers, layers a step of a layer-major prefill: 0 none)
    st.tuples(st.just("open"), st.integers(0, SLOTS - 1), st.integers(9, 60),
              st.integers(0, TINY.num_layers), st.sampled_from([0, 0, 1, 3])),
    step, step, step, step,  # most of a schedule is steps
    st.tuples(st.just("offload"), st.integers(0, SLOTS - 1), st.integers(1, 15)),
    st.tuples(st.just("fetch"), st.integers(0, SLOTS - 1)),
    st.tuples(st.just("close"), st.integers(0, SLOTS - 1)),
    st.tuples(st.just("preempt"), st.integers(0, SLOTS - 1)),  # saved, then closed
)


def _same(x, y) -> None:
    assert (x.token, x.logprob) == (y.token, y.logprob)
    np.testing.assert_array_equal(x.top_logprobs, y.top_logprobs)


@settings(max_examples=25, deadline=None)
@given(st.lists(op, min_size=6, max_size=30), st.integers(0, 2**31 - 1))
def test_page_counts_and_samples_hold_through_random_schedules(params, schedule, seed):
    """Two engines run the same steps; one also offloads and fetches layers at random, and
    feeds some prompts with layers on the host layer-major (a range of layers a step over
    all of it, while the other engine feeds chunks: both sample the same first token). Every
    step samples the same tokens and logprobs in both, a preempted sequence saves the same
    bytes from both, a layer-major prompt's layers cannot be moved part way through, and
    after every call the host count of free pages is the device's; once all is closed,
    every page is free or cached."""
    rng = np.random.default_rng(seed)
    # a tight pool: 3 sequences of 60 tokens hold 8 blocks x 8 (layer, head) pages each.
    # Whatever step the plain engine has room for, the other must have too: a layer-major
    # prompt takes its 3 resident layers' pages at once, 48 more at most, and one layer's
    # 16 while it runs
    plain, moved = engine(params, pages=200), engine(params, pages=200 + 3 * 64)
    prompts = [rng.integers(0, 64, 64).tolist() for _ in range(SLOTS)]
    # who -> {slot in each engine, tokens fed (plain), to feed, sampled; layer-major: layers
    # a step, layers run in `moved`, each engine's first token until both have it}
    live: dict[int, dict] = {}
    # the first one has layers on the host and feeds its prompt layer-major
    starts = [("open", 0, int(rng.integers(9, 60)), int(rng.integers(0, 4)),
               int(rng.choice([1, 3]))),
              ("open", 1, int(rng.integers(9, 60)), int(rng.integers(0, 5)),
               int(rng.choice([0, 1, 3])))]
    # every one taking part in the last steps: prompts part way through are finished
    for action, *args in starts + schedule + [("step", 7)] * 5:
        who = args[0] if action != "step" else None
        if action == "open" and who not in live and len(live) < SLOTS:
            prompt = prompts[who][:args[1]]
            # the same prefix-cache hit in both (a sequence with offloaded layers leaves
            # fewer blocks to the cache when it closes)
            hashes = plain.cache.prompt_hashes(prompt)
            hit = min(plain.cache.lookup(hashes)[0], moved.cache.lookup(hashes)[0])
            a, ca = plain.open(prompt, max_cached=hit)
            b, cb = moved.open(prompt, max_cached=hit, resident=args[2])
            assert ca == cb == hit
            major = args[3] if args[2] < TINY.num_layers else 0
            live[who] = dict(a=a, b=b, fed=ca, start=ca, todo=prompt, out=[], major=major,
                             done=0, first={})
        elif action == "offload" and who in live:
            layers = [x for x in range(TINY.num_layers) if args[1] >> x & 1]
            if 0 < live[who]["done"] < TINY.num_layers:
                with pytest.raises(ValueError, match="part way through"):
                    moved.offload_layers(live[who]["b"], layers)
            else:
                moved.offload_layers(live[who]["b"], layers)
        elif action == "fetch" and who in live:
            slot = live[who]["b"]
            if 0 < live[who]["done"] < TINY.num_layers:
                with pytest.raises(ValueError, match="part way through"):
                    moved.fetch_layers(slot)
            elif moved.pages_to_fetch(slot) <= moved.cache.available_pages:
                moved.fetch_layers(slot)
        elif action == "close" and who in live:
            s = live.pop(who)
            plain.close(s["a"])
            moved.close(s["b"])
        elif action == "preempt" and who in live:  # what a preempted request saves
            s = live.pop(who)
            if not s["major"]:  # (fed layer-major, the engines hold different prefixes yet)
                a, b = plain.save_pages(s["a"]), moved.save_pages(s["b"])
                assert (a.num_blocks, a.hashes) == (b.num_blocks, b.hashes)
                for f, x in a.arrays.items():
                    np.testing.assert_array_equal(b.arrays[f], x, err_msg=f)
            plain.close(s["a"], finished=False)
            moved.close(s["b"], finished=False)
        elif action == "step":
            rows = []  # (entry, plain's row or None, moved's row or None)
            for i, s in sorted(live.items()):
                if not args[0] >> i & 1:
                    continue
                key = np.array([0, i], np.uint32)
                prefilling = s["fed"] < len(s["todo"])
                feed = s["todo"][s["fed"]:s["fed"] + CHUNK] if prefilling else s["out"][-1:]
                if s["fed"] + len(feed) >= 120:
                    continue
                a = None if "a" in s["first"] else Row(s["a"], feed, SAMPLING, key, len(s["out"]))
                b = Row(s["b"], feed, SAMPLING, key, len(s["out"]))
                if s["major"] and (prefilling or s["first"]):  # its prompt, layer-major
                    last = min(s["done"] + s["major"], TINY.num_layers)
                    b = None if "b" in s["first"] else Row(
                        s["b"], s["todo"][s["start"]:], SAMPLING, key, layer_span=(s["done"], last))
                    a = a if prefilling else None
                rows.append((s, a, b))
            # a layer-major prompt's chunks go alone in the plain engine: the one-row calls
            # its layer-major calls make (batched with others, its logprobs would differ
            # in their last bits); its progress in each engine is its own until both are done
            for s, a, _ in rows:
                if s["major"] and a is not None:
                    try:
                        (x,), _ = plain.step([a], [])
                    except RuntimeError:  # no room: it waits
                        continue
                    s["fed"] += len(a.tokens)
                    if s["fed"] >= len(s["todo"]):
                        s["first"]["a"] = x
            rest = [(s, a, b) for s, a, b in rows if not s["major"]]
            try:
                outs_a = iter(plain.step([a for _, a, _ in rest], [])[0])
            except RuntimeError:  # no room in the plain engine: skip the step in both
                continue
            outs_b = iter(moved.step([b for _, _, b in rows if b is not None], [])[0])
            for s, a, b in rows:
                y = None if b is None else next(outs_b)
                if not s["major"]:
                    x = next(outs_a)
                    _same(x, y)
                    s["fed"] += len(a.tokens)
                    if s["fed"] >= len(s["todo"]):
                        s["out"].append(x.token)
                    continue
                if b is not None:
                    s["done"] = b.layer_span[1]
                    if y is not None:
                        s["first"]["b"] = y
                if len(s["first"]) == 2:  # both have fed the whole prompt
                    _same(s["first"]["a"], s["first"]["b"])
                    s["out"].append(s["first"]["a"].token)
                    s["first"], s["major"] = {}, 0
        counts_agree(moved)
        counts_agree(plain)
    for s in live.values():
        plain.close(s["a"])
        moved.close(s["b"])
    for eng in (plain, moved):
        counts_agree(eng)
        assert eng.cache.free_pages + eng.cache.pages_cached == eng.cache.total_pages
