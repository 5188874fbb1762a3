"""Recompute policies as text: "none", "seams", "first:K", "query:K[+ape[:T[:S]]]", "deviation:F",
"exact", "ape[:T[:S]]", "tuned", each but seams, exact and tuned optionally "+primed" -> a
`Recompute`.

A policy is written wherever one is given: a request's `recompute=`, `load(recompute=)`,
or a schema's `recompute` attribute (PML keeps that attribute's text as written and
its location in `Schema.recompute_span`; `schema_policy` reads it here, so a malformed
one is an error located at the attribute). What each policy chooses: choose.py.

  none            serve every cached token as stored
  seams           every cached token that missed another module or text computed per
                  request, but not one that missed only an argument: exact at module
                  seams, the paper's parameter reuse kept
  first:K         the first K cached tokens of every unit that missed a request token
                  before it (EPIC's LegoLink, arXiv 2410.15332: a module's first tokens
                  otherwise become spurious attention sinks; exact tokens are skipped)
  query:K         the K cached tokens (of those that missed a request token before them)
                  the request's last token attends to most, over every layer and head, in
                  a probe pass of the request's own tokens over its cached ones;
                  query:K+ape[:T[:S]]: and the request then attends to the modules' other
                  tokens as APE's contexts (below)
  deviation:F     the fraction F (0 < F <= 1) of the non-root units' cached tokens whose
                  layer-1 keys and values differ most from a pass over the whole request
                  (in the spirit of CacheBlend, arXiv 2405.16444); `F%` also works
  exact           (the default) every cached token that missed a request token before it:
                  the request then equals the full prefill (the cost of one, less the exact
                  prefix and the module sequences seen before: exact.py)
  ape[:T[:S]]     APE (Adaptive Parallel Encoding, arXiv 2502.05431): the modules are
                  contexts encoded in parallel; the schema's own text after them is
                  recomputed, and every token the request computes attends to the
                  modules' tokens with temperature T and scale S (default 0.9, 0.9)
  tuned           serve every cached token as stored (as none), then compute the tokens
                  after the last cached unit, and every decode step, with the model's
                  seam adapter (made by `promptlang tune`, served by
                  runtime/model/seam.py). An LLM without one refuses it.
  P+primed        policy P (any but seams, exact and tuned; "primed" alone is none+primed), with
                  every module that follows another module or text of the request served
                  as encoded after its context's last token, repeated at the position
                  just before the module (the separator a full prefill has there;
                  runtime/recompute/primer.py). Free per request: a second encoding of the
                  module, made once and stored.

Pure: no torch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Literal

from promptlang.errors import RecomputeSpecError, Span

Kind = Literal["none", "seams", "first", "query", "deviation", "exact", "ape", "tuned"]
KINDS = ("none", "seams", "first", "query", "deviation", "exact", "ape", "tuned")
DEFAULT_POLICY = "exact"    # docs/RECOMPUTE.md, "What to use, and the default": why
MAX_SPEC_CHARS = 64         # longer policy text is refused before it is read
MAX_TOKENS_DIGITS = 9       # digits of K in first:K (int() of them stays cheap)
APE_DEFAULTS = (0.9, 0.9)   # APE's temperature and scale: the paper's defaults (its code)


@dataclass(frozen=True)
class Recompute:
    kind: Kind = "none"
    amount: float = 0          # tokens per unit (first), per request (query), or a fraction
    temperature: float = 1     # ape: the contexts' attention temperature
    scale: float = 1           # ape: the scale on the contexts' log-sum-exp
    primed: bool = False       # modules after others served as encoded after a lead token

    @classmethod
    def parse(cls, text: "str | Recompute", span: Span | None = None) -> "Recompute":
        """The policy `text` names; RecomputeSpecError (at `span`) if it names none."""
        if isinstance(text, Recompute):
            return text
        spec = str(text).strip().lower()

        def fail(reason: str) -> RecomputeSpecError:
            return RecomputeSpecError(f"bad recompute policy {text!r}: {reason}", span)

        if len(spec) > MAX_SPEC_CHARS:
            raise RecomputeSpecError(f"bad recompute policy ({len(spec)} characters): a "
                                     f"policy is at most {MAX_SPEC_CHARS}", span)
        return cls._read(spec, fail)

    @classmethod
    def _read(cls, spec: str, fail) -> "Recompute":
        """`spec` (lower case, stripped) as a policy; errors through `fail(reason)`, which
        quotes the whole text the user wrote."""
        if spec in ("none", "off", "0", ""):
            return cls()
        head, plus, last = spec.rpartition("+")
        if plus and last.strip() == "primed":          # P+primed
            base = cls._read(head.strip() or "none", fail)
            if base.primed:
                raise fail("+primed is given twice")
            if base.kind in ("seams", "exact"):
                raise fail(f"{base.kind} recomputes every module seam: primed would change "
                           f"nothing (use it with none, first:K, query:K, deviation:F or ape)")
            if base.kind == "tuned":
                raise fail("the seam adapter was tuned on modules served as encoded apart: "
                           "tuned takes no +primed")
            return replace(base, primed=True)
        if spec == "primed":
            return cls(primed=True)
        if spec == "exact":
            return cls("exact", 1)
        if spec == "seams":
            return cls("seams", 1)
        if spec == "tuned":
            return cls("tuned")
        if spec.startswith("query:") and "+" in spec:       # query:K+ape[:T[:S]]
            head, _, tail = spec.partition("+")
            base = cls._read(head, fail)
            ape = cls._read(tail, fail)
            if base.primed or ape.primed:
                raise fail("+primed comes last: query:K+ape[:T[:S]]+primed")
            if base.kind != "query" or ape.kind != "ape":
                raise fail("expected query:K+ape[:T[:S]]")
            return cls("query", base.amount, ape.temperature, ape.scale)
        kind, colon, amount = spec.partition(":")
        expected = ("expected none, seams, first:K (K tokens per module), query:K (K tokens "
                    "per request), deviation:F (0 < F <= 1), exact, ape[:T[:S]] or tuned, "
                    "optionally followed by +primed")
        if kind == "ape" and not (colon and not amount):
            return cls._ape(amount, fail)
        if kind not in ("first", "query", "deviation") or not amount:
            raise fail(expected)
        if kind in ("first", "query"):
            digits = amount.lstrip("0")
            if not amount.isascii() or not amount.isdigit():
                raise fail("K must be a whole number of tokens")
            if len(digits) > MAX_TOKENS_DIGITS:
                raise fail(f"K has more than {MAX_TOKENS_DIGITS} digits")
            return cls(kind, int(digits)) if digits else cls()
        percent = amount.endswith("%")
        try:
            fraction = float(amount[:-1] if percent else amount) / (100 if percent else 1)
        except ValueError:
            raise fail(expected) from None
        if not (0 <= fraction <= 1) or math.isnan(fraction):
            raise fail("the fraction must be between 0 and 1")
        return cls("deviation", fraction) if fraction else cls()

    @classmethod
    def _ape(cls, amount: str, fail) -> "Recompute":
        """ape, ape:T or ape:T:S (0 < T, S <= 4)."""
        numbers = [part.strip() for part in amount.split(":")] if amount else []
        if len(numbers) > 2:
            raise fail("ape takes at most two numbers: ape:T:S")
        values = list(APE_DEFAULTS)
        for i, text in enumerate(numbers):
            try:
                values[i] = float(text)
            except ValueError:
                raise fail("ape:T:S needs numbers (temperature, scale)") from None
            if not (0 < values[i] <= 4):
                raise fail("ape's temperature and scale must be in (0, 4]")
        return cls("ape", 1, values[0], values[1])

    def __bool__(self) -> bool:
        """Whether the policy recomputes cached tokens (`primed` alone and `tuned` do not)."""
        return self.kind not in ("none", "tuned")

    @property
    def parallel(self) -> bool:
        """Whether the request attends to its modules as APE's contexts (`ape`, and
        `query:K+ape`; at T = S = 1 APE is plain attention)."""
        return self.kind == "ape" or (self.kind == "query"
                                      and (self.temperature, self.scale) != (1, 1))

    def __str__(self) -> str:
        if self.primed:
            base = str(replace(self, primed=False))
            return "primed" if base == "none" else f"{base}+primed"
        if self.kind == "none":
            return "none"
        if self.kind == "query" and self.parallel:
            ape = str(Recompute("ape", 1, self.temperature, self.scale))
            return f"query:{int(self.amount)}+{ape}"
        if self.kind in ("first", "query"):
            return f"{self.kind}:{int(self.amount)}"
        if self.kind in ("exact", "seams", "tuned"):
            return self.kind
        if self.kind == "ape":
            if (self.temperature, self.scale) == APE_DEFAULTS:
                return "ape"
            return f"ape:{self.temperature:g}:{self.scale:g}"
        return f"deviation:{self.amount:g}"


def schema_policy(schema) -> Recompute | None:
    """The policy a schema's `recompute` attribute names (None: it names none), parsed here
    with the attribute's location. `schema`: duck-typed (`.recompute`, `.recompute_span`)."""
    text = getattr(schema, "recompute", None)
    if text is None:
        return None
    return Recompute.parse(text, getattr(schema, "recompute_span", None))
