"""`promptlang bench plan`: `compile --plan`'s estimates against a real encode, in one run.

A RAG template (a documents loop, a conditional system text, a bounded parameter) is
compiled with the Jinja2 frontend at a few document lengths. For each, the cache plan
(compiler/cache_plan.py, with the encode rate kept for this CPU or measured now) gives
the KV bytes and the encode seconds; then the schema is encoded into an empty store of
its own, `rounds` times, and the bytes the store holds and the wall time are compared.

Goals: the byte estimate within 5% of what the store holds, the time estimate within 30%
of the median encode.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import jinja2
import torch

from promptlang.bench.rag import documents
from promptlang.bench.report import Goal, Progress, Section
from promptlang.compiler.cache_plan import plan_schema
from promptlang.compiler.jinja import from_template, template_environment
from promptlang.runtime.engine import LLM
from promptlang.runtime.kv.unit import bytes_per_token
from promptlang.runtime.model.encode_rate import encode_rate
from promptlang.runtime.store import ModuleStore

BYTES_GOAL = 0.05
SECONDS_GOAL = 0.30
TEMPLATE = """{% block system %}Answer from the documents only.{% if strict %} Say "not in the documents" when they do not say.{% endif %}{% endblock %}
{% block user %}Documents for {{ reader | maxlen(8) }}:
{% for doc in docs %}{{ doc }}

{% endfor %}Question: {{ question }}{% endblock %}"""


@dataclass(frozen=True)
class PlanOptions:
    docs: int = 5
    doc_tokens: tuple[int, ...] = (100, 400, 1400)
    rounds: int = 3
    seed: int = 0

    @classmethod
    def quick(cls) -> "PlanOptions":
        return cls(docs=2, doc_tokens=(40,), rounds=1)


@dataclass
class PlanReport:
    options: PlanOptions
    model: str
    rate: dict[str, Any] = field(default_factory=dict)
    rows: list[dict] = field(default_factory=list)
    seconds: float = 0.0

    def goals(self) -> list[Goal]:
        if not self.rows:
            return []
        worst_bytes = max(abs(r["bytes_ratio"] - 1) for r in self.rows)
        worst_time = max(abs(r["seconds_ratio"] - 1) for r in self.rows)
        shown = ", ".join(f"{r['doc_tokens']}: {r['bytes_ratio']:.3f}" for r in self.rows)
        timed = ", ".join(f"{r['doc_tokens']}: {r['seconds_ratio']:.2f}" for r in self.rows)
        return [Goal(f"--plan's KV bytes within {BYTES_GOAL:.0%} of the store's",
                     worst_bytes <= BYTES_GOAL,
                     f"estimate / stored by document tokens: {shown}"),
                Goal(f"--plan's encode time within {SECONDS_GOAL:.0%} of the encode's",
                     worst_time <= SECONDS_GOAL,
                     f"estimate / median encode by document tokens: {timed}")]


def run_plan(llm: LLM, options: PlanOptions = PlanOptions(), *, model_name: str = "",
             progress: bool = True) -> PlanReport:
    """Plan and encode the template at each document length (module docstring)."""
    started = time.perf_counter()
    report = PlanReport(options, model_name)
    adapter = llm.adapter
    rate = encode_rate(adapter, progress=lambda text: print(f"promptlang bench: {text}"))
    report.rate = {"c0": rate.c0, "c1": rate.c1, "c2": rate.c2, "measured": rate.measured,
                   "kept": rate.cached}
    shape = adapter.kv_shape
    per_token = {"float32": bytes_per_token(shape.layers, shape.kv_heads, shape.key_dim,
                                            shape.value_dim, adapter.dtype)}
    environment = template_environment(jinja2.DictLoader({"rag.j2": TEMPLATE}))
    with Progress(total=len(options.doc_tokens) * options.rounds, desc="plan",
                  enabled=progress) as bar:
        for doc_tokens in options.doc_tokens:
            texts, _ = documents(llm.tokenizer, options.docs, doc_tokens, options.seed)
            template = from_template("rag.j2", environment=environment,
                                     documents={"docs": texts})
            plan = plan_schema(template.schema, llm.tokenizer, per_token, rate.seconds)
            stored = []
            timings = []
            for _ in range(options.rounds):
                store = ModuleStore(adapter.device, disk_budget_bytes=0)
                engine = LLM(adapter, llm.tokenizer, store, tail_budget_bytes=0)
                begin = time.perf_counter()
                engine.encode(template.schema)
                timings.append(time.perf_counter() - begin)
                stored.append(sum(entry.nbytes for entry in store.entries()))
                bar.update(1)
            encoded = statistics.median(timings)
            report.rows.append({
                "doc_tokens": doc_tokens, "units": len(plan.rows),
                "tokens": plan.total_tokens,
                "estimated_bytes": plan.total_bytes("float32"), "stored_bytes": stored[0],
                "bytes_ratio": plan.total_bytes("float32") / stored[0],
                "estimated_s": plan.total_seconds, "encode_s": encoded,
                "encode_samples_s": timings,
                "seconds_ratio": plan.total_seconds / encoded})
    report.seconds = time.perf_counter() - started
    return report


def sections(report: PlanReport) -> list[Section]:
    rows = [{"document tokens": r["doc_tokens"], "units": r["units"], "tokens": r["tokens"],
             "KV estimated MiB": r["estimated_bytes"] / 2 ** 20,
             "KV stored MiB": r["stored_bytes"] / 2 ** 20,
             "estimated s": r["estimated_s"], "encode s (median)": r["encode_s"],
             "time estimate / encode": r["seconds_ratio"]} for r in report.rows]
    rate = report.rate
    lines = [f"{report.options.docs} documents per template at each length; each schema "
             f"encoded {report.options.rounds} times into an empty store",
             f"encode time model: {rate.get('c0', 0) * 1e3:.1f} ms + "
             f"{rate.get('c1', 0) * 1e6:.1f} us*N + {rate.get('c2', 0) * 1e9:.2f} ns*N^2 "
             f"({'kept from ' + str(rate.get('measured')) if rate.get('kept') else 'measured in this run'})",
             f"torch threads {torch.get_num_threads()}"]
    goals = [str(goal) for goal in report.goals()]
    return [Section(f"Cache plan against the store ({report.model})", rows, lines),
            Section("Goals", (), goals)]


def to_json(report: PlanReport) -> dict[str, Any]:
    return {"options": asdict(report.options), "model": report.model, "rate": report.rate,
            "rows": report.rows, "seconds": report.seconds,
            "goals": [{"name": g.name, "passed": g.passed, "detail": g.detail}
                      for g in report.goals()]}
