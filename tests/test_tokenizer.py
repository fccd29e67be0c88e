"""The cached tokenizer behaves exactly like the one converted from the GGUF file."""

import pytest

from jkv.models.loaders import default_model_path
from jkv.models.params_cache import cache_root
from jkv.models.tokenizer import eos_token_ids, load_tokenizer

pytestmark = pytest.mark.smollm2

TEXT = "Hello world! Ünïcödé 日本語 <|im_start|>user\n def f(x):\n\treturn x**2  "
MESSAGES = [{"role": "user", "content": "hi there"}, {"role": "assistant", "content": "yo"},
            {"role": "user", "content": "ok?"}]


def test_cached_tokenizer_matches_the_gguf_conversion(tmp_path, monkeypatch):
    from transformers import AutoTokenizer

    monkeypatch.setenv("JKV_CACHE_DIR", str(tmp_path))
    path = default_model_path()
    ref = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    first = load_tokenizer(None)
    assert any((cache_root().parent / "tokenizers").iterdir())
    cached = load_tokenizer(None)
    for tok in (first, cached):
        assert tok.encode(TEXT) == ref.encode(TEXT)
        assert tok.decode(ref.encode(TEXT)) == ref.decode(ref.encode(TEXT))
        assert (tok.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
                == ref.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True))
    assert ref.convert_tokens_to_ids("<|im_end|>") in eos_token_ids(cached)
