"""The engine: `load()` a model, register schemas, and serve prompts from cached modules.

    llm = load()                                   # the embedded default model
    llm.add_schema(open("travel.pml").read())      # or a nodes.Schema, or a path
    result = llm.generate('<prompt schema="travel"><trip-plan duration="3 days"/>...</prompt>')
    print(result.text, result.timings)

A request goes: bind (prompt -> BoundPrompt) -> retrieve (each unit's KV from the
store, encoded on a miss) -> assemble (into a pooled buffer) -> prefill (the
uncached tokens, one pass) -> decode. Every check that can reject a request runs
before anything is encoded, so a rejected request leaves the store as it was.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Iterator

import torch

from promptlang.errors import (ContextLengthError, PromptLangError, TokenizerMismatchError,
                               UnknownSchemaError)
from promptlang.pml import nodes
from promptlang.pml.binding import BoundPrompt, bind
from promptlang.pml.layout import SchemaLayout, lay_out
from promptlang.runtime.assembler import Assembler, KVBuffer, request_keys
from promptlang.runtime.encoder import EncodeStats, UnitEncoder
from promptlang.runtime.generate import (baseline_prefill, decode, prefill, take_last,
                                         uncached_tokens)
from promptlang.runtime.model import ModelAdapter, adapt
from promptlang.runtime.recompute import (NO_RECOMPUTE, Recompute, RecomputePlan,
                                          choose_positions, schema_policy)
from promptlang.runtime.sampling import Decoding, SamplingParams


@dataclass
class Timings:
    """Seconds spent in each phase of one request. `encode` is the part of `retrieve`
    spent encoding units the store lacked; `select` is choosing the tokens to recompute
    (a deviation policy's pass); `first_token` runs from the call to the first picked
    token; `total` to the end."""

    bind: float = 0.0
    retrieve: float = 0.0
    assemble: float = 0.0
    prefill: float = 0.0
    first_token: float = 0.0
    total: float = 0.0
    encode: float = 0.0
    select: float = 0.0

    def __str__(self) -> str:
        parts = [f"{name} {getattr(self, name) * 1000:.1f} ms" for name in
                 ("bind", "retrieve", "encode", "select", "assemble", "prefill", "first_token",
                  "total")]
        return " | ".join(parts)


@dataclass
class Result:
    text: str
    token_ids: list[int]
    finish_reason: str
    timings: Timings
    prefill_tokens: int          # tokens computed by the prefill pass
    cached_tokens: int           # tokens served from cached units
    recomputed_tokens: int = 0   # cached tokens computed again (the recompute policy)


@dataclass
class Prefilled:
    """A prefill's outputs, copied out of the request buffer (for tests and benchmarks).
    Token order: the assembled cached tokens, then the prefilled ones."""

    logits: torch.Tensor         # [R, V]: every prefilled token's, or the last one's
    keys: torch.Tensor           # [L, H_kv, N, D]
    values: torch.Tensor         # [L, H_kv, N, D]
    positions: torch.Tensor      # [N]
    token_ids: torch.Tensor      # [N]
    cached_length: int           # the first cached_length tokens came from the store
    timings: Timings
    bound: BoundPrompt | None = None   # what was bound
    recompute: RecomputePlan = NO_RECOMPUTE   # the cached tokens computed again


@dataclass
class Opened:
    """A prefilled request whose KV buffer the caller keeps (what a Session starts from).
    The caller gives the buffer back with `llm.assembler.release(buffer)`."""

    buffer: KVBuffer
    logits: torch.Tensor         # [V]: the prediction for position `position`
    position: int                # the first position after the request
    bound: BoundPrompt
    timings: Timings
    prefill_tokens: int
    cached_tokens: int
    recomputed_tokens: int = 0


class TextStream:
    """An iterator of text deltas; `result` is set once it is exhausted."""

    def __init__(self, deltas: Iterator[str], request: "_Request"):
        self._deltas = deltas
        self._request = request
        self.result: Result | None = None

    def __iter__(self) -> "TextStream":
        return self

    def __next__(self) -> str:
        try:
            return next(self._deltas)
        except StopIteration:
            self.result = self._request.result
            raise

    def close(self) -> None:
        """Stop early (the request's buffer goes back to the pool)."""
        self._deltas.close()


@dataclass
class _Request:
    bound: BoundPrompt
    params: SamplingParams
    baseline: bool
    recompute: Recompute = Recompute()
    plan: RecomputePlan = NO_RECOMPUTE     # what `recompute` chose for this request
    timings: Timings = field(default_factory=Timings)
    started: float = field(default_factory=time.perf_counter)
    cached_length: int = 0
    prefill_tokens: int = 0
    result: Result | None = None


class LLM:
    """A model with its tokenizer, module store and registered schemas."""

    decode_room = 1024     # generated tokens a request buffer holds before it grows

    def __init__(self, adapter: ModelAdapter, tokenizer, store=None, *, isolate: bool = False,
                 recompute: "str | Recompute" = "none"):
        if store is None:
            from promptlang.runtime.store import ModuleStore
            store = ModuleStore(device=adapter.device)
        self.adapter = adapter
        self.tokenizer = tokenizer
        self.store = store
        self.isolate = isolate
        self.recompute = _policy(recompute)      # used when neither request nor schema says
        self.encoder = UnitEncoder(adapter, store, tokenizer.fingerprint, isolate=isolate)
        self.assembler = Assembler(adapter)
        self._schemas: dict[str, tuple[nodes.Schema, SchemaLayout | None]] = {}
        self._lock = threading.Lock()

    @classmethod
    def from_model(cls, hf_model: torch.nn.Module, tokenizer, *, store=None,
                   isolate: bool = False, recompute: "str | Recompute" = "none") -> "LLM":
        """Wrap an already loaded transformers causal LM (e.g. a tiny test model)."""
        return cls(adapt(hf_model), tokenizer, store, isolate=isolate, recompute=recompute)

    @property
    def max_positions(self) -> int | None:
        limits = [n for n in (self.adapter.max_positions, self.tokenizer.max_positions) if n]
        return min(limits) if limits else None

    @property
    def encoder_calls(self) -> int:
        return self.encoder.calls

    # --- schemas ----------------------------------------------------------------------------

    def add_schema(self, schema) -> nodes.Schema:
        """Register a schema (nodes.Schema, SchemaLayout, PML text or a path to a .pml file)
        under its name; a schema of the same name is replaced."""
        layout = None
        if isinstance(schema, SchemaLayout):
            self._check_layout(schema)
            layout, schema = schema, schema.schema
        elif isinstance(schema, (str, os.PathLike)) and not isinstance(schema, nodes.Schema):
            schema = _read_schema(schema)
        if not isinstance(schema, nodes.Schema):
            raise PromptLangError(f"not a schema: {type(schema).__name__}")
        with self._lock:
            known = self._schemas.get(schema.name)
            if known is None or known[0] != schema or layout is not None:
                self._schemas[schema.name] = (schema, layout)
        return schema

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
            raise PromptLangError("the prompt is empty: nothing to compute", doc.span)
        self._check_fits(bound.end, "the prompt", doc.span)
        return bound

    def generate(self, prompt, *, schema=None, max_new_tokens: int = 256, temperature: float = 0.0,
                 top_p: float = 1.0, top_k: int = 0, seed: int | None = None, stop=(),
                 stream: bool = False, baseline: bool = False, recompute=None):
        """Answer `prompt` (PML text, a nodes.PromptDoc, or an object with `.schema` and
        `.doc`). Returns a Result, or with stream=True a TextStream of text deltas.
        recompute: a policy ("none", "first:K", "deviation:F" or a Recompute; see
        docs/RECOMPUTE.md); None: the schema's `recompute` attribute, else the LLM's."""
        started = time.perf_counter()
        params = SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature,
                                top_p=top_p, top_k=top_k, seed=seed, stop=stop)
        policy = _policy(recompute) if recompute is not None else None
        bound = self.bind(prompt, schema=schema)
        request = _Request(bound, params, baseline, self._recompute_for(bound, policy),
                           started=started)
        request.timings.bind = time.perf_counter() - started
        buffer, logits, position = self._prefill(request, all_logits=False)
        deltas = self._decode(request, buffer, logits[-1], position)
        if stream:
            return TextStream(deltas, request)
        for _ in deltas:
            pass
        return request.result

    def prefill(self, prompt, *, schema=None, baseline: bool = False,
                all_logits: bool = True, recompute=None) -> Prefilled:
        """Run a request's prefill only and return its logits and KV (copies)."""
        started = time.perf_counter()
        policy = _policy(recompute) if recompute is not None else None
        bound = self.bind(prompt, schema=schema)
        request = _Request(bound, SamplingParams(max_new_tokens=1), baseline,
                           self._recompute_for(bound, policy), started=started)
        request.timings.bind = time.perf_counter() - started
        buffer, logits, _ = self._prefill(request, all_logits=all_logits)
        try:
            n = buffer.length
            request.timings.total = time.perf_counter() - started
            return Prefilled(logits.clone(), buffer.keys[:, :, :n].clone(),
                             buffer.values[:, :, :n].clone(), buffer.positions[:n].clone(),
                             buffer.token_ids[:n].clone(), request.cached_length, request.timings,
                             request.bound, request.plan)
        finally:
            self.assembler.release(buffer)

    def open(self, prompt, *, schema=None, baseline: bool = False, room: int = 256,
             add_generation_prompt: bool = False, recompute=None) -> Opened:
        """Bind, retrieve, assemble and prefill `prompt` like `generate`, and hand the request's
        KV buffer to the caller instead of decoding: the start of a Session. `room`: tokens
        the buffer holds after the prompt before it grows."""
        started = time.perf_counter()
        policy = _policy(recompute) if recompute is not None else None
        bound = self.bind(prompt, schema=schema, add_generation_prompt=add_generation_prompt)
        request = _Request(bound, SamplingParams(max_new_tokens=max(1, room)), baseline,
                           self._recompute_for(bound, policy), started=started)
        request.timings.bind = time.perf_counter() - started
        buffer, logits, position = self._prefill(request, all_logits=False)
        request.timings.total = time.perf_counter() - started
        return Opened(buffer, logits[-1], position, request.bound, request.timings,
                      request.prefill_tokens, request.cached_length,
                      len(request.plan))

    def session(self, prompt, *, schema=None, baseline: bool = False,
                add_generation_prompt: bool = False, recompute=None):
        """A multi-turn Session on `prompt` that keeps its KV across turns
        (runtime/session.py); `recompute` applies to the prompt's cached tokens."""
        from promptlang.runtime.session import Session
        return Session(self, prompt, schema=schema, baseline=baseline,
                       add_generation_prompt=add_generation_prompt, recompute=recompute)

    # --- the phases ---------------------------------------------------------------------------

    def _prefill(self, request: _Request, all_logits: bool) -> tuple[KVBuffer, torch.Tensor, int]:
        """Retrieve, assemble and prefill; returns the request's buffer (the caller releases
        it), the prefill's logits and the first position to decode at."""
        bound, t = request.bound, request.timings
        room = request.params.max_new_tokens          # decoding grows the buffer past this
        if self.max_positions is not None:
            room = max(1, min(room, self.max_positions - bound.end))
        room = min(room, self.decode_room)
        if request.baseline:
            ids = bound.token_ids()
            buffer = self.assembler.acquire(len(ids) + room)
            request.cached_length, request.prefill_tokens = 0, len(ids)
            with self._released_on_error(buffer):
                mark = time.perf_counter()
                logits = baseline_prefill(self.adapter, buffer, ids, all_logits)
                t.prefill = time.perf_counter() - mark
            return buffer, logits, len(ids)

        mark = time.perf_counter()
        stats = EncodeStats()
        by_unit = {unit_id: self.encoder.get(bound.layout, unit_id, stats)
                   for unit_id in bound.units}
        units = [(self.encoder.key(bound.layout, unit_id), kv) for unit_id, kv in by_unit.items()
                 if kv.length]
        t.retrieve, t.encode = time.perf_counter() - mark, stats.seconds

        if request.recompute:
            mark = time.perf_counter()
            chosen = choose_positions(
                self.adapter, bound, by_unit, request.recompute,
                lambda unit_id: self.encoder.context_of(bound.layout.units[unit_id]))
            request.plan = RecomputePlan.of(bound, chosen)
            t.select = time.perf_counter() - mark

        mark = time.perf_counter()
        ids, positions = uncached_tokens(request.plan.uncached(bound))
        cached = sum(int((~kv.placeholder).sum()) for _, kv in units)
        buffer = self.assembler.acquire(cached + len(ids) + room,
                                        request_keys(units, request.plan))
        with self._released_on_error(buffer):
            self.assembler.assemble(buffer, units, request.plan)
            if not ids or (buffer.length and
                           int(buffer.positions[:buffer.length].max()) > positions[-1]):
                # the last token's output is needed and it is a cached one: recompute it
                token, position = take_last(buffer)
                at = sum(p < position for p in positions)
                ids, positions = ids[:at] + [token], positions[:at] + [position]
            t.assemble = time.perf_counter() - mark
            request.cached_length, request.prefill_tokens = buffer.length, len(ids)
            mark = time.perf_counter()
            logits = prefill(self.adapter, buffer, ids, positions, all_logits)
            t.prefill = time.perf_counter() - mark
        return buffer, logits, bound.end

    @contextlib.contextmanager
    def _released_on_error(self, buffer: KVBuffer):
        try:
            yield
        except BaseException:
            self.assembler.release(buffer)
            raise

    def _decode(self, request: _Request, buffer: KVBuffer, logits: torch.Tensor,
                position: int) -> Iterator[str]:
        decoding = Decoding(request.params, self.tokenizer)
        t = request.timings
        try:
            first = True
            for _, delta, finished in decode(self.adapter, buffer, logits, position, decoding,
                                             self.max_positions):
                if first:
                    t.first_token = time.perf_counter() - request.started
                    first = False
                if delta:
                    yield delta
                if finished:
                    break
        finally:
            self.assembler.release(buffer)
        t.total = time.perf_counter() - request.started
        text, token_ids, reason = decoding.result()
        request.result = Result(text, token_ids, reason, t, request.prefill_tokens,
                                request.cached_length, len(request.plan))

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
            return _read_prompt(prompt)
        doc, attached = getattr(prompt, "doc", None), getattr(prompt, "schema", None)
        if isinstance(doc, nodes.PromptDoc) and attached is not None:
            self.add_schema(attached)
            return doc
        raise PromptLangError(f"not a prompt: {type(prompt).__name__} (give PML text, a "
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


def _policy(recompute) -> Recompute:
    """A request's or the LLM's policy (RecomputeSpecError, a PromptLangError, if malformed)."""
    return Recompute.parse(recompute)


def _read_schema(source) -> nodes.Schema:
    from promptlang.pml.parser import parse_file, parse_schema
    if isinstance(source, str) and source.lstrip().startswith("<"):
        return parse_schema(source, file="<schema>")
    parsed = parse_file(source)
    if not isinstance(parsed, nodes.Schema):
        raise PromptLangError(f"{os.fspath(source)} holds a prompt, not a schema", parsed.span)
    return parsed


def _read_prompt(source) -> nodes.PromptDoc:
    from promptlang.pml.parser import parse_file, parse_prompt
    if isinstance(source, str) and source.lstrip().startswith("<"):
        return parse_prompt(source, file="<prompt>")
    parsed = parse_file(source)
    if not isinstance(parsed, nodes.PromptDoc):
        raise PromptLangError(f"{os.fspath(source)} holds a schema, not a prompt", parsed.span)
    return parsed


def load(name_or_path: str | os.PathLike | None = None, *, device: str | torch.device = "cpu",
         dtype: torch.dtype = torch.float32, isolate: bool = False, store=None,
         store_dtype: torch.dtype | None = None, recompute: "str | Recompute" = "none") -> LLM:
    """Load a causal LM (None: the embedded default, SmolLM2-135M-Instruct) ready to serve.

    store_dtype (e.g. torch.bfloat16): keep cached KV at that precision (half the bytes).
    With the fused layers (Llama-family models on a CPU with the kernels) long units are
    read in place at that precision; otherwise they go back to `dtype` when copied into a
    request's buffer. Ignored if `store` is given. recompute: the default recompute policy
    of requests whose schema names none (docs/RECOMPUTE.md)."""
    from promptlang.runtime.loading import load_hf_model
    hf_model, tokenizer = load_hf_model(name_or_path, device=device, dtype=dtype)
    adapter = adapt(hf_model)
    if store is None and store_dtype is not None:
        from promptlang.runtime.store import ModuleStore
        # get() hands out the stored tensors as they are: no per-request conversion copy
        store = ModuleStore(device=adapter.device, dtype=store_dtype, compute_dtype=store_dtype)
    return LLM(adapter, tokenizer, store, isolate=isolate, recompute=recompute)
