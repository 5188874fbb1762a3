"""`promptlang bench scaling`: hit rates and TTFT projected to 64 replicas and 1e6 modules.

A simulation, not a measurement: what it takes from this machine is the per-request costs
`promptlang bench cluster` measured (cluster.json's "costs": the TTFT of a k-document
request with its documents in memory, a disk-tier hit's and an encode's cost per
document, a document's KV bytes). What it models:

- `modules` distinct documents with Zipf popularity (exponent `zipf`); each request reads
  `k` distinct ones;
- `replicas` replicas, each an LRU memory tier of `memory_gib` (in documents: its bytes /
  a document's KV bytes);
- a shared disk tier that holds every document already (encoded once by some replica:
  the steady state; encodes happen once per document in the whole cluster);
- routing by two rules: `random` (what power-of-two choices is to a cache: content-blind,
  for load it is better) and `affinity` (promptlang's rule itself, affinity.rank_replicas,
  over a table that is each replica's memory: the router's knowledge is exact, as with
  replicas reporting every step). Load is assumed balanced (the imbalance fallback never
  fires); the busiest replica's share of the requests is reported, since affinity can
  concentrate them.

Per setting: the memory-tier hit rate (after a warm-up of twice the cluster's memory in
document reads), the busiest replica's load relative to the mean, and the projected
TTFT = memory TTFT + (misses per request) x (a disk hit's cost per document, stretched by
1 / (1 - utilisation) of the shared tier's bandwidth: saturated at 1). The disk-tier
table gives, for each tier kind (a shared network filesystem, a remote KV server cluster,
an object store: bandwidth and added latency per read, see TIERS), the replica count at
which it saturates when every replica serves at its all-hits rate.
"""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass
from typing import Any, Sequence

from promptlang.bench.report import Section


@dataclass(frozen=True)
class ScalingOptions:
    replicas: tuple[int, ...] = (2, 4, 8, 16, 32, 64)
    modules: tuple[int, ...] = (1_000, 10_000, 100_000, 1_000_000)
    k: int = 3
    zipf: float = 0.9
    memory_gib: float = 16.0       # each replica's memory tier for module KV
    measured_requests: int = 20_000
    seed: int = 0

    @classmethod
    def quick(cls) -> "ScalingOptions":
        return cls(replicas=(2, 4), modules=(1_000, 10_000), measured_requests=2_000)


@dataclass(frozen=True)
class Tier:
    name: str
    gb_per_s: float            # aggregate bandwidth the cluster shares
    latency_ms: float          # added per read
    per_replica: bool = False  # bandwidth grows with replicas (each has its own link)


TIERS = (Tier("shared NFS (10 GbE server)", 1.25, 0.5),
         Tier("shared parallel filesystem", 10.0, 0.5),
         Tier("remote KV servers, 25 GbE per replica", 3.1, 1.0, per_replica=True),
         Tier("object store (S3-like)", 0.1, 30.0, per_replica=True))


def zipf_sampler(modules: int, exponent: float, rng: random.Random):
    """Draw module indices with probability proportional to 1 / (rank + 1) ** exponent."""
    weights = [1.0 / (i + 1) ** exponent for i in range(modules)]
    cumulative = []
    total = 0.0
    for w in weights:
        total += w
        cumulative.append(total)
    import bisect

    def draw() -> int:
        return min(modules - 1, bisect.bisect_left(cumulative, rng.random() * total))
    return draw


