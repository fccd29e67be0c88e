"""LayerKV's layer-major prefill: a prompt with layers on the host runs one layer at a time
over all of its tokens, so each offloaded layer's pages are taken once, filled by every
part of the prompt, and sent out once (LayerKV 3.3: the prefill computes layer by layer and
each layer's KV leaves while the next one computes).

Fed chunk by chunk through every layer instead, each chunk would bring back every offloaded
layer's earlier chunks: the prompt's KV crosses the bus about chunks / 2 times (an 8K prompt
in 512-token chunks: 8 times; on a GPU that makes its prefill with no layer resident several
times as slow as the resident one). A step runs a range of layers (`Row.layer_span`) over
the whole prompt, in calls of at most `prefill_chunk` tokens (the compiled prefill shapes);
the calls' hidden states wait on the device between steps (the prompt's tokens x the hidden
size: about a layer's KV of it), and the step with the last layer samples the first token.
The scheduler gives a step as many layers as its token budget buys (`layers_for`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from jkv.engine.runner import Batch, ModelRunner, Row
from jkv.kv.layer_offload import LayerOffload
from jkv.kv.manager import KVCacheManager


@dataclass
class _Pending:
    """A prompt part way through its layers: what it feeds, each call's batch, hidden
    states and per-call inputs, and the first layer not yet run."""

    tokens: tuple[int, ...]
    calls: list[list]  # [Batch, x, inputs] per call
    ahead: int  # pages its resident layers took for the prompt (the slot holds them)
    next_layer: int = 0


def layers_for(tokens: int, pending: int, num_layers: int, done: int) -> int:
    """Layers of a `pending`-token prompt that cost about what `tokens` prompt tokens through
    every layer do (at least one, at most those left after `done`)."""
    return max(1, min(num_layers - done, math.ceil(tokens * num_layers / max(pending, 1))))


class LayerMajor:
    """Prompts fed layer-major, by slot; see the module docstring."""

    def __init__(self, cache: KVCacheManager, runner: ModelRunner, layers: LayerOffload,
                 num_layers: int, chunk: int) -> None:
        self.cache, self.runner, self.layers = cache, runner, layers
        self.num_layers, self.chunk = num_layers, chunk
        self._pending: dict[int, _Pending] = {}

    def next_layer(self, slot: int) -> int:
        """The first layer `slot`'s next layer-major step runs (0: none under way)."""
        p = self._pending.get(slot)
        return 0 if p is None else p.next_layer

    def check(self, row: Row) -> None:
        """ValueError unless `row` continues its slot's prompt where it stopped."""
        first, last = row.layer_span
        if not row.tokens:
            raise ValueError("a layer-major prefill row feeds 1 token at least, got none")
        if not 0 <= first < last <= self.num_layers:
            raise ValueError(f"Row.layer_span must be 0 <= first < last <= {self.num_layers}, "
                             f"got {row.layer_span}")
        p = self._pending.get(row.slot)
        if first != (0 if p is None else p.next_layer):
            raise ValueError(f"slot {row.slot}'s layer-major prefill continues at layer "
                             f"{self.next_layer(row.slot)}, not {first}")
        if p is not None and tuple(row.tokens) != p.tokens:
            raise ValueError(f"slot {row.slot}'s layer-major prefill feeds the tokens it "
                             "started with")
        if row.targets is not None:
            raise ValueError("a layer-major prefill gives no prompt logprobs")

    def run(self, row: Row, held: int) -> tuple | None:
        """Dispatch layers `row.layer_span` of `row`'s prompt (the slot holds `held` tokens before
        it); after the model's last layer, the sampled token as `ModelRunner.head` gives it,
        else None. Offloaded layers are brought in (their pages for the whole prompt) before
        they run and sent out after."""
        c, first, last = self.cache, *row.layer_span
        p = self._pending.get(row.slot)
        if p is None:  # (the step has just given its resident layers the prompt's pages)
            p = self._pending[row.slot] = _Pending(
                tuple(row.tokens), self._embed(row, held),
                self.cache.pages_to_grow(row.slot, len(row.tokens)))
        total = held + len(row.tokens)
        offloaded = c.offloaded.get(row.slot, {})

        def through_layers(pool, filling, _pages, _tiers):
            for index in range(first, last):
                moved = index in offloaded
                if moved:
                    pool = self.layers.bring(row.slot, index, total, pool)
                weights = self.runner.layer_weights(index)  # once for all the prompt's calls
                for call in p.calls:
                    call[1], pool, filling, _ = self.runner.layer(
                        index, pool, filling, c.tables.pages, call[1], call[2],
                        weights=weights)
                if moved:
                    self.layers.send(row.slot, index, total, pool)
            return None, pool, filling, None

        c.run_model(through_layers)
        p.next_layer = last
        if last < self.num_layers:
            return None
        del self._pending[row.slot]
        batch, x, _ = p.calls[-1]
        return self.runner.head(x, batch)

    def _embed(self, row: Row, held: int) -> list[list]:
        calls: list[list] = []
        for i in range(0, len(row.tokens), self.chunk):
            part = Row(row.slot, row.tokens[i:i + self.chunk], row.sampling, row.key,
                       row.num_generated)
            batch: Batch = self.runner.batch([part], [held + i])
            x, inputs = self.runner.embed(batch)
            calls.append([batch, x, inputs])
        return calls

    def warmup(self) -> None:
        """Compile a layer call given its own weights for every one-row shape (where the
        weights are not views: a GPU), on the scratch slot, so no prompt compiles."""
        c = self.cache
        weights = self.runner.layer_weights(0)
        if weights is None:
            return
        for rows, tokens in self.runner.shapes():
            if rows == 1:
                batch = self.runner.batch([], [], padded_rows=1, padded_tokens=tokens)
                x, inputs = self.runner.embed(batch)
                c.run_model(lambda pool, filling, pages, _, x=x, inputs=inputs:
                            (None, *self.runner.layer(0, pool, filling, pages, x, inputs,
                                                      weights=weights)[1:3], None))

    def drop(self, slot: int) -> int:
        """Forget `slot`'s prompt under way (its sequence is closing); returns the pages its
        resident layers took for it, which the slot's count of tokens held does not show."""
        p = self._pending.pop(slot, None)
        return 0 if p is None else p.ahead
