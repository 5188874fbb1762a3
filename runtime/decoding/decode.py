"""The decode loop: pick a token, feed it, repeat; the one loop every generation runs.

`LLM.generate` (engine.py), `Session.generate` (session.py, and through it programs and
agents) drive a `Decoder` over a prefilled request buffer:

    decoder = Decoder(adapter, buffer, decoding, position, limit=...)
    for token, delta, finished in decoder.steps(logits):   # logits: [V], for `position`
        ...                                                 # stream `delta`

What differs between callers is a hook, not another loop:
- stop strings, eos, max tokens and streaming text: the `sampling.Decoding` passed in;
- `constrain(token_ids, logits) -> logits`: edits every logits row before a pick
  (structured generation masks tokens here);
- `keep`: the logits after the last `keep` fed tokens are kept, so that a caller can
  roll the buffer back to an earlier token (`rollback`) without recomputing it;
- `draft=K`: speculative decoding with prompt-lookup drafts. The tokens that followed
  the latest earlier occurrence of the last n-gram (`LookupDrafter`) are fed with the
  picked token in ONE pass; each row then picks as a plain step would, and the draft
  is kept up to the first token the model did not pick. Every token is still picked
  from the model's own logits in order, so the output is the same as without drafts
  (bit-exact up to the last-ulp differences of a wider pass), greedy or seeded.

Generated tokens take positions `position, position + 1, ...` and attend to everything
before them. Units the prefill read in place stay read in place by every step where the
fused layers serve the steps (they read stored units as pieces, 16-bit ones at their own
width: a bfloat16 store halves the bytes a step reads); elsewhere they are copied into the
buffer before the first step (`materialize`: transformers' layers read one buffer).
"""

from __future__ import annotations

import collections
from typing import Callable, Iterator, Protocol, Sequence

import torch

from promptlang.errors import InvalidArgumentError
from promptlang.runtime.kv.assembler import KVBuffer
from promptlang.runtime.model import ModelAdapter
from promptlang.runtime.passes.prefill import extend, truncate
from promptlang.runtime.decoding.sampling import Decoding
from promptlang.runtime.fast import native

LOOKUP_NGRAM = 3       # the longest tail of the sequence that a draft lookup matches

Constrain = Callable[[Sequence[int], torch.Tensor], torch.Tensor]


class Drafter(Protocol):
    def propose(self, generated: Sequence[int], count: int) -> list[int]:
        """At most `count` guesses of the tokens after `generated` (all picked so far)."""


class LookupDrafter:
    """Prompt-lookup drafts: after a sequence (the request's tokens, then the generated
    ones), propose the tokens that followed the latest earlier occurrence of its longest
    tail of up to LOOKUP_NGRAM tokens. Answers that copy from a document copy runs of it.

    `candidates`: known continuations (e.g. earlier answers to the same question), tried
    first: the rest of the first one that agrees with every token generated so far.

    The n-gram index is built once (on the first proposal) and extended as tokens come,
    so a proposal costs a few dictionary look-ups, not a scan of the context."""

    def __init__(self, context: Sequence[int], ngram: int = LOOKUP_NGRAM,
                 candidates: Sequence[Sequence[int]] = ()):
        self.tokens = list(context)
        self.ngram = ngram
        self.candidates = [list(c) for c in candidates]
        self._context = len(self.tokens)
        self._next: dict[tuple[int, ...], int] = {}   # n-gram -> the index after its latest end
        self._indexed = 0                              # n-grams ending at or before it are in

    def propose(self, generated: Sequence[int], count: int) -> list[int]:
        """Up to `count` tokens to follow the context and `generated` (every token
        generated so far; the list only grows between calls)."""
        done = len(generated)
        for known in self.candidates:
            if len(known) > done and known[:done] == list(generated):
                return known[done:done + count]
        tokens = self.tokens
        tokens += generated[len(tokens) - self._context:]
        # n-grams ending before the newest token: the tail must not match itself
        for end in range(self._indexed + 1, len(tokens)):
            for n in range(1, min(self.ngram, end) + 1):
                self._next[tuple(tokens[end - n:end])] = end
        self._indexed = max(self._indexed, len(tokens) - 1)
        for n in range(min(self.ngram, len(tokens)), 0, -1):
            at = self._next.get(tuple(tokens[-n:]))
            if at is not None:
                return tokens[at:at + count]
        return []


