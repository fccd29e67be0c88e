"""Tensor parallelism (`tensor_parallel`): a tiny Llama with 4 KV heads split over 2 and 4
forced host devices gives the unsharded run's greedy tokens, in the model dtype, k8v4, under
every KV policy, and through a second turn restored from the store's host or disk tier; its
weights reach the devices from host memory, the params cache's too, and really are split,
as is the pool. The engines run in two subprocesses side by side, whose JAX sees 4 CPU
devices (this process's JAX has 1); the regrouped weights, the allocator's KV-head groups and
the ValueErrors are checked here."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh

from jkv import LLM
from jkv.config import ModelConfig
from jkv.kv.allocator import allocate, free_count, init_free, unref
from jkv.models.llama import fuse_projections, mlp, positional_tables, project_qkv
from jkv.models.tensor_parallel import shard_params

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.long  # (its fixture's two processes start early, not at the run's end)

# 2 prompts of 2 prefill chunks each, up to 4 pages of 4 tokens, decoded together: each engine
# runs two step shapes, (2, 8) and (2, 1), so compiling stays within the file's budget
SETTINGS = {"dtype": "float32", "max_model_len": 64, "params_cache": False, "page_size": 4,
            "max_num_seqs": 2, "prefill_chunk": 8, "max_num_batched_tokens": 16,
            "kv_cache_bytes": 1 << 20, "layer_offload": False}
# leankv with a window short enough that a prompt's tokens are placed in tiers
LEANKV = {"kv_policy": "leankv", "kv_recent_window": 4, "kv_sink_tokens": 1,
          "kv_alpha_high": 1.0, "kv_alpha_low": 0.5}

_PROCESS = textwrap.dedent("""
    import json, logging, sys
    import jax
    import numpy as np
    jax.config.update("jax_default_matmul_precision", "highest")
    import jkv.engine.engine as engine_module
    from jkv import LLM, SamplingParams
    from jkv.models.params_cache import cache_root
    job = json.loads(sys.argv[1])
    greedy = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    out = {"devices": jax.device_count()}
    warned = []  # the params cache's warnings (an unreadable entry, a failed write)
    logging.getLogger("jkv.models.params_cache").addHandler(
        type("Warned", (logging.Handler,), {"emit": lambda self, r: warned.append(r.msg)})())

    def generate(engine, prompts):
        return [o.token_ids for o in engine.generate(prompts, greedy)]

    def split(x):  # a sharded array: its spec and its shards' shapes
        return [list(x.sharding.spec), [list(s.data.shape) for s in x.addressable_shards]]

    def arrays(engine):  # how the weights and the KV state are split
        params, cache = engine.engine.params, engine.engine.cache
        found = {name: split(params["layers"][name]) for name in (
            "wqkv", "wo", "w_gate_up", "w_down", "attn_norm")}
        found.update(embed=split(params["embed"]), pool=split(cache.pool.k),
                     filling=split(cache.filling.k), part=cache.pool.num_pages // 4,
                     host_hits=engine.stats()["prefix_hit_tokens"].get("host", 0),
                     tiers=engine.stats()["kv_tiers"])
        if cache.pool.k_scale is not None:
            found["scale"] = split(cache.pool.k_scale)
        if hasattr(cache.layout, "meta"):  # token tiers' metadata, by page like the pool
            found["meta"] = split(cache.layout.meta.score)
        if hasattr(cache.layout, "blocks"):  # the prefix cache's blocks [rows, L, H]
            blocks = np.asarray(jax.device_get(cache.layout.blocks))
            found["blocks"] = blocks[(blocks > 0).any(axis=(1, 2))].tolist()
        return found

    given = {"before": []}  # what the engine was given to split, and what a device held then

    # arrays of a whole q/k/v or gate/up weight's shape on one device, made since the run
    # began (an earlier engine's may outlive it a while; kept alive, no new array takes
    # their ids)
    def whole_on_one_device():
        known = {id(a) for a in given["before"]}
        return sum(len(a.devices()) == 1 and a.shape in given["shapes"] and id(a) not in known
                   for a in jax.live_arrays())

    split_params = engine_module.split_params

    def spied_split(family, params, cfg, tp):
        given["shapes"] = {params["layers"][n].shape for n in ("wqkv", "w_gate_up")}
        given["host"] = all(type(x) is np.ndarray for x in jax.tree.leaves(params))
        given["whole"] = whole_on_one_device()
        return split_params(family, params, cfg, tp)

    engine_module.split_params = spied_split
    for run in job["runs"]:
        cached, given["before"] = any(cache_root().glob("*/done")), jax.live_arrays()
        with LLM(job["model"], tensor_parallel=run["tp"],
                 **{**job["settings"], **run["extra"]}) as engine:
            loaded = {"cached": cached, "host": given["host"],
                      "whole": [given["whole"], whole_on_one_device()], "warned": warned[:]}
            start = arrays(engine) if run["tp"] == 4 else None  # as placed, before a step
            first = generate(engine, job["prompts"])
            out[run["name"]] = [first]
            if run["turns"]:  # each chat resent with a new message
                if engine.store is not None:  # the first turn's saves written
                    engine.store.flush()
                out[run["name"]].append(generate(engine, [
                    p + t + job["extra"] for p, t in zip(job["prompts"], first)]))
            if start is not None:
                out[run["name"] + "_arrays"] = [start, arrays(engine)]
            stats = engine.stats()
            out[run["name"] + "_stats"] = {"load": loaded, "tiers": stats["kv_tiers"],
                                          "hits": stats["prefix_hit_tokens"]}
        given["before"] = []
    print(json.dumps(out))
