"""The scheduler's side of the KV store (`StoreSide`, a part `jkv.sched.scheduler.Scheduler`
composes).

A waiting request's prompt is also looked up in the store; blocks found there past the
device prefix cache's hit count as held (their pages as pages admission takes) and are
restored into the pool when it is admitted, unless restore planning expects recomputing them
to be faster (`plan_restore`); the entry is read ahead on the store's reader while the
request waits. A finishing or preempted request's full blocks, and a decoding one's every
`save_interval_blocks`, are handed to the store's write-behind. Under token tiers a kept or
stored row is whole: a stored one is restored only into an empty slot, never past a device
hit.

A restore is verified where its entry keeps a fingerprint of the token just past its blocks
(`restore_checks`): the request's first step computes that token over the restored KV, and
a state further from the stored one than the KV format's tolerance (`jkv.store.verify`)
means the KV is not what the model computed: the slot is closed keeping nothing, the request
queued again to recompute, the entry's chain quarantined and the failure counted.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Sequence

import numpy as np

from jkv.config import SchedulerConfig
from jkv.engine.engine import Engine, Sampled, SavedPages
from jkv.engine.saved_pages import split_chunk
from jkv.policies.stored_forms import is_row_form
from jkv.sched.plan_records import Candidate
from jkv.sched.request import Request, SchedulerStats, Tracked
from jkv.sched.restore_checks import for_save, plan_check, record
from jkv.sched.restore_planning import (
    RestoreDecision,
    RestoreRates,
    plan_restore,
    saved_front,
)
from jkv.sched.step_costs import StepCosts
from jkv.store.store import Hit, KVStore
from jkv.store.verify import distance, tolerance

log = logging.getLogger("jkv.sched.scheduler")


class StoreSide:
    """Lookups, restores and saves of the scheduler's requests, over the scheduler's own
    records (`state`, `stats`, shared with it) and `candidate`, which makes a request's
    `Candidate` (request, tokens held, pages pinned)."""

    def __init__(self, engine: Engine, config: SchedulerConfig, store: KVStore | None,
                 stats: SchedulerStats, costs: StepCosts, state: dict[Request, Tracked],
                 candidate: Callable[[Request, int, int], Candidate],
                 layer_offload: bool) -> None:
        self.engine, self.config, self.store, self.stats = engine, config, store, stats
        self.costs, self._state, self._candidate = costs, state, candidate
        self.layer_offload = layer_offload

    def waiting(self, r: Request, rates: RestoreRates, declined: int, now: float
                 ) -> tuple[Candidate, RestoreDecision, int, bool]:
        """`r` as the policy sees it, with the restore planned for it (not yet applied), the
        tokens found on the device, and whether it may be admitted now: its prompt is looked
        up on the device (the prefix cache's blocks, or kept whole rows), then in the
        store, whose entry is read ahead (`KVStore.read_ahead`) while it waits."""
        eng, st = self.engine, self._state[r]
        if r.sampling.prompt_logprobs is not None:  # every prompt token is computed
            return self._candidate(r, 0, 0), RestoreDecision(0), 0, True
        if st.hashes is None:
            st.hashes = eng.cache.prompt_hashes(r.tokens)
        cached, pinned = eng.cache.lookup(st.hashes)
        decision = RestoreDecision(cached)
        # a whole row restores whole into an empty slot, never moved (no rebase)
        whole = eng.connector.stored_whole
        if self.store is not None and not st.abandoned and not (whole and cached):
            decision = plan_restore(
                cached, self.store.lookup(st.hashes, whole=whole),
                None if whole else self._truncated_hit(r), rates, cost=eng.cache.cost,
                planning=self.config.restore_planning, declined=st.declined,
                probe=st.probe, declined_count=declined)
        ready = (decision.hit is None or not self.config.store_read_ahead
                 or self.store.read_ahead(decision.hit))
        if ready:
            st.read_since = None
        else:  # its read is under way: it waits, unless recomputing would be done by now
            st.read_since = now if st.read_since is None else st.read_since
            recompute_s = (decision.held - cached) * self.costs.chunked_token_s(
                self.engine.prefill_chunk)
            if (self.config.restore_planning and recompute_s
                    and now - st.read_since > recompute_s):
                st.abandoned, ready = True, True
                self.stats.restores_abandoned += 1
                decision = RestoreDecision(cached)
        c = self._candidate(r, decision.held, pinned + decision.extra_pages)
        if self.layer_offload and self.engine.layers.layer_major:  # (fed so if admitted
            c = dataclasses.replace(c, layer_major=0)  # offloaded)
        return (c, decision,
                cached, ready)

    def _truncated_hit(self, r: Request) -> tuple[Hit, int] | None:
        """For a truncated prompt: the store's entry of its untruncated source and how many
        of the prompt's blocks it gives once moved (None when it gives none)."""
        t = r.truncation
        if t is None:
            return None
        eng = self.engine
        tokens, k, d = r.tokens, t.keep, t.drop
        if (k > len(tokens) or list(t.source[:k]) != tokens[:k]
                or list(t.source[k + d: len(tokens) + d]) != tokens[k: len(t.source) - d]):
            return None  # not a cut of its source: nothing to move
        st = self._state[r]
        if st.source_hashes is None:
            st.source_hashes = eng.cache.prompt_hashes(list(t.source))
        hit = self.store.lookup(st.source_hashes)
        if hit is None:
            return None
        ps = eng.page_size
        blocks = min((hit.blocks * ps - t.drop) // ps, (len(r.tokens) - 1) // ps)
        return (hit, blocks) if blocks * ps > t.keep else None

    def open(self, r: Request) -> int:
        """Give `r` a slot; its held prefix comes from the device prefix cache and, for a
        store hit, from the store (a hit that cannot be loaded is recomputed). At its first
        admission, what OpenAI's usage reports as cached_tokens is set, with its tiers."""
        eng, st = self.engine, self._state[r]
        hit, restore, mark = st.hit, None, None
        if hit is not None:
            try:
                if self.config.store_read_ahead:
                    loaded = self.store.take(hit)  # read ahead while it waited
                else:  # read here, the step waiting
                    loaded = self.store.load(hit)
                    loaded = None if loaded is None else (loaded, hit.tier)
                if loaded is not None:
                    (arrays, hashes, exact, mark, front), tier = loaded
                    hit = hit._replace(tier=tier)  # counted where it was read from
                    # a row stored in a smaller form goes on in it (as looked up)
                    form = next((f for f, _ in hit.converted if is_row_form(f)), None)
                    restore = SavedPages(hit.blocks, arrays, hashes, exact_blocks=exact,
                                         form=form if exact == 0 else None, front=front)
                    if st.rebase:
                        t = r.truncation
                        restore = eng.rebase(restore, r.tokens, t.keep, t.drop)
            except Exception:  # a failed load or move is a miss, never a failed step
                log.exception("could not restore request %s from the store", r.request_id)
                restore = None
            if restore is None:
                self.stats.store_misses += 1
        before, device = eng.stats.restored_tokens, eng.stats.prefix_hit_tokens
        try:
            # no more of the device cache than planned: a row kept by this step's own
            # preemption was not in the plan's page count
            st.slot, cached = eng.open(r.tokens, restore=restore,
                                       use_prefix_cache=r.sampling.prompt_logprobs is None,
                                       max_cached=st.cached, recompute=st.recompute,
                                       resident=st.resident, prompt_tokens=len(r.prompt))
        except ValueError:  # the loaded blocks do not fit this prompt: never serve them
            log.exception("restoring request %s from the store failed; recomputing",
                          r.request_id)
            self.stats.store_misses += 1
            st.slot, cached = eng.open(r.tokens, max_cached=st.cached, resident=st.resident,
                                       prompt_tokens=len(r.prompt))
        if st.resident is not None:
            self.stats.admitted_offloaded += 1
        if hit is not None:
            restored = eng.stats.restored_tokens - before
            self.stats.restored_tokens[hit.tier] += restored
            if st.rebase:
                self.stats.rebased_tokens += restored
            if restored:
                tol = tolerance(eng.cache.token_policy, eng.kv_format,
                                [f for f, _ in hit.converted], mark is not None and mark.pooled)
                st.check = plan_check(None if st.rebase else mark, r.tokens, cached, tol,
                                      hit.key, hit.tier, restored)
                self.stats.restores_unverified += st.check is None
        if r.cached_tokens is None:
            _set_cached(r, cached, eng.stats.prefix_hit_tokens - device,
                        None if hit is None else hit.tier, eng.stats.restored_tokens - before)
        st.admitted()
        return cached

    def save(self, r: Request, slot: int, marks: dict | None = None) -> None:
        """Hand `r`'s full blocks to the store's write-behind, only those after the run the
        store already has or has queued (never fails the request). A lossy store (one that
        keeps smaller forms) is handed the approximate blocks too, marked: a conversation
        restored from a small form goes on in it instead of losing its later turns. The
        entry keeps the fingerprint of the token just past its blocks, where `marks` (`r`'s
        latest, `Tracked.marks`) has it."""
        try:
            approximate = self.store.keeps_approximate
            hashes = self.engine.saved_hashes(slot, approximate)
            start = self.store.tail_start(hashes)
            if not self.engine.connector.stored_whole and start == len(hashes):
                return  # nothing new (a whole row is saved whole)
            saved = self.engine.gather(slot, start, approximate)
            if saved.rows is not None and saved.exact_blocks is not None and not approximate:
                return  # a row restored from a smaller form: a lossless store never has it
            self.store.save(saved.num_blocks, saved.arrays, saved.hashes, r.session_id,
                            rows=saved.rows, start=saved.start,
                            exact_blocks=saved.exact_blocks, form=saved.form,
                            mark=for_save(marks or {}, saved.num_blocks,
                                          self.engine.page_size, r.tokens),
                            front=self._front(saved, approximate))
        except Exception:
            log.exception("could not queue request %s's KV for the store", r.request_id)

    def _front(self, saved: SavedPages, approximate: bool) -> np.ndarray | None:
        """What a new root entry need not keep: the blocks a split restore of it recomputes,
        where the measured rates say a split pays (`saved_front`); None for a tail, a whole
        row, or a lossy store (which converts what it keeps)."""
        eng = self.engine
        if (saved.start or saved.rows is not None or approximate
                or not eng.connector.splits_restores):
            return None
        rates = RestoreRates(self.store.read_bytes_per_s, eng.connector.load_bytes_per_s,
                             self.costs.chunked_token_s(eng.prefill_chunk), eng.split_overlap)
        nbytes = sum(int(getattr(x, "nbytes", 0)) for x in saved.arrays.values())
        return saved_front(saved.num_blocks, eng.page_size, nbytes, rates,
                           eng.cfg.num_layers, split_chunk(eng.prefill_chunk, eng.page_size))

    def save_decoding(self, decoded: Sequence[Request]) -> None:
        """Requests still decoding whose blocks have grown by the store's save interval
        since their last save queue the new ones (CachedAttention: saving as KV is made,
        not all at the finish)."""
        every = self.store.config.save_interval_blocks
        if not every or self.engine.connector.stored_whole:
            return
        page = self.engine.cache.page_size
        for r in decoded:
            st = self._state.get(r)
            full = 0 if st is None else st.num_computed // page
            if st is not None and not r.finished and full - st.saved >= every:
                # tried again only after another interval, whatever this save covered (a
                # restored history's moved blocks are saved to a lossy store only; a failure
                # is logged)
                self.save(r, st.slot, st.marks)
                st.saved = full

    def after_step(self, prefill: list, out_p: list, decode: list, out_d: list,
                   running: list[Request], waiting: list[Request]) -> tuple[list, ...]:
        """After a step: each request's fingerprints kept (`prefill` and `decode`: the
        step's (request, row) pairs; `out_p`, `out_d`: what each sampled, None for a
        layer-major prompt part way), and a restored request's first one checked against
        its entry's. A request whose check failed has its slot closed keeping nothing and
        moves from `running` to the front of `waiting` (recomputed from scratch); returns
        the four lists without its rows."""
        if self.store is None:
            return prefill, out_p, decode, out_d
        failed = self._check(list(zip(prefill + decode, out_p + out_d, strict=True)))
        running[:] = [r for r in running if r not in failed]
        waiting[:0] = failed
        return (*_without(prefill, out_p, failed), *_without(decode, out_d, failed))

    def _check(self, rows: Sequence[tuple[tuple[Request, object], Sampled | None]]
               ) -> list[Request]:
        """`after_step`'s fingerprints and checks: the requests whose check failed."""
        failed = []
        for (r, _), sampled in rows:
            st = self._state[r]
            if sampled is None:
                continue
            record(st.marks, *sampled.marks, st.num_computed)
            check, st.check = st.check, None
            got = None if check is None else st.marks.get(check.position)
            if check is None or got is None:  # (not computed by its first step: its prompt
                self.stats.restores_unverified += check is not None  # layer-major)
                continue
            far = distance(check.vector, got[0])
            if far <= check.tolerance:
                self.stats.restores_verified += 1
                continue
            log.warning("request %s: its restored KV fails its check (distance %.3g, at most "
                        "%.3g); recomputing, entry %s quarantined", r.request_id, far,
                        check.tolerance, check.key)
            self.stats.verify_failures += 1
            self.stats.restored_tokens[check.tier] -= check.restored  # (recomputed now)
            self.store.reader.quarantine(check.key)
            self.engine.close(st.slot, finished=False, keep=False)
            st.preempted()
            st.computed_before, st.abandoned = 0, True
            r.cached_tokens = r.cached_by_tier = None
            failed.append(r)
        return failed


def _set_cached(r: Request, cached: int, device: int, tier: str | None, restored: int) -> None:
    """What OpenAI's usage reports as `r`'s cached_tokens, and how many of them came from
    the device and from the store's tier `tier`."""
    r.cached_tokens = min(cached, len(r.prompt))
    r.cached_by_tier = {"device": device, "host": 0, "disk": 0}
    if tier is not None:
        r.cached_by_tier[tier] = restored


def _without(rows: list, out: list, failed: list[Request]) -> tuple[list, list]:
    """A step's (request, row) pairs and their outputs, but those of `failed` requests."""
    kept = [i for i, (r, _) in enumerate(rows) if r not in failed]
    return [rows[i] for i in kept], [out[i] for i in kept]
