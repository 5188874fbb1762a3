"""`promptlang bench peers`: promptlang beside llama.cpp (llama-cpp-python) and transformers'
own full prefill, on the same model and the same token ids.

Workloads:

  document  a ~6.4k-token document (latency.document) as a cached module, then new
            questions about it: promptlang serves the document from its store; llama.cpp
            serves it from its prompt cache (the previous request's tokens: a prefix hit,
            its best case); transformers computes the whole prompt. Two kinds of new
            question, each engine asked the same: first ones that open as the previous
            question (its words, a new number: both caches serve that opening too, the
            prompt tails of runtime/kv/tails.py on promptlang's side), then ones whose first
            word no earlier prompt had (each engine computes the whole question). The
            tokens each engine computed per question are in the report.
  decode    greedy tokens after the document's prompt: the time per token at that cached
            context (promptlang stops at end-of-sequence, llama.cpp does not: each the
            mean over the tokens it made).
  rag       k of N ~700-token documents per request (bench/rag.py's plan: new sets,
            reorderings, repeats), a question: promptlang with recompute `none` (the
            documents as encoded apart: the fast path) and with the default `exact` (a
            new combination's later documents computed again), llama.cpp with its
            prompt cache (a hit only where a request starts with the previous one's
            tokens), transformers' full prefill.

The document and decode workloads run three times on promptlang: as the model computes
(the default), from a float16 store (llama.cpp's KV type), and with approximations of the
kind llama.cpp makes (a bf16 store, int8 weights x 12-bit inputs in the linear layers,
bf16 products in the attention: load's int8_linears and bf16_attention), each with goals
of its own. The document goals with the model's numbers also say what the question's
arithmetic alone takes at the run's float32 sgemm rate (bench/floor.py `prefill_flops`;
what llama.cpp's integer linear layers are not held to).

promptlang serves from a store of the run's own (memory only: nothing an earlier run
stored is served). llama.cpp runs in a process of its own (bench/peers_llama.py, no torch)
with the same number of threads, on the default model's GGUF (the file the default model
is converted from; for another model, pass --gguf). The document and decode measurements
take turns, one engine after the other in every round (the machine's speed drifts over
minutes: each ratio compares rounds made side by side), each turn after `settle_s` idle
seconds: promptlang's request right after llama.cpp's, in the other process, took ~1.7x
its time after a pause (the reverse does not hold; why is not known), which no user's
request meets. The RAG requests, whose ratios are in the hundreds, run on llama.cpp after
promptlang's.
Without llama-cpp-python (an optional extra: `pip install llama-cpp-python`, a ~10 minute
build on 2 cores) its column and the goals that need it say N/A. transformers' full prefill
is the model's own forward (no promptlang kernels or hooks) over the same token ids.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import threading
import time
from typing import Sequence

import torch

from promptlang.bench.latency.sweep import build_prompt as doc_prompt, build_schema as doc_schema
from promptlang.bench.floor import prefill_flops
from promptlang.bench.latency.sweep import document
from promptlang.bench.rag import build_prompt, build_schema, plan_requests
from promptlang.bench.peers_report import (APPROXIMATE, DECODE_ROUNDS, DEFAULT_ROW, F16_STORE,
                                           QUESTION_KINDS, PeersOptions, PeersReport,
                                           _median, goals)
from promptlang.runtime.recompute.policy import DEFAULT_POLICY
from promptlang.bench.shapes import shape_from_config
from promptlang.errors import InvalidArgumentError

DOC_SCHEMA = "peers-document"
RAG_SCHEMA = "peers-rag"
LLAMA_TIMEOUT = 3600.0           # seconds a llama.cpp session may last, at most
# first words of the document's new questions of the second kind: none opens any other
# prompt of the run (so no engine reuses any of the question from an earlier request)
OPENERS = ("Briefly", "Quickly", "Carefully", "Honestly", "Simply", "Clearly", "Exactly",
           "Plainly")


def run_peers(llm, options: PeersOptions = PeersOptions(), *, model_name: str = "",
              threads: int | None = None, sgemm_flops_per_s: float | None = None,
              model: str | None = None) -> PeersReport:
    """sgemm_flops_per_s: the machine's float32 matmul rate, for the document's arithmetic;
    model: what `llm` was loaded from (None: the default model), loaded again in a new
    process for the load and memory measurement."""
    from promptlang.runtime.engine import LLM
    from promptlang.runtime.store import ModuleStore

    report = PeersReport(options, model_name, sgemm_flops_per_s=sgemm_flops_per_s)
    threads = threads or torch.get_num_threads()
    gguf = options.gguf or _default_gguf(llm)
    # a store of this run's own, memory only: nothing earlier runs stored is served
    llm = LLM(llm.adapter, llm.tokenizer, ModuleStore(llm.adapter.device, disk_budget_bytes=0))
    if gguf is None:
        report.llama_missing = "no GGUF for this model (give --gguf FILE)"
    try:
        _document(llm, options, report, gguf, threads)
        rag_ids = _rag(llm, options, report)
    finally:
        llm.store.clear()
    if gguf is not None and not report.llama_missing:        # RAG: llama.cpp after
        llama = _LlamaLines.start(gguf, threads, max(len(i) for i in rag_ids) + 64)
        if isinstance(llama, str):
            report.llama_missing = llama
        else:
            try:
                ttft = _guarded(report, lambda ids: llama.request(report, ids)["ttft_s"])
                values = [ttft(ids) for ids in rag_ids]
                if not report.llama_missing:
                    report.rag["llama.cpp"] = values
            finally:
                llama.close()
    report.quantized_weights, report.quantized_max_diff = quantized_check(llm)
    _load_and_memory(report, model, gguf, options.doc_tokens)
    report.quantized_types = linear_types(gguf) if gguf is not None else ""
    report.approximations_missing = missing_approximations()
    report.goals = goals(report)
    return report


def missing_approximations() -> list[str]:
    """The approximations of APPROXIMATE's row this CPU cannot run (their passes then
    compute as the model's): "bf16 attention" without AVX512_BF16, "int8 linears" where the
    kernels cannot run."""
    from promptlang.runtime.fast import native

    return [name for name, kind in (("int8 linears", "int8"), ("bf16 attention", "bf16"))
            if not native.products_available(kind)]


def _document(llm, options: PeersOptions, report: PeersReport, gguf: str | None,
              threads: int) -> None:
    """The document and decode workloads, every engine in turn in each round."""
    from promptlang.runtime.engine import LLM
    from promptlang.runtime.store import ModuleStore

    text, item = document(llm.tokenizer, options.doc_tokens, seed=20)
    schema = doc_schema(DOC_SCHEMA, text)
    llm.add_schema(schema)
    n = options.questions
    if not 1 <= n <= len(OPENERS):
        raise InvalidArgumentError(f"questions must be 1 to {len(OPENERS)}, not {n}")
    # prompt 0 warms every cache (not timed); then n new questions that open as the one
    # before (its words, a new number), then n whose first word no earlier prompt had
    questions = [f"{item.question} Answer in one sentence, #{i}." for i in range(n + 1)] + [
        f"{word}: {item.question}" for word in OPENERS[:n]]
    prompts = [doc_prompt(DOC_SCHEMA, q) for q in questions]
    ids = [llm.bind(p).token_ids() for p in prompts]
    decoder = llm.adapter.fast.decoder
    # the document's KV stored in float16 (read in place by the fused layers), as llama.cpp
    # keeps its KV cache; and in bfloat16 with integer products in the linear layers
    # (llama.cpp quantizes their inputs to 8 bits) and 16-bit ones in the attention
    half = {name: LLM(llm.adapter, llm.tokenizer, ModuleStore(
        llm.adapter.device, disk_budget_bytes=0, dtype=dtype, compute_dtype=dtype))
        for name, dtype in ((F16_STORE, torch.float16), (APPROXIMATE, torch.bfloat16))}
    numerics = {F16_STORE: contextlib.nullcontext, APPROXIMATE: (
        decoder.approximated if decoder is not None else contextlib.nullcontext)}
    # engine -> f(i): prompt i's (TTFT seconds, tokens computed)
    ttft = {"promptlang": lambda i: _ttft(llm, prompts[i])}
    per_token = {"promptlang": lambda: _per_token(llm, prompts[n], options.decode_tokens)}
    if decoder is not None and decoder.quantized_weights:
        per_token["promptlang (float32 weights)"] = _inside(decoder.quantized_off,
                                                            per_token["promptlang"])
    for name, engine in half.items():
        ttft[name] = _inside(numerics[name], lambda i, e=engine: _ttft(e, prompts[i]))
        per_token[name] = _inside(numerics[name], lambda e=engine: _per_token(
            e, prompts[n], options.decode_tokens))
    llama = None
    if gguf is not None:
        llama = _LlamaLines.start(gguf, threads, max(len(i) for i in ids) + 64
                                  + options.decode_tokens)
        if isinstance(llama, str):
            report.llama_missing = llama
            llama = None
        else:
            report.llama_version = llama.version
            ttft["llama.cpp"] = _guarded(report, lambda i: _llama_ttft(
                llama.request(report, ids[i]), len(ids[i])))
            per_token["llama.cpp"] = _guarded(report, lambda: llama.request(
                report, ids[n], options.decode_tokens)["decode_s_per_token"])
    try:
        for engine in half.values():
            engine.add_schema(schema)
        for first in ttft.values():                       # every cache warm: not timed
            first(0)
        shape = shape_from_config(llm.adapter.config)
        for (kind, _), timed in zip(QUESTION_KINDS, (range(1, n + 1), range(n + 1, 2 * n + 1))):
            seconds = {name: [] for name in ttft}
            setattr(report, kind, seconds)
            computed = report.computed[kind] = {name: [] for name in ttft}
            for r, i in enumerate(timed):                 # engines in turn
                for name in _turns(list(ttft), r):
                    time.sleep(options.settle_s)
                    value = ttft[name](i)
                    if value is not None:
                        seconds[name].append(value[0])
                        computed[name].append(value[1])
            if computed["promptlang"]:                    # its first timed question's work
                new = computed["promptlang"][0]
                report.question_flops[kind] = prefill_flops(shape, new, len(ids[timed[0]]) - new)
        report.doc["transformers"] = [_full_prefill(llm, ids[n])]
        rounds: dict[str, list[float]] = {name: [] for name in per_token}
        for r in range(DECODE_ROUNDS):
            for name in _turns(list(per_token), r):
                time.sleep(options.settle_s)
                value = per_token[name]()
                if value is not None:
                    rounds[name].append(value)
        report.decode = {name: _median(v) for name, v in rounds.items()}
        if llama is not None:
            report.llama_load_s = llama.load_s
            report.llama_rss_bytes = llama.rss_bytes or None
        if report.llama_missing:                          # it stopped on the way
            for table in (report.doc, report.doc_new, report.decode):
                table.pop("llama.cpp", None)
    finally:
        if llama is not None:
            llama.close()
        for engine in half.values():
            engine.store.clear()


def _inside(context, call):
    """`call` run inside a fresh `context()` each time."""
    def inside(*args):
        with context():
            return call(*args)
    return inside


def _guarded(report: PeersReport, call):
    """`call`, or None once llama.cpp's process has failed (report.llama_missing says why)."""
    def guarded(*args):
        if report.llama_missing:
            return None
        try:
            return call(*args)
        except _LlamaFailed as failed:
            report.llama_missing = str(failed)
            report.llama_version = None
            return None
    return guarded


