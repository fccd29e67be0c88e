"""The serving loop's warm-up (`jkv.engine.warmup.Warmup`, the server's default on a CPU):
while the loop has no work it compiles what a lone request takes, so a first request after
it compiles nothing; a request arriving during it runs, on the loop's own thread between
two shapes, and gives the tokens it gives without one."""

from __future__ import annotations

import contextlib
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_engine_formats import TINY

from jkv.config import CacheConfig, EngineConfig, StoreConfig
from jkv.engine.engine import Engine
from jkv.engine.sampling import SamplingParams
from jkv.engine.warmup import Warmup
from jkv.models.loaders import random_params
from jkv.sched.scheduler import Request, Scheduler, generate_all
from jkv.sched.step_costs import compilations


@pytest.fixture(scope="module")
def tiny_params():
    return random_params(TINY, seed=3, dtype=jnp.float32)


def engine(params, policy: str) -> Engine:
    return Engine(TINY, params, cache=CacheConfig(page_size=8, kv_cache_bytes=8 << 20,
                                                  kv_policy=policy),
                  config=EngineConfig(max_model_len=128, max_num_seqs=4, prefill_chunk=32,
                                      attention_backend="xla"))


@contextlib.contextmanager
def serving(params, policy: str):
    """(scheduler, warm-up): a scheduler over a fresh engine (with a KV store: a finished
    request is saved) whose loop runs on its own thread, with the warm-up as its idle work."""
    sched = Scheduler(engine(params, policy), store=StoreConfig(host_cache_bytes=64 << 20))
    warm = Warmup(sched.engine)
    stop = threading.Event()
    loop = threading.Thread(target=sched.serve, args=(stop, warm), daemon=True)
    loop.start()
    try:
        yield sched, warm
    finally:
        stop.set()
        sched.wake()
        loop.join()
        sched.close()


def answer(sched: Scheduler, prompt: list[int], n: int, warm: Warmup) -> tuple[Request, bool]:
    """`prompt` through the running loop, greedy for `n` tokens; waits for its end. Returns
    it and whether the warm-up had ended when it did."""
    done, warmed = threading.Event(), []
    r = Request(prompt, SamplingParams(max_tokens=n, temperature=0),
                on_finish=lambda _: (warmed.append(warm.done.is_set()), done.set()))
    sched.add(r)
    assert done.wait(120)
    return r, warmed[0]


@pytest.mark.parametrize("policy", ["none", "leankv"])
def test_a_first_request_after_the_warm_up_compiles_nothing(tiny_params, policy):
    jax.clear_caches()  # engines share compilations: start from none
    rng = np.random.default_rng()
    with serving(tiny_params, policy) as (sched, warm):
        assert warm.shapes == [(1, 1), (1, 16), (1, 32)]  # one row's, of the 8 step shapes
        assert warm.done.wait(300)
        before = compilations()
        prompt = rng.integers(0, TINY.vocab_size, int(rng.integers(2, 32))).tolist()
        r, _ = answer(sched, prompt, int(rng.integers(2, 12)), warm)
        sched.store.flush()  # its save written
        assert r.finish_reason == "length"
        assert compilations() == before


def test_a_request_during_the_warm_up_runs_and_gives_its_own_tokens(tiny_params):
    jax.clear_caches()  # (the warm-up has shapes left to compile when the request comes)
    prompt = np.random.default_rng().integers(0, TINY.vocab_size, 40).tolist()
    with serving(tiny_params, "leankv") as (sched, warm):
        r, warmed = answer(sched, prompt, 8, warm)
        assert not warmed  # it did not wait for the whole warm-up
        assert warm.done.wait(300)  # which ends after it
    want = Request(prompt, SamplingParams(max_tokens=8, temperature=0))
    generate_all(Scheduler(engine(tiny_params, "leankv")), [want])
    assert r.output == want.output and len(r.output) == 8
