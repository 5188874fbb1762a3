"""Structured generation: a regex, a JSON Schema or a Lark grammar on what a generation says.

The constraint engine is llguidance (Guidance's Rust engine; token masks over the whole
vocabulary in tens of microseconds), not hand-written code. A `Constraint` is the decode
loop's `constrain` hook (decode.py): before each pick it lets the matcher consume the tokens
picked since its last call, asks for the set of tokens that keep the output inside the
grammar, and sets every other logit to -inf. The end-of-sequence token is allowed exactly
where the grammar may end, so a complete output ends the generation (finish reason "eos");
one cut by `max_new_tokens` first ends with reason "length" and `complete` False.

The picks stay the sampler's (greedy, temperature, top-p): constrained greedy decoding is
deterministic. Drafted tokens (`draft=K`) are checked by the same hook, row by row, as the
decode loop picks them. A constraint is also a drafter: it proposes the tokens the grammar
forces next (llguidance's fast-forward tokens, e.g. `"name": "` in a JSON object), so the
decode loop feeds a run of them in one pass; each is still picked from the model's masked
logits, so the output is the one decoding without drafts gives.

    constraint = Constraint.of(params, tokenizer)     # None: no constraint
    Decoder(..., constrain=constraint)
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from promptlang.errors import ConstraintError


# JSON Schema outputs are laid out one way, `{"a": 1, "b": [2, 3]}`: no free whitespace
# (a model that likes newlines could otherwise fill max_new_tokens with them)
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def _llguidance():
    try:
        import llguidance
    except ImportError:                                 # a dependency: only a broken install
        raise ConstraintError("structured generation needs the llguidance package "
                              "(pip install llguidance)") from None
    return llguidance


def ll_tokenizer(tokenizer) -> Any:
    """llguidance's view of `tokenizer` (a promptlang HFTokenizer over a fast Hugging Face
    tokenizer): built once per tokenizer (about a second) and kept on it."""
    cached = getattr(tokenizer, "_ll_tokenizer", None)
    if cached is not None:
        return cached
    hf = getattr(tokenizer, "tokenizer", None)
    if hf is None or not getattr(hf, "is_fast", False):
        raise ConstraintError(f"structured generation needs a fast Hugging Face tokenizer; "
                              f"{type(tokenizer).__name__} is not one")
    _llguidance()
    import llguidance.hf

    eos = list(tokenizer.eos_ids) or None
    built = llguidance.hf.from_tokenizer(hf, eos_token=eos)
    tokenizer._ll_tokenizer = built
    return built


def grammar_text(regex: str | None = None, json_schema: str | None = None,
                 grammar: str | None = None) -> str | None:
    """llguidance's grammar for the one constraint given (None: none given)."""
    llg = _llguidance()
    try:
        if regex is not None:
            return llg.LLMatcher.grammar_from_regex(regex)
        if json_schema is not None:      # one JSON layout: a model cannot pad it forever
            return llg.LLMatcher.grammar_from_json_schema(json_schema, JSON_LAYOUT)
        if grammar is not None:
            return llg.LLMatcher.grammar_from_lark(grammar)
    except ValueError as error:
        raise ConstraintError(f"bad constraint: {error}") from None
    return None


FORCED_DRAFT = 16        # forced tokens fed in one pass, at most (when no draft= is asked)


class Constraint:
    """The decode loop's hook for one generation (see the module docstring)."""

    def __init__(self, grammar: str, tokenizer, what: str = "grammar"):
        llg = _llguidance()
        self.tokenizer = ll_tokenizer(tokenizer)
        self.matcher = llg.LLMatcher(self.tokenizer, grammar, log_level=0)
        if self.matcher.is_error():
            raise ConstraintError(f"bad {what}: {self.matcher.get_error()}")
        words = (self.tokenizer.vocab_size + 31) // 32
        self._bits = torch.zeros(words, dtype=torch.int32)
        self._shifts = torch.arange(32, dtype=torch.int32)
        self.consumed = 0                            # picked tokens the matcher has seen

    @classmethod
    def of(cls, params, tokenizer) -> "Constraint | None":
        """The constraint `params` (a SamplingParams) asks for, or None."""
        what = ("regex" if params.regex is not None else
                "JSON Schema" if params.json_schema is not None else
                "grammar" if params.grammar is not None else None)
        if what is None:
            return None
        return cls(grammar_text(params.regex, params.json_schema, params.grammar), tokenizer,
                   what)

    def __call__(self, token_ids: Sequence[int], logits: torch.Tensor) -> torch.Tensor:
        # logits: [V]
        self._consume(token_ids)
        self.matcher.unsafe_compute_mask_ptr(self._bits.data_ptr(), self._bits.numel() * 4)
        # bit j of word i allows token 32 * i + j
        allowed = ((self._bits[:, None] >> self._shifts) & 1).flatten().bool()
        width = logits.shape[-1]
        if allowed.numel() < width:
            allowed = torch.cat([allowed, allowed.new_zeros(width - allowed.numel())])
        return logits.masked_fill(~allowed[:width].to(logits.device), float("-inf"))

    def propose(self, generated: Sequence[int], count: int) -> list[int]:
        """The decode loop's drafter: up to `count` tokens the grammar forces after
        `generated` (every token picked so far)."""
        self._consume(generated)
        if self.matcher.is_stopped():
            return []
        return list(self.matcher.compute_ff_tokens())[:count]

    def _consume(self, token_ids: Sequence[int]) -> None:
        for token in token_ids[self.consumed:]:
            if not self.matcher.consume_token(int(token)):
                raise ConstraintError(f"the constraint refused token {int(token)}: "
                                      f"{self.matcher.get_error()}")
        self.consumed = len(token_ids)

    @property
    def complete(self) -> bool:
        """Whether what was picked so far is a whole output of the grammar."""
        return bool(self.matcher.is_accepting())


def forced_drafts(params, constraint: Constraint | None) -> dict:
    """The Decoder's draft arguments: `draft=` as asked; with a constraint and no `draft=`,
    the constraint's forced tokens as drafts (FORCED_DRAFT at most per pass)."""
    if constraint is not None and not params.draft:
        return {"draft": FORCED_DRAFT, "drafter": constraint}
    return {"draft": params.draft}
