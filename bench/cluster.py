"""`promptlang bench cluster`: routers compared on a local Ray Serve cluster.

A RAG workload -- each request imports k of N documents (bench/rag.py's generator), in an
order of its own, and asks about one -- is served by `replicas` engine replicas on a local
Ray Serve cluster (promptlang/server/cluster.py), once per router:

  pow2      Ray Serve's default: the shorter queue of two random replicas
  prefix    Ray Serve LLM's PrefixCacheAffinityRouter on the request's text
  affinity  promptlang's ModuleAffinityRouter on the request's modules

Each replica's memory tier holds `memory_share` of the documents' KV, so one replica
cannot hold them all, while the replicas together can; every run starts from an empty
shared disk tier of its own. `clients` threads stream the same requests in the same order
(bounded: `requests` in all, `run_timeout` seconds per router). Per router: the request's
units by where they came from (device tier, disk tier, encoded), TTFT p50/p99, requests
per second, requests per replica, and requests lost (must be 0).

Before the cluster starts, this process measures what the projection of docs/SCALING.md
needs (`costs`): the TTFT of a request whose k documents all come from the memory tier,
all from the disk tier, or are all encoded, on one engine at the replicas' thread count,
and the bytes of a document's KV. `promptlang bench scaling` projects from them.
"""

from __future__ import annotations

import concurrent.futures
import http.client
import json
import shutil
import statistics
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Sequence

from promptlang.bench.rag import build_prompt, build_schema, plan_requests
from promptlang.bench.report import Goal, Section

ROUTERS = ("pow2", "prefix", "affinity")
TIERS = ("device", "host", "disk", "encoded")
SCHEMA = "cluster-bench"


@dataclass(frozen=True)
class ClusterOptions:
    replicas: int = 2
    docs: int = 24                 # N documents
    k: int = 3                     # documents per request
    doc_tokens: int = 300          # about this many tokens per document
    requests: int = 96             # per router
    clients: int = 4               # concurrent streams
    max_tokens: int = 8
    memory_share: float = 0.6      # each replica's memory tier: this share of the documents
    routers: tuple[str, ...] = ROUTERS
    threads: int = 1               # torch threads per replica
    cost_repeats: int = 3
    request_timeout: float = 300.0
    run_timeout: float = 1200.0    # seconds per router, at most
    seed: int = 0

    @classmethod
    def quick(cls) -> "ClusterOptions":
        return cls(docs=6, k=2, doc_tokens=48, requests=8, clients=2, max_tokens=4,
                   cost_repeats=1, run_timeout=300.0)


@dataclass
class Sample:
    replica: str | None
    ttft: float | None
    seconds: float
    units: dict[str, int]
    lost: str | None = None


@dataclass
class RouterRun:
    router: str
    samples: list[Sample] = field(default_factory=list)
    wall: float = 0.0
    sent: int = 0

    def answered(self) -> list[Sample]:
        return [s for s in self.samples if s.lost is None]

    def row(self) -> dict[str, Any]:
        answered = self.answered()
        units = {tier: sum(s.units.get(tier, 0) for s in answered) for tier in TIERS}
        total = sum(units.values()) or 1
        ttfts = sorted(s.ttft for s in answered if s.ttft is not None)

        def at(q: float) -> float | None:
            if not ttfts:
                return None
            return round(ttfts[min(len(ttfts) - 1, int(q * len(ttfts)))] * 1e3, 1)

        per_replica = sorted((sum(s.replica == r for s in answered)
                              for r in {s.replica for s in answered}), reverse=True)
        return {"router": self.router, "sent": self.sent, "answered": len(answered),
                "lost": len(self.samples) - len(answered),
                "memory hits %": round(100 * (units["device"] + units["host"]) / total, 1),
                "disk hits %": round(100 * units["disk"] / total, 1),
                "encoded %": round(100 * units["encoded"] / total, 1),
                "ttft p50 ms": at(0.5), "ttft p99 ms": at(0.99),
                "requests/s": round(len(answered) / self.wall, 3) if self.wall else None,
                "per replica": "/".join(map(str, per_replica))}


@dataclass
class ClusterReport:
    options: ClusterOptions
    model: str
    costs: dict[str, float] = field(default_factory=dict)
    runs: list[RouterRun] = field(default_factory=list)
    missing: dict[str, str] = field(default_factory=dict)   # router -> why it did not run
    goals: list[Goal] = field(default_factory=list)


