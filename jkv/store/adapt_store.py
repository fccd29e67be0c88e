"""AdaptCache's policy behind the store's placement interface (`--eviction-policy adaptcache`).

`KVStore` asks its placement where entries go (`put`, `spill`, `adopt`, `access`, `drop`,
`resize`) and carries out the moves; this gives it `jkv.policies.adaptcache.AdaptPlacement`'s
answers: a move may also name the KV format an entry is recompressed to (`Move.form`, the
store's `recompress`). The forms an entry can take are the profile's methods that are KV
formats this jkv can write (`jkv.kv.format.KV_FORMATS`) or shared-layer forms (`krul@<rate>`,
`jkv.kv.shared_form`: made on the writer thread, refused where the conversation's KV would be
kept poorly), sized from the entry's bytes; the store's pool keeps KV in the model dtype (a
profile's rates are against it).
Recompute seconds per token, the tiers' read rates and each form's decode (conversion) rate
come from the running store.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Collection, Hashable, Sequence

from jkv.kv.format import KV_FORMATS
from jkv.kv.shared_form import parse_form
from jkv.policies.adaptcache import AdaptPlacement, Form, Tier
from jkv.policies.adaptcache import Move as AdaptMove
from jkv.policies.stored_forms import is_row_form, row_form_ways
from jkv.store.adapt_profile import Profile
from jkv.store.placement import TIERS, Move

FOREIGN = "foreign"  # `adopt`'s form of an entry not of this KV (another model's): opaque
# read rates assumed until the store has measured its own (bytes per second)
DEFAULT_READ_BPS = {"host": 10e9, "disk": 1e9}


class AdaptStorePlacement:
    """`AdaptPlacement` with `Placement`'s interface, for `KVStore`.

    bf16_ratio: an entry's bf16 bytes over its stored bytes (2 / the dtype's itemsize for a
    pool in the model dtype: float32 pages are twice a profile's bf16 ones). half_life:
    seconds over which an entry's uses halve (`AdaptPlacement`; None: learned). backend:
    the JAX backend the store's conversions run on: the profile's decode rates for it are
    assumed until the store measures its own (`set_decode_rates`). whole_rows: the entries are
    whole rows (a token-tier engine's): their forms are the profile's row forms
    (`jkv.kv.row_forms`, rates against the row as the engine kept it), not KV formats.
    """

    policy = "adaptcache"

    def __init__(self, profile: Profile, alpha: float, quality_floor: float, host_bytes: int,
                 disk_bytes: int, bf16_ratio: float = 1.0, half_life: float | None = None,
                 backend: str = "cpu", whole_rows: bool = False) -> None:
        self.capacity = {"host": host_bytes, "disk": disk_bytes}
        if whole_rows:
            self.methods = tuple(m for m in profile.methods if is_row_form(m))
            if not self.methods:
                raise ValueError(f"the profile names no row form (<way>@<keep>, way one of "
                                 f"{sorted(row_form_ways())}) for a token-tier engine's rows "
                                 f"(methods {sorted(profile.methods)})")
        else:
            self.methods = tuple(m for m in profile.methods
                                 if m in KV_FORMATS or parse_form(m) is not None)
            if not self.methods:
                raise ValueError(f"the profile names no KV format jkv can store (methods "
                                 f"{sorted(profile.methods)}; formats {sorted(KV_FORMATS)} "
                                 f"and the shared-layer forms krul@<rate>)")
        self.profile, self.bf16_ratio = profile, bf16_ratio
        self.adapt = AdaptPlacement(
            [Tier(name, cap, DEFAULT_READ_BPS[name]) for name, cap in self.capacity.items()],
            alpha=alpha, quality_floor=quality_floor, half_life=half_life,
            decode_bps={m: bps for m, bps in profile.decode_bps.get(backend, {}).items()
                        if m in self.methods})
        self.recompute_token_s = 0.0  # a recomputed token's seconds (the scheduler's measure)
        self._unpriced: dict[Hashable, int] = {}  # adopted before that: key -> its tokens

    # ------------------------------------------------------------------ queries

    def where(self, key: Hashable) -> str | None:
        got = self.adapt.where(key)
        return None if got is None else got[0]

    def size(self, key: Hashable) -> int:
        got = self.adapt.where(key)
        return 0 if got is None else got[1].size

    def bytes_used(self, tier: str) -> int:
        return self.adapt.bytes_used(tier)

    def sessions(self, tier: str) -> list[Hashable]:
        return self.adapt.keys(tier)

    def by_recency(self, tier: str) -> list[Hashable]:
        """The tier's entries, most used first (by decayed use, AdaptCache's Freq)."""
        return self.adapt.keys(tier)

    # ------------------------------------------------------------------ updates

    lossy = True  # entries may be recompressed into smaller forms
    weighs_recompute = True  # a miss costs its recompute

    def observe(self, read_bps: dict[str, float], decode_bps: dict[str, float]) -> None:
        """The store's measured read and conversion rates."""
        self.set_read_rates(read_bps)
        self.set_decode_rates(decode_bps)

    def stats(self) -> dict:
        return {"adapt_half_life_s": self.adapt.half_life}

    def set_capacity(self, tier: str, capacity: int,
                     queue: Sequence[Hashable] = ()) -> list[Move]:
        """`Placement.set_capacity`."""
        self.capacity[tier] = capacity
        self.adapt.hint(set(queue))
        return _in_order(self.adapt.set_capacity(tier, capacity, time.monotonic()))

    def set_read_rates(self, rates: dict[str, float]) -> None:
        """The store's measured read rates ("host"/"disk", bytes per second; 0: unknown)."""
        for tier in TIERS:
            self.adapt.set_read_rate(tier, rates.get(tier, 0.0))

    def set_recompute_rate(self, token_s: float) -> None:
        """Seconds a recomputed token costs (the scheduler's measure): what a miss costs;
        entries adopted before it was known are priced now."""
        self.recompute_token_s = token_s
        if token_s > 0:
            for key, tokens in self._unpriced.items():
                self.adapt.set_recompute(key, tokens * token_s)
            self._unpriced.clear()

    def set_decode_rates(self, rates: dict[str, float]) -> None:
        """The store's measured conversion rates (stored KV format -> bytes per second; a
        format is a method here)."""
        for method, bps in rates.items():
            self.adapt.set_decode_rate(method, bps)

    def access(self, key: Hashable, own: bool = True) -> str | None:
        got = self.adapt.access(key, time.monotonic(), learn=own)
        return None if got is None else got[0]

    def put(self, key: Hashable, size: int, queue: Sequence[Hashable] = (),
            keep: Collection[Hashable] = (), tokens: int = 0,
            form: str | None = None) -> list[Move]:
        """Save `key`'s entry (`size` bytes, `tokens` tokens, in the pool's format, or in
        `form`, one of `methods`: a row restored from that form and saved back); returns
        the moves of the others, then this one's (its tier and the form it is written in;
        dst None: not stored)."""
        forms, held = self._forms(size, form)
        self.adapt.hint(set(queue))
        moves = self.adapt.put(key, forms, tokens * self.recompute_token_s, time.monotonic(),
                               keep=keep, held=held)
        out = _in_order([m for m in moves if m.key != key])
        final = self.adapt.where(key)
        if final is None:
            return [*out, Move(key, None, None)]
        tier, form = final
        return [*out, Move(key, None, tier, None if form.method == "full" else form.method)]

    def prefetch(self, queue: Sequence[Hashable]) -> list[Move]:
        self.adapt.hint(set(queue))
        return []  # (what moves up is not AdaptCache's: its entries only shrink and sink)

    def spill(self, key: Hashable, queue: Sequence[Hashable] = ()) -> list[Move]:
        m = self.adapt.spill(key)
        return [] if m is None else [_move(m)]

    def adopt(self, key: Hashable, size: int, tier: str, tokens: int = 0,
              form: str | None = None) -> bool:
        """Count an entry a reopened store holds: `size` bytes of `tokens` tokens in KV
        format `form` (None: the pool's); it keeps the profile's smaller forms to go to.
        An entry of a form the profile does not rate (another model's, say) is held as it
        is, at full quality, and can only move down or out."""
        forms, held = self._forms(size, form)
        if not self.adapt.adopt(key, forms, tier, tokens * self.recompute_token_s,
                                time.monotonic(), held=held):
            return False
        if tokens and not self.recompute_token_s:
            self._unpriced[key] = tokens
        return True

    def _forms(self, size: int, form: str | None) -> tuple[list[Form], int]:
        """The forms of an entry of `size` bytes held in `form` (None: the pool's), and
        which of them it holds. A compressed one's full form stays first (its bf16 bytes
        from the held form's rate) so a form of another method counts both qualities; one
        the profile does not rate (`FOREIGN`: another model's) is held as it is, at full
        quality: it can only move down or out."""
        if form is None:
            return self.profile.forms(round(size * self.bf16_ratio), methods=self.methods,
                                      full_bytes=size), 0
        if form not in self.methods:
            return [Form("stored", 1.0, size, 1.0)], 0
        bf16 = round(size / self.profile.methods[form][0].rate)
        forms = self.profile.forms(bf16, methods=self.methods)
        mine = next(f for f in forms if f.method == form)
        return [forms[0], dataclasses.replace(mine, size=size),
                *(f for f in forms[1:] if f.method != form and f.size < size
                  and mine.reachable(f))], 1

    def resize(self, key: Hashable, size: int) -> list[Move]:
        return _in_order(self.adapt.resize(key, size, time.monotonic()))

    def drop(self, key: Hashable) -> None:
        self.adapt.drop(key)
        self._unpriced.pop(key, None)


def _move(m) -> Move:
    """An AdaptPlacement move as the store's: a change of form names the KV format."""
    form = None
    if m.dst is not None and m.new is not None and m.old is not None \
            and m.new.method != m.old.method:
        form = m.new.method
    return Move(m.key, m.src, m.dst, form)


def _in_order(moves: Sequence[AdaptMove]) -> list[Move]:
    """AdaptPlacement's moves as the store can carry them out one by one: each entry's
    moves as one (where it was, where and in what form it ends), evictions first, then
    recompressions in place, then moves down a tier. The greedy fits the fastest tier
    first, so its list moves an entry down before the evictions that make room for it
    below; each step here only frees room or takes what the final placement has."""
    first: dict = {}
    last: dict = {}
    for m in moves:
        first.setdefault(m.key, m)
        last[m.key] = m
    out = []
    for key, a in first.items():
        b = last[key]
        net = _move(AdaptMove(key, a.src, b.dst, a.old, b.new))
        if net.dst == net.src and net.form is None:
            continue  # back where and as it was
        out.append(net)
    return sorted(out, key=lambda m: 0 if m.dst is None else 1 if m.src == m.dst else 2)


__all__ = ["AdaptStorePlacement"]
