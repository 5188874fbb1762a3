"""`promptlang bench peers`' report: what one run measured (`PeersReport`), its goals
and its tables; the measuring is bench/peers.py."""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Any, Sequence

from promptlang.bench.report import Goal, Section
from promptlang.runtime.recompute.policy import DEFAULT_POLICY

F16_STORE = "promptlang (f16 store)"        # llama.cpp's own KV type
# approximations of the kind llama.cpp makes (16-bit KV, quantized inputs to the linear
# layers): fast/fused.py `approximated`; where the CPU lacks them, the float path runs
# under this name
APPROXIMATE = "promptlang (int8 linears, bf16 attention and store)"
DEFAULT_ROW = f"promptlang ({DEFAULT_POLICY})"   # RAG under the default policy
DECODE_ROUNDS = 3                # decode runs per engine, in turns (the median counts)
# the document's two kinds of new question: (report field, goal and row note)
QUESTION_KINDS = (("doc", "new question"),
                  ("doc_new", "new question with a new opening"))


@dataclass(frozen=True)
class PeersOptions:
    doc_tokens: int = 6400
    questions: int = 3               # timed new questions of each kind about the document
    decode_tokens: int = 64
    rag_docs: int = 8
    rag_k: int = 4
    rag_doc_tokens: int = 700
    rag_requests: int = 6
    gguf: str | None = None          # the GGUF llama.cpp loads (default: the default model's)
    settle_s: float = 1.0            # idle seconds before each engine's turn (bench/peers.py)

    @classmethod
    def quick(cls) -> "PeersOptions":
        return cls(doc_tokens=120, questions=1, decode_tokens=4, rag_docs=3, rag_k=2,
                   rag_doc_tokens=30, rag_requests=2, settle_s=0.0)


@dataclass
class PeersReport:
    options: PeersOptions
    model: str
    # engine -> TTFT seconds of new questions that open as the previous one (its words and
    # a new number: llama.cpp's prefix hit reaches into the question) ...
    doc: dict[str, list[float]] = field(default_factory=dict)
    # ... and of new questions whose first word no earlier request had
    doc_new: dict[str, list[float]] = field(default_factory=dict)
    decode: dict[str, float | None] = field(default_factory=dict)  # engine -> s per token
    rag: dict[str, list[float]] = field(default_factory=dict)     # engine -> TTFT seconds
    # kind ("doc", "doc_new") -> engine -> tokens each timed question computed (the rest:
    # cached or reused)
    computed: dict[str, dict[str, list[int]]] = field(default_factory=dict)
    rag_kinds: list[str] = field(default_factory=list)
    llama_version: str | None = None
    llama_missing: str | None = None  # why llama.cpp was not measured
    llama_reused: list[int] = field(default_factory=list)        # its prefix hits, per request
    quantized_weights: int = 0                 # linear weights read as the GGUF stores them
    quantized_max_diff: float | None = None    # largest logit difference against float ones
    quantized_types: str = ""                  # the GGUF's linear weights' types, counted
    load_s: float | None = None                # promptlang's load call, in a new process
    rss_bytes: int | None = None               # its resident memory after the document
    kv_bytes: int | None = None                # the KV its store held then
    libraries_bytes: int | None = None         # its resident memory before the load
    file_bytes: int | None = None              # the GGUF's size
    llama_load_s: float | None = None
    llama_rss_bytes: int | None = None         # llama.cpp's, after its largest request
    memory_missing: str | None = None          # why the load and memory run failed
    # APPROXIMATE's approximations this CPU lacks (those passes computed as the model's)
    approximations_missing: list[str] = field(default_factory=list)
    # kind -> the arithmetic of promptlang's first timed question (bench/floor.py)
    question_flops: dict[str, float] = field(default_factory=dict)
    sgemm_flops_per_s: float | None = None     # the run's float32 matmul rate (None: unknown)
    goals: list[Goal] = field(default_factory=list)


def _median(values: Sequence[float] | None) -> float | None:
    return statistics.median(values) if values else None


