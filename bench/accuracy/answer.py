"""One item under every setting: each cached rule's LLM (one store per rule), each setting's
request, and its greedy answer -- exact but cheap: drafts from earlier answers or from the
prompt (lookup) verified in one pass each, the model as its own verifier -- with the gold
answer's teacher-forced log-probability and the first-token KL from the baseline.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any, Sequence

from promptlang.bench import metrics, qa
from promptlang.bench.settings import STORE16, split_setting
from promptlang.bench.report import Progress
from promptlang.bench.accuracy.results import AccuracyOptions, Answer, ItemResult
from promptlang.errors import InvalidArgumentError


def _rule_llms(llm, budget: int) -> dict:
    import torch

    from promptlang.runtime.engine import LLM
    from promptlang.runtime.store import ModuleStore

    device = llm.adapter.device
    # exact_reuse off: the settings share a store, and each is measured as it is alone
    # (an `exact` request's units would otherwise serve the other settings exactly); prompt
    # tails off: the cost section asks the same question again and again, and measures
    # each setting's units served with the question computed
    llms = {rule: LLM(llm.adapter, llm.tokenizer,
                      ModuleStore(device, budget, disk_budget_bytes=0, dtype=dtype,
                                  compute_dtype=dtype),       # as load(store_dtype=...) does
                      isolate=isolate, exact_reuse=False, tail_budget_bytes=0)
            for rule, isolate, dtype in (("context", False, None), ("isolate", True, None),
                                         ("context16", False, torch.bfloat16))}
    for rule_llm in llms.values():
        rule_llm.seam = llm.seam          # policy tuned: the model's seam adapter, if any
    return llms


def _requests(item: qa.QAItem, llms: dict, names: Sequence[str]) -> dict[str, tuple]:
    """setting -> (llm, prompt, schema, baseline, recompute spec)."""
    schema, prompt = qa.to_pml(item, f"qa-{item.id}")
    joint_schema, joint_prompt = qa.to_pml(item, f"qa-{item.id}-joint", mode="scaffold")
    requests = {}
    for name in names:
        rule, spec = split_setting(name)
        if rule == "baseline":
            requests[name] = (llms["context"], prompt, schema, True, "none")
        elif rule == "scaffold":
            requests[name] = (llms["context"], joint_prompt, joint_schema, False, spec)
        elif rule == STORE16:
            requests[name] = (llms["context16"], prompt, schema, False, spec)
        elif rule in ("cached", "isolate"):
            requests[name] = (llms["context" if rule == "cached" else "isolate"], prompt,
                              schema, False, spec)
        else:
            raise InvalidArgumentError(f"unknown setting {name!r}")
    return requests


def _family(setting: str) -> str:
    rule = split_setting(setting)[0]
    return {"baseline": "full", "scaffold": "full", STORE16: "cached"}.get(rule, rule)


def gold_ids(llm, item: qa.QAItem) -> list[int]:
    """The gold answer's tokens as the assistant's reply would start with them."""
    return list(llm.tokenizer.encode(item.answer))


def _answer(item: qa.QAItem, llms: dict, options: AccuracyOptions, names: Sequence[str],
            bar: Progress) -> ItemResult:
    requests = _requests(item, llms, names)
    answers: dict[str, Answer] = {}
    tokens = 0
    reference = None
    reference_logprobs = None
    gold = gold_ids(llms["context"], item)
    for setting in names:
        llm, prompt, schema, baseline, spec = requests[setting]
        # drafts: this rule's answers first, the most recent first, then the others
        earlier = list(answers.items())[::-1]
        drafts = [a.token_ids for s, a in earlier if _family(s) == _family(setting)] + \
                 [a.token_ids for s, a in earlier if _family(s) != _family(setting)]
        decoded = greedy_answer(llm, prompt, schema, baseline=baseline, recompute=spec,
                                max_new_tokens=options.max_new_tokens, drafts=drafts,
                                gold=gold)
        if baseline:
            reference = decoded.token_ids
            tokens = decoded.prompt_tokens
            reference_logprobs = decoded.first_logprobs
        kl = math.nan if reference_logprobs is None else \
            metrics.kl_divergence(reference_logprobs, decoded.first_logprobs)
        text = decoded.text
        others = item.distractor_answers
        answers[setting] = Answer(text, decoded.token_ids, qa.exact_match(text, item.answer),
                                  qa.answer_in_output(text, item.answer, others),
                                  decoded.token_ids == reference, decoded.ttft, decoded.encode,
                                  decoded.recomputed, decoded.select, decoded.passes,
                                  decoded.gold_logprob, len(gold), kl,
                                  qa.distracted(text, item.answer, others))
        bar.note(item=item.id, setting=setting)
        bar.update()
    return ItemResult(item, tokens, answers)


@dataclass
class Decoded:
    text: str
    token_ids: list[int]
    finish_reason: str
    ttft: float              # seconds from the call to the first picked token
    encode: float
    recomputed: int
    select: float
    prompt_tokens: int       # tokens in the request's buffer after its prefill
    passes: int              # model passes after the first token
    gold_logprob: float = math.nan    # sum of the gold tokens' log-probabilities
    first_logprobs: Any = None        # float64 numpy [V]: the first generated position's


def teacher_forced(llm, buffer, position: int, first_logits, gold: Sequence[int]) -> float:
    """The summed log-probability of the tokens `gold` right after the request in
    `buffer`: gold[0] from the prefill's `first_logits`, the rest from one pass that feeds
    gold[:-1] into the request's own buffer (the prefill call decoding verifies drafts
    with), which is then rolled back. NaN when the model has no positions left."""
    import torch

    from promptlang.runtime.passes.prefill import prefill, truncate

    if not gold:
        return math.nan
    limit = llm.max_positions
    if limit is not None and position + len(gold) - 1 > limit:
        return math.nan
    rows = [first_logits.reshape(1, -1)]
    feed = list(gold[:-1])
    if feed:
        if buffer.length + len(feed) > buffer.capacity:
            buffer.reserve(buffer.length + len(feed))
        start = buffer.length
        rows.append(prefill(llm.adapter, buffer, feed, range(position, position + len(feed)),
                            all_logits=True))
        truncate(buffer, start)         # the gold tokens were never generated: drop them
    logprobs = torch.log_softmax(torch.cat(rows).double(), dim=-1)
    picked = logprobs[torch.arange(len(gold)), torch.tensor(list(gold))]
    return float(picked.sum())


LOOKUP_TOKENS = 8      # lookup drafts: tokens proposed per pass (runtime/decoding/decode.py)


def greedy_answer(llm, prompt, schema, *, baseline: bool = False, recompute: str = "none",
                  max_new_tokens: int = 16, drafts: Sequence[Sequence[int]] = (),
                  gold: Sequence[int] = ()) -> Decoded:
    """What `llm.generate(prompt, schema=schema, baseline=baseline, recompute=recompute,
    max_new_tokens=max_new_tokens)` answers greedily, decoded with drafts verified by the
    model: the runtime's decode loop (runtime/decoding/decode.py) with `draft=LOOKUP_TOKENS`, whose
    drafter tries the rest of the first of `drafts` (earlier answers, preferred first) that
    agrees with the tokens so far, else a prompt lookup.

    Also returns the first generated position's log-probabilities and, for the token
    ids `gold`, their teacher-forced log-probability on the same request (`teacher_forced`)."""
    import torch

    from promptlang.runtime.decoding.decode import Decoder, LookupDrafter
    from promptlang.runtime.decoding.sampling import Decoding, SamplingParams

    started = time.perf_counter()
    opened = llm.open(prompt, schema=schema, baseline=baseline, room=max_new_tokens + 1,
                      add_generation_prompt=True, recompute=recompute)
    buffer = opened.buffer
    position = opened.position
    limit = llm.max_positions
    decoding = Decoding(SamplingParams(max_new_tokens=max_new_tokens), llm.tokenizer)
    try:
        prompt_tokens = buffer.length
        first_logprobs = torch.log_softmax(opened.logits.double(), dim=-1).cpu().numpy()
        buffer.materialize()          # every pass reads all of the KV: one piece
        gold_logprob = teacher_forced(llm, buffer, position, opened.logits, gold)
        # the engine's decode loop, as llm.generate(..., draft=LOOKUP_TOKENS) runs it, with
        # this item's earlier answers tried as drafts before the prompt lookup
        decoder = Decoder(llm.adapter, buffer, decoding, position,
                          limit=None if limit is None else limit + 1, draft=LOOKUP_TOKENS,
                          drafter=LookupDrafter(opened.bound.token_ids(), candidates=drafts))
        ttft = None
        for _, _, finished in decoder.steps(opened.logits):
            if ttft is None:
                ttft = time.perf_counter() - started
            if finished:
                break
        passes = decoder.passes
    finally:
        llm.assembler.release(buffer)
    text, token_ids, reason = decoding.result()
    t = opened.timings
    return Decoded(text, token_ids, reason, ttft, t.encode, opened.recomputed_tokens,
                   getattr(t, "select", 0.0), prompt_tokens, passes, gold_logprob,
                   first_logprobs)
