"""`promptlang bench memory`: how many bytes the cache holds per token.

KV bytes per token = layers x 2 (K and V) x kv_heads x head_dim x bytes per value.
It counts K and V at `kv_heads`, as the store keeps them (never after repeat_kv).
(transformers' Falcon with the new decoder architecture broadcasts K/V to every head
before caching; the figure here is the architecture's, which our store achieves.)

`run_memory` also measures what the module store really holds: it encodes one module
into a float32 store and into a bfloat16 one (`ModuleStore(dtype=torch.bfloat16)`) and
reads the entries' sizes back, in memory and on disk. Only that part imports torch.
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass, field
from typing import Any

from promptlang.runtime.bench.report import Goal, Section, format_table
from promptlang.runtime.bench.shapes import PUBLISHED, ModelShape, shape_from_config

# Per-token KV sizes from Table 2 of the Prompt Cache paper (Gim et al., arXiv 2311.04934),
# in bytes, keyed like PUBLISHED. Empty: the figures must be filled in from the paper
# itself; until then the table prints "n/a" rather than a number nobody checked.
PAPER_TABLE2: dict[str, int] = {}

DEFAULT_MODEL = "SmolLM2-135M"


def kv_bytes_per_token(config: ModelShape | Any, bytes_per_value: int = 4) -> int:
    """KV bytes one token occupies in the cache, for a ModelShape or a transformers
    config (see shapes.shape_from_config for how kv_heads and head_dim are found)."""
    shape = config if isinstance(config, ModelShape) else shape_from_config(config)
    return shape.layers * 2 * shape.kv_heads * shape.head_dim * bytes_per_value


def memory_rows(shapes: dict[str, ModelShape] | None = None) -> list[dict[str, Any]]:
    """One row per model: its shape, KV bytes per token in 16 and 32 bits, the
    paper's figure (None where unknown), and the float32 cache of 1k tokens in MiB."""
    rows = []
    for name, shape in (shapes or PUBLISHED).items():
        fp32 = kv_bytes_per_token(shape, 4)
        rows.append({
            "model": name,
            "layers": shape.layers,
            "kv_heads": shape.kv_heads,
            "head_dim": shape.head_dim,
            "bytes/token fp16": kv_bytes_per_token(shape, 2),
            "bytes/token fp32": fp32,
            "paper Table 2": PAPER_TABLE2.get(name),
            "MiB/1k tokens fp32": round(fp32 * 1000 / 2**20, 1),
        })
    return rows


def memory_table(shapes: dict[str, ModelShape] | None = None) -> str:
    return format_table(memory_rows(shapes), float_format="{:,.1f}")


# A stored unit keeps, besides K and V, its positions (int64), token ids (int64) and
# placeholder flags (bool) per token.
UNIT_META_BYTES_PER_TOKEN = 8 + 8 + 1
STORE_PROBE_TOKENS = 256


@dataclass(frozen=True)
class StoreBytes:
    """Bytes per token of one encoded module, as a store of `dtype` holds it."""

    dtype: str
    tokens: int
    kv: float          # keys and values only
    stored: float      # the whole entry in memory (K, V, positions, ids, flags)
    file: float        # its safetensors file (header included)

    def row(self) -> dict[str, Any]:
        return {"store dtype": self.dtype, "tokens": self.tokens,
                "K/V bytes/token": _whole(self.kv), "stored bytes/token": _whole(self.stored),
                "file bytes/token": _whole(self.file),
                "MiB/1k tokens (K/V)": round(self.kv * 1000 / 2**20, 1)}


def _whole(value: float) -> int | float:
    return int(value) if float(value).is_integer() else round(value, 1)


@dataclass
class MemoryReport:
    model: str
    shape: ModelShape
    bytes_per_token: dict[str, int]      # from the model's config: "fp16", "fp32"
    stores: list[StoreBytes]
    rows: list[dict[str, Any]]           # the table of published shapes (+ this model)
    goals: list[Goal] = field(default_factory=list)


