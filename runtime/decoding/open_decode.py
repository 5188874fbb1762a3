"""One open generation: a prefilled request, its decode state, and the Result it makes.

`LLM.generate` drives one with `Decoder.steps` (engine.py `_decode`); the server drives many
at once with `decode.BatchStepper` (promptlang/server/worker.py). Either way the pieces are
these: the Decoder over the request's buffer (with the constraint or token healing as its
hook), the text deltas with the healed text left out, the first token's time, and the
Result at the end; `release()` gives the buffer back to the pool.
"""

from __future__ import annotations

import time

from promptlang.runtime.decoding.constrain import Constraint, forced_drafts
from promptlang.runtime.decoding.decode import Decoder
from promptlang.runtime.decoding.engine_view import EngineView
from promptlang.runtime.decoding.healing import Healing
from promptlang.runtime.decoding.results import Opened, Result
from promptlang.runtime.decoding.sampling import Decoding, SamplingParams


class Generation:
    def __init__(self, llm: EngineView, opened: Opened, params: SamplingParams,
                 constraint: Constraint | None = None):
        self.llm = llm
        self.opened = opened
        self.constraint = constraint
        self.decoding = Decoding(params, llm.tokenizer)
        limit = llm.max_positions
        hook = constraint
        if opened.healed:                       # the generation first spells the removed text
            hook = Healing(opened.healed, llm.tokenizer)
        # the last picked token is never computed: it may take the model's last position + 1
        model = llm.adapter if opened.model is None else opened.model
        self.decoder = Decoder(model, opened.buffer, self.decoding, opened.position,
                               limit=None if limit is None else limit + 1, constrain=hook,
                               **forced_drafts(params, constraint))
        self._skip = len(opened.healed)         # ... which the caller already has
        self._first = True
        self._released = False

    def delta(self, text: str) -> str:
        """A text delta as the caller sees it (the healed text left out); the first call
        marks the time of the first token."""
        if self._first:
            self.opened.timings.first_token = time.perf_counter() - self.opened.started
            self._first = False
        if self._skip and text:
            cut = min(self._skip, len(text))
            text, self._skip = text[cut:], self._skip - cut
        return text

    def release(self) -> None:
        if not self._released:
            self._released = True
            self.llm.finish(self.opened)

    def result(self) -> Result:
        """The Result (call after the last step; releases the buffer)."""
        self.release()
        opened = self.opened
        t = self.opened.timings
        t.total = time.perf_counter() - opened.started
        text, token_ids, reason = self.decoding.result()
        if opened.healed:            # the removed text is the caller's; a cut-short spelling too
            text = "" if opened.healed.startswith(text) else text.removeprefix(opened.healed)
        return Result(text=text,
                      token_ids=token_ids,
                      finish_reason=reason,
                      timings=t,
                      prefill_tokens=opened.prefill_tokens,
                      cached_tokens=opened.cached_tokens,
                      recomputed_tokens=opened.recomputed_tokens,
                      exact_units=len(opened.exact),
                      renumbered=opened.renumbered,
                      approximate_tokens=opened.approximate_tokens,
                      complete=None if self.constraint is None else self.constraint.complete,
                      units=dict(opened.units),
                      primed_units=len(opened.primed),
                      tail_tokens=opened.tail_tokens)