def run_cluster(llm, options: ClusterOptions = ClusterOptions(), *,
                model_name: str = "") -> ClusterReport:
    """Measure the costs on `llm`, then serve the workload once per router."""
    import ray
    from ray import serve

    from promptlang.pml.writer import write
    from promptlang.server.cluster import build_app

    report = ClusterReport(options, model_name)
    texts, questions = _documents(llm, options)
    schema = build_schema(texts, SCHEMA)
    plan = plan_requests(options.docs, options.k, options.requests, seed=options.seed)
    bodies = [_body(write(build_prompt(r.docs, questions[r.question_of], SCHEMA)), options)
              for r in plan]
    work = Path(tempfile.mkdtemp(prefix="promptlang-bench-cluster-"))
    try:
        _say("measuring the per-request costs on one engine")
        report.costs = measure_costs(llm, schema, plan, questions, options, work / "costs")
        (work / "schemas").mkdir()
        (work / "schemas" / "rag.pml").write_text(write(schema))
        budget = int(options.memory_share * options.docs * report.costs["bytes_per_doc"])
        ray.init(num_cpus=max(2, options.replicas), include_dashboard=False,
                 log_to_driver=False)
        try:
            port = free_port()
            serve.start(http_options={"host": "127.0.0.1", "port": port})
            for router in options.routers:
                why = _unavailable(router)
                if why:
                    report.missing[router] = why
                    continue
                store = work / f"store-{router}"
                serve.run(build_app({"store": str(store), "replicas": options.replicas,
                                     "schemas": [str(work / "schemas")], "router": router,
                                     "threads": options.threads, "recompute": "none",
                                     "device_budget_bytes": budget,
                                     "max_batch": max(4, options.clients)}),
                          name="cluster-bench", route_prefix="/")
                _say(f"{router}: serving {len(bodies)} requests, {options.clients} at a time")
                report.runs.append(_serve_all(router, port, bodies, options))
                row = report.runs[-1].row()
                _say(f"{router}: {row['answered']} answered, {row['lost']} lost, "
                     f"{row['memory hits %']}% memory hits, TTFT p50 {row['ttft p50 ms']} ms")
                serve.delete("cluster-bench")
        finally:
            serve.shutdown()
            ray.shutdown()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    report.goals = goals(report)
    return report


def _say(message: str) -> None:
    import sys

    print(f"promptlang bench cluster: {message}", file=sys.stderr, flush=True)


def _documents(llm, options: ClusterOptions) -> tuple[list[str], list[str]]:
    from promptlang.bench.latency.sweep import document

    texts = []
    questions = []
    for i in range(options.docs):
        text, item = document(llm.tokenizer, options.doc_tokens, seed=7000 + i)
        texts.append(text)
        questions.append(item.question)
    return texts, questions


def _body(pml: str, options: ClusterOptions) -> dict:
    return {"model": "promptlang", "messages": [], "max_tokens": options.max_tokens,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True},
            "promptlang": {"pml": pml}}


def _unavailable(router: str) -> str | None:
    if router != "prefix":
        return None
    try:
        from promptlang.server.cluster import PREFIX_ROUTER

        module, _, name = PREFIX_ROUTER.partition(":")
        getattr(__import__(module, fromlist=[name]), name)
    except Exception as error:       # noqa: BLE001 - an optional part of Ray
        return f"Ray Serve LLM's prefix router does not import here: {error}"
    return None


def free_port() -> int:
    """A free TCP port on 127.0.0.1 (probed, then released for the server to bind)."""
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def measure_costs(llm, schema, plan, questions, options: ClusterOptions,
                  folder: Path) -> dict[str, float]:
    """TTFT of one k-document request with its documents in the memory tier, in the disk
    tier (memory tiers cleared; the file in the page cache), and encoded (every tier
    cleared), each the median of `cost_repeats`; and a document's KV bytes."""
    import torch

    from promptlang.runtime.engine import LLM
    from promptlang.runtime.store import ModuleStore

    store = ModuleStore(disk_dir=folder)
    # no prompt tails: the same request is timed again and again, and what is measured is
    # the documents served from each tier with the question computed
    engine = LLM(llm.adapter, llm.tokenizer, store, recompute="none", tail_budget_bytes=0)
    engine.add_schema(schema)
    request = plan[0]
    prompt = build_prompt(request.docs, questions[request.question_of], SCHEMA)
    threads = torch.get_num_threads()
    torch.set_num_threads(options.threads)
    try:
        def ttft(clear: list[str] | None) -> float:
            if clear is not None:
                store.clear(tiers=clear)
            result = engine.generate(prompt, max_new_tokens=1, temperature=0)
            return result.timings.first_token

        ttft(None)                     # warm: first-call costs are not the tiers'
        encoded = [ttft(["device", "host", "disk"]) for _ in range(options.cost_repeats)]
        disk = [ttft(["device", "host"]) for _ in range(options.cost_repeats)]
        memory = [ttft(None) for _ in range(options.cost_repeats)]
    finally:
        torch.set_num_threads(threads)
    sizes = [entry.nbytes for entry in store.entries()
             if entry.meta.get("unit", "").startswith("module:doc")]
    store.clear()
    k = len(request.docs)
    return {"k": k, "threads": options.threads, "bytes_per_doc": statistics.mean(sizes),
            "ttft_memory_s": statistics.median(memory),
            "ttft_disk_s": statistics.median(disk),
            "ttft_encoded_s": statistics.median(encoded),
            "per_doc_disk_s": (statistics.median(disk) - statistics.median(memory)) / k,
            "per_doc_encode_s": (statistics.median(encoded) - statistics.median(memory)) / k}


