"""Across processes on the embedded SmolLM2: a conversation one process wrote to the store is
reused from disk by the next with the tokens recomputing gives, and a store whose entry bytes
were damaged is answered from recomputation, the corruption counted."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from jkv import LLM, SamplingParams
from jkv.config import HOST_CACHE_CAP
from jkv.store.tiers import PersistentTier

pytestmark = [pytest.mark.smollm2, pytest.mark.long]

SETTINGS = {"max_model_len": 512, "max_num_seqs": 2, "kv_cache_bytes": 64 << 20,
            "dtype": "float32"}
GREEDY = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)

_PROCESS = textwrap.dedent("""
    import json, sys
    from jkv import LLM, SamplingParams
    job = json.loads(sys.argv[1])
    with LLM(store_dir=job["store_dir"], **job["settings"]) as llm:
        out = llm.generate(job["prompt"], SamplingParams(max_tokens=10, temperature=0,
                                                         ignore_eos=True))[0]
        print(json.dumps({"tokens": out.token_ids, "stats": llm.stats()}))
""")


def in_new_process(store_dir, prompt: list[int]) -> dict:
    job = json.dumps({"store_dir": str(store_dir), "settings": SETTINGS, "prompt": prompt})
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    done = subprocess.run([sys.executable, "-c", _PROCESS, job], capture_output=True,
                          text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_conversation_survives_the_process_and_corruption_is_a_counted_miss(tmp_path):
    first = in_new_process(tmp_path, _prompt())
    assert first["stats"]["store"]["saves"] == 1
    follow_up = _prompt() + first["tokens"] + _prompt(seed=1)[:40]
    second = in_new_process(tmp_path, follow_up)
    recompute = LLM(enable_prefix_caching=False, **SETTINGS)
    assert second["tokens"] == recompute.generate(follow_up, GREEDY)[0].token_ids
    restored = second["stats"]["prefix_hit_tokens"]["disk"]
    assert restored == (len(_prompt()) + len(first["tokens"]) - 1) // 16 * 16
    assert second["stats"]["prompt_tokens_computed"] == len(follow_up) - restored

    # damage the newest entry's bytes where the OCDBT data files hold them
    tier = PersistentTier(tmp_path, 1 << 40)
    key = max(tier.keys(), key=tier.size)
    data = tier.get(key)
    rng = np.random.default_rng()
    damaged = 0
    for path in (tmp_path / "d").iterdir():
        raw = bytearray(path.read_bytes())
        at = raw.find(data[1 << 16: (1 << 16) + 4096])
        if at >= 0:
            for i in at + rng.choice(4096, 5, replace=False):
                raw[i] ^= 0x5A
            path.write_bytes(bytes(raw))
            damaged += 1
    assert damaged >= 1  # (a replaced entry may leave the same bytes in an older file)
    third_prompt = follow_up + [28, 29, 30]
    with LLM(store_dir=tmp_path, **SETTINGS) as third:  # (a third reader: this process)
        tokens = third.generate(third_prompt, GREEDY)[0].token_ids
        assert third.stats()["store"]["corrupt_entries"] == 1
    assert tokens == recompute.generate(third_prompt, GREEDY)[0].token_ids


def _prompt(seed: int = 0) -> list[int]:
    """A few hundred token ids of plain text-like ids (any ids do; fixed for the test)."""
    rng = np.random.default_rng(seed)
    return rng.integers(100, 40000, 200).tolist()


@pytest.fixture(scope="module")
def session_llm():
    llm = LLM(host_cache_bytes=1 << 30, max_model_len=256, max_num_seqs=2,
              kv_cache_bytes=64 << 20, dtype="float32")
    yield llm
    llm.close()


def test_session_prompt_drops_the_oldest_turns_after_the_system_prompt(session_llm):
    llm = session_llm
    system = {"role": "system", "content": "You are a terse assistant."}
    turns = []
    for i in range(12):
        turns += [{"role": "user", "content": f"Question {i}: what is {i} times {i + 3}?"},
                  {"role": "assistant", "content": f"It is {i * (i + 3)}. " * 3}]
    messages = [system] + turns + [{"role": "user", "content": "And 7 times 9?"}]
    ids, cut = llm.session_prompt(messages, reserve=40)
    assert cut is not None and len(ids) + 40 <= llm.max_model_len
    assert list(cut.source) == llm._template_ids(messages) and len(cut.source) > 256
    assert list(cut.source[: cut.keep]) + list(cut.source[cut.keep + cut.drop:]) == ids
    text = llm.tokenizer.decode(ids)
    assert "terse assistant" in llm.tokenizer.decode(ids[: cut.keep])  # the system prompt
    assert "Question 0:" not in text and "7 times 9" in text  # the oldest turns went
    assert text.rstrip().endswith("assistant")
    assert llm.session_prompt(messages[:3], reserve=40) == (llm.chat_prompt(messages[:3]),
                                                            None)
    with pytest.raises(ValueError, match="do not fit"):
        llm.session_prompt([system, {"role": "user", "content": "word " * 400}])


def test_an_overflowing_session_reuses_its_stored_kv_re_rotated(session_llm):
    llm = session_llm
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    messages = [{"role": "system", "content": "You are a helpful assistant."}]
    # long questions and short answers: prefill, not decode, fills the context
    for topic in ("rivers", "mountains", "deserts", "oceans", "forests"):
        question = f"Tell me a fact about {topic}, one that few people know and that is true. "
        messages.append({"role": "user", "content": question * 4})
        before = llm.stats()
        out = llm.chat(messages, params, session_id="long-chat")
        llm.store.flush()
        messages.append({"role": "assistant", "content": out.text})
        after = llm.stats()
        if after["store"]["rebased_tokens"] > before["store"]["rebased_tokens"]:
            break
    else:
        pytest.fail("the conversation never overflowed max_model_len with a stored history")
    rebased = after["store"]["rebased_tokens"] - before["store"]["rebased_tokens"]
    computed = after["prompt_tokens_computed"] - before["prompt_tokens_computed"]
    assert len(out.prompt_token_ids) < llm.max_model_len
    assert computed + rebased + (after["prefix_hit_tokens"]["device"]
                                 - before["prefix_hit_tokens"]["device"]) == len(
        out.prompt_token_ids)
    assert rebased >= 64 and out.text.strip()


def test_the_default_host_tier_keeps_a_chat_the_device_cache_dropped():
    with LLM(max_model_len=512, max_num_seqs=1, device_cache_bytes=0) as llm:  # no store args
        assert llm.store is not None
        assert 0 < llm.store.host.capacity <= HOST_CACHE_CAP  # a quarter of available memory
        params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
        messages = [{"role": "user", "content": "Tell me two facts about rivers. " * 8}]
        first = llm.chat(messages, params)
        llm.store.flush()
        messages += [{"role": "assistant", "content": first.text},
                     {"role": "user", "content": "And one about lakes?"}]
        llm.chat(messages, params)
        hits = llm.stats()["prefix_hit_tokens"]
        assert hits["device"] == 0 and hits["host"] >= 64, hits