""")


def _run(name: str, tp: int, extra: dict | None = None, turns: bool = False) -> dict:
    return {"name": name, "tp": tp, "extra": extra or {}, "turns": turns}


# the other KV policies (leankv runs above): the token policies set to drop some of these
# prompts' tokens within a 4-token window (h2o keeps a quarter beside it, snapkv a quarter of
# the prompt, streaming only its 1 sink), and kivi's 2-bit pages
TOKEN_POLICIES = ("h2o", "snapkv", "streaming")
POLICIES = (*TOKEN_POLICIES, "kivi")
POLICY = {"kv_recent_window": 4, "kv_sink_tokens": 1, "kv_heavy_ratio": 0.25}


def _processes(store_dir: str) -> list[list[dict]]:
    """Two processes of about the same work, run side by side. The store's host tier (four)
    or its disk tier alone (disk) brings back each chat's first turn where the device prefix
    cache is off; two writes the converted-params cache and disk reads it."""
    restored = {"enable_prefix_caching": False, "restore_planning": False}
    disk = {**restored, "host_cache_bytes": 0, "store_dir": store_dir, "params_cache": True}
    policies = [_run(f"{name}{suffix}", tp, {"kv_policy": name, **POLICY})
                for name in POLICIES for suffix, tp in (("_one", 1), ("", 2))]
    return [[_run("one", 1, turns=True), _run("four", 4, restored, turns=True),
             _run("k8v4_one", 1, {"kv_format": "k8v4"}), _run("k8v4", 4, {"kv_format": "k8v4"}),
             *policies[:3], policies[-1]],
            [_run("leankv_one", 1, LEANKV), _run("leankv", 4, LEANKV),
             _run("two", 2, {"params_cache": True}), _run("disk", 2, disk, turns=True),
             *policies[3:-1]]]


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    """A 2-layer Llama with 8 query heads over 4 KV heads of 64 channels; weights large
    enough that attention, and so every KV head's pages, decide the tokens."""
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128,
                                   head_dim=64, num_hidden_layers=2, num_attention_heads=8,
                                   num_key_value_heads=4, max_position_embeddings=64,
                                   initializer_range=0.3)
    path = tmp_path_factory.mktemp("tiny-gqa")
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def four_devices(tiny_model, tmp_path_factory):
    """What the subprocesses with 4 forced host devices found (`_PROCESS`, `_processes`),
    each with a converted-params cache of its own."""
    rng = np.random.default_rng(0)
    job = {"model": str(tiny_model), "settings": SETTINGS,
           "prompts": [rng.integers(0, 256, n).tolist() for n in (16, 13)],
           "extra": rng.integers(0, 256, 3).tolist()}
    tmp = tmp_path_factory.mktemp("tp")
    # (the backend's code unoptimised: the sixteen engines' compiles are most of this
    # fixture's time, and it checks which tokens come out, not how fast)
    env = {**os.environ, "HF_HUB_OFFLINE": "1",
           "XLA_FLAGS": (os.environ.get("XLA_FLAGS", "")
                         + " --xla_force_host_platform_device_count=4"
                         + " --xla_backend_optimization_level=0"
                         + " --xla_llvm_disable_expensive_passes=true").strip()}
    procs = [subprocess.Popen([sys.executable, "-c", _PROCESS, json.dumps({**job, "runs": runs})],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env={**env, "JKV_CACHE_DIR": str(tmp / f"cache{i}")})
             for i, runs in enumerate(_processes(str(tmp / "store")))]
    out = {}
    try:
        for proc in procs:
            stdout, stderr = proc.communicate(timeout=600)
            assert proc.returncode == 0, stderr[-3000:]
            found = json.loads(stdout.strip().splitlines()[-1])
            assert found["devices"] == 4
            out.update(found)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    return out


