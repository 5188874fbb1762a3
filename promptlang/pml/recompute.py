"""Kept only for the parser's check of a schema's `recompute` attribute (to be deleted).

The runtime owns recompute policies (runtime/recompute/policy.py: `Recompute`,
`RecomputeSpecError`, `schema_policy`). The parser is changing to keep the attribute's raw
text and location (`Schema.recompute`, `Schema.recompute_span`) and to stop importing
this module; once it has, nothing imports this file: delete it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

Kind = Literal["none", "first", "deviation"]
KINDS = ("none", "first", "deviation")
MAX_SPEC_CHARS = 64         # longer policy text is refused before it is read
MAX_TOKENS_DIGITS = 9       # digits of K in first:K (int() of them stays cheap)


class RecomputeSpecError(ValueError):
    """A recompute policy's text is malformed (the message says what is expected)."""


@dataclass(frozen=True)
class Recompute:
    kind: Kind = "none"
    amount: float = 0          # tokens per unit (first) or a fraction (deviation)

    @classmethod
    def parse(cls, text: "str | Recompute") -> "Recompute":
        if isinstance(text, Recompute):
            return text
        spec = str(text).strip().lower()
        if len(spec) > MAX_SPEC_CHARS:
            raise RecomputeSpecError(f"bad recompute policy ({len(spec)} characters): a "
                                     f"policy is at most {MAX_SPEC_CHARS}")
        if spec in ("none", "off", "0", ""):
            return cls()
        kind, _, amount = spec.partition(":")
        expected = "expected none, first:K (K tokens per module) or deviation:F (0 < F <= 1)"
        if kind not in KINDS or not amount:
            raise RecomputeSpecError(f"bad recompute policy {text!r}: {expected}")
        if kind == "first":
            digits = amount.lstrip("0")
            if not amount.isascii() or not amount.isdigit():
                raise RecomputeSpecError(f"bad recompute policy {text!r}: K must be a "
                                         "whole number of tokens")
            if len(digits) > MAX_TOKENS_DIGITS:
                raise RecomputeSpecError(f"bad recompute policy {text!r}: K has more than "
                                         f"{MAX_TOKENS_DIGITS} digits")
            return cls("first", int(digits)) if digits else cls()
        percent = amount.endswith("%")
        try:
            fraction = float(amount[:-1] if percent else amount) / (100 if percent else 1)
        except ValueError:
            raise RecomputeSpecError(f"bad recompute policy {text!r}: {expected}") from None
        if not (0 <= fraction <= 1) or math.isnan(fraction):
            raise RecomputeSpecError(f"bad recompute policy {text!r}: the fraction must be "
                                     "between 0 and 1")
        return cls("deviation", fraction) if fraction else cls()

    def __bool__(self) -> bool:
        return self.kind != "none"

    def __str__(self) -> str:
        if self.kind == "none":
            return "none"
        if self.kind == "first":
            return f"first:{int(self.amount)}"
        return f"deviation:{self.amount:g}"
