"""Whether a waiting request's store hit is restored or recomputed (`plan_restore`), as pure
functions over measured rates (`RestoreRates`) and the KV cache manager's `PageCost`, so the
policy can be unit-tested without a model, an engine or a store.

A store hit past the device prefix cache's hit is restored only while loading
it (reading it, converting what is stored in another form, writing it into the pool) is
expected to beat recomputing it (`restore_pays`, from measured rates); every
`PROBE_EVERY`-th declined hit is restored anyway, so that rates measured once (badly, or
before the load changed) are measured again. A restored hit may be split (Krul 6.1, eq. 1):
a share r_c of it recomputed while the rest loads, r_c balancing the two (`split_share`);
full load (0) and full recompute (declining the hit) are its two ends.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from jkv.engine.saved_pages import pyramid
from jkv.kv.page_cost import PageCost

if TYPE_CHECKING:
    from jkv.store.store import Hit

PROBE_EVERY = 16  # of the store hits restore planning declines, one is restored anyway


def restore_pays(tokens: int, read_bytes: int, write_bytes: int, read_bytes_per_s: float,
                 write_bytes_per_s: float, prefill_token_seconds: float,
                 convert_s: float = 0.0) -> bool:
    """Restore planning: is loading `tokens` tokens of KV (reading `read_bytes` from a store
    tier, converting what is stored in another form in `convert_s` seconds, writing
    `write_bytes` into the pool) expected to beat recomputing them? From measured rates;
    True until the read, write and prefill rates have been measured (loading is the usual
    winner)."""
    if not (read_bytes_per_s and write_bytes_per_s and prefill_token_seconds):
        return True
    load = read_bytes / read_bytes_per_s + convert_s + write_bytes / write_bytes_per_s
    return load < tokens * prefill_token_seconds


def split_share(recompute_s: float, write_s: float, read_s: float,
                overlap: float) -> float:
    """Krul's recompute ratio r_c (eq. 1: min |T_C - T_L|) for a hit that recomputes in
    `recompute_s` seconds, or is read in `read_s` (whole, before anything) and written into
    the pool in `write_s`: r_c = T_W / (T_C + T_W) when that beats both ends, else 0.
    `overlap` in [0, 1]: how much of the shorter of the two parts the device hides behind the
    longer (1: fully, separate copy and compute engines; 0: one after the other, when a split
    only interpolates)."""
    if recompute_s <= 0 or write_s <= 0:
        return 0.0
    share = write_s / (recompute_s + write_s)
    both = share * recompute_s  # = (1 - share) * write_s: the two parts' common length
    if read_s + (2.0 - overlap) * both < min(recompute_s, read_s + write_s):
        return share
    return 0.0


@dataclass(frozen=True)
class RestoreRates:
    """The measured rates restore planning weighs; 0.0 means not measured yet."""

    read_bytes_per_s: Mapping[str, float]  # reading an entry, per store tier ("host", "disk")
    write_bytes_per_s: float  # host arrays into the pool (`Engine.load_bytes_per_s`)
    prefill_token_seconds: float  # computing one prompt token
    split_overlap: float = 0.0  # `split_share`'s overlap (`Engine.split_overlap`)
    # converting an entry stored in another form into the pool's, per stored KV format
    convert_bytes_per_s: Mapping[str, float] = field(default_factory=dict)

    def convert_seconds(self, hit: Hit) -> float:
        """Seconds converting `hit`'s entries stored in other forms takes (`Hit.converted`;
        a format not measured yet counts nothing)."""
        return sum(n / rate for fmt, n in hit.converted
                   if (rate := self.convert_bytes_per_s.get(fmt, 0.0)) > 0)


@dataclass(frozen=True)
class RestoreDecision:
    """Restore planning's answer for one waiting request; the scheduler applies it after the
    step is planned (and counts `newly_declined`)."""

    held: int  # tokens it would hold on admission: the device hit's, or the restored blocks'
    hit: Hit | None = None  # the store entry to restore on admission; None: none
    extra_pages: int = 0  # pages restoring takes past those of the device hit
    rebase: int = 0  # blocks `hit` gives once re-rotated (a truncated prompt); 0: in place
    newly_declined: bool = False  # recomputing the hit was planned for the first time
    probe: bool = False  # the request's probe flag from now on: restore anyway, to measure
    recompute: float = 0.0  # share of the restored blocks recomputed meanwhile (a split)

    @property
    def restore(self) -> bool:
        return self.hit is not None


def plan_restore(cached: int, hit: Hit | None, moved: tuple[Hit, int] | None,
                 rates: RestoreRates, *, cost: PageCost,
                 planning: bool = True, declined: bool = False, probe: bool = False,
                 declined_count: int = 0) -> RestoreDecision:
    """Whether a waiting request restores a store hit, as a pure function so it can be
    tested and the scheduler can count its statistics after planning.

    `cached`: tokens the device prefix cache holds of its prompt; `hit`: the store's run of
    its blocks; `moved`: for a truncated prompt, its source's entry and the prompt blocks it
    gives once re-rotated (used when it gives more than `hit`). `planning=False` restores
    every hit that adds blocks. `declined`/`probe`: the request's earlier decisions (a
    decline is counted once; a probe restores without weighing rates); `declined_count`:
    declines counted so far, which picks every `PROBE_EVERY`-th one as a probe."""
    blocks, rebase = (0 if hit is None else hit.blocks), False
    if moved is not None and moved[1] > blocks:
        (hit, blocks), rebase = moved, True
    tokens = blocks * cost.page_size
    newly = False
    if (hit is not None and tokens > cached and planning and not probe and not restore_pays(
            tokens - cached, hit.entry_bytes, hit.blocks_bytes,
            rates.read_bytes_per_s[hit.tier], rates.write_bytes_per_s,
            rates.prefill_token_seconds, rates.convert_seconds(hit))):
        if not declined:
            newly = True
            probe = (declined_count + 1) % PROBE_EVERY == 0
        if not probe:
            hit = None
    if hit is None or tokens <= cached:
        return RestoreDecision(cached, newly_declined=newly, probe=probe)
    share = 0.0
    read_rate = rates.read_bytes_per_s.get(hit.tier, 0.0)
    if planning and not probe and read_rate and rates.write_bytes_per_s:
        share = split_share((tokens - cached) * rates.prefill_token_seconds,
                            hit.blocks_bytes * (tokens - cached) / tokens
                            / rates.write_bytes_per_s,
                            hit.entry_bytes / read_rate + rates.convert_seconds(hit),
                            rates.split_overlap)
    # restoring takes new pages for the stored blocks past the device hit
    return RestoreDecision(tokens, hit, cost.grow(cached, tokens - cached),
                           blocks if rebase else 0, newly, probe, share)


def saved_front(blocks: int, page_size: int, nbytes: int, rates: RestoreRates,
                num_layers: int, chunk: int) -> np.ndarray | None:
    """Krul's lossless saving (6.2): the blocks [0, b_l) of each layer l that a split
    restore of a new entry of `blocks` blocks (`nbytes` in the pool) would recompute, so the
    entry need not keep them; None where no split pays by the measured rates (unmeasured,
    or `split_share` gives 0: at `Engine.split_overlap` 0, as now on every backend). Planned as
    `plan_restore` would plan restoring it whole from the host tier, whose read is the
    fastest: a slower read only recomputes more."""
    read_rate = rates.read_bytes_per_s.get("host", 0.0)
    if not (blocks and read_rate and rates.write_bytes_per_s and rates.prefill_token_seconds):
        return None
    share = split_share(blocks * page_size * rates.prefill_token_seconds,
                        nbytes / rates.write_bytes_per_s, nbytes / read_rate,
                        rates.split_overlap)
    front = pyramid(0, blocks, num_layers, share, chunk) if share else None
    return None if front is None or not front.any() else front


__all__ = ["PROBE_EVERY", "RestoreDecision", "RestoreRates", "plan_restore", "restore_pays",
           "saved_front", "split_share"]
