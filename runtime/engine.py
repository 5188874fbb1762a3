"""The engine: `load()` a model, register schemas, and serve prompts from cached modules.

    llm = load()                                   # the embedded default model
    llm.add_schema(open("travel.pml").read())      # or a nodes.Schema, or a path
    result = llm.generate('<prompt schema="travel"><trip-plan duration="3 days"/>...</prompt>')
    print(result.text, result.timings)

A request goes: bind (prompt -> BoundPrompt) -> retrieve (each unit's KV from the
store, encoded on a miss) -> assemble (into a pooled buffer) -> prefill (the
uncached tokens, one pass; prefill.py) -> decode (decode.py). `_open` runs the steps
up to the prefill and returns an `Opened` request, which `generate` decodes, `prefill`
copies out and `open` hands to a Session. Every check that can reject a request runs
before anything is encoded, so a rejected request leaves the store as it was.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from dataclasses import dataclass
from typing import Callable, Generator

import torch

from promptlang.errors import (ConfigError, ContextLengthError, EmptyPromptError,
                               InvalidArgumentTypeError, TokenizerMismatchError,
                               UnknownSchemaError, UnsupportedModelError)
from promptlang.pml import nodes
from promptlang.pml.binding import BoundPrompt, bind
from promptlang.pml.layout import SchemaLayout, lay_out
from promptlang.runtime.kv.assembler import Assembler, KVBuffer, request_keys
from promptlang.runtime.decoding.constrain import Constraint
from promptlang.runtime.decoding.open_decode import Generation
from promptlang.runtime.decoding.healing import heal_point
from promptlang.runtime.kv.unit import UnitKV
from promptlang.runtime.passes.encoder import EncodeStats, UnitEncoder
from promptlang.runtime.model import ModelAdapter, adapt
from promptlang.runtime.model import heap
from promptlang.runtime.model.seam import SeamModel, find_seam_adapter, load_seam
from promptlang.runtime.recompute import (DEFAULT_POLICY, NO_RECOMPUTE, Recompute,
                                          RecomputePlan, candidates, choose_positions, exact,
                                          parallel_contexts, schema_policy)
from promptlang.runtime.recompute import contiguous
from promptlang.runtime.recompute.contiguous import Renumbering
from promptlang.runtime.recompute.primer import primed_units
from promptlang.runtime.passes.probe import probe_choice
from promptlang.runtime.passes.prefill import baseline_prefill, prefill, uncached_tokens, with_last
from promptlang.runtime.decoding.results import Opened, PendingPrefill, Prefilled, Result, Timings
from promptlang.runtime.decoding.sampling import SamplingParams, options_to_params
from promptlang.runtime.fast import native
from promptlang.runtime.sources import read_prompt, read_schema
from promptlang.runtime.kv.tails import DEFAULT_BUDGET as TAIL_BUDGET, TailCache, plan_tail


class TextStream:
    """An iterator of text deltas; `result` is set once it is exhausted."""

    def __init__(self, deltas: Generator[str, None, Result]):
        self._deltas = deltas
        self.result: Result | None = None

    def __iter__(self) -> "TextStream":
        return self

    def __next__(self) -> str:
        try:
            return next(self._deltas)
        except StopIteration as done:
            if done.value is not None:       # the generator's return value: the Result
                self.result = done.value
            raise

    def close(self) -> None:
        """Stop early (the request's buffer goes back to the pool)."""
        self._deltas.close()


@dataclass(frozen=True, kw_only=True)
class _Request:
    """How `LLM._open` serves one request (what generate, prefill, open and start ask)."""

    schema: object = None                # a schema to register first (add_schema's input)
    baseline: bool = False               # no reuse: every token prefilled contiguously
    recompute: object = None             # the request's policy (None: schema's, else LLM's)
    room: int = 1                        # tokens to generate: the buffer's room after it
    add_generation_prompt: bool = True   # append the assistant's prefix (bind's option)
    all_logits: bool = False             # the prefill's logits for every token, not the last
    started: float = 0.0                 # time.perf_counter() when the request was made
    heal: bool = False                   # take the prompt's last token off (token healing)
    defer: int = 0                       # a prefill of at most this many tokens is left in
                                         # Opened.pending for the caller to run in a batch


@dataclass(frozen=True, kw_only=True)
class _Retrieved:
    """A request's units, retrieved (`LLM._retrieve`)."""

    keys: dict[str, str]                 # unit id -> its store key (+ the request's side)
    bf16: bool                           # the prompt's passes on the bfloat16 twin (compute.py)
    context_of: Callable                 # unit id -> the tokens it was encoded after
    missed: dict                         # unit id -> its positions that missed request tokens
    served: dict                         # unit id -> (key, UnitKV) of an exact entry
    numbers: Renumbering | None          # contiguous positions (recompute/contiguous.py)
    primed: frozenset[str]               # units served primed (recompute/primer.py)
    stats: EncodeStats                   # what encoding the misses cost, and tiers hit
    by_unit: dict[str, UnitKV]           # unit id -> its KV as encoded apart
    units: list[tuple[str, UnitKV]]      # (key, KV) of every non-empty unit, as served


@dataclass(frozen=True, kw_only=True)
class _Selected:
    """What the request's policy computes again (`LLM._select`)."""

    plan: RecomputePlan                  # the cached positions computed again
    contexts: object                     # APE's ParallelContexts, or None
    approximate: int                     # cached tokens served as encoded apart though they
                                         # missed request tokens before them
    seam: SeamModel | None = None        # policy tuned: what the tokens after the last
                                         # cached unit, and the decode steps, run on


class LLM:
    """A model with its tokenizer, module store and registered schemas."""

    decode_room = 1024     # generated tokens a request buffer holds before it grows

    def __init__(self, adapter: ModelAdapter, tokenizer, store=None, *, isolate: bool = False,
                 recompute: "str | Recompute" = DEFAULT_POLICY, exact_reuse: bool = True,
                 tail_budget_bytes: int = TAIL_BUDGET):
        if store is None:
            from promptlang.runtime.store import ModuleStore
            store = ModuleStore(device=adapter.device)
        self.adapter = adapter
        self.tokenizer = tokenizer
        self.store = store
        # where `load` spent its time, in seconds: file, weights, tokenizer, adapter, blocks
        self.load_steps: dict[str, float] = {}
        self.isolate = isolate
        self.recompute = _policy(recompute)      # used when neither request nor schema says
        self.exact_reuse = exact_reuse           # keep and serve exact units (recompute/exact.py)
        self.encoder = UnitEncoder(adapter, store, tokenizer.fingerprint, isolate=isolate)
        self.assembler = Assembler(adapter)
        self.tails = TailCache(tail_budget_bytes)    # prompt tails seen before (tails.py)
        self.seam: SeamModel | None = None           # policy tuned's (use_seam_adapter)
        self.seam_encoder: UnitEncoder | None = None  # its units' encoder, if it encodes
        self._schemas: dict[str, tuple[nodes.Schema, SchemaLayout | None]] = {}
        self._lock = threading.Lock()

    @classmethod
    def from_model(cls, hf_model: torch.nn.Module, tokenizer, *, store=None,
                   isolate: bool = False, recompute: "str | Recompute" = DEFAULT_POLICY,
                   exact_reuse: bool = True) -> "LLM":
        """Wrap an already loaded transformers causal LM (e.g. a tiny test model)."""
        return cls(adapt(hf_model), tokenizer, store, isolate=isolate, recompute=recompute,
                   exact_reuse=exact_reuse)

    @property
    def max_positions(self) -> int | None:
        limits = [n for n in (self.adapter.max_positions, self.tokenizer.max_positions) if n]
        return min(limits) if limits else None

    @property
    def encoder_calls(self) -> int:
        seam = 0 if self.seam_encoder is None else self.seam_encoder.calls
        return self.encoder.calls + seam

    # --- schemas ----------------------------------------------------------------------------

    def add_schema(self, schema) -> nodes.Schema:
        """Register a schema (nodes.Schema, SchemaLayout, PML text or a path to a .pml file)
        under its name; a schema of the same name is replaced."""
        layout = None
        if isinstance(schema, SchemaLayout):
            self._check_layout(schema)
            layout = schema
            schema = schema.schema
        elif isinstance(schema, (str, os.PathLike)) and not isinstance(schema, nodes.Schema):
            schema = read_schema(schema)
        if not isinstance(schema, nodes.Schema):
            raise InvalidArgumentTypeError(f"not a schema: {type(schema).__name__}")
        with self._lock:
            known = self._schemas.get(schema.name)
            if known is None or known[0] != schema or layout is not None:
                self._schemas[schema.name] = (schema, layout)
        return schema

    def remove_schema(self, name: str) -> bool:
        """Forget the schema registered as `name` (its units' KV stays in the store, under
        keys of their own, until the store evicts it); False if none was."""
        with self._lock:
            return self._schemas.pop(name, None) is not None

    def layout(self, schema) -> SchemaLayout:
        """The layout of a registered schema (by name or node), memoised."""
        name = schema if isinstance(schema, str) else schema.name
        with self._lock:
            entry = self._schemas.get(name)
        if entry is None:
            raise UnknownSchemaError(f"unknown schema {name!r} (registered: "
                                     f"{', '.join(sorted(self._schemas)) or 'none'})")
        schema, layout = entry
        if layout is None:
            layout = lay_out(schema, self.tokenizer)
            self._check_fits(layout.end, f"schema {schema.name!r}", schema.span)
            with self._lock:
                if self._schemas.get(name, (None,))[0] is schema:
                    self._schemas[name] = (schema, layout)
        return layout

    def encode(self, schema) -> int:
        """Register `schema` and encode every cached unit the store lacks; returns how many."""
        schema = self.add_schema(schema)
        return self.encoder.warm(self.layout(schema))

    # --- requests ---------------------------------------------------------------------------

    def bind(self, prompt, *, schema=None, add_generation_prompt: bool = True) -> BoundPrompt:
        """Parse (if needed) and bind `prompt` to its registered schema. A prompt that uses
        chat roles and leaves none open gets the assistant's prefix appended."""
        doc = self._prompt_doc(prompt, schema)
        with self._lock:
            entry = self._schemas.get(doc.schema)
        if entry is None:
            raise UnknownSchemaError(
                f"unknown schema {doc.schema!r} (registered: "
                f"{', '.join(sorted(self._schemas)) or 'none'})", doc.span)
        bound = bind(doc, self.layout(doc.schema), self.tokenizer,
                     add_generation_prompt=add_generation_prompt)
        if bound.cached_token_count + bound.uncached_token_count == 0:
            raise EmptyPromptError("the prompt is empty: nothing to compute", doc.span)
        self._check_fits(bound.end, "the prompt", doc.span)
        return bound

    def generate(self, prompt, *, schema=None, stream: bool = False, baseline: bool = False,
                 recompute=None, sampling: SamplingParams | None = None, **options):
        """Answer `prompt` (PML text, a nodes.PromptDoc, or an object with `.schema` and
        `.doc`). Returns a Result, or with stream=True a TextStream of text deltas.
        options: the fields of SamplingParams (max_new_tokens=256, temperature=0.0,
        top_p=1.0, top_k=0, seed=None, stop=(), stop_token_ids=(), draft=0, and one of
        regex=, json_schema=, grammar= for structured output: runtime/decoding/constrain.py),
        applied on top of `sampling` when given. recompute: a policy ("none", "first:K",
        "deviation:F", "exact", "seams", "ape" or a Recompute; docs/RECOMPUTE.md); None: the
        schema's `recompute` attribute, else the LLM's."""
        started = time.perf_counter()
        params = options_to_params(sampling, **options)
        constraint = Constraint.of(params, self.tokenizer)    # a bad one fails before the prefill
        heal = params.token_healing and constraint is None
        request = _Request(schema=schema, baseline=baseline, recompute=recompute,
                           room=params.max_new_tokens, started=started, heal=heal)
        opened, _ = self._open(prompt, request)
        deltas = self._decode(opened, params, constraint)
        if stream:
            return TextStream(deltas)
        while True:
            try:
                next(deltas)
            except StopIteration as done:
                return done.value

    def prefill(self, prompt, *, schema=None, baseline: bool = False,
                all_logits: bool = True, recompute=None) -> Prefilled:
        """Run a request's prefill only and return its logits and KV (copies)."""
        started = time.perf_counter()
        request = _Request(schema=schema, baseline=baseline, recompute=recompute, room=1,
                           all_logits=all_logits, started=started)
        opened, logits = self._open(prompt, request)
        buffer = opened.buffer
        n = buffer.length
        try:
            opened.timings.total = time.perf_counter() - started
            return Prefilled(logits=logits.clone(),
                             keys=buffer.keys[:, :, :n].clone(),
                             values=buffer.values[:, :, :n].clone(),
                             positions=buffer.positions[:n].clone(),
                             token_ids=buffer.token_ids[:n].clone(),
                             cached_length=opened.cached_tokens,
                             timings=opened.timings,
                             bound=opened.bound,
                             recompute=opened.recompute,
                             exact=opened.exact,
                             renumbered=opened.renumbered,
                             approximate_tokens=opened.approximate_tokens,
                             parallel=_context_positions(buffer),
                             primed=opened.primed)
        finally:
            self.assembler.release(buffer)
            heap.release_if_grown()

    def open(self, prompt, *, schema=None, baseline: bool = False, room: int = 256,
             add_generation_prompt: bool = False, recompute=None) -> Opened:
        """Bind, retrieve, assemble and prefill `prompt` like `generate`, and hand the request's
        KV buffer to the caller instead of decoding: the start of a Session. `room`: tokens
        the buffer holds after the prompt before it grows."""
        started = time.perf_counter()
        request = _Request(schema=schema, baseline=baseline, recompute=recompute,
                           room=max(1, room), add_generation_prompt=add_generation_prompt,
                           started=started)
        opened, _ = self._open(prompt, request)
        opened.timings.total = time.perf_counter() - started
        return opened

    def session(self, prompt, *, schema=None, baseline: bool = False,
                add_generation_prompt: bool = False, recompute=None):
        """A multi-turn Session on `prompt` that keeps its KV across turns
        (runtime/conversation/session.py); `recompute` applies to the prompt's cached tokens."""
        from promptlang.runtime.conversation.session import Session
        return Session(self, prompt, schema=schema, baseline=baseline,
                       add_generation_prompt=add_generation_prompt, recompute=recompute)

    # --- the phases ---------------------------------------------------------------------------

    def _open(self, prompt, request: _Request) -> tuple[Opened, torch.Tensor | None]:
        """Bind, retrieve, assemble and prefill; returns the open request (the caller
        releases its buffer) and the prefill's logits ([Q, V] with all_logits, else [1, V];
        None when the prefill is left pending)."""
        native.adapt_torch_threads()            # fewer threads while other processes run
        bound, healed, policy = self._bind_request(prompt, request)
        t = Timings(bind=time.perf_counter() - request.started)
        room = self._room(bound, request.room)
        if request.baseline:
            return self._open_baseline(bound, healed, t, room, request)
        mark = time.perf_counter()
        retrieved = self._retrieve(bound, policy)
        t.retrieve = time.perf_counter() - mark
        t.encode = retrieved.stats.seconds
        mark = time.perf_counter()
        selected = self._select(bound, policy, retrieved)
        t.select = time.perf_counter() - mark
        return self._assemble_and_prefill(bound, healed, t, room, request, retrieved, selected)

    def _bind_request(self, prompt, request: _Request) -> tuple[BoundPrompt, str, Recompute]:
        """The bound prompt (its last token taken off where token healing applies:
        runtime/decoding/healing.py), the healed text, and the request's policy."""
        policy = _policy(request.recompute) if request.recompute is not None else None
        bound = self.bind(prompt, schema=request.schema,
                          add_generation_prompt=request.add_generation_prompt)
        point = heal_point(bound, self.tokenizer) if request.heal else None
        healed = ""
        if point is not None:
            bound = point.bound
            healed = point.text
        return bound, healed, self._recompute_for(bound, policy)

    def _room(self, bound: BoundPrompt, room: int) -> int:
        """Tokens the request's buffer holds after the prompt (decoding grows it past this)."""
        if self.max_positions is not None:
            room = max(1, min(room, self.max_positions - bound.end))
        return min(room, self.decode_room)

    def _open_baseline(self, bound: BoundPrompt, healed: str, t: Timings, room: int,
                       request: _Request) -> tuple[Opened, torch.Tensor]:
        """The request's tokens prefilled at contiguous positions with no reuse at all."""
        ids = bound.token_ids()
        buffer = self.assembler.acquire(len(ids) + room)
        with self._released_on_error(buffer):
            mark = time.perf_counter()
            with self.adapter.passes_in(self.adapter.bf16_request(len(ids))):
                logits = baseline_prefill(self.adapter, buffer, ids, request.all_logits)
            t.prefill = time.perf_counter() - mark
        opened = Opened(buffer=buffer,
                        logits=logits[-1],
                        position=len(ids),
                        bound=bound,
                        timings=t,
                        prefill_tokens=len(ids),
                        cached_tokens=0,
                        recomputed_tokens=0,
                        started=request.started,
                        healed=healed)
        return opened, logits

    def _retrieve(self, bound: BoundPrompt, policy: Recompute) -> _Retrieved:
        """Each unit's KV: from an exact entry made by an earlier request with the same tokens
        before it (recompute/exact.py), else from the store, encoded on a miss (under
        `tuned` with an adapter that encodes, by that adapter, under keys of its own)."""
        layout = bound.layout
        encoder = self.encoder
        if policy.kind == "tuned" and self.seam_encoder is not None:
            encoder = self.seam_encoder
        # the request's side (compute.py); its token count only where there is a twin
        bf16 = self.adapter.compute is not None and self.adapter.bf16_request(
            len(bound.token_ids()))
        side = "|bf16-passes" if bf16 else ""     # exact entries: made on the request's side
        keys = {unit_id: encoder.key(layout, unit_id) + side for unit_id in bound.units}
        context_of = lambda unit_id: encoder.context_of(layout.units[unit_id])  # noqa: E731
        missed = candidates(bound, context_of)         # unit -> its tokens that missed some
        numbers, missed, served = self._exact_entries(bound, policy, keys, missed)
        context_of = exact.context_with(context_of, bound, list(served))
        primed = frozenset(primed_units(bound, context_of) if policy.primed else ())
        stats = EncodeStats()
        by_unit = {unit_id: encoder.get(layout, unit_id, stats, primed=primed)
                   for unit_id in bound.units}
        units = [served.get(u, (encoder.key(layout, u, primed),
                                kv if numbers is None else numbers.unit(kv)))
                 for u, kv in by_unit.items() if kv.length]
        return _Retrieved(keys=keys,
                          bf16=bf16,
                          context_of=context_of,
                          missed=missed,
                          served=served,
                          numbers=numbers,
                          primed=primed,
                          stats=stats,
                          by_unit=by_unit,
                          units=units)

    def _exact_entries(self, bound: BoundPrompt, policy: Recompute, keys: dict[str, str],
                       missed: dict[str, list[int]]
                       ) -> tuple[Renumbering | None, dict[str, list[int]], dict]:
        """The request's renumbering (None: its layout positions), the tokens it misses at
        those positions (unit -> positions), and the units exact entries serve it.
        `exact` renumbers a request with gaps (recompute/contiguous.py); another policy
        only where exact entries serve every unit that missed a token or moves (it then
        computes no approximation)."""
        numbers = contiguous.renumbering(bound)
        if numbers is not None:
            more = contiguous.moved(bound, numbers)
            everything = contiguous.merged(missed, more)
            served = (exact.lookup(self.store, bound, keys, list(everything), numbers)
                      if self.exact_reuse else {})
            if policy.kind == "exact" or all(unit in served for unit in everything):
                return numbers, everything, served
        served = exact.lookup(self.store, bound, keys, list(missed)) if self.exact_reuse else {}
        return None, missed, served

    def _select(self, bound: BoundPrompt, policy: Recompute,
                retrieved: _Retrieved) -> _Selected:
        """The cached positions the request's policy computes again, and APE's contexts."""
        plan = NO_RECOMPUTE
        if policy:                       # query:K: a probe pass over the request ranks them
            if policy.kind == "query":
                chosen = probe_choice(self.adapter, self.assembler, bound, retrieved.units,
                                      candidates(bound, retrieved.context_of),
                                      int(policy.amount))
            else:
                chosen = choose_positions(self.adapter, bound, retrieved.by_unit, policy,
                                          retrieved.context_of)
            if retrieved.numbers is not None:     # what moved is computed again
                chosen = sorted({*chosen, *(p for unit, found in retrieved.missed.items()
                                            if unit not in retrieved.served for p in found)})
            plan = RecomputePlan.of(bound, chosen)
        seam = None
        if policy.kind == "tuned":
            if self.seam is None:
                raise ConfigError(f"recompute policy 'tuned' needs a seam adapter for this "
                                  f"model; make one with `promptlang tune` (it is then "
                                  f"found by load()), or load one with "
                                  f"LLM.use_seam_adapter(path)")
            seam = self.seam
        missed_apart = [u for u in retrieved.missed if u not in retrieved.served]
        approximate = sum(p not in plan.positions
                          for u in missed_apart for p in retrieved.missed[u])
        contexts = parallel_contexts(bound, retrieved.by_unit, policy, missed_apart,
                                     plan.positions)
        if contexts is not None and not self.adapter.attends_in_parallel:
            raise UnsupportedModelError(f"recompute policy {str(policy)!r} needs a RoPE model "
                                  f"(Llama family) with promptlang's attention; this one is "
                                  f"{self.adapter.model_type!r}")
        return _Selected(plan=plan, contexts=contexts, approximate=approximate, seam=seam)

    def _assemble_and_prefill(self, bound: BoundPrompt, healed: str, t: Timings, room: int,
                              request: _Request, retrieved: _Retrieved,
                              selected: _Selected) -> tuple[Opened, torch.Tensor | None]:
        """The units' KV into a pooled buffer, a prompt tail seen before placed after them,
        then one pass over the uncached tokens (or none: a tail seen whole, or a prefill left
        to the caller's batch)."""
        mark = time.perf_counter()
        plan = selected.plan
        contexts = selected.contexts
        units = retrieved.units
        ids, positions = uncached_tokens(plan.uncached(bound))
        numbers = retrieved.numbers
        if numbers is not None:
            positions = numbers.positions(positions)
        tail = None
        if not plan and contexts is None and not request.all_logits and selected.seam is None:
            tail = plan_tail(self.tails, self.adapter.numerics, units, ids, positions)
        cached = sum(int((~kv.placeholder).sum()) for _, kv in units)
        # the assembler names tokens by the positions the units hold (renumbered with them)
        left_out = plan if numbers is None else RecomputePlan(
            frozenset(numbers.positions(plan.positions)))
        links = 0 if selected.seam is None else selected.seam.link_tokens
        buffer = self.assembler.acquire(cached + len(ids) + links + room,
                                        request_keys(units, left_out))
        with self._released_on_error(buffer):
            self.assembler.assemble(buffer, units, left_out)
            shift = 0
            if selected.seam is not None and numbers is None and buffer.length:
                last = int(buffer.positions[:buffer.length].max())
                positions, shift = contiguous.closed_tail(positions, last)
            if tail is not None:
                ids, positions = tail.place(buffer, ids, positions)
            if contexts is not None:
                device = buffer.positions.device
                buffer.contexts = contexts._replace(context=contexts.context.to(device))
            else:
                buffer.contexts = None
            whole = None if tail is None else tail.logits    # the tail seen whole before
            if whole is None:
                ids, positions = with_last(buffer, ids, positions)
            t.assemble = time.perf_counter() - mark
            opened = Opened(buffer=buffer,
                            logits=None,
                            position=bound.end - shift if numbers is None else numbers.end,
                            bound=bound,
                            timings=t,
                            prefill_tokens=len(ids),
                            cached_tokens=buffer.length,
                            recomputed_tokens=len(plan),
                            started=request.started,
                            recompute=plan,
                            exact=tuple(retrieved.served),
                            renumbered=numbers is not None,
                            approximate_tokens=selected.approximate,
                            healed=healed,
                            units=dict(retrieved.stats.tiers),
                            primed=tuple(sorted(retrieved.primed)),
                            tail=tail,
                            model=selected.seam)

            def finish(last: torch.Tensor) -> None:        # the prefill's KV is in the buffer
                opened.logits = last
                if tail is not None:
                    tail.keep(self.tails, buffer, last)
                if plan and self.exact_reuse and contexts is None:   # APE's tokens: not exact
                    self._remember_exact(bound, buffer, retrieved, plan)
            if whole is not None:                        # nothing to compute
                opened.logits = whole
                return opened, whole[None]
            if len(ids) <= request.defer and not request.all_logits and selected.seam is None:
                opened.pending = PendingPrefill(ids, positions, finish, bf16=retrieved.bf16)
                return opened, None
            mark = time.perf_counter()
            with self.adapter.passes_in(retrieved.bf16):
                logits = self._prefill(buffer, ids, positions, request.all_logits,
                                       selected.seam)
            t.prefill = time.perf_counter() - mark
            finish(logits[-1])
        return opened, logits

    def _prefill(self, buffer: KVBuffer, ids: list[int], positions: list[int],
                 all_logits: bool, seam: SeamModel | None) -> torch.Tensor:
        """The request's uncached tokens (positions increasing) into `buffer`; with a seam
        adapter, the tokens after every cached one run on it, those before on the base
        model (runtime/model/seam.py)."""
        if seam is None:
            return prefill(self.adapter, buffer, ids, positions, all_logits)
        last = int(buffer.positions[:buffer.length].max()) if buffer.length else -1
        before = sum(p <= last for p in positions)
        parts = []
        if before:
            parts.append(prefill(self.adapter, buffer, ids[:before], positions[:before],
                                 all_logits))
        if before < len(ids):
            seam.place_links(buffer, positions[before])
            parts.append(prefill(seam, buffer, ids[before:], positions[before:], all_logits))
        return torch.cat(parts) if all_logits else parts[-1]

    def use_seam_adapter(self, path: str | os.PathLike | None) -> None:
        """Serve policy `tuned` with the seam adapter file `path` (made by `promptlang
        tune` for this model; None: none). AdapterFileError if it is not one for this
        model."""
        self.seam = None if path is None else load_seam(self.adapter, path)
        self.seam_encoder = None
        if self.seam is not None and self.seam.encodes:
            self.seam_encoder = UnitEncoder(self.seam, self.store, self.tokenizer.fingerprint,
                                            isolate=self.encoder.isolate)

    def _remember_exact(self, bound: BoundPrompt, buffer: KVBuffer, retrieved: _Retrieved,
                        plan: RecomputePlan) -> None:
        """Keep the units this request made exact, for later requests with the same tokens
        before them (recompute/exact.py)."""
        made = exact.made_exact(bound, retrieved.missed, plan.positions, list(retrieved.served))
        exact.remember(self.store, bound, buffer, retrieved.keys, made,
                       bound.layout.schema.name, retrieved.numbers)

    @contextlib.contextmanager
    def _released_on_error(self, buffer: KVBuffer):
        try:
            yield
        except BaseException:
            self.assembler.release(buffer)
            raise

    def _decode(self, opened: Opened, params: SamplingParams,
                constraint: Constraint | None = None) -> Generator[str, None, Result]:
        """Decode after an open request, yielding text deltas; returns the Result. The
        request's buffer goes back to the pool at the end, or when the caller stops."""
        generation = Generation(self, opened, params, constraint)
        try:
            for _, delta, finished in generation.decoder.steps(opened.logits):
                delta = generation.delta(delta)
                if delta:
                    yield delta
                if finished:
                    break
        finally:
            generation.release()
        return generation.result()

    def start(self, prompt, *, schema=None, baseline: bool = False, recompute=None,
              sampling: SamplingParams | None = None, defer: int = 0,
              **options) -> Generation:
        """Open a request for a caller that drives its decoding itself (the server's batch
        scheduler): bind, retrieve, assemble, prefill as `generate` does; the Generation's
        decoder then starts from `generation.opened.logits`. The caller calls `result()` at
        the end, or `release()` to stop early. `defer`: a prefill of at most this many
        tokens is left to the caller (`generation.opened.pending`: decode.BatchStepper.join
        runs it inside a decode step)."""
        started = time.perf_counter()
        params = options_to_params(sampling, **options)
        constraint = Constraint.of(params, self.tokenizer)
        heal = params.token_healing and constraint is None
        request = _Request(schema=schema, baseline=baseline, recompute=recompute,
                           room=params.max_new_tokens, started=started, heal=heal, defer=defer)
        opened, _ = self._open(prompt, request)
        return Generation(self, opened, params, constraint)

    # --- what decoders use (decoding/engine_view.py) -----------------------------------------

    def acquire_buffer(self, capacity: int) -> KVBuffer:
        """A request buffer from the pool with room for `capacity` tokens."""
        return self.assembler.acquire(capacity)

    def release_buffer(self, buffer: KVBuffer) -> None:
        """Give a request buffer back to the pool."""
        self.assembler.release(buffer)

    def finish(self, opened: Opened) -> None:
        """The end of an opened request's decoding: its prompt tail is kept with the decoded
        tokens (runtime/kv/tails.py), then its buffer goes back to the pool."""
        if opened.tail is not None:
            opened.tail.keep_decoded(self.tails, opened.buffer)
        self.assembler.release(opened.buffer)
        heap.release_if_grown()          # a long prompt's activations: freed to the system

    # --- helpers ------------------------------------------------------------------------------

    def _recompute_for(self, bound: BoundPrompt, policy: Recompute | None) -> Recompute:
        """The request's policy, else its schema's, else this LLM's."""
        if policy is not None:
            return policy
        schema = schema_policy(bound.layout.schema)      # "none" there overrides the LLM's
        return schema if schema is not None else self.recompute

    def _prompt_doc(self, prompt, schema) -> nodes.PromptDoc:
        if schema is not None:
            self.add_schema(schema)
        if isinstance(prompt, nodes.PromptDoc):
            return prompt
        if isinstance(prompt, (str, os.PathLike)):
            return read_prompt(prompt)
        doc = getattr(prompt, "doc", None)
        attached = getattr(prompt, "schema", None)
        if isinstance(doc, nodes.PromptDoc) and attached is not None:
            self.add_schema(attached)
            return doc
        raise InvalidArgumentTypeError(f"not a prompt: {type(prompt).__name__} (give PML text, a "
                              "PromptDoc, or an object with .schema and .doc)")

    def _check_layout(self, layout: SchemaLayout) -> None:
        if layout.tokenizer_fingerprint != self.tokenizer.fingerprint:
            raise TokenizerMismatchError(
                f"schema {layout.schema.name!r} was laid out for tokenizer "
                f"{layout.tokenizer_fingerprint[:16]}, but this model's tokenizer is "
                f"{self.tokenizer.fingerprint[:16]}: lay it out again for this model",
                layout.schema.span)

    def _check_fits(self, end: int, what: str, span) -> None:
        limit = self.max_positions
        if limit is not None and end > limit:
            raise ContextLengthError(f"{what} needs {end} positions; the model has {limit}", span)


def _context_positions(buffer: KVBuffer) -> frozenset[int]:
    """The positions APE attends to as contexts in `buffer` (none without the ape policy)."""
    if buffer.contexts is None:
        return frozenset()
    return frozenset(torch.nonzero(buffer.contexts.context)[:, 0].tolist())


def _policy(recompute) -> Recompute:
    """A request's or the LLM's policy (RecomputeSpecError, a PromptLangError, if malformed)."""
    return Recompute.parse(recompute)


def load(name_or_path: str | os.PathLike | None = None, *, device: str | torch.device = "cpu",
         dtype: torch.dtype = torch.float32, isolate: bool = False, store=None,
         store_dtype: torch.dtype | None = None, recompute: "str | Recompute" = DEFAULT_POLICY,
         exact_reuse: bool = True, quantized: bool = True, quantize: str | None = None,
         bf16_attention: bool = False, int8_linears: bool = False,
         tail_budget_bytes: int = TAIL_BUDGET,
         seam_adapter: "str | os.PathLike | bool" = True,
         memory_budget_bytes: int | None = None,
         disk_budget_bytes: int | None = None,
         compute: "str | torch.dtype" = "float32") -> LLM:
    """Load a causal LM (None: the embedded default, SmolLM2-135M-Instruct) ready to serve.

    memory_budget_bytes, disk_budget_bytes: the store's budgets (None: unlimited), the
    least recently used units evicted past them (runtime/store/eviction.py). Ignored if
    `store` is given.
    store_dtype (e.g. torch.bfloat16): keep cached KV at that precision (half the bytes).
    With the fused layers (Llama-family models on a CPU with the kernels) long units are
    read in place at that precision; otherwise they go back to `dtype` when copied into a
    request's buffer. Ignored if `store` is given.
    recompute: the default recompute policy of requests whose schema names none ("exact":
    answers as the full prefill's; docs/RECOMPUTE.md).
    exact_reuse: keep the units a request makes exact and serve them to later requests with
    the same tokens before them (docs/RECOMPUTE.md, "Exact reuse").
    quantized: a model from a GGUF (the default one included) has the fused layers read its
    linear weights (Q4_1, Q5_0, Q8_0 and the K-quants) and Q8_0 LM head as stored (the same values as the float copy, bit for bit: fast/fused.py
    attach_blocks, attach_q8_head), and keeps no float copy of them (fast/blocks.py).
    quantize ("q4_1" or "q8_0"; Llama-family float32 checkpoints, not a GGUF): weight-only
    quantization -- the decoder's linear weights become Q4_1 or Q8_0 blocks (the LM head
    Q8_0) and the model computes with their dequantized values everywhere, while the fused
    layers read the blocks (runtime/model/quantize.py); answers are then the quantized model's.
    bf16_attention: passes of 8+ new tokens compute the attention's products from bfloat16
    inputs (fused layers, CPUs with AVX512_BF16): approximate.
    int8_linears: the fused layers' linear layers multiply int8 weights (a scale per row) by
    12-bit inputs (a scale per token; integer products, AVX512_VNNI's where the CPU has them):
    approximate.
    What each costs and buys is measured in docs/BENCHMARKS.md.
    tail_budget_bytes: KV of recent requests' last uncached tokens kept for later requests that
    start them the same way after the same units (runtime/kv/tails.py; 0: off).
    seam_adapter: the seam adapter policy `tuned` serves with (runtime/model/seam.py).
    True finds the one `promptlang tune` made for this model, else the one shipped for it.
    Where there is none, `tuned` is refused with how to make one.
    A path loads that file.
    False loads none.

    compute: the dtype of passes of many new tokens (module encode, recompute, prefill):
    "float32", "bfloat16" (bfloat16 products with float32 sums, on a bfloat16 copy of the
    weights; CPUs with AMX or AVX512-BF16, RoPE models) or "auto" (bfloat16 where the CPU
    has those units). Decode steps and short passes stay float32; KV stays float32. What it
    changes in answers is measured in docs/BENCHMARKS.md (runtime/model/compute.py).

    The loading runs on a thread that then ends (runtime/passing.py), so that the caller's
    thread keeps no OpenMP pool: a server's engine thread is then the only one that has one."""
    from promptlang.runtime.passing import on_passing_thread
    return on_passing_thread(lambda: _load(name_or_path, device, dtype, isolate, store,
                                           store_dtype, recompute, exact_reuse, quantized,
                                           quantize, bf16_attention, int8_linears,
                                           tail_budget_bytes, seam_adapter,
                                           memory_budget_bytes, disk_budget_bytes, compute),
                             name="promptlang-load")


def _load(name_or_path, device, dtype, isolate, store, store_dtype, recompute, exact_reuse,
          quantized, quantize=None, bf16_attention=False, int8_linears=False,
          tail_budget_bytes=TAIL_BUDGET, seam_adapter=True, memory_budget_bytes=None,
          disk_budget_bytes=None, compute="float32") -> LLM:
    from promptlang.runtime.model.compute import attach_bf16, resolve
    from promptlang.runtime.model.loading import gguf_source, load_model_files
    from promptlang.runtime.model.quantize import checked_scheme, quantize_model, serve_numerics
    compute_dtype = resolve(compute)        # before the model loads: a bad value fails fast
    scheme = checked_scheme(quantize, name_or_path, dtype)
    steps: dict[str, float] = {}
    hf_model, tokenizer, record = load_model_files(name_or_path, device=device, dtype=dtype,
                                                   steps=steps)
    began = time.perf_counter()
    # before adapt: the fingerprint must see the quantized weights
    blocks = None if scheme is None else quantize_model(hf_model, scheme)
    # a converted copy's weights, as loaded, have the fingerprint an earlier load recorded
    recorded = f"model_fingerprint:{dtype}"
    known = record.get(recorded) if record is not None and scheme is None else None
    adapter = adapt(hf_model, known if isinstance(known, str) else None)
    if record is not None and scheme is None and known is None:
        record.put(recorded, adapter.weights_fingerprint)
    adapted = time.perf_counter()
    steps["adapter"] = adapted - began
    source = gguf_source(name_or_path) if quantized else None
    serve_numerics(adapter, source, dtype, scheme, blocks, bf16_attention, int8_linears,
                   record)
    steps["blocks"] = time.perf_counter() - adapted
    if compute_dtype == torch.bfloat16 and dtype == torch.float32:
        attach_bf16(adapter, progress=lambda text: print(f"promptlang: {text}", file=sys.stderr))
    budgets = (memory_budget_bytes, disk_budget_bytes)
    if store is None and (store_dtype is not None or budgets != (None, None)):
        from promptlang.runtime.store import ModuleStore
        # get() hands out the stored tensors as they are: no per-request conversion copy
        store = ModuleStore(device=adapter.device, device_budget_bytes=memory_budget_bytes,
                            disk_budget_bytes=disk_budget_bytes, dtype=store_dtype,
                            compute_dtype=store_dtype)
    llm = LLM(adapter, tokenizer, store, isolate=isolate, recompute=recompute,
              exact_reuse=exact_reuse, tail_budget_bytes=tail_budget_bytes)
    if seam_adapter is True:
        seam_adapter = find_seam_adapter(adapter.weights_fingerprint)
    if seam_adapter not in (None, False):
        llm.use_seam_adapter(seam_adapter)
    llm.load_steps = steps
    return llm
