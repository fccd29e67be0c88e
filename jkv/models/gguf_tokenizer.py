"""A GGUF file's tokenizer and chat template, built with `tokenizers` alone.

transformers' own GGUF conversion reads the file through torch, which jkv does not need at
run time; the file's metadata (llama.cpp's key names) is all a tokenizer needs: the vocabulary,
the merges, the token types (control tokens stay whole) and the special token ids.
Byte-level BPE (`tokenizer.ggml.model == "gpt2"`: Llama 3, Qwen2, SmolLM2) is built here;
other types raise `UnsupportedTokenizer` (`jkv.models.tokenizer` then falls back to
transformers' conversion, which needs torch).
"""

from __future__ import annotations

from functools import cache
from pathlib import Path

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, processors
from tokenizers import pre_tokenizers as pre

_CONTROL, _USER_DEFINED = 3, 4  # llama.cpp token types

# how the text is split before BPE, by `tokenizer.ggml.pre` (None: GPT-2's own regex)
_LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
           r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
          r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
SPLITS = {"llama3": _LLAMA3, "llama-v3": _LLAMA3, "llama-bpe": _LLAMA3, "smaug-bpe": _LLAMA3,
          "qwen2": _QWEN2, "deepseek-r1-qwen": _QWEN2}


class UnsupportedTokenizer(ValueError):
    """The file's tokenizer type is not one this module builds."""


@cache
def _byte_alphabet() -> dict[int, str]:
    """GPT-2's printable spelling of each byte."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
            *range(ord("®"), ord("ÿ") + 1)]
    spelled, extra = {}, 0
    for b in range(256):
        if b in keep:
            spelled[b] = chr(b)
        else:
            spelled[b] = chr(256 + extra)
            extra += 1
    return spelled


def read_metadata(file: str | Path) -> dict:
    """The `tokenizer.*` metadata of a GGUF file, decoded to Python values."""
    from gguf import GGUFReader

    fields = GGUFReader(str(file)).fields
    return {name: field.contents() for name, field in fields.items()
            if name.startswith("tokenizer.")}


def build_tokenizer(meta: dict) -> tuple[Tokenizer, dict]:
    """The tokenizer that GGUF metadata `meta` describes, and its special tokens and chat
    template (`jkv.models.tokenizer.Tokenizer`'s keyword arguments)."""
    kind = meta.get("tokenizer.ggml.model")
    tokens: list[str] = list(meta.get("tokenizer.ggml.tokens") or [])
    if not tokens:
        raise ValueError("the GGUF file has no tokenizer.ggml.tokens")
    types = list(meta.get("tokenizer.ggml.token_type") or [1] * len(tokens))
    if kind != "gpt2":
        raise UnsupportedTokenizer(f"tokenizer.ggml.model {kind!r}: jkv builds byte-level BPE "
                                   f"('gpt2') tokenizers from GGUF files")
    tok = _byte_level(tokens, meta)
    specials = [AddedToken(t, normalized=False, special=True)
                for t, ty in zip(tokens, types, strict=True) if ty == _CONTROL]
    alphabet = set(_byte_alphabet().values())  # a control token outside it is a mislabel
    specials = [t for t in specials if set(t.content) <= alphabet]
    tok.add_special_tokens(specials)
    tok.add_tokens([AddedToken(t, normalized=False, special=False)
                    for t, ty in zip(tokens, types, strict=True) if ty == _USER_DEFINED])

    def special(key: str) -> str | None:
        i = meta.get(f"tokenizer.ggml.{key}_token_id")
        return tokens[i] if i is not None and 0 <= i < len(tokens) else None

    bos = special("bos")
    if meta.get("tokenizer.ggml.add_bos_token", False) and bos is not None:
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
            special_tokens=[(bos, meta["tokenizer.ggml.bos_token_id"])])
    return tok, {"bos_token": bos, "eos_token": special("eos"), "unk_token": special("unknown"),
                 "pad_token": special("padding"),
                 "chat_template": meta.get("tokenizer.chat_template")}


def _byte_level(tokens: list[str], meta: dict) -> Tokenizer:
    spelled = _byte_alphabet()
    alphabet = set(spelled.values())
    vocab = {}
    for i, t in enumerate(tokens):
        key = t if set(t) <= alphabet else "".join(spelled[b] for b in t.encode("utf-8"))
        vocab.setdefault(key, i)
    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges") or []]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
    split = SPLITS.get(meta.get("tokenizer.ggml.pre"))
    prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", False))
    if split is None:
        tok.pre_tokenizer = pre.ByteLevel(add_prefix_space=prefix)
    else:
        tok.pre_tokenizer = pre.Sequence([pre.Split(Regex(split), behavior="isolated"),
                                          pre.ByteLevel(add_prefix_space=prefix, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    return tok
