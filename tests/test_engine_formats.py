"""Every KV format through the whole engine: the pallas and xla attention backends produce
the same greedy tokens, and quantized formats stay close to the unquantized cache."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jkv.config import CacheConfig, EngineConfig, ModelConfig
from jkv.engine.engine import Engine
from jkv.engine.sampling import SamplingParams
from jkv.kv.format import KV_FORMATS, KVFormat
from jkv.models.loaders import random_params
from jkv.sched.scheduler import Request, Scheduler, generate_all

FORMATS = ["auto", "k4v2"]  # int8, int4, k8v4 (k8v8, k4v4): the same kernel paths, more bits
TINY = ModelConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_layers=2,
                   num_heads=8, num_kv_heads=2, head_dim=64, rope_theta=10000.0)


def greedy(engine: Engine, prompts: list[list[int]], n: int) -> list[list[int]]:
    requests = [Request(p, SamplingParams(max_tokens=n, temperature=0)) for p in prompts]
    generate_all(Scheduler(engine), requests)
    return [r.output for r in requests]


def make_engine(cfg, params, fmt: str, backend: str, page_size: int = 8,
                kv_format: KVFormat | None = None, **kw) -> Engine:
    cache = CacheConfig(page_size=page_size, kv_cache_bytes=8 << 20,
                        kv_format=kv_format or KV_FORMATS[fmt])
    return Engine(cfg, params, cache=cache, config=EngineConfig(
        max_model_len=128, max_num_seqs=4, attention_backend=backend, prefill_chunk=16, **kw))


@pytest.fixture(scope="module")
def tiny_params():
    return random_params(TINY, seed=3, dtype=jnp.float32)


# per token; KIVI's per channel (k4v2's per-channel path: the SmolLM2 test below)
@pytest.mark.parametrize("fmt", ["k8v4t", "k2v2"])
def test_pallas_and_xla_backends_agree_on_a_tiny_model(tiny_params, fmt):
    rng = np.random.default_rng()
    # ragged prompts: shorter than a page, exact page multiples, several prefill chunks
    prompts = [rng.integers(0, TINY.vocab_size, n).tolist() for n in (3, 16, 37)]
    xla = greedy(make_engine(TINY, tiny_params, fmt, "xla"), prompts, 20)
    pallas = greedy(make_engine(TINY, tiny_params, fmt, "pallas"), prompts, 20)
    assert pallas == xla


def test_a_rotated_format_attends_as_the_model_does(tiny_params):
    """Keys and values stored rotated (q rotated to meet them, the output rotated back): the
    prompt's logprobs, read back from 8-bit pages chunk by chunk, stay as close to the
    unquantized cache's as the unrotated format's do."""
    rng = np.random.default_rng()
    prompt = rng.integers(0, TINY.vocab_size, 60).tolist()

    def logprobs(fmt: KVFormat) -> np.ndarray:
        engine = make_engine(TINY, tiny_params, "auto", "xla", kv_format=fmt)
        r = Request(prompt, SamplingParams(max_tokens=1, prompt_logprobs=1))
        generate_all(Scheduler(engine), [r])
        return np.array([e[0] for e in r.prompt_logprobs[1:]])

    exact = logprobs(KVFormat())
    rotated = np.abs(logprobs(KVFormat(8, 8, 32, token_keys=True, rotated=True)) - exact)
    plain = np.abs(logprobs(KVFormat(8, 8, 32, token_keys=True)) - exact)
    assert rotated.max() < 0.05 and rotated.mean() < 2 * plain.mean() + 1e-4


def test_bf16_pages_take_two_bytes_per_element_under_a_float32_model(tiny_params):
    """kv_format bf16 stores bfloat16 pages whatever the model dtype: half the bytes of a
    float32 model's own ("auto"), twice the pages in the same budget, and the prompt's
    logprobs within bfloat16's rounding of float32 pages'."""
    engines = {fmt: make_engine(TINY, tiny_params, fmt, "xla") for fmt in ("auto", "bf16")}
    pool = engines["bf16"].cache.pool
    assert pool.k.dtype == pool.v.dtype == jnp.bfloat16
    elements = 8 * 2 * TINY.head_dim  # a page: 8 tokens' keys and values
    assert engines["bf16"].cache.one_page == 2 * elements
    assert engines["auto"].cache.one_page == 4 * elements
    assert engines["bf16"].cache.total_pages >= 2 * engines["auto"].cache.total_pages
    prompt = np.random.default_rng().integers(0, TINY.vocab_size, 60).tolist()
    got = {}
    for fmt, engine in engines.items():
        r = Request(prompt, SamplingParams(max_tokens=1, prompt_logprobs=1))
        generate_all(Scheduler(engine), [r])
        got[fmt] = np.array([e[0] for e in r.prompt_logprobs[1:]])
    diff = np.abs(got["bf16"] - got["auto"])
    assert 0 < diff.max() < 0.05  # rounded to bfloat16, and only that


def test_unknown_backend_is_a_value_error(tiny_params):
    with pytest.raises(ValueError, match="attention_backend"):
        make_engine(TINY, tiny_params, "auto", "triton")


@pytest.fixture(scope="module")
def smollm2():
    from jkv import LLM

    llm = LLM(dtype="float32", max_model_len=256, max_num_seqs=4, kv_cache_bytes=64 << 20)
    return llm.cfg, llm.engine.params, llm.tokenizer


@pytest.mark.smollm2
@pytest.mark.parametrize("fmt", FORMATS)
def test_smollm2_pallas_and_xla_give_identical_greedy_tokens(smollm2, fmt):
    cfg, params, tok = smollm2
    prompts = [tok.encode("The history of computing is a story of abstraction. Early machines "
                          "were programmed by rewiring panels, then by punching cards."),
               tok.encode("def fibonacci(n):")]
    kw = dict(page_size=16)
    xla = greedy(make_engine(cfg, params, fmt, "xla", **kw), prompts, 24)
    pallas = greedy(make_engine(cfg, params, fmt, "pallas", **kw), prompts, 24)
    assert pallas == xla, f"{fmt}: pallas and xla greedy tokens differ"


def test_cpu_layers_read_their_weights_in_place(tiny_params):
    """On CPU each layer's weights are views into the stacked arrays: decode steps run layer
    by layer on them, so no layer's weights are copied (XLA would, picking a layer by a
    traced index) and no memory is added."""
    if jax.default_backend() != "cpu":
        pytest.skip("views of the stacked weights exist on CPU only")
    eng = make_engine(TINY, tiny_params, "auto", "xla")
    views = eng.runner.views
    assert views is not None and len(views) == TINY.num_layers
    for name, w in tiny_params["layers"].items():
        step = w.nbytes // TINY.num_layers
        assert [v[name].unsafe_buffer_pointer() for v in views] == [
            w.unsafe_buffer_pointer() + i * step for i in range(TINY.num_layers)], name