def test_split_runs_give_the_unsharded_tokens(four_devices):
    out = four_devices
    assert out["two"][0] == out["four"][0] == out["one"][0]
    assert out["k8v4"] == out["k8v4_one"]
    assert out["leankv"] == out["leankv_one"]
    tiers = out["leankv_arrays"][1]["tiers"]  # (leankv placed tokens low, or pruned them)
    assert tiers["low"] + tiers["pruned"] > 0
    # a lossy format's or leankv's pages change the tokens: what the pages hold is read
    assert out["k8v4_one"] != out["one"][:1] or out["leankv_one"] != out["one"][:1]


def test_a_second_turn_restored_from_the_host_tier_gives_the_unsharded_tokens(four_devices):
    out = four_devices
    assert out["four"][1] == out["one"][1]
    # both chats' full blocks (4 and 3 of them) came back from the host tier
    assert out["four_arrays"][1]["host_hits"] == 16 + 12


def test_a_second_turn_restored_from_the_disk_tier_gives_the_unsharded_tokens(four_devices):
    out = four_devices
    assert out["disk"] == out["one"]
    # both chats' full blocks came back from the disk tier, the host tier being off
    assert out["disk_stats"]["hits"] == {"device": 0, "host": 0, "disk": 16 + 12}


@pytest.mark.parametrize("policy", POLICIES)
def test_a_kv_policy_split_gives_the_unsharded_tokens(four_devices, policy):
    out = four_devices
    assert out[policy] == out[policy + "_one"]
    if policy in TOKEN_POLICIES:  # the policy dropped some of the prompts' tokens
        for run in (policy, policy + "_one"):
            assert out[run + "_stats"]["tiers"]["pruned"] > 0
    else:  # what kivi's pages hold is read
        assert out[policy] != out["one"][:1]


def test_split_weights_are_loaded_from_host_memory_through_the_params_cache(four_devices):
    """Every split run's engine was given numpy weights, and no device held a whole split
    weight, as the engine split them or after; the unsharded engine is given device arrays.
    The params cache, written by one split run and read by the next, gives the same tokens."""
    out = four_devices
    loads = {run[:-len("_stats")]: found["load"] for run, found in out.items()
             if run.endswith("_stats")}
    split = [run for run in loads if run in ("two", "four", "disk", "k8v4", "leankv",
                                             *POLICIES)]
    assert len(split) == 9
    for run in split:
        assert loads[run]["host"] and loads[run]["whole"] == [0, 0], run
    assert not loads["one"]["host"]
    assert not loads["two"]["cached"] and loads["disk"]["cached"]  # written, then read
    assert loads["disk"]["warned"] == []  # (an unreadable entry would have been rebuilt)
    assert out["two"][0] == out["disk"][0] == out["one"][0]


@pytest.mark.parametrize("when", [0, 1], ids=["as-placed", "after-steps"])
def test_weights_and_pages_are_split_by_kv_head(four_devices, when):
    split, tp = four_devices["four_arrays"][when], "tp"
    # [L, D, Hkv, (G + 2) * Dh]: a KV head's 2 query heads, key and value on one device
    assert split["wqkv"] == [[None, None, tp], [[2, 64, 1, 256]] * 4]
    assert split["wo"] == [[None, tp], [[2, 128, 64]] * 4]
    assert split["w_gate_up"] == [[None, None, None, tp], [[2, 64, 2, 32]] * 4]
    assert split["w_down"] == [[None, tp], [[2, 32, 64]] * 4]
    assert split["attn_norm"] == [[], [[2, 64]] * 4]  # whole on every device
    assert split["embed"] == [[], [[256, 64]] * 4]
    assert split["pool"] == [[tp], [[split["part"], 4, 64]] * 4]  # [pages, page, D]
    assert split["filling"] == [[None, None, tp], [[3, 2, 1, 4, 64]] * 4]
    for name in ("k8v4", "leankv"):  # quantized pages: their scales split with them
        found = four_devices[name + "_arrays"][when]
        spec, shards = found["scale"]
        assert spec == [tp] and [s[0] for s in shards] == [found["part"]] * 4
    meta = four_devices["leankv_arrays"][when]["meta"]
    assert meta[0] == [tp] and len(meta[1]) == 4


