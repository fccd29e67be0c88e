"""AdaptCache's policy: each stored entry's compressed form and tier, by marginal utility.

Feng et al., "AdaptCache", section 2. An entry can be held in any of several forms (a
compression method at a rate: its bytes and the answer quality it keeps, from offline
profiles) in any tier (each with a byte capacity and a read rate), or not at all (recomputed
when used: full quality, a prefill's time). Its utility where it is held is

    Utility(i) = Freq(i) * (alpha * Quality(i, M, R) - size(i, M, R) / Bandwidth(tier)
                            - size(i, M, R) / Decode(M))

(seconds: alpha weighs quality against load time; Decode(M): the rate a form of method M is
converted back at, from the profile and then as the store measures it; unknown: free, as the
full form is). Held nowhere, the delay is recomputing
it, and so it is where loading would take longer (the engine recomputes then, at full
quality). When a tier is over its capacity, the choice that loses the least utility per byte it
frees there goes next (the greedy multiple-choice knapsack step of the paper): a smaller form
in the same tier, the same form one tier down, or out of the store; repeated until the tier
fits, the fastest tier first (what moves down is then the next tier's to fit). Forms only
shrink: a compressed entry is never expanded back. Profiles measure each method from the full
KV: a smaller form of the held form's family keeps the quality measured for it, another
method applied on top of a compressed form is counted at the product of both qualities (an
estimate that errs low). Forms below `quality_floor` are never chosen (the entry goes out instead).
Forms reported (`where`, `access`, moves) carry that effective quality.

Freq is an entry's uses (its saves and its hits) with exponential decay (half-life
`half_life` in the caller's clock: a conversation that has gone quiet stops counting), plus
one while the scheduler's queue holds a request that will read it (the queue hint). A
`half_life` of None is learned: twice the median of the last `GAPS` reuse gaps (from an
entry's last save or hit to its next hit: the users' think time and the queue's wait), so
an entry quiet for a few of its users' usual pauses stops counting; `DEFAULT_HALF_LIFE`
until a gap is seen.

Pure bookkeeping, like `Placement`: it returns the moves, the store moves (and recompresses)
the bytes, and the simulator (`benchmarks/store_sim.py`) drives the same object.
"""

from __future__ import annotations

import dataclasses
import heapq
import math
import statistics
from collections import deque
from collections.abc import Collection, Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple

DEFAULT_HALF_LIFE = 600.0  # seconds, until a learned half-life has a reuse gap to go on
GAPS = 64  # reuse gaps a learned half-life is the median of (x2)
MIN_HALF_LIFE = 1.0  # seconds: hits right after their save must not erase every use


@dataclass(frozen=True)
class Form:
    """One way to hold an entry: `method` at `rate` (bytes kept over the full form's),
    `size` bytes, and the quality of answers read from it (1: as from the full KV). Forms
    of one `family` (default: the method) are made from any larger one of the family at the
    quality measured from the full KV (quantized formats requantized to fewer bits; a
    window of recent tokens cut shorter)."""

    method: str
    rate: float
    size: int
    quality: float
    family: str = ""
    # the share of the entry's tokens the form keeps (a whole row's form: tokens dropped,
    # `stored_forms`), None for all of them: such a form is made only from one keeping
    # a larger share (dropping more of what another way kept, never restoring any)
    share: float | None = None

    @property
    def kin(self) -> str:
        return self.family or self.method

    def reachable(self, smaller: Form) -> bool:
        """Whether `smaller` can be made from this form."""
        return smaller.share is None or smaller.share < (
            1.0 if self.share is None else self.share)


@dataclass(frozen=True)
class Tier:
    """A store tier: its byte capacity and the rate its entries are read at (bytes per
    second; converting a compressed form back is its method's decode rate on top)."""

    name: str
    capacity: int
    read_bps: float


class Move(NamedTuple):
    """`key`'s entry goes from (`src`, form `old`) to (`dst`, form `new`); a `dst` of None
    drops it; a `src` of None is a new entry."""

    key: Hashable
    src: str | None
    dst: str | None
    old: Form | None
    new: Form | None


@dataclass
class _Entry:
    forms: tuple[Form, ...]  # the choices, largest first; forms[form] is the one held
    form: int
    tier: int
    carried: float  # the quality of methods applied before the held one (1: none)
    recompute_s: float
    uses: float  # decayed count of saves and hits at `stamp`
    stamp: float
    cheapest: tuple[float, int, int] | None | bool = False  # (False: not worked out yet)


