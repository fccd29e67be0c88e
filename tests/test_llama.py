"""The model against transformers: SmolLM2 real weights (GGUF) and tiny HF-directory models."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from jkv import LLM, SamplingParams  # noqa: E402
from jkv.attention.layer_kv import LayerKV  # noqa: E402
from jkv.kv.allocator import init_free, init_tables, reserve  # noqa: E402
from jkv.kv.format import KVFormat  # noqa: E402
from jkv.kv.page_pool import init_filling  # noqa: E402
from jkv.kv.pages import KVPages  # noqa: E402
from jkv.models import forward, lm_head, load_params  # noqa: E402
from jkv.models.loaders import default_model_path  # noqa: E402

pytestmark = pytest.mark.long

PROMPTS = [
    "The capital of France is",
    "Write a haiku about the sea.",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "The three primary colors are",
    "Explain why the sky is blue in one sentence:",
]
LONG_TEXT = (
    "The history of computing is a story of abstraction. Early machines were programmed by "
    "rewiring panels, then by punching cards, and later by writing assembly code that mapped "
    "one to one onto the instructions of a particular processor. High-level languages such as "
    "Fortran and Lisp let programmers describe what they wanted rather than how the hardware "
    "should do it, and compilers took over the tedious work of translation. Operating systems "
    "hid the details of disks, memory and devices behind files and processes. Networks joined "
    "machines into larger systems, and the web turned documents into applications. Each layer "
    "made the one below it invisible to most people, and each new layer was built by people "
    "who could take the lower ones for granted. Today, machine learning models are trained on "
    "clusters of accelerators whose memory hierarchies are as intricate as any processor's, "
    "and inference engines must decide which numbers stay close to the arithmetic units and "
    "which are sent away to slower, larger memories until they are needed again."
)


def rel_err(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def jkv_logits(cfg, params, ids: list[int], page_size: int = 16) -> np.ndarray:
    """Logits for every position of one prompt, through the public functional API."""
    t = len(ids)
    width = -(-t // page_size)
    dtype = params["embed"].dtype
    num_pages = width * cfg.num_layers * cfg.num_kv_heads + 1
    pool = KVPages.zeros(num_pages, page_size, cfg.head_dim, dtype, KVFormat())
    free = init_free(num_pages, page_size)
    filling = init_filling(1, cfg.num_layers, cfg.num_kv_heads, page_size, cfg.head_dim, dtype)
    tables = init_tables(1, cfg.num_layers, cfg.num_kv_heads, width)
    free, tables, ok = reserve(free, tables, jnp.asarray([t], jnp.int32))
    assert bool(ok)

    @jax.jit
    def run(params, pool, filling, pages, tokens):
        positions = jnp.arange(t, dtype=jnp.int32)[None]
        kv = LayerKV(pool=pool, fill_k=filling.k, fill_v=filling.v, pages=pages)
        hidden, _ = forward(params, cfg, tokens, positions, jnp.ones((1, t), bool), kv)
        return lm_head(params, hidden)

    return np.asarray(run(params, pool, filling, tables.pages, jnp.asarray([ids])))[0]


def hf_greedy(model, ids: list[int], n: int) -> list[int]:
    """Greedy continuation with transformers' own KV cache, EOS not special."""
    out, past = [], None
    x = torch.tensor([ids])
    with torch.no_grad():
        for _ in range(n):
            res = model(input_ids=x, past_key_values=past, use_cache=True)
            past = res.past_key_values
            nxt = int(res.logits[0, -1].argmax())
            out.append(nxt)
            x = torch.tensor([[nxt]])
    return out


# ---------------------------------------------------------------- SmolLM2 (real weights)


@pytest.fixture(scope="module")
def smollm2():
    path = default_model_path()
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, torch_dtype=torch.float32)
    hf.eval()
    llm = LLM(dtype="float32", max_model_len=512, max_num_seqs=8, prefill_chunk=64)
    return llm, hf


@pytest.mark.smollm2
def test_smollm2_logits_match_transformers_on_200_tokens(smollm2):
    llm, hf = smollm2
    ids = llm.tokenizer.encode(LONG_TEXT + " " + LONG_TEXT)[:200]
    assert len(ids) == 200
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].numpy()
    got = jkv_logits(llm.cfg, llm.engine.params, ids)
    err = rel_err(got, ref)
    print(f"SmolLM2 float32 logits over 200 tokens: relative error {err:.2e}")
    assert err < 1e-4


@pytest.mark.smollm2
def test_smollm2_prompt_logprobs_match_transformers(smollm2):
    """prompt_logprobs through chunked prefill (64-token chunks: later chunks read earlier
    ones from pages) against transformers' log-softmax over the whole prompt at once."""
    llm, hf = smollm2
    ids = llm.tokenizer.encode(LONG_TEXT + " " + LONG_TEXT)[:200]
    [out] = llm.generate(ids, SamplingParams(max_tokens=1, prompt_logprobs=3))
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([ids])).logits[0], -1).numpy()
    got = out.prompt_logprobs
    assert len(got) == len(ids) and got[0] is None
    for p in range(1, len(ids)):
        assert got[p][ids[p]] == pytest.approx(ref[p - 1, ids[p]], abs=2e-3), p
        top = np.argsort(-ref[p - 1])[:3]
        assert set(top) <= set(got[p]), p  # the top 3 and the prompt's token
        assert len(got[p]) <= 4


