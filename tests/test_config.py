"""One place for defaults: every config field is an LLM keyword and a server flag with the
same default and help, and each config validates its own fields."""

import argparse
import dataclasses
import inspect
import re
from pathlib import Path

import pytest

import jkv.api
from jkv import LLM
from jkv.config import (
    DEFAULT_MAX_MODEL_LEN,
    OPTIONS,
    USER_CONFIGS,
    CacheConfig,
    EngineConfig,
    LoadConfig,
    SchedulerConfig,
    StoreConfig,
    split_options,
)
from jkv.kv.format import KV_FORMATS, KVFormat
from jkv.server.flags import build_parser

USER_FIELDS = [(config, f) for config in USER_CONFIGS for f in dataclasses.fields(config)]


def _words(text: str) -> str:
    return " ".join(text.split())


def _as_flag_text(text: str) -> str:
    return re.sub(r"`(\w+)`", lambda m: "--" + m[1].replace("_", "-"), text)


@pytest.fixture
def no_model_load(monkeypatch):
    """LLM(...) must fail before it looks for or loads any weights."""

    def boom(*args, **kwargs):
        raise AssertionError("a model was loaded before the options were validated")

    monkeypatch.setattr(jkv.api, "default_model_path", boom)
    monkeypatch.setattr(jkv.api, "load_params", boom)


def test_the_user_configs_are_the_documented_ones():
    assert USER_CONFIGS == (LoadConfig, EngineConfig, CacheConfig, SchedulerConfig, StoreConfig)
    assert [f.name for f in dataclasses.fields(LoadConfig)] == ["model", "dtype", "params_cache"]
    assert [f.name for f in dataclasses.fields(EngineConfig)] == [
        "max_model_len", "max_num_seqs", "attention_backend", "prefill_chunk", "seed",
        "enable_prefix_caching", "device_cache_bytes", "execution", "tensor_parallel"]
    assert [o.name for o in OPTIONS] == [f.name for _, f in USER_FIELDS]


@pytest.mark.parametrize("config,f", USER_FIELDS, ids=lambda x: getattr(x, "name", ""))
def test_every_field_is_an_llm_keyword_and_a_server_flag_with_its_default_and_help(config, f):
    help_text = f.metadata["help"]
    assert help_text and f.default is not dataclasses.MISSING
    # LLM(...): a keyword argument with the field's default, documented in the docstring
    param = inspect.signature(LLM).parameters[f.name]
    assert param.default == f.default
    assert param.kind == (inspect.Parameter.POSITIONAL_OR_KEYWORD if f.name == "model"
                          else inspect.Parameter.KEYWORD_ONLY)
    assert _words(help_text) in _words(LLM.__doc__)
    # the server: --flag-name, same default, same help, same choices
    flag = "--" + f.name.replace("_", "-")
    (action,) = [a for a in build_parser()._actions if a.dest == f.name]
    assert flag in action.option_strings
    assert action.default == f.default
    assert _as_flag_text(help_text) in action.help.replace("%%", "%")
    if isinstance(f.default, bool):
        assert isinstance(action, argparse.BooleanOptionalAction)
        assert "--no-" + flag[2:] in action.option_strings
    if "choices" in f.metadata:
        assert tuple(action.choices) == tuple(f.metadata["choices"])
    assert build_parser().parse_args([]).__dict__[f.name] == f.default


