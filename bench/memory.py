"""`promptlang bench memory`: how many bytes the cache holds per token.

KV bytes per token = layers x 2 (K and V) x kv_heads x head_dim x bytes per value.
It counts K and V at `kv_heads`, as the store keeps them (never after repeat_kv).
(transformers' Falcon with the new decoder architecture broadcasts K/V to every head
before caching; the figure here is the architecture's, which our store achieves.)

The table of published models prints ours in MiB per token at 16 bits beside the
Prompt Cache paper's Table 2 (PAPER_TABLE2), and says for each paper figure whether it
agrees with ours or counts K/V for every attention head of a model that shares them.

`run_memory` also measures what the module store really holds: it encodes one module
into a float32 store and into a bfloat16 one (`ModuleStore(dtype=torch.bfloat16)`) and
reads the entries' sizes back, in memory and on disk. Only that part imports torch.
"""

from __future__ import annotations

import dataclasses
import math
import tempfile
from dataclasses import dataclass, field
from typing import Any

from promptlang.bench.report import Goal, Section, format_table
from promptlang.bench.shapes import PUBLISHED, ModelShape, shape_from_config

# Table 2, "Memory overhead of caching a single token", row "MB/token", of the Prompt
# Cache paper (Gim et al., arXiv 2311.04934v2, MLSys 2024), as printed; Section 5.5 says
# it assumes 16-bit floats. Its "MB" is MiB (Llama 7B: 32 x 2 x 4096 x 2 B = 524,288 B =
# 0.50 MiB), cut, not rounded, to two decimals (BERT 0.035 -> 0.03, Falcon 1B 0.1875 ->
# 0.18, Falcon 40B 1.875 -> 1.87). Keyed by our PUBLISHED rows; the paper's names:
# BERT (-base, from its size), Falcon 1B (falcon-rw-1b), Llama 7B/13B/70B, MPT 30B,
# Falcon 40B, Falcon 180B. Llama 7B and 13B map to our Llama-2 rows: Llama-1 and
# Llama-2 share those shapes. Llama 70B exists only as Llama-2 (with GQA). The paper
# counts K/V for every attention head, also for models that share them (GQA/MQA:
# Llama-2-70B, Falcon-40B, Falcon-180B), which real caches, ours included, do not.
PAPER_TABLE2: dict[str, str] = {
    "BERT-base": "0.03",
    "Falcon-RW-1B": "0.18",
    "Llama-2-7B": "0.50",
    "Llama-2-13B": "0.78",
    "MPT-30B": "1.31",
    "Falcon-40B": "1.87",
    "Llama-2-70B": "2.5",
    "Falcon-180B": "4.53",
}
PAPER_COLUMN = "paper Table 2"                        # the rows' (and CSV's) key
PAPER_HEADER = "paper Table 2 MiB/token fp16"         # its header in printed tables
OURS_MIB = "ours MiB/token fp16"
MIB = 2**20

DEFAULT_MODEL = "SmolLM2-135M"


def kv_bytes_per_token(config: ModelShape | Any, bytes_per_value: int = 4) -> int:
    """KV bytes one token occupies in the cache, for a ModelShape or a transformers
    config (see shapes.shape_from_config for how kv_heads and head_dim are found)."""
    shape = config if isinstance(config, ModelShape) else shape_from_config(config)
    return shape.layers * 2 * shape.kv_heads * shape.head_dim * bytes_per_value


class _Decimals(float):
    """A float that tables print with its own number of decimals (a Section has one
    float format for every column); CSV and JSON still get the plain number."""

    def __new__(cls, value: float, decimals: int):
        number = super().__new__(cls, value)
        number.decimals = decimals
        return number

    def __format__(self, spec: str) -> str:
        return f"{float(self):,.{self.decimals}f}"


def _decimals(printed: str) -> int:
    return len(printed.partition(".")[2])


def reads_as(mib: float, printed: str) -> bool:
    """Whether `mib` cut (not rounded) to the decimals of `printed` is `printed`, the
    way the paper's Table 2 prints its figures."""
    scale = 10 ** _decimals(printed)
    return math.floor(mib * scale + 1e-9) == round(float(printed) * scale)