@pytest.mark.smollm2
def test_smollm2_greedy_32_tokens_match_transformers(smollm2):
    llm, hf = smollm2
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=32, temperature=0, ignore_eos=True))
    for prompt, out in zip(PROMPTS, outs, strict=True):
        ref = hf_greedy(hf, out.prompt_token_ids, 32)
        assert out.token_ids == ref, f"greedy continuation differs for {prompt!r}"
    print(f"SmolLM2: {len(PROMPTS)} prompts x 32 greedy tokens identical to transformers")


@pytest.mark.smollm2
def test_smollm2_with_most_layers_on_the_host_generates_the_same_tokens(smollm2):
    """LayerKV's offload on real weights: 10 of 30 layers resident from the prefill on (the
    other 20 go through the pool a layer at a time; the prompt fed chunk by chunk, or
    layer-major: 7 layers a step over all of it), then fetched back mid-decode."""
    from jkv.engine.runner import Row

    llm, _ = smollm2
    eng = llm.engine
    ids = llm.tokenizer.encode(LONG_TEXT)[:150]
    greedy = SamplingParams(temperature=0, logprobs=2)

    def generate(resident, layer_major: bool = False):
        slot, pos = eng.open(ids, use_prefix_cache=False, resident=resident)
        key = eng.request_key(0)
        for first in range(0, 30, 7) if layer_major else ():
            (s,), _ = eng.step([Row(slot, ids[pos:], greedy, key,
                                    layer_span=(first, min(first + 7, 30)))], [])
        pos = len(ids) if layer_major else pos
        while pos < len(ids):
            (s,), _ = eng.step([Row(slot, ids[pos:pos + 64], greedy, key)], [])
            pos += 64
        out = [(s.token, s.logprob)]
        for i in range(12):
            if i == 6:
                eng.fetch_layers(slot)
            _, (s,) = eng.step([], [Row(slot, [out[-1][0]], greedy, key, len(out))])
            out.append((s.token, s.logprob))
        eng.close(slot, keep=False)
        return out

    resident = generate(None)
    assert generate(10) == resident
    assert generate(10, layer_major=True) == resident
    assert eng.cache.free_pages + eng.cache.pages_cached == eng.cache.total_pages


# ---------------------------------------------------------------- tiny HF-directory models


def _tiny(kind: str):
    common = dict(vocab_size=320, hidden_size=64, intermediate_size=160, num_hidden_layers=3,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  rms_norm_eps=1e-6, initializer_range=0.1, tie_word_embeddings=False)
    if kind == "qwen2":
        return transformers.Qwen2Config(rope_theta=1e6, **common)
    if kind == "mistral":
        return transformers.MistralConfig(rope_theta=1e4, sliding_window=None, **common)
    if kind == "llama3":
        return transformers.LlamaConfig(
            rope_theta=5e5, rope_scaling={"rope_type": "llama3", "factor": 8.0,
                                          "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                          "original_max_position_embeddings": 64}, **common)
    raise ValueError(kind)


@pytest.fixture(scope="module", params=["qwen2", "mistral", "llama3"])
def tiny(request, tmp_path_factory):
    torch.manual_seed(1234)
    cfg = _tiny(request.param)
    model = transformers.AutoModelForCausalLM.from_config(cfg, torch_dtype=torch.float32)
    if request.param == "qwen2":  # make the q/k/v biases matter
        with torch.no_grad():
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj,
                             layer.self_attn.v_proj):
                    proj.bias.normal_(0, 0.5)
    model.eval()
    path = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(path)
    return request.param, path, model


def test_tiny_model_logits_match_transformers(tiny):
    kind, path, hf = tiny
    cfg, params = load_params(path, jnp.float32, use_cache=False)
    if kind == "qwen2":
        assert cfg.qkv_bias
    if kind == "llama3":
        assert cfg.rope_scaling is not None
    assert not cfg.tie_word_embeddings
    ids = np.random.default_rng().integers(0, cfg.vocab_size, 200).tolist()
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].numpy()
    err = rel_err(jkv_logits(cfg, params, ids, page_size=8), ref)
    print(f"{kind}: logits relative error {err:.2e}")
    assert err < 1e-4


def test_tiny_model_greedy_matches_transformers(tiny):
    kind, path, hf = tiny
    llm = LLM(str(path), dtype="float32", max_model_len=128, params_cache=False, page_size=8,
              max_num_seqs=8)
    assert llm.tokenizer is None
    rng = np.random.default_rng()
    prompts = [rng.integers(0, 320, n).tolist() for n in (3, 17, 40, 9, 25)]
    outs = llm.generate(prompts, SamplingParams(max_tokens=32, temperature=0))
    for p, out in zip(prompts, outs, strict=True):
        assert out.token_ids == hf_greedy(hf, p, 32)
    with pytest.raises(ValueError, match="token ids"):
        llm.generate("text needs a tokenizer")