def test_existing_flag_spellings_and_the_host_tier_default_stay_in_help():
    help_text = build_parser().format_help()
    for flag in ("--model", "--dtype", "--max-model-len", "--attention-backend", "--kv-format",
                 "--seed", "--page-size", "--kv-cache-bytes", "--max-num-seqs",
                 "--prefill-chunk", "--enable-prefix-caching", "--no-enable-prefix-caching",
                 "--device-cache-bytes", "--max-num-batched-tokens", "--execution",
                 "--host-cache-bytes", "--disk-cache-bytes", "--store-dir", "--store-spec",
                 "--eviction-policy", "--restore-planning", "--no-restore-planning",
                 "--host", "--port", "--served-model-name", "--precompile", "--no-precompile",
                 "--compilation-cache-dir", "--api-key", "--max-queue", "--request-timeout",
                 "--drain-timeout", "--log-level"):
        assert flag in help_text
    assert re.search(r"\(here \d+\.\d GiB\)", _words(help_text))
    args = build_parser().parse_args(["--no-enable-prefix-caching", "--no-restore-planning",
                                      "--host-cache-bytes", "0", "--kv-format", "k8v4"])
    assert (args.enable_prefix_caching, args.restore_planning) == (False, False)
    assert (args.host_cache_bytes, args.kv_format) == (0, "k8v4")


BAD = [(LoadConfig, "model", 3), (LoadConfig, "dtype", "fp8"),
       (LoadConfig, "params_cache", "yes"),
       (EngineConfig, "max_model_len", 1), (EngineConfig, "max_num_seqs", 0),
       (EngineConfig, "attention_backend", "cuda"), (EngineConfig, "prefill_chunk", 300),
       (EngineConfig, "seed", "x"), (EngineConfig, "enable_prefix_caching", "no"),
       (EngineConfig, "device_cache_bytes", -1), (EngineConfig, "execution", "eager"),
       (EngineConfig, "tensor_parallel", 0),
       (CacheConfig, "page_size", 12), (CacheConfig, "kv_cache_bytes", 0),
       (CacheConfig, "kv_format", "int3"), (CacheConfig, "kv_policy", "pyramidkv"),
       (CacheConfig, "kv_alpha_high", -1.0), (CacheConfig, "kv_alpha_low", float("nan")),
       (CacheConfig, "kv_recent_window", 8), (CacheConfig, "kv_sink_tokens", -1),
       (CacheConfig, "kv_heavy_ratio", 1.5), (CacheConfig, "kv_placement_interval", 0),
       (SchedulerConfig, "max_num_batched_tokens", 0), (SchedulerConfig, "restore_planning", 1),
       (SchedulerConfig, "store_read_ahead", "yes"),
       (SchedulerConfig, "layer_offload", 1),
       (StoreConfig, "host_cache_bytes", -1), (StoreConfig, "disk_cache_bytes", -1),
       (StoreConfig, "save_interval_blocks", -1),
       (StoreConfig, "store_dir", 5), (StoreConfig, "store_spec", 5),
       (StoreConfig, "store_coordinator", "no port"),
       (StoreConfig, "eviction_policy", "random"), (StoreConfig, "adapt_alpha", -1.0),
       (StoreConfig, "adapt_quality_floor", 1.5),
       (StoreConfig, "adapt_half_life", 0), (StoreConfig, "store_kv_format", "k9v9"),
       (StoreConfig, "kv_sharing", "xkv"), (StoreConfig, "kv_sharing_rate", 0.0),
       (StoreConfig, "adapt_profile", "p.json")]  # (without eviction_policy adaptcache)


def test_leankv_settings_are_checked_together():
    assert CacheConfig(kv_policy="leankv").kv_format.name == "k8v4t"  # its high tier
    with pytest.raises(ValueError, match=r"kv_alpha_low \(2.0\) must not exceed"):
        CacheConfig(kv_alpha_high=1.0, kv_alpha_low=2.0)
    with pytest.raises(ValueError, match="CacheConfig.kv_format 'k8v4' cannot be leankv"):
        CacheConfig(kv_policy="leankv", kv_format="k8v4")  # no per-token key scales
    assert CacheConfig(kv_policy="leankv", kv_format="k4v8t").kv_format.halved().name == "k2v4t"
    # per-token formats are rotated, and so are their halvings; unrotated ones are named so
    assert all(f.rotated == f.token_keys for f in KV_FORMATS.values())
    plain = dataclasses.replace(KVFormat.parse("k8v4t"), rotated=False)
    assert plain.name == "k8v4tg32-unrotated" and not plain.halved().rotated
    with pytest.raises(ValueError, match="KVFormat.rotated needs token_keys"):
        KVFormat(8, 4, rotated=True)
    assert CacheConfig(kv_policy="kivi").kv_format.name == "k2v2"
    assert CacheConfig(kv_policy="streaming").kv_format.name == "auto"  # model dtype
    with pytest.raises(ValueError, match="CacheConfig.kv_format 'k8v4' cannot hold h2o"):
        CacheConfig(kv_policy="h2o", kv_format="k8v4")


