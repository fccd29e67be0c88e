"""Rewriting a stored entry in a smaller KV form in place (`StoreWriter.recompress`, what
AdaptCache's placement asks for): the tier's put replaces the old bytes only once the new ones
are whole, so a failure midway leaves the old entry as it was."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Sequence

from jkv.store.codec import CorruptEntry, EntryMismatch, decode
from jkv.store.entry_forms import HASHES, count_shared, encode_entry
from jkv.store.fronts import FRONT
from jkv.store.host_tier import HostTier
from jkv.store.index import meta_record
from jkv.store.parts import StoreParts
from jkv.store.placement import Move
from jkv.store.tiers import PersistentTier
from jkv.store.verify import pop_mark

log = logging.getLogger("jkv.store.store")  # (the store's one logger)


def rewrite(p: StoreParts, t: HostTier | PersistentTier, key: str, tier: str, kv_format: str,
            apply: Callable[[Sequence[Move]], bool]) -> bool | None:
    """Entry `key` of tier `t` (named `tier`) rewritten in the smaller KV form `kv_format`:
    True done, None nothing to do (already in that form, it would not shrink, or it leaves
    out a front to recompute: `fronts`), False failed (gone, unreadable, the tier's error;
    the old bytes stay). `apply` carries out the moves its new size asks of the placement."""
    data, meta = t.get(key), t.meta(key)
    if data is None or p.convert is None:
        return False
    try:
        info, arrays = decode(data, model=p.model, page_size=p.page_size)
    except (CorruptEntry, EntryMismatch):
        return False  # (a read finds, counts and deletes it)
    if kv_format in (info.kv_format, p.kv_format) or FRONT in arrays:
        return None  # already so (the pool's own form is a load's), or pages left out
    hashes, mark = arrays.pop(HASHES), pop_mark(arrays)
    try:
        out, written, shared = encode_entry(p, arrays, info.kv_format, kv_format,
                                            info.num_tokens, info.key, hashes, mark)
    except ValueError:  # no such form from this one (a row form no smaller than it)
        return None
    if written != kv_format or len(out) >= len(data):
        return None  # the form refused it, or it would not shrink (forms only shrink)
    with p.lock:
        entry = p.index.get(key)
    if entry is not None:  # its record names the form the bytes are in
        meta = meta_record(p.model, entry.session, dataclasses.replace(entry, form=kv_format))
    try:
        t.put(key, out, meta or b"")
    except Exception as e:  # an I/O error: the old bytes stay
        log.warning("could not recompress KV entry %s to %s: %s", key, kv_format, e)
        return False
    if shared is not None:
        count_shared(p.stats, *shared)
    if tier == "host" and p.disk is not None and p.disk.is_spare(key):
        p.disk.delete(key)  # its spare copy holds the old form
    with p.lock:
        if entry is not None:
            entry.form = None if kv_format == p.kv_format else kv_format
        more = p.placement.resize(key, len(out))
    apply(more)
    return True


__all__ = ["rewrite"]
