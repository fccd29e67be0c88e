"""The offline API on the embedded SmolLM2: batching, stopping, seeds, chat, bad input."""

import pytest

from jkv import LLM, SamplingParams

pytestmark = pytest.mark.smollm2


@pytest.fixture(scope="module")
def llm():
    return LLM(max_model_len=256, max_num_seqs=4, kv_cache_bytes=64 << 20)


GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


def test_text_and_token_prompts_agree_and_batching_does_not_change_tokens(llm):
    prompts = ["The capital of France is", "List three fruits:", "2 + 2 =",
               "A short poem about rain:", "The opposite of hot is"]
    batched = llm.generate(prompts, GREEDY)  # 5 prompts over max_num_seqs=4: two batches
    for p, out in zip(prompts, batched, strict=True):
        alone = llm.generate(llm.encode(p), GREEDY)[0]
        assert alone.token_ids == out.token_ids
        assert out.prompt == p and alone.prompt is None
        assert len(out.token_ids) == 12 and out.finish_reason == "length"


def test_stop_string_truncates_text_and_finishes(llm):
    full = llm.generate("The capital of France is", SamplingParams(max_tokens=20, temperature=0,
                                                                     ignore_eos=True))[0]
    assert "." in full.text
    out = llm.generate("The capital of France is",
                       SamplingParams(max_tokens=20, temperature=0, stop="."))[0]
    assert out.finish_reason == "stop"
    assert out.text == full.text[: full.text.index(".")]


def test_stop_token_ids_and_eos(llm):
    full = llm.generate("Hello", GREEDY)[0]
    third = full.token_ids[2]
    out = llm.generate("Hello", SamplingParams(max_tokens=12, temperature=0,
                                               stop_token_ids=[third], ignore_eos=True))[0]
    assert out.finish_reason == "stop"
    assert out.token_ids == full.token_ids[: full.token_ids.index(third) + 1]


def test_seeded_sampling_is_reproducible(llm):
    sp = SamplingParams(max_tokens=16, temperature=1.0, seed=1234, ignore_eos=True)
    a = llm.generate("Tell me a story:", sp)[0]
    b = llm.generate("Tell me a story:", sp)[0]
    assert a.token_ids == b.token_ids
    outs = [llm.generate("Tell me a story:", SamplingParams(max_tokens=16, temperature=1.0,
                                                            seed=s, ignore_eos=True))[0]
            for s in range(4)]
    assert len({tuple(o.token_ids) for o in outs}) > 1, "different seeds gave identical samples"


def test_streamed_deltas_join_to_the_final_text(llm):
    ids = llm.encode("Count from one to ten: one, two,")
    pieces: list[str] = []
    [t] = llm.run([ids], [SamplingParams(max_tokens=16, temperature=0, stop=["seven"])],
                  on_delta=lambda i, d: pieces.append(d))
    assert "".join(pieces) == t.text
    assert "seven" not in t.text


def test_chat_applies_the_template(llm):
    out = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                   SamplingParams(max_tokens=24, temperature=0), session_id="s1")
    assert "Paris" in out.text
    assert out.session_id == "s1"
    assert out.finish_reason in ("stop", "length")


@pytest.mark.parametrize("messages,field", [([], "messages"),
                                            ([{"role": "wizard", "content": "x"}], "role"),
                                            ([{"role": "user", "content": 3}], "content"),
                                            ([{"role": "user", "content": "\ud800"}],
                                             r"messages\[0\]\.content is not valid Unicode")])
def test_chat_rejects_bad_messages(llm, messages, field):
    with pytest.raises(ValueError, match=field):
        llm.chat(messages)


def test_bad_prompts_raise_value_errors(llm):
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate([1] * 300)
    with pytest.raises(ValueError, match="empty"):
        llm.generate("")
    with pytest.raises(ValueError, match="prompt is not valid Unicode"):
        llm.generate("a\udfff")
    with pytest.raises(ValueError, match="token ids"):
        llm.generate([[10**9]])
    with pytest.raises(ValueError, match="sampling_params"):
        llm.generate(["a", "b"], [GREEDY])


def test_steady_workload_does_not_recompile(llm):
    llm.generate(["one two three"] * 2, GREEDY)
    compiles = llm.engine.num_compiles
    llm.generate(["four five six"] * 2, GREEDY)
    llm.generate(["seven eight nine ten"] * 2, SamplingParams(max_tokens=12, seed=3))
    assert llm.engine.num_compiles == compiles


def test_a_random_model_at_a_presets_shapes_serves_token_ids():
    """random:<preset> (benchmarks at a real model's shapes without its files): random
    weights, no tokenizer, so prompts are token ids and text prompts are a clear error."""
    llm = LLM("random:smollm2-135m", max_model_len=64, max_num_seqs=2, prefill_chunk=16,
              kv_cache_bytes=32 << 20, host_cache_bytes=0)
    assert llm.cfg.num_layers == 30 and llm.tokenizer is None
    [out] = llm.generate([[5, 6, 7, 8, 9]], SamplingParams(max_tokens=3, temperature=0,
                                                           ignore_eos=True))
    assert len(out.token_ids) == 3 and all(0 <= t < 49152 for t in out.token_ids)
    deltas, done = [], []  # a stream still sees each token arrive (with no text)
    llm.submit([5, 6, 7], SamplingParams(max_tokens=4, ignore_eos=True),
               on_delta=lambda text, entries: deltas.append(text), on_finish=done.append)
    while not done:
        llm.scheduler.step()
    assert deltas == [""] * 4 and done[0].token_ids and len(done[0].token_ids) == 4
    with pytest.raises(ValueError, match="tokenizer"):
        llm.generate("some text", GREEDY)
    with pytest.raises(ValueError, match="LoadConfig.model"):
        LLM("random:no-such-model")