class Decoder:
    """One generation on one buffer (see the module doc). `position` is where the first
    picked token goes; no token is picked at a position >= `limit` (None: no limit).
    After `steps` ends, `position` is the first position with no KV and `fed` counts
    the generated tokens whose KV the buffer holds (all picked ones but the last)."""

    def __init__(self, adapter: ModelAdapter, buffer: KVBuffer, decoding: Decoding,
                 position: int, *, limit: int | None = None, draft: int = 0,
                 drafter: Drafter | None = None, constrain: Constrain | None = None,
                 keep: int = 0, materialize: bool | None = None):
        self.adapter = adapter
        self.buffer = buffer
        self.decoding = decoding
        self.position = position
        self.limit = limit
        self.draft = draft
        self.drafter = drafter
        self.constrain = constrain
        if materialize is None:          # the fused layers read stored units in place
            fused = getattr(getattr(adapter, "fast", None), "decoder", None)
            materialize = fused is None or not fused.available()
        self.materialize = materialize
        self.start_length = buffer.length
        self.start_position = position
        self.fed = 0                     # generated tokens fed to the model and kept
        self.computed = 0                # tokens run through the model, rejected drafts too
        self.passes = 0                  # forward passes run
        self.first_logits: torch.Tensor | None = None
        self.recent = collections.deque(maxlen=keep) if keep else None   # (fed, logits [V])

    @torch.inference_mode()
    def steps(self, logits: torch.Tensor) -> Iterator[tuple[int | None, str, bool]]:
        """Yield (token id, text delta, finished) per picked token, from `logits` ([V],
        the prediction for `position`) onward; the last item has finished=True. When
        no position is left the generation ends with reason "length" (token None)."""
        decoding = self.decoding
        limit = self.limit
        self.first_logits = logits
        if limit is not None and self.position >= limit:
            yield None, decoding.finish("length"), True
            return
        token, delta, finished = self._pick(logits)
        while True:
            if finished:
                yield token, delta, True
                return
            yield token, delta, False
            if limit is not None and self.position + 1 >= limit:   # no position to pick at
                yield None, decoding.finish("length"), True
                return
            feed = [token] + self._propose()
            rows = self._feed(feed)                  # rows[i]: the prediction after feed[i]
            for kept in range(len(feed)):
                token, delta, finished = self._pick(rows[kept])
                if finished or kept == len(feed) - 1 or token != feed[kept + 1]:
                    break
                yield token, delta, False            # a drafted token the model picked
            self._keep(kept + 1, len(feed), rows)

    def rollback(self, count: int) -> torch.Tensor | None:
        """Keep the KV of the first `count` generated tokens only (count <= fed); returns
        the logits after them when kept (None: the caller recomputes the last one)."""
        truncate(self.buffer, self.start_length + count)
        self.position = self.start_position + count
        self.fed = count
        return self.first_logits if count == 0 else dict(self.recent or ()).get(count)

    def _pick(self, logits: torch.Tensor) -> tuple[int, str, bool]:
        # logits: [V]
        if self.constrain is not None:
            logits = self.constrain(self.decoding.token_ids, logits)
        return self.decoding.step(logits)

    def _propose(self) -> list[int]:
        """Draft tokens to feed after the picked one: no more than can still be picked,
        nor than positions are left."""
        if not self.draft:
            return []
        done = self.decoding.token_ids
        count = min(self.draft, self.decoding.params.max_new_tokens - len(done) - 1)
        if self.limit is not None:
            count = min(count, self.limit - self.position - 2)
        if count <= 0:
            return []
        if self.drafter is None:
            self.drafter = LookupDrafter(_in_position_order(self.buffer, self.start_length))
        return self.drafter.propose(done, count)

    def _feed(self, feed: list[int]) -> torch.Tensor:
        if self.materialize:
            self.buffer.materialize()
        rows = extend(self.adapter, self.buffer, feed,
                      range(self.position, self.position + len(feed)), len(feed) > 1, None, True)
        self.passes += 1
        self.computed += len(feed)
        return rows

    def _keep(self, kept: int, fed: int, rows: torch.Tensor) -> None:
        """The first `kept` of the `fed` tokens were the right ones: drop the rest."""
        if kept < fed:
            truncate(self.buffer, self.buffer.length - (fed - kept))
        if self.recent is not None:
            for i in range(kept):
                self.recent.append((self.fed + i + 1, rows[i]))
        self.fed += kept
        self.position += kept


