"""Token healing: the prompt's last token given back to the generation.

A prompt that ends mid-word ("The address is http") ends on a token ("http") that the
model would rarely have chosen there: in its training text "https" is one token. Healing
takes that last token off the prompt, and lets the generation start over from it: the first
generated tokens must spell the removed text (and may go on: "https", "http://"), after
which generation is free. The removed text is not returned again: the answer is what comes
after it.

Where it applies (`heal_point`): the request's last token is text computed per request (the
prompt's own text, not a role marker and not a cached module's token), so taking it off
changes nothing in the cache layout; its text decodes cleanly; and some longer token starts
with it (else nothing could merge with it); and it is not the request's only token (a
one-token prompt, "hi", would leave nothing to compute). Not under a regex/JSON/grammar
constraint (that constraint then says what the output starts with). Sessions (and so
programs) heal the same way at `generate`: the last token of the text appended since the
last computed token (`healable` on it; runtime/conversation/session.py).

    point = heal_point(bound, tokenizer)       # None: nothing to heal
    bound = point.bound                        # the request without its last token
    Decoder(..., constrain=point.constraint())
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, replace
from typing import Sequence

import torch

from promptlang.pml.binding import BoundPrompt


def token_texts(tokenizer) -> tuple[list[str], list[int]]:
    """Every token's decoded text, sorted, with the ids in the same order (built once per
    tokenizer and kept on it)."""
    cached = getattr(tokenizer, "_token_texts", None)
    if cached is None:
        size = len(tokenizer.tokenizer) if hasattr(tokenizer, "tokenizer") else 0
        pairs = sorted((tokenizer.decode([i]), i) for i in range(size))
        cached = ([t for t, _ in pairs], [i for _, i in pairs])
        tokenizer._token_texts = cached
    return cached


def _starting_with(prefix: str, texts: list[str], ids: list[int]) -> list[int]:
    """Ids of the tokens whose text starts with `prefix` (a range of the sorted texts)."""
    lo = bisect.bisect_left(texts, prefix)
    hi = bisect.bisect_left(texts, prefix + "\U0010ffff")
    return ids[lo:hi]


@dataclass(frozen=True)
class HealPoint:
    bound: BoundPrompt           # the request without its last token
    text: str                    # the removed token's text: the generation starts with it
    tokenizer: object

    def constraint(self) -> "Healing":
        return Healing(self.text, self.tokenizer)


def heal_point(bound: BoundPrompt, tokenizer) -> HealPoint | None:
    """Where `bound` can be healed (see the module docstring), or None."""
    if not bound.uncached or not hasattr(tokenizer, "tokenizer"):
        return None
    last = bound.uncached[-1]
    cached_end = max((seg.end for seg, origin in bound.segments() if origin != "uncached"),
                     default=0)
    if last.kind != "prompt" or last.role is not None or not last.token_ids \
            or last.end != bound.end or last.end <= cached_end:     # role markers: never
        return None
    if sum(len(seg.token_ids) for seg, _ in bound.segments()) < 2:
        return None              # the prompt's only token: taking it off leaves nothing to run
    text = healable(tokenizer, last.token_ids[-1])
    if text is None:
        return None
    shorter = replace(last, token_ids=last.token_ids[:-1], text=last.text[:-len(text)]
                      if last.text.endswith(text) else last.text)
    uncached = bound.uncached[:-1] + ((shorter,) if shorter.token_ids else ())
    return HealPoint(replace(bound, uncached=uncached, end=bound.end - 1), text, tokenizer)


def healable(tokenizer, token_id: int) -> str | None:
    """The text of `token_id` where giving it back can change the output: it decodes
    cleanly, and some longer token starts with it; else None."""
    if not hasattr(tokenizer, "tokenizer"):
        return None
    text = tokenizer.decode([token_id])
    if not text or "\ufffd" in text:
        return None
    texts, ids = token_texts(tokenizer)
    if len(_starting_with(text, texts, ids)) <= len(_exact(text, texts, ids)):
        return None                                 # no longer token starts with it
    return text


class Healing:
    """The decode loop's `constrain` hook while the removed text is being spelled: only
    tokens that continue it (or finish it and go on) are allowed; then nothing is masked."""

    def __init__(self, text: str, tokenizer):
        self.text = text
        self.tokenizer = tokenizer
        self.done = False

    def __call__(self, token_ids: Sequence[int], logits: torch.Tensor) -> torch.Tensor:
        # logits: [V]
        if self.done:
            return logits
        spelled = self.tokenizer.decode(list(token_ids)) if token_ids else ""
        if len(spelled) >= len(self.text):
            self.done = True
            return logits
        rest = self.text[len(spelled):]
        texts, ids = token_texts(self.tokenizer)
        allowed = set(_starting_with(rest, texts, ids))
        allowed.update(i for n in range(1, len(rest)) for i in _exact(rest[:n], texts, ids))
        mask = torch.full_like(logits, float("-inf"))
        index = torch.tensor(sorted(i for i in allowed if i < logits.shape[-1]),
                             dtype=torch.int64, device=logits.device)
        mask[index] = 0.0
        return logits + mask


def _exact(text: str, texts: list[str], ids: list[int]) -> list[int]:
    lo = bisect.bisect_left(texts, text)
    hi = bisect.bisect_right(texts, text)
    return ids[lo:hi]
