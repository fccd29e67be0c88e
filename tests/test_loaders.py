"""Loaders and the converted-params cache."""

import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jkv.config import PRESETS
from jkv.models import loaders, params_cache
from jkv.models.loaders import _unpermute_rotary, hf_config, load_model, random_params
from jkv.models.params_cache import cache_root, load_params


def _llama_cpp_permute(w, n_heads):  # what llama.cpp's converter does to Q/K rows
    return (w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def test_unpermute_inverts_the_gguf_converter():
    w = np.random.default_rng().normal(size=(3 * 64, 40))
    permuted = _llama_cpp_permute(w, 3)
    assert not np.allclose(permuted, w)
    np.testing.assert_array_equal(_unpermute_rotary(permuted, 3), w)


@pytest.fixture
def tiny_dir(tmp_path):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, max_position_embeddings=128)
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(tmp_path / "m")
    return tmp_path / "m"


def test_params_cache_roundtrip_and_rebuild(tiny_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("JKV_CACHE_DIR", str(tmp_path / "cache"))
    cfg, first = load_params(tiny_dir, jnp.float32)
    entries = list(cache_root().iterdir())
    assert len(entries) == 1 and (entries[0] / "done").exists()
    cfg2, second = load_params(tiny_dir, jnp.float32)
    assert cfg2 == cfg
    for a, b in zip(jax.tree.leaves(first), jax.tree.leaves(second), strict=True):
        np.testing.assert_array_equal(a, b)
    # a corrupt entry is rebuilt, not trusted
    (entries[0] / "config.json").write_text("{not json")
    cfg3, third = load_params(tiny_dir, jnp.float32)
    assert cfg3 == cfg
    json.loads((entries[0] / "config.json").read_text())


def test_host_and_device_params_read_each_others_cache_entries(tiny_dir, tmp_path, monkeypatch,
                                                               caplog):
    """A tensor-parallel engine loads numpy arrays (bfloat16 through ml_dtypes), the cache
    included, none of them read through a device; an entry written from either placement
    reads back, equal, in the other."""
    monkeypatch.setenv("JKV_CACHE_DIR", str(tmp_path / "cache"))
    given = []  # what host params were made of: numpy arrays only, never a device's

    def to_host(params: dict, dtype) -> dict:
        given.append(all(type(x) is np.ndarray for x in jax.tree.leaves(params)))
        return loaders.to_host(params, dtype)

    monkeypatch.setattr(params_cache, "to_host", to_host)
    _, expected = load_params(tiny_dir, jnp.bfloat16, use_cache=False, on_host=True)
    for writer in (True, False):  # on_host of the load that writes the entry
        shutil.rmtree(tmp_path / "cache", ignore_errors=True)
        for on_host in (writer, not writer):  # (the second reads the entry)
            _, params = load_params(tiny_dir, jnp.bfloat16, on_host=on_host)
            for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(expected), strict=True):
                assert (type(a) is np.ndarray) == on_host and a.dtype == jnp.bfloat16
                np.testing.assert_array_equal(np.asarray(a), b)
    assert given == [True] * 3  # (uncached, writing the entry, reading a device load's)
    assert "cache" not in caplog.text  # no entry was found unreadable or left unwritten


def test_bad_model_paths_raise_clear_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_model(tmp_path / "nope")
    (tmp_path / "x.bin").write_bytes(b"0")
    with pytest.raises(ValueError, match="gguf"):
        load_model(tmp_path / "x.bin")
    with pytest.raises(ValueError, match="model_type"):
        hf_config({"model_type": "gpt2"})


def test_random_params_have_the_preset_shapes():
    cfg = PRESETS["smollm2-135m"].replace(num_layers=2)
    p = random_params(cfg, dtype=jnp.float32)
    assert p["layers"]["wqkv"].shape == (2, 576, 576 + 2 * 192)
    assert p["layers"]["w_gate_up"].shape == (2, 576, 2 * 1536)
    assert "lm_head" not in p
    assert np.isfinite(np.asarray(p["layers"]["w_down"])).all()


def test_kv_format_names():
    from jkv.kv.format import KVFormat

    assert KVFormat.parse("k4v2") == KVFormat(4, 2)
    assert KVFormat.parse("int8").name == "int8" and KVFormat.parse("k8v4").name == "k8v4"
    assert KVFormat.parse("k8v4").bytes_per_token(64, 2) < KVFormat.parse("auto").bytes_per_token(
        64, 2)
    with pytest.raises(ValueError, match="kv_format"):
        KVFormat.parse("int3")
