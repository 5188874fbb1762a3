"""`promptlang bench memory`: how many bytes the cache holds per token.

KV bytes per token = layers x 2 (K and V) x kv_heads x head_dim x bytes per value.
It counts K and V at `kv_heads`, as the store keeps them (never after repeat_kv).
(transformers' Falcon with the new decoder architecture broadcasts K/V to every head
before caching; the figure here is the architecture's, which our store achieves.)
"""

from __future__ import annotations

from typing import Any

from promptlang.runtime.bench.report import format_table
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