def _in_position_order(buffer: KVBuffer, length: int) -> list[int]:
    """The token ids of the buffer's first `length` slots, sorted by position."""
    order = torch.argsort(buffer.positions[:length], stable=True)
    return buffer.token_ids[:length][order].tolist()


class BatchStepper:
    """Decoders stepped together: every `step()` feeds each live decoder's picked token in
    ONE forward pass (ModelAdapter.forward_batch: the linear layers read each weight once
    for all of them), each token seeing its own request's KV only; decoders join (`add`)
    and leave (finishing, or `remove`) between steps. Each decoder's output is the one it
    gives alone (`Decoder.steps`); drafts are not used. Where the batch cannot be fused the
    step runs request by request (the same results).

    A request whose prefill is still to run (`join`: a few tokens, e.g. a question after
    cached modules) has it run inside the next step with the decoders' tokens, as many as
    fit `adapter.max_batch_tokens`: the step reads the weights once for both, and the
    decoders do not wait for it. While fewer than `prefill_first_below` decoders are live,
    a step with prefills to run runs the first of them alone instead, one a step in the
    order they joined (its first token comes a combined step's extra work sooner; on a
    CPU, whose cores the prefills' rows fill, several together would make each wait for
    all: `bench serve` at 4 clients, TTFT p50 117-130 -> 97-107 ms; the few decoders wait
    a step each). Stored units are read in place by every request that holds them, never
    copied per request."""

    def __init__(self, adapter: ModelAdapter, prefill_first_below: int = 0):
        self.adapter = adapter
        self.prefill_first_below = prefill_first_below
        self.picked: dict[object, tuple[Decoder, int]] = {}    # key -> (decoder, next token)
        self.joining: dict[object, tuple[Decoder, object]] = {}   # key -> (decoder, pending)
        self.batched = 0                                       # fused passes of 2+ requests

    def __len__(self) -> int:
        return len(self.picked) + len(self.joining)

    def join(self, key, decoder: Decoder, pending) -> None:
        """Queue a request whose prefill is `pending` (results.PendingPrefill: its tokens,
        positions, and `finish(logits)`): the prefill runs in a coming step, and that step's
        events include the decoder's first pick."""
        self._check_model(decoder)
        self.joining[key] = (decoder, pending)

    @torch.inference_mode()
    def add(self, key, decoder: Decoder, logits: torch.Tensor) -> tuple[int | None, str, bool]:
        """Start `decoder` from `logits` ([V], for its position): its first pick, as
        (token id, text delta, finished); it joins the next steps unless finished."""
        self._check_model(decoder)
        decoder.first_logits = logits
        if decoder.limit is not None and decoder.position >= decoder.limit:
            return None, decoder.decoding.finish("length"), True
        token, delta, finished = decoder._pick(logits)
        if not finished:
            self.picked[key] = (decoder, token)
        return token, delta, finished

    def _check_model(self, decoder: Decoder) -> None:
        """A decoder stepped here runs on this model, or on a view of it (a seam adapter's,
        runtime/model/seam.py: stepped on its own)."""
        model = decoder.adapter
        if model is not self.adapter and getattr(model, "base", None) is not self.adapter:
            raise InvalidArgumentError("decoders stepped together must share one model")

    def remove(self, key) -> None:
        self.picked.pop(key, None)
        self.joining.pop(key, None)

    @torch.inference_mode()
    def step(self) -> list[tuple[object, int | None, str, bool]]:
        """One pass for every live decoder and the joining prefills that fit: (key, token
        id, text delta, finished) each."""
        native.adapt_torch_threads()            # fewer threads while other processes run
        events = []
        live = []
        for key, (d, token) in list(self.picked.items()):
            if d.limit is not None and d.position + 1 >= d.limit:   # no position to pick at
                del self.picked[key]
                events.append((key, None, d.decoding.finish("length"), True))
                continue
            live.append((key, d, [token], [d.position], None))
        first = bool(self.joining) and len(live) < self.prefill_first_below
        if first:
            live = []                            # few decode: the prefills go first, alone
        budget = self.adapter.max_batch_tokens - len(live)
        for key, (d, pending) in list(self.joining.items()):
            if live and (first or len(pending.token_ids) > budget):
                continue                         # the next step takes it
            del self.joining[key]
            budget -= len(pending.token_ids)
            live.append((key, d, list(pending.token_ids), list(pending.positions), pending))
        if not live:
            return events
        for _, d, ids, _, _ in live:
            if d.buffer.length + len(ids) > d.buffer.capacity:
                d.buffer.reserve(max(d.buffer.length + len(ids), int(d.buffer.capacity * 1.5) + 1))
        device = self.adapter.device
        items = [(torch.tensor(ids, device=device), torch.tensor(pos, device=device),
                  d.buffer.past(), pending is not None) for _, d, ids, pos, pending in live]
        # the decoders on this model in one pass; one on another view of it (a seam
        # adapter's) runs alone
        batched = [i for i, (_, d, _, _, pending) in enumerate(live)
                   if d.adapter is self.adapter and not (pending is not None and pending.bf16)]
        steps = None
        if len(batched) > 1:
            steps = self.adapter.forward_batch([items[i] for i in batched])
        rows: list[torch.Tensor | None] = [None] * len(live)
        if steps is not None:
            self.batched += 1
            for i, step in zip(batched, steps):
                ids, pos, _, _ = items[i]
                live[i][1].buffer.append(ids, pos)
                rows[i] = step.logits[-1]
        for i, (_, d, ids, pos, pending) in enumerate(live):   # the rest as each would alone
            if rows[i] is None:
                with self.adapter.passes_in(pending is not None and pending.bf16):
                    rows[i] = extend(d.adapter, d.buffer, ids, pos, False, None,
                                     pending is None)[-1]
        for (key, d, _, _, pending), row in zip(live, rows):
            if pending is not None:              # a prefill: the decoder starts here
                pending.finish(row)
                events.append((key, *self.add(key, d, row)))
                continue
            d.passes += 1
            d.computed += 1
            d._keep(1, 1, row[None])
            token, delta, finished = d._pick(row)
            events.append((key, token, delta, finished))
            if finished:
                del self.picked[key]
            else:
                self.picked[key] = (d, token)
        return events


def steps_together(decoders: Sequence[Decoder], logits: Sequence[torch.Tensor]
                   ) -> Iterator[tuple[int, int | None, str, bool]]:
    """Decode `decoders` together to the end (BatchStepper): yields (index of the decoder,
    token id, text delta, finished) as `Decoder.steps` would for each."""
    if not decoders:
        return
    model = decoders[0].adapter
    stepper = BatchStepper(getattr(model, "base", model))      # a seam view's own model
    for i, (d, first) in enumerate(zip(decoders, logits)):
        yield (i, *stepper.add(i, d, first))
    while len(stepper):
        yield from stepper.step()