def goals(report: PeersReport) -> list[Goal]:
    out = []
    missing = report.llama_missing or "llama.cpp not measured"

    def ratio(name: str, mine: float | None, theirs: float | None, target: float,
              at_most: bool, what: str) -> None:
        if mine is None or theirs is None:
            out.append(Goal(name, None, missing if theirs is None else "not measured"))
            return
        r = mine / theirs if at_most else theirs / mine
        out.append(Goal(name, r <= target if at_most else r >= target,
                        f"{what}: {r:.2f}x ({mine * 1e3:.1f} vs {theirs * 1e3:.1f} ms)"))

    rag = report.rag
    for kind, what in QUESTION_KINDS:
        doc = getattr(report, kind)
        first = len(out)
        theirs_doc = _median(doc.get("llama.cpp"))
        for engine, note in (("promptlang", ""), (APPROXIMATE, f" ({APPROXIMATE[12:-1]})")):
            ratio(f"document ~6.4k{'' if kind == 'doc' else ', ' + what}, promptlang cached "
                  f"TTFT <= 0.8x llama.cpp's prefix hit{note}", _median(doc.get(engine)),
                  theirs_doc, 0.8, True, "medians")
        flops = report.question_flops.get(kind)
        if out[first].passed is not None and flops and report.sgemm_flops_per_s:
            floor = flops / report.sgemm_flops_per_s      # the model's numbers
            out[first] = Goal(out[first].name, out[first].passed, f"{out[first].detail}; the "
                              f"question's arithmetic alone ({flops / 1e9:.1f} GFLOP) at this "
                              f"run's float32 sgemm ({report.sgemm_flops_per_s / 1e9:.0f} "
                              f"GFLOP/s): {floor * 1e3:.0f} ms = {floor / theirs_doc:.2f}x")
    for policy in ("none", DEFAULT_POLICY):
        ratio(f"RAG {report.options.rag_k} of {report.options.rag_docs}, promptlang "
              f"({policy}) >= 100x faster than llama.cpp",
              _median(rag.get(f"promptlang ({policy})")), _median(rag.get("llama.cpp")), 100,
              False, "medians")
        ratio(f"RAG {report.options.rag_k} of {report.options.rag_docs}, promptlang "
              f"({policy}) >= 50x faster than transformers' full prefill",
              _median(rag.get(f"promptlang ({policy})")), _median(rag.get("transformers")),
              50, False, "medians")
    theirs = report.decode.get("llama.cpp")
    for engine in ("promptlang", F16_STORE, APPROXIMATE):
        mine = report.decode.get(engine)
        note = engine[len("promptlang"):]
        name = f"decode at the document's cached context >= llama.cpp's tokens/s{note}"
        if mine is None or theirs is None:
            out.append(Goal(name, None, missing if theirs is None else "not measured"))
        else:
            out.append(Goal(name, mine <= theirs, f"{1 / mine:.1f} vs {1 / theirs:.1f} "
                                                  f"tokens/s = {theirs / mine:.2f}x"))
    out.extend(_load_memory_goals(report))
    if report.quantized_max_diff is None:
        out.append(Goal("the quantized path's logits equal the dequantized path's", None,
                        "this model has no GGUF blocks the kernels read"))
    else:
        out.append(Goal("the quantized path's logits equal the dequantized path's",
                        report.quantized_max_diff <= 1e-4,
                        f"{report.quantized_weights} weights read as the GGUF stores them"
                        f"{f' (of {report.quantized_types})' if report.quantized_types else ''}"
                        f"; largest "
                        f"logit difference {report.quantized_max_diff:.2g} (layers bit for "
                        f"bit; the Q8_0 head sums in another order than torch's)"))
    return out


LOAD_GOAL_S = 2.0             # a new process's load call, seconds
MEMORY_GOAL = 1.5             # resident memory <= this x the GGUF's size + the requests' KV


def _load_memory_goals(report: PeersReport) -> list[Goal]:
    if report.load_s is None or report.rss_bytes is None:
        why = report.memory_missing or "not measured"
        return [Goal(f"load in a new process <= {LOAD_GOAL_S:g} s", None, why),
                Goal(f"resident memory <= {MEMORY_GOAL:g}x the GGUF's size + the KV", None, why)]
    beside = (f"; llama.cpp {report.llama_load_s:.2f} s" if report.llama_load_s is not None
              else "")
    out = [Goal(f"load in a new process <= {LOAD_GOAL_S:g} s", report.load_s <= LOAD_GOAL_S,
                f"{report.load_s:.2f} s (the load call; the model converted earlier){beside}")]
    if not report.file_bytes:
        out.append(Goal(f"resident memory <= {MEMORY_GOAL:g}x the GGUF's size + the KV", None,
                        "no GGUF file to compare with"))
        return out
    limit = MEMORY_GOAL * report.file_bytes + (report.kv_bytes or 0)
    theirs = (f"; llama.cpp {report.llama_rss_bytes / 1e6:,.0f} MB"
              if report.llama_rss_bytes else "")
    out.append(Goal(f"resident memory <= {MEMORY_GOAL:g}x the GGUF's size + the KV",
                    report.rss_bytes <= limit,
                    f"{report.rss_bytes / 1e6:,.0f} MB after a request over the document "
                    f"({report.rss_bytes / report.file_bytes:.1f}x the "
                    f"{report.file_bytes / 1e6:,.0f} MB file, its KV "
                    f"{(report.kv_bytes or 0) / 1e6:,.0f} MB, limit "
                    f"{limit / 1e6:,.0f} MB{_libraries(report)}){theirs}"))
    return out


