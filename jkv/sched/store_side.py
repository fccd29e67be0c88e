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
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Sequence

from jkv.config import SchedulerConfig
from jkv.engine.engine import Engine, SavedPages
from jkv.policies.stored_forms import is_row_form
from jkv.sched.plan_records import Candidate
from jkv.sched.request import Request, SchedulerStats, Tracked
from jkv.sched.restore_planning import RestoreDecision, RestoreRates, plan_restore
from jkv.sched.step_costs import StepCosts
from jkv.store.store import Hit, KVStore

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
        store hit, from the store (a hit that cannot be loaded is recomputed)."""
        eng, st = self.engine, self._state[r]
        hit, restore = st.hit, None
        if hit is not None:
            try:
                if self.config.store_read_ahead:
                    loaded = self.store.take(hit)  # read ahead while it waited
                else:  # read here, the step waiting
                    loaded = self.store.load(hit)
                    loaded = None if loaded is None else (loaded, hit.tier)
                if loaded is not None:
                    (arrays, hashes, exact), tier = loaded
                    hit = hit._replace(tier=tier)  # counted where it was read from
                    # a row stored in a smaller form goes on in it (as looked up)
                    form = next((f for f, _ in hit.converted if is_row_form(f)), None)
                    restore = SavedPages(hit.blocks, arrays, hashes, exact_blocks=exact,
                                         form=form if exact == 0 else None)
                    if st.rebase:
                        t = r.truncation
                        restore = eng.rebase(restore, r.tokens, t.keep, t.drop)
            except Exception:  # a failed load or move is a miss, never a failed step
                log.exception("could not restore request %s from the store", r.request_id)
                restore = None
            if restore is None:
                self.stats.store_misses += 1
        before = eng.stats.restored_tokens
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
        st.admitted()
        return cached

    def save(self, r: Request, slot: int) -> None:
        """Hand `r`'s full blocks to the store's write-behind, only those after the run the
        store already has or has queued (never fails the request). A lossy store (one that
        keeps smaller forms) is handed the approximate blocks too, marked: a conversation
        restored from a small form goes on in it instead of losing its later turns."""
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
                            exact_blocks=saved.exact_blocks, form=saved.form)
        except Exception:
            log.exception("could not queue request %s's KV for the store", r.request_id)

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
                self.save(r, st.slot)
                st.saved = full