def test_each_kv_heads_pages_sit_in_its_devices_part(four_devices):
    found = four_devices["k8v4_arrays"][1]
    blocks = np.array(found["blocks"])  # [rows, L, H]
    assert len(blocks) == 4 + 3 and (blocks > 0).all()  # both chats' full blocks, cached
    heads = np.broadcast_to(np.arange(4), blocks.shape)
    assert (blocks // found["part"] == heads).all()


def test_regrouped_weights_compute_the_fused_layers_projections():
    """`shard_params`' layout (here over a mesh of this process's one device) gives
    `project_qkv` and `mlp` the fused layout's results, q/k/v biases included (Qwen2)."""
    cfg = ModelConfig(vocab_size=32, hidden_size=16, intermediate_size=24, num_layers=1,
                      num_heads=6, num_kv_heads=2, head_dim=8, qkv_bias=True)
    rng = np.random.default_rng()
    shapes = {"wq": (16, 48), "wk": (16, 16), "wv": (16, 16), "bq": (48,), "bk": (16,),
              "bv": (16,), "wo": (48, 16), "w_gate": (16, 24), "w_up": (16, 24),
              "w_down": (24, 16), "attn_norm": (16,)}
    layers = fuse_projections({name: rng.normal(size=(1, *shape)).astype(np.float32)
                               for name, shape in shapes.items()})
    grouped = shard_params({"embed": np.zeros((32, 16), np.float32), "layers": layers}, cfg,
                           Mesh(np.array(jax.devices()[:1]), ("tp",)))["layers"]
    assert grouped["wqkv"].shape == (1, 16, 2, (3 + 2) * 8)
    x = jnp.asarray(rng.normal(size=(2, 5, 16)), jnp.float32)

    @jax.jit
    def projections(weights: dict) -> tuple:
        w = {name: a[0] for name, a in weights.items()}
        rope = positional_tables(cfg, jnp.broadcast_to(jnp.arange(5), (2, 5)))
        return *project_qkv(w, cfg, x, rope), mlp(x, w["w_gate_up"], w["w_down"])

    for a, b in zip(projections(layers), projections(grouped), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


def test_grouped_free_list_hands_each_group_its_own_pages():
    take, drop = jax.jit(allocate, static_argnums=2), jax.jit(unref)
    free = init_free(16, 4, groups=4, group_heads=2)  # 4 parts of 4 pages, 8 KV heads
    need = jnp.array([[1, 0, 2, 1, 0, 0, 3, 0]])  # [slots, KV heads]
    free, ids, ok = take(free, need, 4)
    assert bool(ok)
    ids = np.asarray(ids)[0]
    for head, row in enumerate(ids):
        taken = row[row > 0]
        assert len(taken) == int(need[0, head])
        assert ((taken // 4 == head // 2) & (taken % 4 > 0)).all()  # its part, not its null
    assert np.asarray(free.num_free).tolist() == [2, 0, 3, 0]
    assert free_count(free.num_free) == 0  # the emptiest group bounds what the host counts
    free = drop(free, jnp.asarray(ids))
    assert np.asarray(free.num_free).tolist() == [3] * 4
    _, _, ok = take(free, jnp.array([[0, 0, 0, 0, 4, 0, 0, 0]]), 4)
    assert not bool(ok)  # group 2 has 3 pages; the others' do not count


def test_a_count_the_model_or_the_devices_cannot_take_is_a_value_error(tiny_model):
    with pytest.raises(ValueError, match=r"tensor_parallel=3 must divide the model's 4 KV"):
        LLM(str(tiny_model), tensor_parallel=3, **SETTINGS)
    with pytest.raises(ValueError, match=r"tensor_parallel=2 exceeds the 1 cpu device"):
        LLM(str(tiny_model), tensor_parallel=2, **SETTINGS)
