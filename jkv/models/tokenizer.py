"""The model's tokenizer and chat template, from a GGUF file's metadata or an HF directory.

`Tokenizer` is a `tokenizers.Tokenizer` with its special tokens and a jinja2 chat template.
Building it imports neither transformers nor torch, so `pip install jkv` serves a GGUF model
without either; only a directory with no `tokenizer.json` (a SentencePiece `tokenizer.model`
alone) or a GGUF file whose tokenizer is not byte-level BPE goes through transformers.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import shutil
import tempfile
from functools import cached_property
from pathlib import Path

import tokenizers
import tokenizers.decoders

from jkv.models.gguf_tokenizer import UnsupportedTokenizer, build_tokenizer, read_metadata
from jkv.models.loaders import default_model_path
from jkv.models.params_cache import cache_root, file_key

log = logging.getLogger(__name__)

SPECIAL_NAMES = ("bos_token", "eos_token", "unk_token", "pad_token")
_CLEANUPS = ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"),
             (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"), (" 're", "'re"))


class Tokenizer:
    """Text <-> token ids and the chat template, with the calls of a transformers tokenizer
    that jkv makes (`encode`, `decode`, `apply_chat_template`, `convert_tokens_to_ids`)."""

    def __init__(self, backend: tokenizers.Tokenizer, *, chat_template: str | None = None,
                 clean_up_tokenization_spaces: bool = False, **special: str | None) -> None:
        unknown = set(special) - set(SPECIAL_NAMES)
        if unknown:
            raise ValueError(f"unknown special tokens {sorted(unknown)}; use {SPECIAL_NAMES}")
        self.backend = backend
        self.chat_template = chat_template
        self.clean_up_tokenization_spaces = clean_up_tokenization_spaces
        self.special = {name: special.get(name) for name in SPECIAL_NAMES}

    def __len__(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def _id(self, name: str) -> int | None:
        token = self.special[name]
        return None if token is None else self.backend.token_to_id(token)

    @property
    def bos_token_id(self) -> int | None:
        return self._id("bos_token")

    @property
    def eos_token_id(self) -> int | None:
        return self._id("eos_token")

    @property
    def unk_token_id(self) -> int | None:
        return self._id("unk_token")

    @property
    def pad_token_id(self) -> int | None:
        return self._id("pad_token")

    def convert_tokens_to_ids(self, token: str) -> int | None:
        tid = self.backend.token_to_id(token)
        return self.unk_token_id if tid is None else tid

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        text = self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)
        return _clean_up(text) if self.clean_up_tokenization_spaces else text

    @cached_property
    def _template(self):
        import jinja2
        import jinja2.ext
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message: str):
            raise jinja2.exceptions.TemplateError(message)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                           extensions=[jinja2.ext.loopcontrols])
        env.filters["tojson"] = lambda x, indent=None, **_: json.dumps(
            x, ensure_ascii=False, indent=indent)
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
        return env.from_string(self.chat_template)

    def apply_chat_template(self, messages: list[dict], tokenize: bool = False,
                            add_generation_prompt: bool = False, **kwargs) -> str | list[int]:
        """The conversation as the model's chat template writes it (jinja2 errors for
        conversations the template rejects)."""
        if not self.chat_template:
            raise ValueError("this tokenizer has no chat template")
        text = self._template.render(messages=messages,
                                     add_generation_prompt=add_generation_prompt,
                                     **{k: v for k, v in self.special.items() if v}, **kwargs)
        return self.encode(text, add_special_tokens=False) if tokenize else text

    def save(self, directory: str | os.PathLike) -> None:
        d = Path(directory)
        d.mkdir(parents=True, exist_ok=True)
        self.backend.save(str(d / "tokenizer.json"))
        (d / "jkv_tokenizer.json").write_text(json.dumps(
            {"chat_template": self.chat_template,
             "clean_up_tokenization_spaces": self.clean_up_tokenization_spaces,
             **self.special}))

    @classmethod
    def load(cls, directory: str | os.PathLike) -> Tokenizer:
        """A tokenizer `save` wrote."""
        d = Path(directory)
        extra = json.loads((d / "jkv_tokenizer.json").read_text())
        return cls(tokenizers.Tokenizer.from_file(str(d / "tokenizer.json")), **extra)

    @classmethod
    def from_hf_directory(cls, directory: str | os.PathLike) -> Tokenizer:
        """`tokenizer.json` with the special tokens and template of `tokenizer_config.json`
        (or `chat_template.jinja`)."""
        d = Path(directory)
        conf = {}
        if (d / "tokenizer_config.json").exists():
            conf = json.loads((d / "tokenizer_config.json").read_text())
        template = conf.get("chat_template")
        if isinstance(template, list):  # named templates: the default one
            named = {t.get("name"): t.get("template") for t in template}
            template = named.get("default", next(iter(named.values()), None))
        if (d / "chat_template.jinja").exists():
            template = (d / "chat_template.jinja").read_text()

        def token(name: str) -> str | None:
            value = conf.get(name)
            return value.get("content") if isinstance(value, dict) else value

        return cls(tokenizers.Tokenizer.from_file(str(d / "tokenizer.json")),
                   chat_template=template,
                   clean_up_tokenization_spaces=bool(conf.get("clean_up_tokenization_spaces")),
                   **{name: token(name) for name in SPECIAL_NAMES})


def _clean_up(text: str) -> str:
    for old, new in _CLEANUPS:
        text = text.replace(old, new)
    return text


# later text can still change this many trailing characters of the cleaned-up text (a cleanup
# pattern is at most this long plus the character that completes it)
CLEANUP_REACH = max(len(old) for old, _ in _CLEANUPS) - 1


class TextStream:
    """One sequence's text, token by token, with per-token work independent of its length:
    `add(id)` appends the text that id completes (a character split across tokens comes
    with its last byte), so `text` equals decoding all ids at once (special tokens skipped).
    With the cleanup of spaces before punctuation on, the last `hold` characters may still
    change. A `tokenizers` backend decodes with its `DecodeStream`; any other tokenizer
    (transformers' slow ones) through a window of its last tokens."""

    def __init__(self, tokenizer) -> None:
        backend = getattr(tokenizer, "backend", None) or getattr(
            tokenizer, "backend_tokenizer", None)
        self._clean = bool(getattr(tokenizer, "clean_up_tokenization_spaces", False))
        self.hold = CLEANUP_REACH if self._clean else 0
        self.text = ""
        if isinstance(backend, tokenizers.Tokenizer):
            stream = tokenizers.decoders.DecodeStream(skip_special_tokens=True)
            self._step = lambda token: stream.step(backend, token) or ""
        else:
            self._step = self._windowed(tokenizer)

    @staticmethod
    def _windowed(tokenizer):
        """vLLM's incremental detokenization: decode the tokens since the last emitted piece
        with a few before them, keep what they add."""
        ids: list[int] = []
        start = emitted = 0  # window start, tokens whose text is out

        def step(token: int) -> str:
            nonlocal start, emitted
            ids.append(token)
            before = tokenizer.decode(ids[start:emitted], skip_special_tokens=True,
                                      clean_up_tokenization_spaces=False)
            after = tokenizer.decode(ids[start:], skip_special_tokens=True,
                                     clean_up_tokenization_spaces=False)
            if len(after) <= len(before) or after.endswith("\ufffd"):
                return ""  # nothing new yet, or a character still incomplete
            start, emitted = emitted, len(ids)
            return after[len(before):]

        return step

    def add(self, token: int) -> None:
        """Append `token`'s text (cleaned up: the last `hold` characters rewritten)."""
        piece = self._step(token)
        if self._clean and piece:
            keep = max(len(self.text) - self.hold, 0)
            self.text = self.text[:keep] + _clean_up(self.text[keep:] + piece)
        else:
            self.text += piece


def load_tokenizer(path: str | os.PathLike | None):
    """The model's tokenizer, or None for an HF directory that ships none (token-id prompts)."""
    p = default_model_path() if path is None else Path(path)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if p.is_file():
        return _gguf_tokenizer(p)
    ggufs = sorted(p.glob("*.gguf"))
    if not (p / "config.json").exists() and ggufs:
        return _gguf_tokenizer(ggufs[0])
    if (p / "tokenizer.json").exists():
        return Tokenizer.from_hf_directory(p)
    if not any((p / f).exists() for f in ("tokenizer_config.json", "tokenizer.model",
                                          "vocab.json")):
        log.info("%s has no tokenizer; prompts must be token ids", p)
        return None
    from transformers import AutoTokenizer  # a slow tokenizer to convert: transformers' job

    return AutoTokenizer.from_pretrained(str(p))


def _gguf_tokenizer(file: Path):
    """Reading a GGUF vocabulary takes seconds; keep the built tokenizer beside the converted
    params and load that on later starts."""
    entry = cache_root().parent / "tokenizers" / file_key(file, "gguf-tokenizer")
    if (entry / "jkv_tokenizer.json").exists():
        try:
            return Tokenizer.load(entry)
        except Exception as exc:  # a damaged entry: build again
            log.warning("cached tokenizer %s is unreadable (%s); building again", entry, exc)
    try:
        backend, extra = build_tokenizer(read_metadata(file))
    except UnsupportedTokenizer as exc:  # transformers' conversion reads the file with torch
        log.info("%s; converting with transformers", exc)
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(file.parent), gguf_file=file.name)
    tok = Tokenizer(backend, **extra)
    try:  # written aside and renamed: a reader never sees half an entry
        entry.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=entry.parent))
        tok.save(tmp)
        shutil.rmtree(entry, ignore_errors=True)
        tmp.rename(entry)
    except OSError as exc:
        log.warning("could not cache the tokenizer in %s: %s", entry, exc)
    return tok


def eos_token_ids(tokenizer, generation_config: dict | None = None) -> list[int]:
    """Token ids that end a generation: the tokenizer's EOS plus the chat end-of-turn token."""
    ids: set[int] = set()
    if tokenizer is not None:
        if tokenizer.eos_token_id is not None:
            ids.add(int(tokenizer.eos_token_id))
        for tok in ("<|im_end|>", "<|eot_id|>", "<|end_of_text|>", "<|endoftext|>"):
            tid = tokenizer.convert_tokens_to_ids(tok)
            if isinstance(tid, int) and tid != tokenizer.unk_token_id and tid >= 0:
                ids.add(tid)
    if generation_config:
        eos = generation_config.get("eos_token_id")
        ids.update([eos] if isinstance(eos, int) else (eos or []))
    return sorted(ids)
