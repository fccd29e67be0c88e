"""The GGUF tokenizer jkv builds without torch behaves exactly like transformers' conversion,
built fresh and loaded from its cache; `LLM()` + `generate` never imports torch."""

import os
import subprocess
import sys

import pytest

from jkv.models.gguf_tokenizer import build_tokenizer, read_metadata
from jkv.models.loaders import default_model_path
from jkv.models.params_cache import cache_root
from jkv.models.tokenizer import Tokenizer, eos_token_ids, load_tokenizer

pytestmark = pytest.mark.smollm2

TEXTS = [
    "Hello world! Ünïcödé 日本語 <|im_start|>user\n def f(x):\n\treturn x**2  ",
    "12345 67 1.5e10 $300,000 in 2024; don't I'll WE'RE",
    " leading  spaces\n\n\nand\ttabs\r\n", "emoji 🤖👍🏽 <|endoftext|><|im_end|> <file_sep>",
]
MESSAGES = [{"role": "user", "content": "hi there"}, {"role": "assistant", "content": "yo"},
            {"role": "user", "content": "ok?"}]


def test_gguf_tokenizer_matches_transformers_conversion(tmp_path, monkeypatch):
    from transformers import AutoTokenizer

    monkeypatch.setenv("JKV_CACHE_DIR", str(tmp_path))
    path = default_model_path()
    ref = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    built = load_tokenizer(None)
    assert any((cache_root().parent / "tokenizers").iterdir())
    cached = load_tokenizer(None)
    assert type(cached) is type(built)
    for tok in (built, cached):
        assert len(tok) == len(ref)
        for text in TEXTS:
            ids = ref.encode(text)
            assert tok.encode(text) == ids, text
            assert tok.decode(ids) == ref.decode(ids)
            assert tok.decode(ids, skip_special_tokens=True) == ref.decode(
                ids, skip_special_tokens=True)
        assert (tok.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
                == ref.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True))
        for name in ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id"):
            assert getattr(tok, name) == getattr(ref, name), name
    assert ref.convert_tokens_to_ids("<|im_end|>") in eos_token_ids(cached)


def test_hf_directory_tokenizer_matches_transformers(tmp_path):
    from transformers import AutoTokenizer

    path = default_model_path()
    AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name).save_pretrained(
        str(tmp_path))
    ref = AutoTokenizer.from_pretrained(str(tmp_path))
    tok = load_tokenizer(tmp_path)
    assert isinstance(tok, Tokenizer) and len(tok) == len(ref)
    for text in TEXTS:
        assert tok.encode(text) == ref.encode(text), text
        assert tok.decode(ref.encode(text), skip_special_tokens=True) == ref.decode(
            ref.encode(text), skip_special_tokens=True)
    assert (tok.apply_chat_template(MESSAGES, add_generation_prompt=True)
            == ref.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True))
    assert tok.eos_token_id == ref.eos_token_id


def test_add_bos_token_and_a_damaged_cache_entry(tmp_path, monkeypatch):
    monkeypatch.setenv("JKV_CACHE_DIR", str(tmp_path))
    meta = read_metadata(default_model_path())
    backend, extra = build_tokenizer({**meta, "tokenizer.ggml.add_bos_token": True})
    tok = Tokenizer(backend, **extra)
    assert tok.encode("hi")[0] == tok.bos_token_id == meta["tokenizer.ggml.bos_token_id"]
    assert tok.encode("hi", add_special_tokens=False)[0] != tok.bos_token_id
    first = load_tokenizer(None)
    (entry,) = (cache_root().parent / "tokenizers").iterdir()
    (entry / "tokenizer.json").write_text("{not json")
    again = load_tokenizer(None)  # rebuilt, not raised
    assert again.encode(TEXTS[0]) == first.encode(TEXTS[0])
    assert Tokenizer.load(entry).encode(TEXTS[0]) == first.encode(TEXTS[0])


def test_llm_generates_without_importing_torch(tmp_path):
    code = ("import sys\nfrom jkv import LLM, SamplingParams\n"
            "llm = LLM(max_model_len=256, max_num_seqs=1)\n"
            "out = llm.generate(['The capital of France is'], "
            "SamplingParams(max_tokens=4, temperature=0))\n"
            "assert out[0].token_ids, out\n"
            "print('TORCH' if 'torch' in sys.modules else 'NO-TORCH')\n")
    env = dict(os.environ, JKV_CACHE_DIR=str(tmp_path), HF_HUB_OFFLINE="1")
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.strip().splitlines()[-1] == "NO-TORCH", run.stdout


class _SlowTokenizer:
    """A tokenizer with nothing but `decode` (transformers' slow ones): the windowed path."""

    def __init__(self, tok: Tokenizer) -> None:
        self.tok = tok

    def decode(self, ids, skip_special_tokens=False, clean_up_tokenization_spaces=None):
        return self.tok.decode(ids, skip_special_tokens=skip_special_tokens)


@pytest.mark.parametrize("kind", ["stream", "cleanup", "windowed"])
def test_streamed_text_equals_a_one_shot_decode(kind):
    from jkv.engine.sampling import SamplingParams
    from jkv.outputs import Tracker

    tok = load_tokenizer(None)
    if kind == "cleanup":
        tok = Tokenizer(tok.backend, clean_up_tokenization_spaces=True, **tok.special)
    text = "".join(TEXTS) + " a ,b . c ' d don 't 🧑‍🚀 ąę 한국어 ∑x² €"
    ids = tok.encode(text)
    # characters split across tokens: a token that completes no character on its own
    assert any("\ufffd" in tok.decode([i]) for i in ids)
    tracker = Tracker(_SlowTokenizer(tok) if kind == "windowed" else tok,
                      SamplingParams(), frozenset())
    deltas = []
    for i in ids:
        assert not tracker.add(i)
        deltas.append(tracker.delta())
    deltas.append(tracker.delta(final=True))
    assert tracker.text == "".join(deltas) == tok.decode(ids, skip_special_tokens=True)
    assert "\ufffd" not in "".join(deltas)

    # a stop string is found in the new text, spanning tokens, and cuts the text there
    stop = "日本"
    tracker = Tracker(tok, SamplingParams(stop=[stop]), frozenset())
    streamed = ""
    for n in range(len(ids)):
        done = tracker.add(ids[n])
        streamed += tracker.delta(final=done)
        if done:
            break
    full = tok.decode(ids[:n + 1], skip_special_tokens=True)
    assert tracker.finish_reason == "stop" and streamed == tracker.text == full[:full.index(stop)]