def _libraries(report: PeersReport) -> str:
    """What of the resident memory was there before the load: the libraries imported."""
    if not report.libraries_bytes:
        return ""
    own = report.rss_bytes - report.libraries_bytes
    return (f"; {report.libraries_bytes / 1e6:,.0f} MB of it resident before the load, the "
            f"libraries imported; the rest {own / 1e6:,.0f} MB = "
            f"{own / report.file_bytes:.2f}x the file")


def sections(report: PeersReport) -> list[Section]:
    o = report.options

    def ms(v):
        return None if v is None else round(v * 1e3, 1)

    rows = []

    def row(workload: str, engine: str, values=None, per_token=None) -> None:
        rows.append({"workload": workload, "engine": engine,
                     "TTFT ms (median)": ms(_median(values)),
                     "min ms": ms(min(values)) if values else None,
                     "max ms": ms(max(values)) if values else None,
                     "n": len(values) if values else None, "ms/token": ms(per_token),
                     "tokens/s": round(1 / per_token, 1) if per_token else None})
    for kind, what in QUESTION_KINDS:
        for name, values in getattr(report, kind).items():
            row(f"document ~{o.doc_tokens}, {what}", name, values)
    for name, value in report.decode.items():
        row("decode after the document", name, per_token=value)
    for name, values in report.rag.items():
        row(f"RAG {o.rag_k} of {o.rag_docs} (~{o.rag_doc_tokens} each)", name, values)
    lines = [f"same token ids to every engine; llama.cpp "
             f"{report.llama_version or 'not run: ' + str(report.llama_missing)}, in a "
             "process of its own, same thread count; document and decode: the engines in "
             f"turn each round, each turn after {o.settle_s:g} s idle (decode: median of "
             f"{DECODE_ROUNDS} runs each)",
             "document: llama.cpp's TTFT is its prefix hit (the previous request held the "
             "document, and the previous question's opening where the question repeats it); "
             "promptlang serves the document module from its store, and the question's "
             "opening from a recent question's (prompt tails: runtime/kv/tails.py); new "
             "questions that open as the previous one (its words, a new number) come first, "
             "then new questions whose first word no earlier request had",
             "tokens computed per timed question: " + "; ".join(
                 f"{what}: " + ", ".join(f"{name} {v}" for name, v in
                                          report.computed.get(kind, {}).items())
                 for kind, what in QUESTION_KINDS),
             f"RAG request kinds: {', '.join(report.rag_kinds)}; llama.cpp reused "
             f"{report.llama_reused[-len(report.rag_kinds):] if report.llama_reused else '-'} "
             "prompt tokens per request from its cache",
             "promptlang (none): documents as encoded apart (the fast path; its cost in "
             "answers: docs/RECOMPUTE.md); promptlang (exact): the default, answers as the "
             "full prefill's (a new combination computes its later documents again)"]
    if report.approximations_missing:
        lines.append(f"{APPROXIMATE}: this CPU cannot run its "
                     f"{' and '.join(report.approximations_missing)} (bf16 attention needs "
                     "AVX512_BF16): those passes computed as the model's")
    return [Section(f"Peers ({report.model})", rows, lines),
            Section("Goals", (), [str(g) for g in report.goals
                                             if not _default_policy(g)]),
            Section(f"Goals of the default policy ({DEFAULT_POLICY}: answers as the full "
                    "prefill's)", (), [str(g) for g in report.goals
                                                 if _default_policy(g)])]


def _default_policy(goal: Goal) -> bool:
    """A RAG goal of the default policy, whose cost on a new combination of documents is the
    seam goal's (docs/BENCHMARKS.md): the peers' own RAG goals are the cached path's (`none`)."""
    return f"({DEFAULT_POLICY})" in goal.name


def to_json(report: PeersReport) -> dict[str, Any]:
    return {"model": report.model, "options": report.options.__dict__, "doc": report.doc,
            "doc_new": report.doc_new, "decode": report.decode, "rag": report.rag,
            "rag_kinds": report.rag_kinds,
            "llama_version": report.llama_version, "llama_missing": report.llama_missing,
            "llama_reused": report.llama_reused, "computed": report.computed,
            "quantized_weights": report.quantized_weights,
            "quantized_max_diff": report.quantized_max_diff,
            "quantized_types": report.quantized_types,
            "load_s": report.load_s, "rss_bytes": report.rss_bytes, "kv_bytes": report.kv_bytes,
            "libraries_bytes": report.libraries_bytes,
            "file_bytes": report.file_bytes, "llama_load_s": report.llama_load_s,
            "llama_rss_bytes": report.llama_rss_bytes, "memory_missing": report.memory_missing,
            "approximations_missing": report.approximations_missing,
            "question_flops": report.question_flops,
            "sgemm_flops_per_s": report.sgemm_flops_per_s,
            "goals": [{"name": g.name, "passed": g.passed, "detail": g.detail}
                      for g in report.goals]}