class AdaptPlacement:
    """Which form and tier each stored entry has, and the policy that changes them."""

    def __init__(self, tiers: Sequence[Tier], alpha: float, quality_floor: float = 0.0,
                 half_life: float | None = DEFAULT_HALF_LIFE,
                 decode_bps: Mapping[str, float] | None = None) -> None:
        if not tiers:
            raise ValueError("tiers must name at least one tier")
        names = [t.name for t in tiers]
        if len(set(names)) != len(names):
            raise ValueError(f"tiers must have distinct names, got {names}")
        for t in tiers:
            if t.capacity < 0:
                raise ValueError(f"tier {t.name!r}: capacity must be >= 0, got {t.capacity}")
            if not t.read_bps > 0:
                raise ValueError(f"tier {t.name!r}: read_bps must be > 0, got {t.read_bps}")
        if alpha < 0:
            raise ValueError(f"alpha must be >= 0, got {alpha}")
        if not 0.0 <= quality_floor <= 1.0:
            raise ValueError(f"quality_floor must be in [0, 1], got {quality_floor}")
        if half_life is not None and not half_life > 0:
            raise ValueError(f"half_life must be > 0 (or None: learned), got {half_life}")
        for method, bps in (decode_bps or {}).items():
            if not bps > 0:
                raise ValueError(f"decode_bps[{method!r}] must be > 0, got {bps}")
        self.decode_bps = dict(decode_bps or {})  # a method's forms converted back, bytes/s
        self.tiers = tuple(tiers)
        self.alpha = alpha
        self.quality_floor = quality_floor
        self.learned = half_life is None
        self._gaps: deque[float] = deque(maxlen=GAPS)
        self._set_half_life(DEFAULT_HALF_LIFE if half_life is None else half_life)
        self._index = {t.name: i for i, t in enumerate(self.tiers)}
        self._entries: dict[Hashable, _Entry] = {}
        self._used = [0] * len(self.tiers)
        self._queued: set[Hashable] = set()

    # ------------------------------------------------------------------ queries

    def where(self, key: Hashable) -> tuple[str, Form] | None:
        """The tier and form holding `key`, or None."""
        e = self._entries.get(key)
        return None if e is None else (self.tiers[e.tier].name, _form(e, e.form))

    def bytes_used(self, tier: str) -> int:
        return self._used[self._index[tier]]

    def freq(self, key: Hashable, now: float) -> float:
        """The expected uses of `key`'s entry: its decayed saves and hits, one more while a
        queued request will read it."""
        e = self._entries[key]
        return self._decayed(e, now) + (key in self._queued)

    def _decayed(self, e: _Entry, now: float) -> float:
        return e.uses * math.exp(-self._decay * max(now - e.stamp, 0.0))

    def _set_half_life(self, seconds: float) -> None:
        self.half_life = seconds
        self._decay = math.log(2) / seconds

    # ------------------------------------------------------------------ updates

    def hint(self, queue: Collection[Hashable]) -> None:
        """The scheduler's queue: keys its waiting requests will read."""
        self._queued = set(queue)

    def access(self, key: Hashable, now: float, learn: bool = True) -> tuple[str, Form] | None:
        """A request reads `key` now: its tier and form (None: a miss), counted as a hit.
        `learn`: its gap since the last use counts towards a learned half-life (not for an
        entry read only as what another continues: a shared prefix's gaps are the arrivals')."""
        e = self._entries.get(key)
        if e is None:
            return None
        if self.learned and learn and e.uses > 0:  # (an adopted entry's stamp is no use's)
            self._gaps.append(max(now - e.stamp, 0.0))
            self._set_half_life(max(2.0 * statistics.median(self._gaps), MIN_HALF_LIFE))
        e.uses, e.stamp = self._decayed(e, now) + 1.0, now
        return self.tiers[e.tier].name, _form(e, e.form)

    def put(self, key: Hashable, forms: Sequence[Form], recompute_s: float, now: float,
            keep: Collection[Hashable] = (), held: int = 0) -> list[Move]:
        """Save `key`'s entry (replacing an older one; its uses carry over) in `forms[held]`
        (what the engine holds: the ones after it are what it may be compressed to; the full
        form first when the engine holds a compressed one, a row restored from a smaller
        form) in the fastest tier, then fit every tier. `recompute_s`: the seconds a miss
        costs. Entries in `keep` move only when the others cannot make the room. Returns the
        moves in order, this entry's first."""
        if not forms:
            raise ValueError("forms must hold at least the entry's own form")
        if recompute_s < 0:
            raise ValueError(f"recompute_s must be >= 0, got {recompute_s}")
        for f in forms:
            if f.size < 0 or not 0.0 <= f.quality <= 1.0:
                raise ValueError(f"form {f}: size must be >= 0 and quality in [0, 1]")
        first = forms[held]
        smaller = sorted((f for f in forms[held + 1:] if f.size < first.size),
                         key=lambda f: -f.size)
        moves: list[Move] = []
        uses, src, old = 1.0, None, None
        if key in self._entries:
            prev = self._entries.pop(key)
            self._used[prev.tier] -= prev.forms[prev.form].size
            uses += self._decayed(prev, now)
            src, old = self.tiers[prev.tier].name, _form(prev, prev.form)
        entry = _Entry((*forms[:held], first, *smaller), held, 0, 1.0, recompute_s, uses, now)
        self._entries[key] = entry
        self._used[0] += first.size
        moves.append(Move(key, src, self.tiers[0].name, old, _form(entry, held)))
        self._fit(now, set(keep), moves)
        return moves

    def adopt(self, key: Hashable, forms: Sequence[Form], tier: str, recompute_s: float,
              now: float, held: int = 0) -> bool:
        """Count an entry already held in `tier` in `forms[held]` (a store reopened: the
        ones after it are what it may still shrink to; the full form first when `held` is
        a compressed one); False, and nothing counted, if it does not fit."""
        form = forms[held]
        t = self._index[tier]
        if key in self._entries or self._used[t] + form.size > self.tiers[t].capacity:
            return False
        smaller = sorted((f for f in forms[held + 1:] if f.size < form.size),
                         key=lambda f: -f.size)
        self._entries[key] = _Entry((*forms[:held + 1], *smaller), held, t, 1.0, recompute_s,
                                    0.0, now)
        self._used[t] += form.size
        return True

    def set_recompute(self, key: Hashable, recompute_s: float) -> None:
        """What a miss of `key` costs, in seconds (known only once the engine has measured
        its prefill: an adopted entry's)."""
        e = self._entries.get(key)
        if e is not None and recompute_s >= 0:
            e.recompute_s, e.cheapest = recompute_s, False

    def spill(self, key: Hashable) -> Move | None:
        """Move `key` from the fastest tier to the next as it is (a store closing keeps what
        it can), where that has room; None otherwise."""
        e = self._entries.get(key)
        if e is None or e.tier + 1 >= len(self.tiers):
            return None
        size = e.forms[e.form].size
        if self._used[e.tier + 1] + size > self.tiers[e.tier + 1].capacity:
            return None
        return self._apply(key, e, e.form, e.tier + 1)

    def resize(self, key: Hashable, size: int, now: float) -> list[Move]:
        """`key`'s held form takes `size` bytes as stored (known once encoded, the profile's
        rate an estimate): the moves that fit every tier again, `key` kept if others can
        make the room."""
        e = self._entries.get(key)
        if e is None:
            return []
        f = e.forms[e.form]
        self._used[e.tier] += size - f.size
        e.forms = (*e.forms[:e.form], dataclasses.replace(f, size=size), *e.forms[e.form + 1:])
        e.cheapest = False
        moves: list[Move] = []
        self._fit(now, {key}, moves)
        return moves

    def set_capacity(self, tier: str, capacity: int, now: float) -> list[Move]:
        """`tier` now holds at most `capacity` bytes: the moves that fit every tier again."""
        t = self._index[tier]
        self.tiers = (*self.tiers[:t], dataclasses.replace(self.tiers[t], capacity=capacity),
                      *self.tiers[t + 1:])
        for e in self._entries.values():  # (which tiers an entry fits is part of its ways)
            e.cheapest = False
        moves: list[Move] = []
        self._fit(now, set(), moves)
        return moves

    def set_read_rate(self, tier: str, read_bps: float) -> None:
        """`tier`'s entries are read at `read_bps` (measured by the store as it reads)."""
        if read_bps > 0:
            t = self._index[tier]
            self.tiers = (*self.tiers[:t], dataclasses.replace(self.tiers[t], read_bps=read_bps),
                          *self.tiers[t + 1:])
            for e in self._entries.values():
                e.cheapest = False

    def set_decode_rate(self, method: str, bps: float) -> None:
        """`method`'s forms are converted back at `bps` stored bytes per second (measured
        by the store as it reads them)."""
        if bps > 0 and self.decode_bps.get(method) != bps:
            self.decode_bps[method] = bps
            for e in self._entries.values():
                e.cheapest = False

    def keys(self, tier: str) -> list[Hashable]:
        """The entries `tier` holds, most used first."""
        t = self._index[tier]
        return sorted((k for k, e in self._entries.items() if e.tier == t),
                      key=lambda k: -self._entries[k].uses)

    def drop(self, key: Hashable) -> None:
        """Forget `key` (its entry is gone: corrupt, or deleted by the store)."""
        e = self._entries.pop(key, None)
        if e is not None:
            self._used[e.tier] -= e.forms[e.form].size

    # ------------------------------------------------------------------ the greedy step

    def _per_use(self, e: _Entry, form: int, tier: int) -> float:
        """Utility over Freq: alpha x quality less the load (or recompute) seconds. A hit
        slower to load than to recompute is recomputed (the engine's restore planner
        does): held there, it is worth what it is out of the store."""
        recompute = self.alpha - e.recompute_s
        if tier < 0:
            return recompute
        f = _form(e, form)
        load = f.size / self.tiers[tier].read_bps
        if decode := self.decode_bps.get(f.method):
            load += f.size / decode
        return max(self.alpha * f.quality - load, recompute)

    def _cheapest(self, e: _Entry) -> tuple[float, int, int] | None:
        """(utility drop per byte freed in its tier over Freq, form, tier) of the cheapest
        way `e` can free bytes where it is: a smaller form, one tier down, or out of the
        store. Freq scales every way alike, so the choice is kept until `e` moves."""
        if e.cheapest is not False:
            return e.cheapest
        here = self._per_use(e, e.form, e.tier)
        size = e.forms[e.form].size
        out = []
        for j in range(e.form + 1, len(e.forms)):
            f = _form(e, j)
            if (f.size < size and f.quality >= self.quality_floor
                    and e.forms[e.form].reachable(f)):
                out.append(((here - self._per_use(e, j, e.tier)) / (size - f.size), j, e.tier))
        if size > 0:
            down = e.tier + 1
            if down < len(self.tiers) and size <= self.tiers[down].capacity:
                out.append(((here - self._per_use(e, e.form, down)) / size, e.form, down))
            out.append(((here - self._per_use(e, e.form, -1)) / size, e.form, -1))
        e.cheapest = min(out, default=None)
        return e.cheapest

    def _fit(self, now: float, keep: set, moves: list[Move]) -> None:
        for t, tier in enumerate(self.tiers):
            for protect in (keep, set()):  # kept entries move only when nothing else can
                heap = []
                for key, e in self._entries.items():
                    if e.tier == t and key not in protect:
                        best = self._cheapest(e)
                        if best is not None:
                            heap.append((best[0] * self.freq(key, now), *best[1:], id(key),
                                         key))
                heapq.heapify(heap)
                while self._used[t] > tier.capacity and heap:
                    _, form, dst, _, key = heapq.heappop(heap)
                    e = self._entries[key]
                    moves.append(self._apply(key, e, form, dst))
                    if dst == t:  # still here, smaller: its next cheapest way
                        best = self._cheapest(e)
                        if best is not None:
                            heapq.heappush(heap, (best[0] * self.freq(key, now), *best[1:],
                                                  id(key), key))
                if self._used[t] <= tier.capacity:
                    break

    def _apply(self, key: Hashable, e: _Entry, form: int, dst: int) -> Move:
        old = _form(e, e.form)
        src = self.tiers[e.tier].name
        self._used[e.tier] -= old.size
        if dst < 0:
            del self._entries[key]
            return Move(key, src, None, old, None)
        if form != e.form and e.form > 0 and e.forms[form].kin != old.kin:
            e.carried = old.quality  # the held method stays applied under the new one
        e.form, e.tier, e.cheapest = form, dst, False
        new = _form(e, form)  # (as `where` will report it, to the last bit)
        self._used[dst] += new.size
        return Move(key, src, self.tiers[dst].name, old, new)


def _form(e: _Entry, j: int) -> Form:
    """`e.forms[j]` reached from the held form, with the quality it would have."""
    f = e.forms[j]
    held = e.forms[e.form]
    q = e.carried * f.quality
    if j != e.form and e.form > 0 and f.kin != held.kin:
        q *= held.quality
    return f if q == f.quality else dataclasses.replace(f, quality=q)