def test_every_field_is_validated():
    assert sorted(name for _, name, _ in BAD) == sorted(o.name for o in OPTIONS)


@pytest.mark.parametrize("config,name,bad", BAD, ids=[name for _, name, _ in BAD])
def test_a_bad_value_raises_a_value_error_naming_the_field(config, name, bad, no_model_load):
    match = rf"{config.__name__}\.{name}\b"
    with pytest.raises(ValueError, match=match):
        config(**{name: bad})
    with pytest.raises(ValueError, match=match):
        LLM(**{name: bad})


def test_byte_options_take_sizes_as_text_as_keywords_and_flags(no_model_load):
    """Every `*_bytes` option takes 512MiB / 8GiB / 1.5G as well as an int, from LLM(...)
    and from its flag; bad text is a ValueError naming the field (a usage error on the
    command line)."""
    sizes = [o for o in OPTIONS if o.name.endswith("_bytes")]
    assert {o.name for o in sizes} >= {"kv_cache_bytes", "host_cache_bytes", "disk_cache_bytes"}
    for o in sizes:
        parts = split_options({o.name: "512MiB"})
        assert parts[o.config] == {o.name: 512 << 20}
        assert split_options({o.name: "1.5G"})[o.config] == {o.name: 1_500_000_000}
        assert getattr(build_parser().parse_args([o.flag, "8GiB"]), o.name) == 8 << 30
        with pytest.raises(ValueError, match=rf"{o.config.__name__}\.{o.name}"):
            LLM(**{o.name: "lots"})
        with pytest.raises(SystemExit):
            build_parser().parse_args([o.flag, "8 gigs"])


def test_unknown_keywords_are_type_errors_listing_the_valid_names(no_model_load):
    with pytest.raises(TypeError, match=r"unexpected keyword argument 'max_model_length'.*"
                                        r"max_model_len"):
        LLM(max_model_length=512)
    with pytest.raises(TypeError, match="unexpected keyword argument 'cache'"):
        split_options({"cache": 1})
    parts = split_options({"page_size": 8, "seed": 3, "model": None})
    assert parts[CacheConfig] == {"page_size": 8} and parts[EngineConfig] == {"seed": 3}
    assert parts[StoreConfig] == {} and parts[LoadConfig] == {"model": None}


def test_max_model_len_is_resolved_against_the_models_limit_in_one_place():
    assert EngineConfig().resolve_max_model_len(131072) == DEFAULT_MAX_MODEL_LEN == 8192
    assert EngineConfig().resolve_max_model_len(2048) == 2048
    assert EngineConfig(max_model_len=512).resolve_max_model_len(2048) == 512
    with pytest.raises(ValueError, match=r"EngineConfig\.max_model_len must be in \[2, 2048\]"):
        EngineConfig(max_model_len=4096).resolve_max_model_len(2048)


def test_resolved_defaults():
    assert CacheConfig().kv_format == KVFormat() == CacheConfig(kv_format=KVFormat()).kv_format
    assert CacheConfig(kv_format="k8v4").kv_format == KVFormat(8, 4) == KVFormat.parse("k8v4")
    assert isinstance(StoreConfig().host_cache_bytes, int)
    assert StoreConfig(host_cache_bytes=0).host_cache_bytes == 0
    assert StoreConfig(store_dir=Path("/tmp/x")).store_dir == "/tmp/x"
    with pytest.raises(ValueError, match=r"StoreConfig\.store_dir or StoreConfig\.store_spec"):
        StoreConfig(store_dir="/tmp/x", store_spec="memory://")
