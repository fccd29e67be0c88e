"""The scheduler's pure policies: which requests run next (`plan_step`) and whether a store
hit is restored or recomputed (`restore_pays`, `plan_restore`); no model, no engine."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from jkv.kv.page_cost import PageCost
from jkv.policies.layerkv import offload_beats_recompute
from jkv.sched.plan_records import Budget, Candidate
from jkv.sched.planning import (
    min_resident,
    plan_step,
    prefill_fits,
    prefill_pages,
    step_fits,
    step_pages,
    steps_until_freed,
)
from jkv.sched.restore_planning import (
    PROBE_EVERY,
    RestoreDecision,
    RestoreRates,
    plan_restore,
    restore_pays,
    split_share,
)
from jkv.store.store import Hit

PS, BP = 16, 4  # page size, pages per block


def budget(**kw) -> Budget:
    base = dict(available_pages=1000, free_slots=8, max_tokens=64, chunk=32,
                cost=PageCost(PS, BP))
    return Budget(**{**base, **kw})


def waiting(rid: str, pending: int, arrival: float = 0.0, **kw) -> Candidate:
    return Candidate(rid, arrival, pending, 0, False, **kw)


def running(rid: str, held: int, arrival: float = 0.0, pending: int = 1, **kw) -> Candidate:
    kw.setdefault("pin_pages", -(-held // PS) * BP)
    return Candidate(rid, arrival, pending, held, True, **kw)


# ---------------------------------------------------------------------------- plan_step

LAYERS, HEADS = 4, 2  # the layer-offload tests' model: 8 pages per block, 2 per layer
LAYERED = PageCost(PS, LAYERS * HEADS, layers=LAYERS)


def layered(**kw) -> Budget:
    return budget(cost=LAYERED, layer_offload=True, **kw)


def offloadable(rid: str, held: int, arrival: float, resident: int | None = None,
                **kw) -> Candidate:
    """A running request of the layered model holding its own pages (nothing shared)."""
    r = LAYERS if resident is None else resident
    own = -(-held // PS) * HEADS
    return running(rid, held, arrival, pin_pages=own * r, offload_pages=own * r,
                   fetch_pages=own * (LAYERS - r), resident=resident, **kw)


def test_fcfs_chunks_prefill_under_the_token_budget_after_decodes():
    plan = plan_step([running("d1", 40), running("d2", 17)],
                     [waiting("b", 100, arrival=2.0), waiting("a", 100, arrival=1.0)],
                     budget(max_tokens=64, chunk=32))
    assert plan.decode == ["d1", "d2"]
    assert plan.prefill == [("a", 32), ("b", 30)]  # 64 - 2 decodes, first come first
    assert plan.admit == ["a", "b"] and plan.preempt == []


def test_partial_prefills_continue_before_new_admissions_and_slots_bound_admission():
    plan = plan_step([running("p", 32, pending=50)], [waiting("w1", 10), waiting("w2", 10)],
                     budget(max_tokens=100, chunk=64, free_slots=1))
    assert plan.prefill == [("p", 50), ("w1", 10)]
    assert plan.admit == ["w1"]


def test_priority_and_ttft_deadline_order_the_queue():
    plan = plan_step([], [waiting("late", 8, arrival=0.0, priority=1),
                          waiting("slo", 8, arrival=2.0, ttft_deadline=3.0),
                          waiting("fifo", 8, arrival=1.0)], budget())
    assert plan.admit == ["slo", "fifo", "late"]


def test_head_of_line_waits_for_pages_and_is_not_overtaken():
    plan = plan_step([], [waiting("big", 64, arrival=0.0), waiting("small", 4, arrival=1.0)],
                     budget(available_pages=3 * BP, chunk=64))
    assert plan.admit == []
    plan = plan_step([], [waiting("big", 64, arrival=0.0, pin_pages=BP)],
                     budget(available_pages=4 * BP, chunk=64))
    assert plan.admit == [], "pinning the cached blocks counts against the pages"


def test_pages_short_for_decodes_preempt_the_newest_running_request():
    # each decode crosses into a new page: 3 blocks needed, 2 available
    run = [running("old", 32, arrival=0.0), running("mid", 48, arrival=1.0),
           running("new", 64, arrival=2.0)]
    plan = plan_step(run, [], budget(available_pages=2 * BP))
    assert plan.preempt == ["new"]
    assert plan.decode == ["old", "mid"]
    # a low-priority request goes before a newer high-priority one
    run[0] = running("old", 32, arrival=0.0, priority=5)
    plan = plan_step(run, [], budget(available_pages=2 * BP))
    assert plan.preempt == ["old"]
    # a newer prefill whose pages are all on the host would free none: it goes on
    run[0] = running("old", 32, arrival=0.0)
    feeding = running("feed", 32, arrival=3.0, pending=64, pin_pages=0)
    plan = plan_step([*run, feeding], [], budget(available_pages=2 * BP))
    assert plan.preempt == ["new"] and plan.decode == ["old", "mid"]


def test_prefills_holding_every_page_preempt_the_newest_instead_of_stalling():
    # both at a page boundary, no page left, no decode that could finish and free one
    run = [running("old", 32, arrival=0.0, pending=64), running("mid", 32, arrival=1.0,
                                                                pending=64),
           running("new", 16, arrival=2.0, pending=64, pin_pages=0)]
    plan = plan_step(run, [], budget(available_pages=0))
    # "new" frees nothing (its blocks are shared): preempting it would lose its prefill
    assert plan.preempt == ["mid"]
    assert plan.prefill == [("old", 32)] and plan.decode == []
    # a running decode will free pages when it ends: nothing is preempted for prefills
    run[2] = running("new", 16, arrival=2.0)
    plan = plan_step(run, [], budget(available_pages=BP))
    assert plan.preempt == [] and plan.decode == ["new"] and plan.prefill == []


def test_prefill_shrinks_to_the_pages_left():
    plan = plan_step([running("p", 16, pending=100)], [], budget(available_pages=2 * BP,
                                                                  chunk=64, max_tokens=64))
    assert plan.prefill == [("p", 32)]  # two more pages of 16 tokens


def test_tpot_targets_cap_prefill_tokens_even_past_a_ttft_deadline():
    run = [running("d", 40, tpot_slo=0.05)]
    cost = dict(decode_step_seconds=0.03, prefill_token_seconds=0.001, now=10.0)
    plan = plan_step(run, [waiting("w", 100, arrival=9.0)], budget(max_tokens=256, chunk=256,
                                                                   **cost))
    assert plan.prefill == [("w", 20)]  # (0.05 - 0.03) / 0.001
    # a broken TTFT promise does not break a running request's TPOT too
    plan = plan_step(run, [waiting("w", 100, arrival=9.0, ttft_deadline=9.5)],
                     budget(max_tokens=256, chunk=256, **cost))
    assert plan.prefill == [("w", 20)]
    plan = plan_step([], [waiting("w", 100, arrival=9.0, ttft_deadline=9.5)],
                     budget(max_tokens=256, chunk=256, **cost))
    assert plan.prefill == [("w", 100)]  # nothing decoding: no cap
    plan = plan_step([running("d", 40, tpot_slo=0.02)], [waiting("w", 100)],
                     budget(**cost))
    assert plan.prefill == [] and plan.decode == ["d"]


def test_tpot_slack_lets_a_longer_prefill_in_and_the_smallest_one_caps_it():
    # LayerKV eq. 1-2: a request that decoded faster than its target has slack to spend
    cost = dict(decode_step_seconds=0.03, prefill_token_seconds=0.001, now=10.0)
    ahead = running("a", 40, tpot_slo=0.05, tpot_slack=0.09)
    plan = plan_step([ahead], [waiting("w", 100)], budget(max_tokens=256, chunk=256, **cost))
    assert plan.prefill == [("w", 90)]  # 0.09 s of prefill
    behind = running("b", 40, tpot_slo=0.5, tpot_slack=0.004)  # a looser target, less slack
    plan = plan_step([ahead, behind], [waiting("w", 100)],
                     budget(max_tokens=256, chunk=256, **cost))
    assert plan.prefill == [("w", 4)] and sorted(plan.decode) == ["a", "b"]
    # one already behind its target: what keeps each step within it, (0.05 - 0.03) / 0.001
    late = running("l", 40, tpot_slo=0.05, tpot_slack=-1.0)
    plan = plan_step([late], [waiting("w", 100)], budget(max_tokens=256, chunk=256, **cost))
    assert plan.prefill == [("w", 20)] and plan.decode == ["l"]
    slow = dict(cost, decode_step_seconds=0.06)  # a step alone already takes longer:
    plan = plan_step([late], [waiting("w", 100)], budget(max_tokens=256, chunk=256, **slow))
    assert plan.prefill == [("w", 100)] and plan.decode == ["l"]  # holding w keeps nothing
    plan = plan_step([running("d", 40, tpot_slo=0.05)], [waiting("w", 100)],
                     budget(max_tokens=256, chunk=256, **slow))
    assert plan.prefill == [] and plan.decode == ["d"]  # (d's slack not known: it holds)


def test_each_prefill_row_pays_its_own_cost_out_of_the_spare():
    # a row is a call (its dispatches, its padding): 5 ms of the 20 ms spare before tokens
    cost = dict(decode_step_seconds=0.03, prefill_token_seconds=0.001,
                prefill_row_seconds=0.005, now=10.0)
    run = [running("d", 40, tpot_slo=0.05)]
    plan = plan_step(run, [waiting("w", 100)], budget(max_tokens=256, chunk=256, **cost))
    assert plan.prefill == [("w", 15)]  # (0.05 - 0.03 - 0.005) / 0.001
    plan = plan_step(run, [waiting("v", 4, arrival=1.0), waiting("w", 100, arrival=2.0)],
                     budget(max_tokens=256, chunk=256, **cost))
    assert plan.prefill == [("v", 4), ("w", 6)]  # 20 - 5 - 4 - 5 tokens' worth for w
    tight = dict(cost, prefill_row_seconds=0.02)  # the call alone would use the spare up
    plan = plan_step(run, [waiting("w", 100)], budget(max_tokens=256, chunk=256, **tight))
    assert plan.prefill == [] and plan.decode == ["d"]


def test_a_decode_past_saving_does_not_hold_up_a_prefill_that_can_still_meet_its_ttft():
    # l misses its target whatever this step does (slack below 0): a prefill past its TTFT
    # deadline (or with none) keeps each step within l's target; one that can still meet its
    # deadline is not held for l, only for decodes whose targets can still be met
    cost = dict(decode_step_seconds=0.03, prefill_token_seconds=0.001, now=10.0,
                prefill_row_seconds=0.025)
    late = running("l", 40, tpot_slo=0.05, tpot_slack=-1.0, remaining=20)

    def plan(*run: Candidate, deadline: float | None = 10.5, arrival: float = 9.0):
        w = waiting("w", 100, arrival, ttft_deadline=deadline, remaining=20)
        return plan_step(list(run), [w], budget(max_tokens=256, chunk=256,
                                                decode_step_by_rows=(0.0, 0.03, 0.04),
                                                **cost))

    assert plan(late, deadline=None).prefill == []  # 20 ms a step: less than the row's 25
    assert plan(late, deadline=10.05).prefill == []  # 100 tokens take 0.1 s: too late now
    assert plan(late).prefill == [("w", 100)] and plan(late).admit == ["w"]
    # its row in l's later steps (10 ms over the step's 50) does not hold it either
    assert plan(late).held == []
    ahead = running("a", 40, tpot_slo=0.05, tpot_slack=0.06, remaining=20)
    assert plan(late, ahead).prefill == [("w", 35)]  # a's 60 ms, less the row's 25
    # a running prefill that can still meet its deadline goes on likewise
    p = running("p", 16, 8.0, pending=100, ttft_deadline=10.5)
    assert plan_step([late, p], [], budget(max_tokens=256, chunk=256, **cost)).prefill == [
        ("p", 100)]
    p = dataclasses.replace(p, ttft_deadline=10.0)
    assert plan_step([late, p], [], budget(max_tokens=256, chunk=256, **cost)).prefill == []


def test_a_decode_whose_every_step_is_past_its_target_holds_back_no_prefill():
    # h's target (25 ms) is shorter than a decode step (30 ms): no step keeps it, so a
    # prefill past its TTFT deadline (or with none) is neither capped nor held for it
    cost = dict(decode_step_seconds=0.03, prefill_token_seconds=0.001, now=10.0,
                prefill_row_seconds=0.025)
    hopeless = running("h", 40, tpot_slo=0.025, tpot_slack=-1.0, remaining=20)
    late = running("l", 40, tpot_slo=0.05, tpot_slack=-1.0, remaining=20)

    def plan(*run: Candidate, deadline: float | None = None):
        w = waiting("w", 100, 9.0, ttft_deadline=deadline, remaining=20)
        return plan_step(list(run), [w], budget(max_tokens=256, chunk=256,
                                                decode_step_by_rows=(0.0, 0.03, 0.04),
                                                **cost))

    for deadline in (None, 10.05):
        assert plan(hopeless, deadline=deadline).admit == ["w"]
        assert plan(hopeless, deadline=deadline).prefill == [("w", 100)]
        # one whose steps still meet its target goes on holding it (see above)
        assert plan(hopeless, late, deadline=deadline).prefill == []
    # a running prefill past its deadline goes on likewise
    p = running("p", 16, 8.0, pending=100, ttft_deadline=10.0)
    assert plan_step([hopeless, p], [], budget(max_tokens=256, chunk=256, **cost)).prefill == [
        ("p", 100)]


# ---------------------------------------------------------------------------- restores

MB = 10**6
FAST = RestoreRates({"host": 1e9, "disk": 1e9}, 1e9, 1e-5)  # loading 2 MB: 4 ms
UNMEASURED = RestoreRates({"host": 0.0, "disk": 0.0}, 0.0, 0.0)


def hit(blocks: int, tier: str = "host", key: str = "e") -> Hit:
    return Hit(key, blocks, tier, entry_bytes=2 * MB, blocks_bytes=2 * MB)


def restore(cached: int, found: Hit | None, moved=None, rates: RestoreRates = FAST,
            **kw) -> RestoreDecision:
    return plan_restore(cached, found, moved, rates, cost=PageCost(PS, BP), **kw)


def test_restore_pays_weighs_loading_against_recomputing():
    assert restore_pays(100, MB, MB, 0.0, 0.0, 0.0)  # nothing measured: load
    assert restore_pays(100, MB, MB, 1e9, 0.0, 1e-5)  # the pool writes not measured: load
    # 2 MB at 1 GB/s read and write = 2 ms, against 100 tokens at 10 us = 1 ms: recompute
    assert not restore_pays(100, MB, MB, 1e9, 1e9, 1e-5)
    assert restore_pays(1000, MB, MB, 1e9, 1e9, 1e-5)  # 10 ms of compute: load


def test_a_hit_worth_loading_is_restored_and_its_new_pages_counted():
    d = restore(16, hit(30))  # 480 tokens, 464 past the device hit: 4.6 ms of compute
    assert d == RestoreDecision(held=30 * PS, hit=hit(30), extra_pages=(30 - 1) * BP)
    assert d.restore and not d.newly_declined and not d.probe
    # a device hit ending mid-block: its last page is already counted
    assert restore(20, hit(30)).extra_pages == (30 - 2) * BP


def test_a_hit_cheaper_to_recompute_is_declined_once():
    d = restore(16, hit(10))  # 144 tokens: 1.4 ms of compute against 4 ms of loading
    assert d == RestoreDecision(held=16, newly_declined=True)
    # declined before: not counted again, still recomputed
    assert restore(16, hit(10), declined=True) == RestoreDecision(held=16)
    # the rates changed so that loading now wins: restored after all
    assert restore(16, hit(10), rates=RestoreRates({"host": 1e10}, 1e10, 1e-5),
                   declined=True).restore


def test_a_hit_stored_in_another_form_counts_converting_it():
    stored = hit(30)._replace(converted=(("k4v2t", 2 * MB),))
    assert restore(16, stored).restore  # the conversion's rate not measured yet: as before
    # 4.6 ms of compute against 4 ms of reading and writing: loaded; converting 2 MB at
    # 1 GB/s on top (6 ms): recomputed
    slow = dataclasses.replace(FAST, convert_bytes_per_s={"k4v2t": 1e9})
    assert slow.convert_seconds(stored) == pytest.approx(2e-3)
    assert slow.convert_seconds(hit(30)) == 0.0  # nothing stored in another form
    assert restore(16, hit(30), rates=slow).restore
    assert restore(16, stored, rates=slow) == RestoreDecision(held=16, newly_declined=True)
    fast = dataclasses.replace(FAST, convert_bytes_per_s={"k4v2t": 1e11})
    assert restore(16, stored, rates=fast).restore


def test_rates_not_measured_yet_restore():
    d = restore(0, hit(10), rates=UNMEASURED)
    assert d.restore and d.held == 10 * PS and not d.newly_declined
    assert restore(0, hit(10), rates=RestoreRates({"host": 1e9}, 0.0, 1e-5)).restore


@pytest.mark.parametrize("count", [0, PROBE_EVERY - 2, PROBE_EVERY, 2 * PROBE_EVERY - 1])
def test_every_probe_every_th_decline_is_restored_anyway(count):
    d = restore(16, hit(10), declined_count=count)
    probe = (count + 1) % PROBE_EVERY == 0
    assert d.newly_declined and d.probe == probe and d.restore == probe
    if probe:  # restored as a hit worth loading would be
        assert (d.held, d.extra_pages) == (10 * PS, 9 * BP)
        # a probing request restores from then on, rates unweighed, counted no more
        again = restore(16, hit(10), declined=True, probe=True)
        assert again.restore and again.probe and not again.newly_declined


def test_planning_off_restores_every_hit_that_adds_blocks():
    d = restore(16, hit(10), planning=False)
    assert d.restore and not d.newly_declined


def test_nothing_to_restore_past_the_device_hit():
    assert restore(7, None) == RestoreDecision(held=7)
    # the device already holds as much: neither restored nor counted as declined
    assert restore(10 * PS, hit(10)) == RestoreDecision(held=10 * PS)
    assert restore(12 * PS, hit(10), planning=False) == RestoreDecision(held=12 * PS)


def test_each_tier_is_weighed_at_its_own_read_rate():
    rates = RestoreRates({"host": 1e10, "disk": 1e7}, 1e10, 1e-5)
    assert restore(0, hit(10, "host"), rates=rates).restore
    assert not restore(0, hit(10, "disk"), rates=rates).restore


def test_a_truncated_prompt_rebases_its_source_when_that_gives_more_blocks():
    source = hit(12, "disk", key="source")
    d = restore(0, hit(3), (source, 6), planning=False)
    assert (d.hit, d.held, d.rebase, d.extra_pages) == (source, 6 * PS, 6, 6 * BP)
    for found in (hit(6), hit(8)):  # the prompt's own entry gives as many or more: in place
        d = restore(0, found, (source, 6), planning=False)
        assert d.hit == found and d.rebase == 0
    d = restore(0, None, (source, 6), planning=False)
    assert d.hit == source and d.rebase == 6
    # the moved hit is weighed like any other (its entry's bytes, its tier's rate)
    d = restore(0, None, (source, 6), rates=RestoreRates({"disk": 1e9}, 1e9, 1e-6))
    assert not d.restore and d.rebase == 0 and d.newly_declined


def test_split_share_balances_recompute_and_load():
    # Krul eq. 1: 3 s of recompute, 1 s of writes, fully overlapped: recompute a quarter,
    # both parts then take 0.75 s
    share = split_share(3.0, 1.0, 0.0, overlap=1.0)
    assert share == pytest.approx(0.25) and share * 3.0 == pytest.approx((1 - share) * 1.0)
    assert split_share(3.0, 1.0, 0.0, overlap=0.0) == 0.0  # one after the other: interpolation
    assert split_share(1.0, 1.0, 2.0, overlap=1.0) == 0.0  # the read alone outlasts recompute
    assert split_share(0.0, 1.0, 0.0, overlap=1.0) == split_share(1.0, 0.0, 0.0, 1.0) == 0.0
    rng = np.random.default_rng()
    for _ in range(200):  # a chosen split is predicted faster than both of its ends
        c, w, r = rng.exponential(size=3)
        o = rng.uniform()
        share = split_share(c, w, r, o)
        if share:
            split = r + (2 - o) * share * c
            assert split < c and split < r + w
    assert all(split_share(c, w, r, 0.0) == 0.0 for c, w, r in rng.exponential(size=(50, 3)))
    # nothing to read first and full overlap: splitting always beats both ends
    assert all(split_share(c, w, 0.0, 1.0) > 0 for c, w in rng.exponential(size=(50, 2)))


def test_a_restore_is_split_where_the_device_overlaps_copies_and_compute():
    overlapped = RestoreRates({"host": 1e9}, 1e9, 1e-5, split_overlap=1.0)
    d = restore(16, hit(30), rates=overlapped)
    # 464 tokens: 4.64 ms of recompute against 2 ms of reading and 1.93 ms of writing
    compute, write = 464 * 1e-5, 2 * MB * 464 / 480 / 1e9
    assert d.restore and d.recompute == pytest.approx(write / (compute + write))
    assert d.held == 30 * PS and d.extra_pages == (30 - 1) * BP  # the pages are all taken
    assert restore(16, hit(30)).recompute == 0.0  # FAST: no overlap, a whole load
    assert restore(16, hit(30), rates=overlapped, probe=True).recompute == 0.0  # a probe loads
    assert restore(16, hit(30), rates=overlapped, planning=False).recompute == 0.0


# ---------------------------------------------------------------------------- layer offload


def test_step_pages_count_resident_layers_and_one_offloaded_layer_in_flight():
    assert step_pages(LAYERED, None, 15, 2) == 8  # a new block in every layer
    assert step_pages(LAYERED, 3, 15, 2) == 3 * 2 + 2 * 2  # 3 layers' new block + one layer
    assert step_pages(LAYERED, 0, 0, 40) == 3 * 2  # one layer of 3 blocks in flight
    for resident in (None, 0, 1, 3):
        for pages in range(0, 30):
            n = step_fits(LAYERED, resident, 10, 60, pages)
            assert n == 0 or step_pages(LAYERED, resident, 10, n) <= pages
            assert n == 60 or step_pages(LAYERED, resident, 10, n + 1) > pages


def test_short_of_pages_the_newest_request_offloads_layers_instead_of_being_preempted():
    # two decodes each crossing into a new block: 16 pages needed, 10 available
    a, b = offloadable("a", 32, 1.0), offloadable("b", 48, 2.0)
    plan = plan_step([a, b], [], layered(available_pages=10))
    assert plan.preempt == [] and plan.decode == ["a", "b"]
    # b (the newest) keeps as many layers as the gap allows: with r resident it takes
    # 2r new pages + one layer of 4 blocks in flight (8) and frees 6 per offloaded layer
    keep = plan.offload["b"]
    assert list(plan.offload) == ["b"] and 0 <= keep < LAYERS
    assert 8 + 2 * keep + 8 <= 10 + 6 * (LAYERS - keep)
    assert keep == LAYERS - 1 or 8 + 2 * (keep + 1) + 8 > 10 + 6 * (LAYERS - keep - 1)
    # without layer offload it is preempted
    assert plan_step([a, b], [], budget(cost=LAYERED, available_pages=10)).preempt == ["b"]


def test_offloaded_layers_come_back_when_the_forecast_allows_and_admission_keeps_fewer():
    a = offloadable("a", 20, 1.0, resident=1)  # 3 layers of 2 blocks on the host: 12 pages
    plan = plan_step([a], [], layered(available_pages=100))
    assert plan.fetch == ["a"] and plan.offload == {}
    plan = plan_step([a], [], layered(available_pages=11))  # the fetch does not fit
    assert plan.fetch == [] and plan.decode == ["a"]
    # a 64-token chunk needs 4 blocks x 8 pages; with 20 pages it starts with 1 layer
    # resident (8 + one layer in flight: 8) and never fewer than min_resident
    chunk = dict(chunk=64, max_tokens=64)
    plan = plan_step([], [waiting("w", 64)], layered(available_pages=20, **chunk))
    assert plan.admit == ["w"] and plan.resident == {"w": 1}
    plan = plan_step([], [waiting("w", 64)], layered(available_pages=20, min_resident=2,
                                                     **chunk))
    assert plan.admit == [] and plan.resident == {}
    plan = plan_step([], [waiting("w", 64)], layered(available_pages=40, **chunk))
    assert plan.admit == ["w"] and plan.resident == {}  # all fits: all resident


def test_a_long_prompt_admitted_offloaded_goes_layer_major_and_takes_its_pages_at_once():
    # 128 tokens, 8 blocks; a chunk of 64. Fed layer-major, its resident layers take all 8
    chunk = dict(chunk=64, max_tokens=64)
    # blocks at once: with r resident, 16 r pages + one layer of 8 blocks (16) in flight; its
    # first chunk with every layer (32 pages) does not fit in 30
    w = waiting("w", 128, layer_major=0)
    plan = plan_step([], [w], layered(available_pages=30, **chunk))
    assert plan.admit == ["w"] and plan.resident == {"w": 0} and plan.layer_major == ["w"]
    assert plan.prefill == [("w", 64)]  # a chunk's worth of compute this step
    # chunk by chunk it would have started with 2 resident layers (8 r + 8 <= 30)
    plan = plan_step([], [waiting("w", 128)], layered(available_pages=30, **chunk))
    assert plan.resident == {"w": 2} and plan.layer_major == []
    # a prompt within one chunk, or one that fits with every layer: never layer-major
    for c, pages in ((waiting("w", 64, layer_major=0), 40), (w, 1000)):
        assert plan_step([], [c], layered(available_pages=pages, **chunk)).layer_major == []
    # part way through its layers: each step takes one layer of its prompt (16 pages) in
    # flight, nothing else, and its layers are not moved
    mid = dataclasses.replace(offloadable("m", 0, 0.0, resident=1), pending=128,
                              layer_major=2, offload_pages=0, fetch_pages=0)
    assert prefill_pages(LAYERED, mid, 64) == 16
    plan = plan_step([mid], [], layered(available_pages=16, **chunk))
    assert plan.prefill == [("m", 64)] and plan.offload == {} and plan.fetch == []
    assert plan_step([mid], [], layered(available_pages=15, **chunk)).prefill == []
    assert prefill_fits(LAYERED, mid, 64, 15) == 0 and prefill_fits(LAYERED, mid, 64, 16) == 64


def test_a_long_prompt_whose_first_chunk_fits_but_not_the_rest_goes_layer_major_at_once():
    # 128 tokens (64 pages with every layer); its first chunk (32 pages) fits in 50, the
    # rest would not: admitted chunk by chunk it would stall part way, waiting for pages.
    # Fed layer-major its resident layers take the whole prompt: 16 r + 16 in flight <= 50
    chunk = dict(chunk=64, max_tokens=64)
    w = waiting("w", 128, layer_major=0)
    plan = plan_step([], [w], layered(available_pages=50, **chunk))
    assert plan.admit == ["w"] and plan.resident == {"w": 2} and plan.layer_major == ["w"]
    # the whole prompt's pages free: chunk by chunk with every layer
    plan = plan_step([], [w], layered(available_pages=64, **chunk))
    assert plan.admit == ["w"] and plan.resident == {} and plan.layer_major == []
    # without layer offload its first chunk admits it (vLLM's chunked prefill)
    plan = plan_step([], [w], budget(cost=LAYERED, available_pages=50, **chunk))
    assert plan.admit == ["w"] and plan.resident == {}


def test_a_decode_is_preempted_where_its_layers_on_the_host_cost_more_than_recomputing():
    # b (the newest, 48 tokens) must give up layers so that a and b decode (as above)
    a = offloadable("a", 32, 1.0, remaining=10)
    b = offloadable("b", 48, 2.0, remaining=10)
    costs = dict(prefill_token_seconds=0.001, available_pages=10)
    # a layer on the host 1 ms a step over its 10 steps: k x 10 ms against 48 ms of recompute
    plan = plan_step([a, b], [], layered(offload_layer_seconds=0.001, **costs))
    assert plan.preempt == [] and list(plan.offload) == ["b"]
    assert offload_beats_recompute(layered(offload_layer_seconds=0.001, **costs), 4, b)
    # 10 ms a layer a step: 100 ms a layer, more than recomputing its 48 tokens
    plan = plan_step([a, b], [], layered(offload_layer_seconds=0.01, **costs))
    assert plan.preempt == ["b"] and plan.offload == {} and plan.decode == ["a"]
    # no output estimate (no reply seen yet) or no rate: offloaded as before
    plan = plan_step([a, offloadable("b", 48, 2.0)], [],
                     layered(offload_layer_seconds=0.01, **costs))
    assert plan.preempt == [] and list(plan.offload) == ["b"]
    plan = plan_step([a, b], [], layered(offload_layer_seconds=0.01, available_pages=10))
    assert plan.preempt == [] and list(plan.offload) == ["b"]


def test_with_tpot_targets_a_decode_keeps_going_offloaded_where_preempted_it_would_wait():
    # b must move 2 layers to the host (as above): 2 x 10 ms a step over its 10 steps,
    # 0.2 s against 48 ms of recompute: preempted where no one carries a target
    costs = dict(prefill_token_seconds=0.001, available_pages=10, offload_layer_seconds=0.01,
                 decode_step_seconds=0.02)

    def plan(a_remaining=40, a_slack=1.0, b_slack=1.0):
        a = offloadable("a", 32, 1.0, remaining=a_remaining, tpot_slo=0.1, tpot_slack=a_slack)
        b = offloadable("b", 48, 2.0, remaining=10, tpot_slo=0.1, tpot_slack=b_slack)
        return plan_step([a, b], [], layered(**costs))

    untargeted = [offloadable("a", 32, 1.0, remaining=40), offloadable("b", 48, 2.0,
                                                                        remaining=10)]
    assert plan_step(untargeted, [], layered(**costs)).preempt == ["b"]
    # with targets its own wait counts: preempted, it waits at least for a's 40 steps (0.8 s,
    # shared over the 2 rows) before recomputing: 0.448 s against 0.2 s; and the 20 ms a
    # step more over b's 10 steps fits a's slack (0.2 s of 1 s) and b's own
    p = plan()
    assert p.preempt == [] and p.offload == {"b": 2} and p.decode == ["a", "b"]
    # a's slack does not cover it (0.1 s late): preempted, as b's slack covers its wait and
    # recompute (0.848 s of 1 s); where it does not (0.3 s: 0.548 s late) b goes on
    assert plan(a_slack=0.1).preempt == ["b"]
    p = plan(a_slack=0.1, b_slack=0.3)
    assert p.preempt == [] and p.offload == {"b": 2}
    # a already behind: the whole 0.2 s is late; b's 0.848 s less its 0.7 s is less
    assert plan(a_slack=-0.5, b_slack=0.7).preempt == ["b"]
    assert plan(a_slack=-0.5, b_slack=0.5).offload == {"b": 2}
    # preempted where a finishes soon (b back in 2 steps: 0.068 s)
    assert plan(a_remaining=2).preempt == ["b"]


def test_an_offloaded_admission_waits_when_its_layers_cost_the_decodes_more_than_its_wait():
    # 20 pages admit the 64-token chunk with 1 resident layer (3 on the host); d decodes
    # 50 more steps of 10 ms: waiting for its pages costs w 0.5 s at most
    chunk = dict(chunk=64, max_tokens=64, available_pages=20, decode_step_seconds=0.01)
    d = offloadable("d", 20, 0.0, remaining=50)
    w = waiting("w", 64, 1.0, remaining=20)

    def plan(seconds: float, w: Candidate = w):
        return plan_step([d], [w], layered(offload_layer_seconds=seconds, **chunk))

    # 2 rows x 3 layers x 1 ms x its 20 steps: 0.12 s, less than its wait: admitted now
    assert plan(0.001).resident == {"w": 1}
    # 2 x 3 x 5 ms x 20: 0.6 s, more than its wait: it waits for d's pages
    p = plan(0.005)
    assert p.admit == [] and p.held == ["w"] and p.decode == ["d"] and p.resident == {}
    # not weighed without an estimate of its output
    assert plan(0.005, waiting("w", 64, 1.0)).resident == {"w": 1}


def test_an_offloaded_admission_waits_while_its_steps_would_break_a_decodes_tpot():
    # a 64-token chunk takes 32 pages with every layer; 20 fit it with 1 resident layer
    chunk = dict(chunk=64, max_tokens=64, available_pages=20)
    d = offloadable("d", 20, 0.0, tpot_slo=0.1, tpot_slack=0.5, remaining=100)

    def plan(seconds: float, w: Candidate, *ds: Candidate):
        return plan_step(list(ds), [w], layered(offload_layer_seconds=seconds, **chunk))

    w = waiting("w", 64, 1.0, remaining=50)
    # 3 layers on the host: 3 x 2 ms a step over the 50 steps both decode: 0.3 s of 0.5
    p = plan(0.002, w, d)
    assert p.resident == {"w": 1} and p.held == []
    # 3 x 4 ms over 50 steps: 0.6 s, more than d's slack: w waits for pages instead
    p = plan(0.004, w, d)
    assert p.admit == [] and p.resident == {} and p.decode == ["d"] and p.held == ["w"]
    # over 30 steps it fits again; so it does when d will stop first
    assert plan(0.004, waiting("w", 64, 1.0, remaining=30), d).resident == {"w": 1}
    short = offloadable("d", 20, 0.0, tpot_slo=0.1, tpot_slack=0.5, remaining=40)
    assert plan(0.004, w, short).resident == {"w": 1}
    # not weighed: a cost not measured, a slack not known
    assert plan(0.0, w, d).resident == {"w": 1}
    assert plan(0.004, w, offloadable("d", 20, 0.0, tpot_slo=0.1)).resident == {"w": 1}
    # weighed still when its own TTFT deadline has passed
    late = waiting("w", 64, 1.0, remaining=50, ttft_deadline=-1.0)
    assert plan(0.004, late, d).held == ["w"]
    # one that fits with every layer resident costs no step anything
    p = plan_step([d], [w], layered(offload_layer_seconds=1.0, chunk=64, max_tokens=64,
                                    available_pages=40))
    assert p.admit == ["w"] and p.resident == {}


def test_layers_on_the_host_count_only_until_finishing_decodes_free_their_pages():
    # w keeps 1 of 4 layers (24 pages of its prompt on the host, 4 ms a step each of 3):
    # over the 50 steps it shares with d that is 0.6 s, more than d's 0.5 s of slack; with
    # e expected to finish in 5 steps and free its 56 pages, the pool takes w's layers back
    # then: 5 steps of them, 0.06 s
    chunk = dict(chunk=64, max_tokens=64, available_pages=20, offload_layer_seconds=0.004)
    d = offloadable("d", 20, 0.0, tpot_slo=0.1, tpot_slack=0.5, remaining=100)
    w = waiting("w", 64, 1.0, remaining=50)

    def e(remaining: int, held: int = 100) -> Candidate:
        return offloadable("e", held, 0.0, tpot_slo=0.1, tpot_slack=5.0, remaining=remaining)

    assert plan_step([d], [w], layered(**chunk)).held == ["w"]
    p = plan_step([d, e(5)], [w], layered(**chunk))
    assert p.admit == ["w"] and p.resident == {"w": 1} and p.held == []
    assert plan_step([d, e(60)], [w], layered(**chunk)).held == ["w"]  # too late
    assert plan_step([d, e(5, held=20)], [w], layered(**chunk)).held == ["w"]  # too few
    # with no targets its layers are charged for its whole output (3 rows x 3 layers x 4 ms
    # x 50 steps: 1.8 s) against its wait for e's end (5 steps of 0.1 s): it waits
    free = [dataclasses.replace(c, tpot_slo=None, tpot_slack=None) for c in (d, e(5))]
    assert plan_step(free, [w], layered(decode_step_seconds=0.1, **chunk)).held == ["w"]
    assert plan_step(free, [dataclasses.replace(w, remaining=5)],
                     layered(decode_step_seconds=0.1, **chunk)).admit == ["w"]
    # the finishes as counted: first expected first, prefills and unknown lengths not
    assert steps_until_freed(0, [d]) == 0
    assert steps_until_freed(24, [d, e(5)]) == 5
    assert steps_until_freed(60, [d, e(5)]) == 100  # e's 56 and d's 16
    assert steps_until_freed(80, [d, e(5)]) is None
    assert steps_until_freed(24, [e(None)]) is None
    assert steps_until_freed(24, [dataclasses.replace(e(5), pending=40)]) is None


def test_an_admission_makes_room_by_moving_the_newest_decodes_layers_to_the_host():
    # d holds 60 tokens with every layer (32 pages); w needs 8 pages at 0 resident (its
    # one layer in flight); 4 are free
    d = offloadable("d", 60, 0.0, tpot_slo=0.1, tpot_slack=1.0, remaining=10)
    w = waiting("w", 64, 1.0, remaining=10)
    costs = dict(chunk=64, max_tokens=64, available_pages=4)
    p = plan_step([d], [w], layered(offload_layer_seconds=0.001, **costs))
    assert p.admit == ["w"] and p.resident == {"w": 0} and p.held == []
    # d keeps as many layers as leave room for w's pages and d's step (with a layer on
    # the host, one layer's pages of its whole length while that layer runs); each layer
    # moved frees its 8 pages
    kept = p.offload["d"]
    assert kept == max(k for k in range(LAYERS) if step_pages(LAYERED, 0, 0, 64)
                       + step_pages(LAYERED, k, 60, 1) <= 4 + 8 * (LAYERS - k))
    # the layers moved count in d's slack: w's 4 alone (4 x 20 ms x 10 steps: 0.8 s of
    # 1.0) would fit, with d's too they do not: w waits and d keeps its layers
    moved = LAYERS - kept
    assert (LAYERS + moved) * 0.02 * 10 > 1.0 >= LAYERS * 0.02 * 10
    p = plan_step([d], [w], layered(offload_layer_seconds=0.02, **costs))
    assert p.admit == [] and p.offload == {} and p.held == ["w"]
    # without layer offload w waits for d's pages
    p = plan_step([d], [w], budget(cost=LAYERED, **costs))
    assert p.admit == [] and p.offload == {}


def test_an_admission_counts_the_running_prefills_and_its_own_target():
    # p (prefilling, all 4 layers on the host) will decode in the steps w would. 6 pages:
    # p grows by 2 over w's steps, w keeps 1 layer (4 pages with its layer in flight): w's
    # 3 layers on the host alone fit d's slack (3 x 10 ms x 10 steps: 0.3 s of 0.5), with
    # p's 4 they do not
    d = offloadable("d", 20, 0.0, tpot_slo=0.1, tpot_slack=0.5, remaining=10)
    pre = dataclasses.replace(offloadable("p", 64, 0.5, resident=0, remaining=10), pending=40)
    w = waiting("w", 16, 1.0, remaining=10)
    costs = dict(chunk=16, max_tokens=64, offload_layer_seconds=0.01)
    p = plan_step([d], [w], layered(available_pages=6, **costs))
    assert p.admit == ["w"] and p.resident == {"w": 2}  # (without p: no growth, 2 kept)
    p = plan_step([d, pre], [w], layered(available_pages=6, **costs))
    assert p.admit == [] and p.held == ["w"]
    # its own steps, the decodes' (20 ms) and its layers (4 pages: 3 on the host, 30 ms),
    # beyond its own target
    costs.update(available_pages=4, decode_step_seconds=0.02)
    p = plan_step([d], [dataclasses.replace(w, tpot_slo=0.045)], layered(**costs))
    assert p.admit == [] and p.held == ["w"]
    p = plan_step([d], [dataclasses.replace(w, tpot_slo=0.055)], layered(**costs))
    assert p.admit == ["w"]


def test_an_admission_meets_its_own_target_on_average_not_each_shared_step():
    # w keeps 1 of 4 layers (3 on the host, 30 ms a step) and decodes 10 steps: while d
    # runs, steps of d's 20 ms, w's row 10 and its layers 30; once d ends and frees its
    # pages, w's layers come back and its steps cost its own row's 10 ms. Against a 45-ms
    # target: held while d decodes as long as w (60 ms each), admitted where d ends after
    # 2 of w's steps ((2 x 60 + 8 x 10) / 10 = 20 ms) and no one waits behind w
    costs = dict(chunk=16, max_tokens=64, offload_layer_seconds=0.01, available_pages=4,
                 decode_step_seconds=0.02, decode_step_by_rows=(0.0, 0.01, 0.02, 0.03))
    w = waiting("w", 16, 1.0, remaining=10, tpot_slo=0.045)

    def plan(d_remaining: int | None, w: Candidate = w, behind: tuple = ()):
        d = offloadable("d", 20, 0.0, tpot_slo=0.1, tpot_slack=5.0, remaining=d_remaining)
        return plan_step([d], [w, *behind], layered(**costs))

    assert plan(10).held == ["w"]
    assert plan(2).admit == ["w"] and plan(2).resident == {"w": 1}
    # with a queue behind it, others would take d's place: each step within its target
    assert plan(2, behind=(waiting("x", 16, 2.0),)).held == ["w"]
    assert plan(None).held == ["w"]  # no estimate of d's end: it may share them all
    # no estimate of its own length: each step within its target
    assert plan(2, dataclasses.replace(w, remaining=None)).held == ["w"]
    # a target below that mean holds it
    assert plan(2, dataclasses.replace(w, tpot_slo=0.015)).held == ["w"]
    assert plan(2, dataclasses.replace(w, tpot_slo=0.025)).admit == ["w"]
    # with a TTFT target it can still meet: held until d ends (10 steps, 0.2 s) it would
    # be further past it than admitted it runs past its own (10 x 60 ms against 45: 0.15 s)
    assert plan(10, dataclasses.replace(w, ttft_deadline=0.01)).admit == ["w"]
    assert plan(10, dataclasses.replace(w, ttft_deadline=0.1)).held == ["w"]  # 0.1 s


def test_a_preempted_request_comes_back_only_with_every_layer():
    # 20 pages admit the 64-token chunk with 1 resident layer; one preempted before (its
    # layers on the host judged dearer than recomputing it) waits for all its pages: back
    # at once with layers on the host it would pay both, and be preempted again
    chunk = dict(chunk=64, max_tokens=64, available_pages=20)
    assert plan_step([], [waiting("w", 64)], layered(**chunk)).resident == {"w": 1}
    p = plan_step([], [waiting("w", 64, whole=True)], layered(**chunk))
    assert p.admit == [] and p.resident == {}
    p = plan_step([], [waiting("w", 64, whole=True)], layered(chunk=64, max_tokens=64,
                                                               available_pages=32))
    assert p.admit == ["w"] and p.resident == {}


def test_min_resident_hides_the_copy_out_behind_the_prefill():
    # 1 ms a token, 1 GB/s out of the pool, 200 KB a token per layer: 5 layers' copies hide
    assert min_resident(30, 200_000, 1e9, 1e-3) == 25
    assert min_resident(30, 200_000, 1e12, 1e-3) == 0
    assert min_resident(30, 200_000, 0.0, 1e-3) == 0  # not measured: offload freely


def test_an_admission_waits_while_its_row_would_break_a_decodes_tpot():
    # a step of n decodes: 10 ms with 1 or 2 (one padded shape), 30 ms with 3 or 4
    by_rows = (0.0, 0.010, 0.010, 0.030, 0.030)
    d = running("d", 40, tpot_slo=0.1, tpot_slack=0.5, remaining=100)

    def plan(w: Candidate, *ds: Candidate, **kw):
        return plan_step(list(ds), [w], budget(decode_step_by_rows=by_rows,
                                               decode_step_seconds=0.010, **kw))

    # a second decode shares the step's shape: it costs d nothing
    assert plan(waiting("w", 20, 1.0, remaining=50), d).admit == ["w"]
    e = running("e", 40, tpot_slo=0.1, tpot_slack=0.5, remaining=100)
    # a third pads the step to 4 rows: 20 ms more over the 50 steps both decode (1 s > 0.5)
    p = plan(waiting("w", 20, 1.0, remaining=50), d, e)
    assert p.admit == [] and p.held == ["w"] and sorted(p.decode) == ["d", "e"]
    assert plan(waiting("w", 20, 1.0, remaining=20), d, e).admit == ["w"]  # 0.4 s fits
    # two waiting: the second would be the third decode; it waits, nothing overtakes it
    p = plan_step([d], [waiting("v", 20, 0.5, remaining=50), waiting("w", 20, 1.0,
                                                                     remaining=50),
                        waiting("x", 20, 2.0, remaining=1)],
                  budget(decode_step_by_rows=by_rows, decode_step_seconds=0.010))
    assert p.admit == ["v"] and p.held == ["w"]
    # one already behind its target only asks that each step stay within it
    roomy = running("r", 40, tpot_slo=0.1, tpot_slack=5.0, remaining=100)
    behind = running("b", 40, tpot_slo=0.1, tpot_slack=-1.0, remaining=100)
    assert plan(waiting("w", 20, 1.0, remaining=50), behind, roomy).admit == ["w"]  # 30 ms
    tight = running("b", 40, tpot_slo=0.025, tpot_slack=-1.0, remaining=100)
    assert plan(waiting("w", 20, 1.0, remaining=50), tight, roomy).held == ["w"]
    # not measured: an admission costs no row
    assert plan_step([d, e], [waiting("w", 20, 1.0, remaining=50)], budget()).admit == ["w"]


def test_an_admission_that_breaks_a_slack_goes_in_where_holding_it_runs_later():
    # each row more: 20 ms a step; d has 1 s of slack and 100 steps to go (2 s more
    # admitted: 1 s past its target); held, w waits until d ends (100 steps of 30 ms)
    cost = dict(decode_step_seconds=0.03, prefill_token_seconds=0.001, now=10.0,
                decode_step_by_rows=(0.0, 0.03, 0.05))
    d = running("d", 40, tpot_slo=0.1, tpot_slack=1.0, remaining=100)

    def plan(deadline: float | None, slack: float = 1.0):
        w = waiting("w", 20, 9.0, ttft_deadline=deadline, remaining=100)
        return plan_step([dataclasses.replace(d, tpot_slack=slack)], [w],
                         budget(max_tokens=256, chunk=256, **cost))

    assert plan(None).held == ["w"]  # no TTFT target: d's slack holds it (LayerKV)
    assert plan(15.0).held == ["w"]  # held, it starts at 13.02 s: still within its target
    # due at 11 s: held, 2 s late; admitted, d is 1 s late
    assert plan(11.0).admit == ["w"]
    assert plan(11.0, slack=0.05).admit == ["w"]  # 1.95 s against 2.02
    assert plan(12.5).held == ["w"]  # 0.52 s late held, against d's 1 s admitted
    # past saving (its 20 tokens no longer fit before the deadline): LayerKV's rule again
    assert plan(10.01).held == ["w"]