def _serve_all(router: str, port: int, bodies: Sequence[dict],
               options: ClusterOptions) -> RouterRun:
    """Every body once, `clients` at a time, in order; stops sending at `run_timeout`."""
    run = RouterRun(router)
    deadline = time.perf_counter() + options.run_timeout
    lock = threading.Lock()
    queue = list(bodies)

    def client() -> None:
        while time.perf_counter() < deadline:
            with lock:
                if not queue:
                    return
                body = queue.pop(0)
                run.sent += 1
            sample = _one(port, body, options.request_timeout)
            with lock:
                run.samples.append(sample)

    began = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(options.clients) as pool:
        for future in [pool.submit(client) for _ in range(options.clients)]:
            future.result()
    run.wall = time.perf_counter() - began
    return run


def _one(port: int, body: dict, timeout: float) -> Sample:
    """One streamed chat request over HTTP: its replica, TTFT, time and units."""
    from promptlang.server.cluster import REPLICA_HEADER

    began = time.perf_counter()
    ttft = None
    units = {}
    replica = None
    finished = False
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("POST", "/v1/chat/completions", body=json.dumps(body).encode(),
                     headers={"content-type": "application/json"})
        response = conn.getresponse()
        replica = response.getheader(REPLICA_HEADER)
        if response.status != 200:
            return Sample(replica, None, time.perf_counter() - began, {},
                          f"HTTP {response.status}: {response.read()[:200]!r}")
        for raw in response:
            line = raw.decode("utf-8").strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            for choice in chunk.get("choices", []):
                if choice.get("delta", {}).get("content") and ttft is None:
                    ttft = time.perf_counter() - began
                finished |= choice.get("finish_reason") is not None
            units = (chunk.get("promptlang") or {}).get("units", units)
    except Exception as error:        # noqa: BLE001 - a lost request: counted, never raised
        return Sample(replica, ttft, time.perf_counter() - began, units,
                      f"{type(error).__name__}: {error}")
    finally:
        conn.close()
    lost = None if finished else "the stream ended without a finish reason"
    return Sample(replica, ttft, time.perf_counter() - began, units, lost)


def goals(report: ClusterReport) -> list[Goal]:
    rows = {run.router: run.row() for run in report.runs}
    lost = sum(row["lost"] for row in rows.values())
    out = [Goal("no request lost", lost == 0 if rows else None,
                f"{lost} lost of {sum(r['sent'] for r in rows.values())} sent")]
    if "affinity" in rows and "pow2" in rows:
        a = rows["affinity"]
        p = rows["pow2"]
        out.append(Goal("module affinity keeps more in memory than power-of-two",
                        a["memory hits %"] > p["memory hits %"],
                        f"{a['memory hits %']}% against {p['memory hits %']}%"))
    return out


def sections(report: ClusterReport) -> list[Section]:
    o = report.options
    c = report.costs
    lines = [f"model {report.model}; {o.replicas} replicas of {o.threads} torch thread(s); "
             f"{o.docs} documents of ~{o.doc_tokens} tokens, k={o.k} per request, "
             f"{o.requests} requests per router, {o.clients} concurrent streams, "
             f"{o.max_tokens} new tokens; each replica's memory tier holds "
             f"{o.memory_share:.0%} of the documents' KV; recompute none"]
    lines += [f"{router}: not run: {why}" for router, why in report.missing.items()]
    cost_lines = [f"a document's KV: {c['bytes_per_doc'] / 2**20:.1f} MiB",
                  f"TTFT of a {c['k']}-document request, documents from the memory tier "
                  f"{c['ttft_memory_s'] * 1e3:.0f} ms, from the disk tier "
                  f"{c['ttft_disk_s'] * 1e3:.0f} ms, encoded {c['ttft_encoded_s'] * 1e3:.0f} ms",
                  f"per document: a disk-tier hit adds {c['per_doc_disk_s'] * 1e3:.1f} ms, "
                  f"an encode {c['per_doc_encode_s'] * 1e3:.1f} ms"] if c else []
    return [Section("Cluster: routers on the same RAG workload",
                    [run.row() for run in report.runs], lines),
            Section("Per-request costs (one engine, this process)", (), cost_lines),
            Section("Goals", (), [str(g) for g in report.goals])]


def to_json(report: ClusterReport) -> dict:
    return {"model": report.model, "options": asdict(report.options), "costs": report.costs,
            "runs": [{"router": run.router, "row": run.row(),
                      "samples": [asdict(s) for s in run.samples]} for run in report.runs],
            "missing": report.missing,
            "goals": [{"name": g.name, "passed": g.passed, "detail": g.detail}
                      for g in report.goals]}


__all__ = ["ClusterOptions", "ClusterReport", "run_cluster", "measure_costs", "sections",
           "to_json", "goals"]
