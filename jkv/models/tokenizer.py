"""Tokenizer and chat template through transformers (a GGUF file carries both)."""

from __future__ import annotations

import logging
import os
from pathlib import Path

from jkv.models.loaders import default_model_path
from jkv.models.params_cache import cache_root, file_key

log = logging.getLogger(__name__)


def load_tokenizer(path: str | os.PathLike | None):
    """The model's tokenizer, or None for an HF directory that ships none (token-id prompts)."""
    from transformers import AutoTokenizer

    p = default_model_path() if path is None else Path(path)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if p.is_file():
        return _gguf_tokenizer(p)
    ggufs = sorted(p.glob("*.gguf"))
    if not (p / "config.json").exists() and ggufs:
        return _gguf_tokenizer(ggufs[0])
    if not any((p / f).exists() for f in ("tokenizer.json", "tokenizer_config.json",
                                          "tokenizer.model", "vocab.json")):
        log.info("%s has no tokenizer; prompts must be token ids", p)
        return None
    return AutoTokenizer.from_pretrained(str(p))


def _gguf_tokenizer(file: Path):
    """Converting a GGUF vocabulary takes seconds; keep the converted tokenizer beside the
    converted params and load that on later starts."""
    from transformers import AutoTokenizer

    entry = cache_root().parent / "tokenizers" / file_key(file, "tokenizer")
    if (entry / "tokenizer_config.json").exists():
        try:
            return AutoTokenizer.from_pretrained(str(entry))
        except Exception as exc:  # a torn entry: convert again
            log.warning("cached tokenizer %s is unreadable (%s); converting again", entry, exc)
    tok = AutoTokenizer.from_pretrained(str(file.parent), gguf_file=file.name)
    try:
        tok.save_pretrained(str(entry))
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
