"""The form an entry is written in: the store's own (`store_kv_format`, the shared-layer form of
`kv_sharing`), and an entry's bytes in a form, made on the writer thread.

The shared-layer form (`krul@<rate>`) may refuse an entry it would keep poorly
(`FormRefused`), fail on it, or not make it smaller (a pool already in few bits): the entry is
then written in the form it came in, and counted.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

import numpy as np

from jkv.config import StoreConfig
from jkv.kv.shared_form import FormRefused, form_name, parse_form, shared_groups
from jkv.store.codec import EntryInfo, encode_aligned
from jkv.store.parts import StoreParts, StoreStats
from jkv.store.verify import mark_arrays

log = logging.getLogger("jkv.store.store")  # (the store's one logger)
HASHES = "block_hashes"  # the entry array holding its chained block hashes


def store_form(config: StoreConfig, kv_format: str, whole_rows: bool) -> str | None:
    """The form the store writes entries in (None: the pool's); ValueError for kv_sharing
    with a token-tier engine's whole rows."""
    if config.kv_sharing != "none":
        if whole_rows:
            raise ValueError(f"StoreConfig.kv_sharing {config.kv_sharing!r} cannot keep a "
                             "token-tier kv_policy's rows (leankv, streaming, h2o, snapkv: "
                             "each head holds its own tokens, so layers share no token axis); "
                             "use kv_sharing with block pages (kv_policy none, kivi)")
        return form_name(config.kv_sharing_rate)
    return None if config.store_kv_format in (None, kv_format) else config.store_kv_format


def encode_entry(p: StoreParts, arrays: Mapping[str, np.ndarray], src: str, fmt: str,
                 num_tokens: int, key: str, hashes: np.ndarray, mark: tuple | None = None
                 ) -> tuple[memoryview, str, tuple[int, int] | None]:
    """An entry's bytes in KV format `fmt`, its pages converted from `src` where that differs
    (a smaller form), with its block hashes and fingerprint; the form written (`src` where
    the shared-layer form refused the entry) and, for that form, its groups of several
    layers and the bytes it saved."""
    shared = None
    if parse_form(fmt) is not None:
        arrays, fmt, shared = _shared(p, arrays, src, fmt)
    elif fmt != src:
        arrays = p.convert(arrays, src, fmt)
    info = EntryInfo(p.model, fmt, p.page_size, num_tokens, key)
    return encode_aligned(info, {**arrays, HASHES: hashes, **mark_arrays(mark)}), fmt, shared


def _shared(p: StoreParts, arrays: Mapping[str, np.ndarray], src: str, fmt: str
            ) -> tuple[Mapping[str, np.ndarray], str, tuple[int, int] | None]:
    """The entry in the shared-layer form `fmt`, or as it came (`src`, counted refused) where
    the form refuses it, would not be smaller, or fails (logged: the save goes on)."""
    try:
        converted = p.convert(arrays, src, fmt)
    except FormRefused:
        converted = None
    except (ValueError, ArithmeticError, np.linalg.LinAlgError) as e:
        log.warning("the shared-layer form failed on an entry (%s); stored as it was", e)
        converted = None
    saved = 0 if converted is None else _nbytes(arrays) - _nbytes(converted)
    if converted is None or saved <= 0:
        p.stats.shared_refused += 1
        return arrays, src, None
    return converted, fmt, (shared_groups(converted), saved)


def count_shared(stats: StoreStats, groups: int, saved: int) -> None:
    """A written shared-layer entry into the store's counters."""
    stats.shared_entries += 1
    stats.shared_groups += groups
    stats.shared_bytes_saved += saved


def _nbytes(arrays: Mapping[str, np.ndarray]) -> int:
    return sum(np.asarray(x).nbytes for x in arrays.values())