def simulate(router: str, replicas: int, modules: int, capacity: int, k: int,
             zipf: float, measured: int, seed: int = 0) -> dict[str, float]:
    """Memory hit rate and the busiest replica's load share (x the mean) of `router`."""
    from promptlang.server.affinity import AffinityTable, rank_replicas

    rng = random.Random(f"promptlang.bench.scaling:{seed}:{router}:{replicas}:{modules}")
    draw = zipf_sampler(modules, zipf, rng)
    table = AffinityTable(max_bytes=max(1, capacity))
    names = list(range(replicas))
    for r in names:
        table.observe(r, {}, capacity=capacity)
    warmup = max(2_000, 2 * replicas * capacity // k)
    hits = reads = 0
    served = [0] * replicas
    for step in range(warmup + measured):
        request: dict[int, int] = {}
        while len(request) < min(k, modules):
            request[draw()] = 1
        if router == "affinity":
            first = rank_replicas(request, names, {}, table)[0]
            chosen = first[rng.randrange(len(first))]
        else:
            chosen = rng.randrange(replicas)
        if step >= warmup:
            hits += table.held_bytes(chosen, request)
            reads += len(request)
            served[chosen] += 1
        table.record(chosen, request)
    return {"hit_rate": hits / reads, "busiest": max(served) * replicas / sum(served)}


def run_scaling(costs: dict[str, float], options: ScalingOptions = ScalingOptions(),
                progress=None) -> dict[str, Any]:
    """Every (router, replicas, modules) setting, projected with `costs`."""
    capacity = int(options.memory_gib * 2**30 // costs["bytes_per_doc"])
    rows = []
    for modules in options.modules:
        for replicas in options.replicas:
            for router in ("random", "affinity"):
                found = simulate(router, replicas, modules, capacity, options.k,
                                 options.zipf, options.measured_requests, options.seed)
                misses = options.k * (1 - found["hit_rate"])
                rows.append({"modules": modules, "replicas": replicas, "router": router,
                             "memory hit %": round(100 * found["hit_rate"], 1),
                             "busiest x mean": round(found["busiest"], 2),
                             "disk reads/request": round(misses, 2),
                             "ttft ms (idle disk)": round(1e3 * (
                                 costs["ttft_memory_s"] + misses * costs["per_doc_disk_s"]),
                                 1)})
                if progress is not None:
                    progress(rows[-1])
    return {"options": asdict(options), "costs": costs, "capacity_docs": capacity,
            "rows": rows, "tiers": tier_rows(costs, rows, options)}


def tier_rows(costs: dict[str, float], rows: Sequence[dict], options: ScalingOptions
              ) -> list[dict[str, Any]]:
    """Per tier kind and router (at the largest module count): the replicas at which the
    tier saturates, and the TTFT at 64 replicas."""
    out = []
    largest = max(options.modules)
    rate = 1.0 / costs["ttft_memory_s"]            # requests/s of one replica at all hits
    for tier in TIERS:
        for router in ("random", "affinity"):
            mine = [r for r in rows if r["modules"] == largest and r["router"] == router]
            saturates = None
            for row in sorted(mine, key=lambda r: r["replicas"]):
                if _utilisation(tier, row, rate, costs) >= 1 and saturates is None:
                    saturates = row["replicas"]
            top = max(mine, key=lambda r: r["replicas"])
            out.append({"tier": tier.name, "router": router,
                        "GB/s": tier.gb_per_s, "latency ms": tier.latency_ms,
                        "saturates at replicas": saturates or f"> {top['replicas']}",
                        f"ttft ms at {top['replicas']}": _ttft(tier, top, rate, costs)})
    return out


def _utilisation(tier: Tier, row: dict, rate: float, costs: dict[str, float]) -> float:
    demand = row["replicas"] * rate * row["disk reads/request"] * costs["bytes_per_doc"]
    bandwidth = tier.gb_per_s * 1e9 * (row["replicas"] if tier.per_replica else 1)
    return demand / bandwidth


def _ttft(tier: Tier, row: dict, rate: float, costs: dict[str, float]) -> float | str:
    u = _utilisation(tier, row, rate, costs)
    if u >= 1:
        return "saturated"
    per_read = (costs["bytes_per_doc"] / (tier.gb_per_s * 1e9) + tier.latency_ms / 1e3
                + costs["per_doc_disk_s"])
    return round(1e3 * (costs["ttft_memory_s"] + row["disk reads/request"] * per_read
                        / (1 - u)), 1)


def sections(result: dict[str, Any]) -> list[Section]:
    o = result["options"]
    c = result["costs"]
    lines = [f"Zipf exponent {o['zipf']}, k={o['k']} documents per request, "
             f"{o['memory_gib']} GiB memory tier per replica = {result['capacity_docs']:,} "
             f"documents of {c['bytes_per_doc'] / 2**20:.1f} MiB; "
             f"{o['measured_requests']:,} requests measured after a warm-up",
             f"costs measured by bench cluster: all-hits TTFT {c['ttft_memory_s'] * 1e3:.0f} "
             f"ms for k={c['k']}, a disk-tier hit +{c['per_doc_disk_s'] * 1e3:.1f} ms per "
             f"document, an encode +{c['per_doc_encode_s'] * 1e3:.0f} ms per document "
             f"({c['threads']} thread(s))"]
    return [Section("Projected memory hits and TTFT", result["rows"], lines),
            Section("Where the shared tier becomes the limit (largest module count; every "
                    "replica at its all-hits request rate)", result["tiers"],
                    [f"{t.name}: {t.gb_per_s} GB/s{' per replica' if t.per_replica else ''}"
                     f", +{t.latency_ms} ms per read" for t in TIERS])]


__all__ = ["ScalingOptions", "run_scaling", "simulate", "sections", "TIERS"]