def measure_store_bytes(llm, dtype, workdir=None, tokens: int = STORE_PROBE_TOKENS) -> StoreBytes:
    """Encode one module of about `tokens` tokens into a fresh store of `dtype` (None:
    as computed) with a disk tier in a temporary folder, and read the sizes back."""
    from promptlang.runtime.bench import latency
    from promptlang.runtime.engine import LLM
    from promptlang.runtime.store import ModuleStore

    with tempfile.TemporaryDirectory(prefix=".kv-memory-", dir=workdir) as folder:
        store = ModuleStore(llm.adapter.device, dtype=dtype, disk_dir=folder)
        probe = LLM(llm.adapter, llm.tokenizer, store)
        text, _ = latency.document(llm.tokenizer, tokens)
        probe.encode(latency.build_schema("memory-probe", text))
        entry = max(store.entries(), key=lambda e: int(e.meta.get("tokens", 0)))
        n = int(entry.meta["tokens"])
        name = str(dtype or llm.adapter.dtype).removeprefix("torch.")
        result = StoreBytes(name, n, (entry.nbytes - UNIT_META_BYTES_PER_TOKEN * n) / n,
                            entry.nbytes / n, (entry.file_bytes or 0) / n)
        store.clear()
    return result


def run_memory(llm, model_name: str = "", workdir=None) -> MemoryReport:
    """KV bytes per token of `llm`'s model from its config and from its store (as
    computed and in bfloat16), beside the table of published shapes."""
    import torch

    shape = shape_from_config(llm.adapter.config, model_name or None)
    per_token = {"fp16": kv_bytes_per_token(shape, 2), "fp32": kv_bytes_per_token(shape, 4)}
    stores = [measure_store_bytes(llm, None, workdir),
              measure_store_bytes(llm, torch.bfloat16, workdir)]
    rows = memory_rows()
    if not any(_same_cache_shape(shape, known) for known in PUBLISHED.values()):
        rows += memory_rows({f"{shape.name} (this run)": shape})
    report = MemoryReport(model_name or shape.name, shape, per_token, stores, rows)
    full, half = stores
    report.goals = [Goal(
        "a 16-bit store halves KV bytes per token", half.kv * 2 == full.kv,
        f"{full.dtype} store {full.kv:,.0f} B/token, {half.dtype} store {half.kv:,.0f} "
        f"B/token ({half.kv / full.kv:.3f}x; files {full.file:,.0f} and {half.file:,.0f} "
        f"B/token)")]
    return report


def _same_cache_shape(a: ModelShape, b: ModelShape) -> bool:
    return (a.layers, a.kv_heads, a.head_dim) == (b.layers, b.kv_heads, b.head_dim)


def sections(report: MemoryReport) -> list[Section]:
    shape = report.shape
    return [
        Section(f"KV bytes per token of {report.model}", [s.row() for s in report.stores], lines=[
            f"from the config: {shape.layers} layers x 2 x {shape.kv_heads} KV heads x "
            f"{shape.head_dim} head dim x bytes = {report.bytes_per_token['fp32']:,} (32-bit), "
            f"{report.bytes_per_token['fp16']:,} (16-bit)",
            f"measured: one {report.stores[0].tokens}-token module encoded into each store; "
            f"stored bytes add {UNIT_META_BYTES_PER_TOKEN} bytes/token of positions, ids and "
            f"flags"], float_format="{:,.1f}"),
        Section("KV bytes per token of published models (from their config.json)", report.rows,
                ["paper Table 2: n/a where the paper's figure is not transcribed here"],
                float_format="{:,.1f}"),
        Section("Goals (issue 7)", (), [str(g) for g in report.goals]),
    ]


def to_json(report: MemoryReport) -> dict[str, Any]:
    from dataclasses import asdict

    return {"model": report.model, "shape": asdict(report.shape),
            "bytes_per_token": report.bytes_per_token,
            "stores": [asdict(s) for s in report.stores], "table": report.rows,
            "goals": [asdict(g) | {"verdict": g.verdict} for g in report.goals]}