def _turns(names: list[str], r: int) -> list[str]:
    """The engines' order in round r: each one first in turn."""
    k = r % len(names)
    return names[k:] + names[:k]


class _LlamaFailed(Exception):
    """llama.cpp's process answered with an error or not at all."""


class _LlamaLines:
    """bench/peers_llama.py: llama.cpp in a process of its own, one request at a time;
    killed after LLAMA_TIMEOUT seconds in all."""

    def __init__(self, process: subprocess.Popen, timer: threading.Timer, version: str):
        self.process = process
        self.timer = timer
        self.version = version
        self.load_s: float | None = None
        self.rss_bytes = 0                 # after its latest request

    @classmethod
    def start(cls, gguf: str, threads: int, n_ctx: int) -> "_LlamaLines | str":
        """The session, or why there is none."""
        process = subprocess.Popen([sys.executable, "-m", "promptlang.bench.peers_llama"],
                                   stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                   stderr=subprocess.PIPE, text=True, env=dict(os.environ))
        timer = threading.Timer(LLAMA_TIMEOUT, process.kill)
        timer.daemon = True
        timer.start()
        session = cls(process, timer, "")
        try:
            hello = session._send({"gguf": gguf, "threads": threads, "n_ctx": n_ctx})
        except _LlamaFailed as failed:
            session.close()
            return str(failed)
        session.version = hello["version"]
        session.load_s = hello.get("load_s")
        return session

    def request(self, report: PeersReport, tokens: Sequence[int], decode: int = 0) -> dict:
        out = self._send({"tokens": list(tokens), "decode": decode})
        report.llama_reused.append(out["reused"])
        self.rss_bytes = max(self.rss_bytes, int(out.get("rss_bytes", 0)))
        return out

    def _send(self, message: dict) -> dict:
        try:
            self.process.stdin.write(json.dumps(message) + "\n")
            self.process.stdin.flush()
            line = self.process.stdout.readline()
        except (BrokenPipeError, OSError):
            line = ""
        if not line:
            err = self.process.stderr.read() if self.process.poll() is not None else ""
            raise _LlamaFailed(f"llama.cpp's runner stopped (exit {self.process.poll()}): "
                               f"{err.strip()[-400:]}")
        out = json.loads(line)
        if "error" in out:
            raise _LlamaFailed(out["error"])
        return out

    def close(self) -> None:
        self.timer.cancel()
        try:
            self.process.stdin.close()
            self.process.wait(timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            self.process.kill()


def _per_token(llm, prompt, tokens: int) -> float | None:
    """Seconds per decoded token after the first, greedy."""
    result = llm.generate(prompt, max_new_tokens=tokens)
    n = len(result.token_ids)
    t = result.timings
    return (t.total - t.first_token) / (n - 1) if n > 1 else None


def quantized_check(llm) -> tuple[int, float | None]:
    """(weights the fused layers read quantized, the largest logit difference of a 1-row
    pass over a 200-token past between the quantized and the float weights)."""
    from promptlang.runtime.model import Past

    decoder = llm.adapter.fast.decoder
    count = decoder.quantized_weights if decoder is not None else 0
    if not count:
        return 0, None
    adapter = llm.adapter
    logits = []
    ids = torch.randint(0, 1000, (201,), generator=torch.Generator().manual_seed(5))
    keys, values = adapter.empty_kv(201)
    adapter.forward(ids[:200], torch.arange(200), Past(keys, values, torch.arange(0)), None)
    for off in (False, True):
        past = Past(keys.clone(), values.clone(), torch.arange(200))
        with decoder.quantized_off() if off else contextlib.nullcontext():
            logits.append(adapter.forward(ids[200:], torch.tensor([200]), past, None,
                                          torch.tensor([0])).logits)
    return count, float((logits[0] - logits[1]).abs().max())


def _load_and_memory(report: PeersReport, model: str | None, gguf: str | None,
                     doc_tokens: int) -> None:
    """promptlang's load in a new process and its resident memory after a request over the
    document (bench/peers_memory.py), beside the GGUF's size."""
    if gguf is not None and os.path.isfile(gguf):
        report.file_bytes = os.path.getsize(gguf)
    try:
        done = subprocess.run([sys.executable, "-m", "promptlang.bench.peers_memory",
                               model or "-", str(doc_tokens)], capture_output=True, text=True,
                              timeout=LLAMA_TIMEOUT, env=dict(os.environ))
        out = json.loads(done.stdout.strip().splitlines()[-1])
    except (subprocess.TimeoutExpired, IndexError, json.JSONDecodeError) as err:
        report.memory_missing = f"the load and memory run failed ({type(err).__name__})"
        return
    report.load_s = out["load_s"]
    report.rss_bytes = out["rss_bytes"]
    report.kv_bytes = out["kv_bytes"]
    report.libraries_bytes = out.get("libraries_bytes")


def linear_types(gguf: str) -> str:
    """The types of a GGUF's decoder-layer linear weights, counted: "Q5_0 x 132, Q4_K x 12"."""
    from collections import Counter
    from pathlib import Path

    from gguf import GGMLQuantizationType

    from promptlang.runtime.model.gguf_index import read_index
    from promptlang.runtime.model.loading import GGUF_LINEARS

    counts = Counter(GGMLQuantizationType(entry.type).name
                     for name, entry in read_index(Path(gguf)).tensors.items()
                     if name.startswith("blk.") and name.split(".")[2] in GGUF_LINEARS
                     and name.endswith(".weight"))
    return ", ".join(f"{kind} x {n}" for kind, n in counts.most_common())


def _rag(llm, options: PeersOptions, report: PeersReport) -> list[list[int]]:
    texts = []
    questions = []
    for i in range(options.rag_docs):
        text, item = document(llm.tokenizer, options.rag_doc_tokens, seed=9100 + i)
        texts.append(text)
        questions.append(item.question)
    llm.add_schema(build_schema(texts, RAG_SCHEMA))
    for i in range(options.rag_docs):                           # each document stored once
        llm.generate(build_prompt([i], questions[i], RAG_SCHEMA), max_new_tokens=1,
                     recompute="none")
    plan = plan_requests(options.rag_docs, options.rag_k, options.rag_requests, seed=3)
    prompts = [build_prompt(r.docs, questions[r.question_of], RAG_SCHEMA) for r in plan]
    report.rag_kinds = [r.kind for r in plan]
    # `none` first: it stores no exact entries, so `exact` then meets each combination new
    report.rag["promptlang (none)"] = [_ttft(llm, p, recompute="none")[0] for p in prompts]
    report.rag[DEFAULT_ROW] = [_ttft(llm, p, recompute=DEFAULT_POLICY)[0] for p in prompts]
    ids = [llm.bind(p).token_ids() for p in prompts]
    report.rag["transformers"] = [_full_prefill(llm, i) for i in ids]
    return ids


def _ttft(llm, prompt, **options) -> tuple[float, int]:
    """The request's TTFT (seconds) and the tokens it computed."""
    result = llm.generate(prompt, max_new_tokens=1, **options)
    return result.timings.first_token, result.prefill_tokens


def _llama_ttft(answer: dict, tokens: int) -> tuple[float, int]:
    return answer["ttft_s"], tokens - answer["reused"]


@torch.inference_mode()
def _full_prefill(llm, token_ids: Sequence[int]) -> float:
    """transformers' own forward over the whole prompt and the argmax of its last logits
    (promptlang's linear layers answer only inside its own passes: runtime/fast/linear.py)."""
    ids = torch.tensor([list(token_ids)], device=llm.adapter.device)
    began = time.perf_counter()
    out = llm.adapter.model(input_ids=ids, use_cache=False, logits_to_keep=1)
    int(out.logits[0, -1].argmax())
    return time.perf_counter() - began


def _default_gguf(llm) -> str | None:
    from promptlang.default_model import GGUF_FILE, default_model_dir

    path = default_model_dir() / GGUF_FILE
    name = getattr(llm.tokenizer, "name", "") or ""
    return str(path) if path.is_file() and "smollm2" in name.lower() else None
