"""What a request gives back (`RequestOutput`) and the `Tracker` that builds it as tokens
arrive: detokenizing, stop strings and logprobs are per-request bookkeeping, apart from how
`LLM` loads, queues and serves."""

from __future__ import annotations

from dataclasses import dataclass, field

from jkv.engine.sampling import SamplingParams
from jkv.models.tokenizer import TextStream


@dataclass
class RequestOutput:
    """One finished request: generated text and token ids, and why it stopped."""

    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    finish_reason: str  # "stop" (EOS, stop string or stop token), "length" or "abort"
    prompt: str | None = None
    session_id: str | None = None
    # with SamplingParams(logprobs=n): per token, {token id: logprob} for it and the top n
    logprobs: list[dict[int, float]] | None = None
    # with SamplingParams(prompt_logprobs=n): the same per prompt token (None for the first)
    prompt_logprobs: list[dict[int, float] | None] | None = None


@dataclass
class Tracker:
    """Detokenizes one request as tokens arrive and decides when it stops."""

    tokenizer: object
    params: SamplingParams
    stop_ids: frozenset
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    emitted: int = 0
    finish_reason: str | None = None
    # with logprobs: per token (id, logprob, top ids, top logprobs); `taken` of them sent
    logprobs: list[tuple[int, float, list[int], list[float]]] = field(default_factory=list)
    taken: int = 0
    # with prompt_logprobs: the scheduler's per prompt token (logprob, top ids, top logprobs)
    prompt_entries: list | None = None
    prompt_ids: list[int] | None = None
    stream: TextStream | None = None  # the incremental detokenizer (on the first token)

    def take_logprobs(self) -> list:
        """Logprob entries not yet handed out (a stream attaches them to its next chunk)."""
        out, self.taken = self.logprobs[self.taken:], len(self.logprobs)
        return out

    def logprob_dicts(self) -> list[dict[int, float]] | None:
        if self.params.logprobs is None:
            return None
        return [{tok: lp, **dict(zip(ids, lps, strict=True))}
                for tok, lp, ids, lps in self.logprobs]

    def prompt_logprob_dicts(self) -> list[dict[int, float] | None] | None:
        if self.params.prompt_logprobs is None or self.prompt_entries is None:
            return None
        return [None if e is None else {tok: e[0], **dict(zip(e[1], e[2], strict=True))}
                for tok, e in zip(self.prompt_ids, self.prompt_entries, strict=True)]

    def add(self, token: int) -> bool:
        """Take the next token: True when the request stops here. The text grows by what the
        token completes (`TextStream`), and stop strings are looked for in the new text only:
        no work per token grows with the output."""
        self.token_ids.append(token)
        if token in self.stop_ids:
            self.finish_reason = "stop"
            return True
        if self.tokenizer is None:
            return False
        if self.stream is None:
            self.stream = TextStream(self.tokenizer)
        before = max(len(self.stream.text) - self.stream.hold, 0)
        self.stream.add(token)
        self.text = self.stream.text
        for s in self.params.stop or ():
            idx = self.text.find(s, max(0, before - len(s) + 1))
            if idx >= 0:
                self.text = self.text[:idx]
                self.finish_reason = "stop"
                return True
        return False

    def delta(self, final: bool = False) -> str:
        """Text not yet streamed, holding back what could still start a stop string (or
        still change: `TextStream.hold`)."""
        hold = 0 if final else max([len(s) - 1 for s in self.params.stop or ()]
                                   + [self.stream.hold if self.stream else 0])
        end = max(self.emitted, len(self.text) - hold)
        out, self.emitted = self.text[self.emitted:end], end
        return out