def all_heads(shape: ModelShape) -> ModelShape:
    """`shape` with K and V kept for every attention head (no GQA/MQA sharing)."""
    return dataclasses.replace(shape, kv_heads=shape.heads)


def paper_note(shape: ModelShape, printed: str | None) -> str:
    """How the paper's figure (as printed) relates to ours for `shape`."""
    if printed is None:
        return ""
    ours = kv_bytes_per_token(shape, 2) / MIB
    every = kv_bytes_per_token(all_heads(shape), 2) / MIB
    if reads_as(ours, printed):
        return "agrees"
    if shape.kv_heads < shape.heads and reads_as(every, printed):
        kind = "MQA" if shape.kv_heads == 1 else "GQA"
        return f"all {shape.heads} heads: {every:.4f} ({kind}, {shape.kv_heads} cached)"
    return f"differs (all {shape.heads} heads: {every:.4f})"


def memory_rows(shapes: dict[str, ModelShape] | None = None) -> list[dict[str, Any]]:
    """One row per model: its shape, KV bytes per token in 16 and 32 bits, the float32
    cache of 1k tokens in MiB, and ours in MiB per token at 16 bits beside the paper's
    Table 2 figure as printed (MiB per token at 16 bits; None where the paper lists no
    such model) and how the two relate ("paper vs ours", see `paper_note`)."""
    rows = []
    for name, shape in (shapes or PUBLISHED).items():
        fp16 = kv_bytes_per_token(shape, 2)
        fp32 = kv_bytes_per_token(shape, 4)
        printed = PAPER_TABLE2.get(name)
        rows.append({
            "model": name,
            "layers": shape.layers,
            "heads": shape.heads,
            "kv_heads": shape.kv_heads,
            "head_dim": shape.head_dim,
            "bytes/token fp16": fp16,
            "bytes/token fp32": fp32,
            "MiB/1k tokens fp32": round(fp32 * 1000 / MIB, 1),
            OURS_MIB: _Decimals(fp16 / MIB, 4),
            PAPER_COLUMN: None if printed is None else _Decimals(float(printed),
                                                                 _decimals(printed)),
            "paper vs ours": paper_note(shape, printed),
        })
    return rows


def _printed(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The rows as tables print them: the paper's column headed with its unit."""
    return [{(PAPER_HEADER if key == PAPER_COLUMN else key): value
             for key, value in row.items()} for row in rows]


def memory_table(shapes: dict[str, ModelShape] | None = None) -> str:
    return format_table(_printed(memory_rows(shapes)), float_format="{:,.1f}")


def paper_lines(rows: list[dict[str, Any]]) -> list[str]:
    """The notes under the table of published models."""
    lines = [
        "ours: layers x 2 x kv_heads x head_dim x 2 bytes, in MiB (2^20 bytes)",
        "paper: Table 2 'MB/token' of Prompt Cache (Gim et al., arXiv 2311.04934v2), "
        "16-bit (its Section 5.5), as printed: MiB cut to two decimals; n/a: not in the paper",
        "the paper's Llama 7B/13B/70B are our Llama-2 rows (Llama-1 7B/13B share the "
        "shapes; 70B is Llama-2 only), its BERT BERT-base, its Falcon 1B Falcon-RW-1B"]
    shared = [r for r in rows if r["paper vs ours"].startswith("all ")]
    if shared:
        lines.append(
            "GQA/MQA: the paper counts K/V for all attention heads; the model shares them "
            "and real caches (ours too) keep kv_heads: " + ", ".join(
                f"{r['model']} {r['heads'] / r['kv_heads']:g}x" for r in shared) + " smaller")
    return lines


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
                "MiB/1k tokens (K/V)": round(self.kv * 1000 / MIB, 1)}


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
    from promptlang.bench import latency
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
        Section("KV bytes per token of published models (from their config.json)",
                _printed(report.rows), paper_lines(report.rows), float_format="{:,.1f}"),
        Section("Goals", (), [str(g) for g in report.goals]),
    ]


def to_json(report: MemoryReport) -> dict[str, Any]:
    from dataclasses import asdict

    return {"model": report.model, "shape": asdict(report.shape),
            "bytes_per_token": report.bytes_per_token,
            "stores": [asdict(s) for s in report.stores], "table": report.rows,
            "goals": [asdict(g) | {"verdict": g.verdict} for g in report.goals]}
