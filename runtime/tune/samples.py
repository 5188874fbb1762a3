"""Training samples for the seam adapter: one combination of documents, its teacher and its
student.

A sample is a prompt that imports k of a schema's document modules and asks a question.
- Teacher: the plain model's full prefill of the prompt's tokens at contiguous positions
  (what a user gets from transformers on the same text), then its greedy answer; the
  teacher's next-token log-probabilities on every token after the documents (the question,
  the assistant's affix, the answer) are the targets.
- Student: the same request served as the runtime serves it under policy `tuned`: each
  document's KV encoded apart, from the store, at its layout position (as `none` serves
  it), then the tokens after the documents, at the positions right after the last cached
  token's (contiguous.closed_tail, as `tuned` serves them) -- or, with `close_tail=False`,
  at the layout's positions, after the gaps of the documents the prompt leaves out (as
  `none` serves them) -- computed by the plain model with the adapter attached. Only that
  last pass carries gradients: the cached KV is the base model's.
- Student of an adapter that encodes (lora.py): the cached tokens are computed again with
  the adapter attached, each seeing what the runtime's encoder lets it see (its own unit's
  tokens and its context units' at positions up to its own), in one pass with the tokens
  after them; gradients reach the modules' KV too.

`student_logprobs(..., adapter=None)` is exactly what `tuned` serves with an untrained
adapter (B = 0): the runtime's `none` prefill where the request leaves no module out after
its last imported one (tested), so training starts from the fast path.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import DynamicCache

from promptlang.errors import InvalidArgumentError
from promptlang.pml import nodes
from promptlang.runtime.model.lora import SeamLoRA, attached
from promptlang.runtime.recompute.contiguous import closed_tail


@dataclass(frozen=True, kw_only=True)
class Sample:
    """One combination, ready for a training step."""

    cached_keys: torch.Tensor      # [L, H_kv, S, D]: the documents' KV as served (no grad)
    cached_values: torch.Tensor    # [L, H_kv, S, D]
    ids: torch.Tensor              # [R]: the tokens after the documents, then the answer
    positions: torch.Tensor        # [R]: their positions as the runtime serves them
    teacher: torch.Tensor          # [R, V]: the teacher's log-probabilities after each
    answer_length: int             # of `ids`, the last answer_length are the answer
    records: bool = False          # a combination of same-shaped records (corpus.py)
    quoted: bool = False           # its answer is a sentence of a document, not the teacher's
    gapless: bool = False          # its schema holds only the documents it imports
    cached_ids: torch.Tensor | None = None        # [S]: the cached tokens' ids
    cached_positions: torch.Tensor | None = None  # [S]: their positions
    cached_sees: torch.Tensor | None = None       # [S, S] bool: what each sees when encoded


def rag_schema(name: str, system: str, label: str, texts: list[str]) -> nodes.Schema:
    """A system turn, then each text as a module (`doc-0`, `doc-1`, ...) in a user turn."""
    modules = tuple(nodes.Module(f"doc-{i}", (nodes.Text(text + "\n\n"),))
                    for i, text in enumerate(texts))
    return nodes.Schema(name, (nodes.RoleOpen("system"), nodes.Text(system),
                               nodes.RoleClose("system"), nodes.RoleOpen("user"),
                               nodes.Text(label), *modules))


def rag_prompt(name: str, docs: list[int], question: str) -> nodes.PromptDoc:
    """The prompt importing documents `docs` and asking `question`."""
    refs = [nodes.ModuleRef(f"doc-{i}") for i in docs]
    return nodes.PromptDoc(name, tuple(refs + [nodes.Text(question), nodes.RoleClose("user"),
                                               nodes.RoleOpen("assistant")]))


def make_sample(llm, teacher_model: torch.nn.Module, prompt: nodes.PromptDoc,
                answer_tokens: int, end_ids: set[int], answer_text: str | None = None, *,
                close_tail: bool = True) -> Sample:
    """Teacher and student inputs of `prompt` (its schema registered on `llm`). The answer
    is the teacher's greedy one, or `answer_text`'s tokens (at most `answer_tokens`) where
    given: the teacher then reads them, as the student does. `close_tail`: the student's
    tokens after the documents right after the last one (else at the layout's positions)."""
    served = llm.prefill(prompt, recompute="none", all_logits=True)
    n = served.cached_length
    tail_ids = served.token_ids[n:]
    tail_positions = served.positions[n:]
    if n and close_tail:     # computed right after the last cached token, as `tuned` serves
        moved, _ = closed_tail(tail_positions.tolist(), int(served.positions[:n].max()))
        tail_positions = torch.tensor(moved, dtype=tail_positions.dtype)
    plain = torch.tensor(served.bound.token_ids())
    if len(tail_ids) == 0 or not torch.equal(plain[len(plain) - len(tail_ids):], tail_ids):
        raise InvalidArgumentError("the prompt's tokens after its documents are not its last "
                                   "tokens")
    if answer_text is None:
        teacher_rows, answer = _teacher(teacher_model, plain, len(tail_ids), answer_tokens,
                                        end_ids)
    else:
        answer = llm.tokenizer.encode(answer_text)[:answer_tokens]
        teacher_rows = _teacher_reading(teacher_model, plain, len(tail_ids), answer)
    step = torch.arange(1, len(answer) + 1, dtype=tail_positions.dtype)
    positions = torch.cat([tail_positions, tail_positions[-1] + step])
    ids = torch.cat([tail_ids, torch.tensor(answer, dtype=tail_ids.dtype)])
    return Sample(cached_keys=served.keys[:, :, :n],
                  cached_values=served.values[:, :, :n],
                  ids=ids,
                  positions=positions,
                  teacher=teacher_rows,
                  answer_length=len(answer),
                  quoted=answer_text is not None,
                  cached_ids=served.token_ids[:n],
                  cached_positions=served.positions[:n],
                  cached_sees=encoder_visibility(llm, served.bound, served.positions[:n]))


def encoder_visibility(llm, bound, positions: torch.Tensor) -> torch.Tensor:
    """[S, S] bool: which cached tokens (at `positions`, in buffer order) each one attends
    to when the runtime's encoder computes it: its own unit's and its context units'
    tokens (runtime/passes/encoder.py) at positions up to its own."""
    unit_at = {}
    for unit_id in bound.units:
        for segment in bound.layout.units[unit_id].segments:
            for position in segment.positions:
                unit_at[position] = unit_id
    owners = []
    for position in positions.tolist():
        if position not in unit_at:
            raise InvalidArgumentError(f"cached position {position} belongs to no served unit")
        owners.append(unit_at[position])
    index = {unit_id: i for i, unit_id in enumerate(bound.units)}
    seen = torch.zeros(len(index), len(index), dtype=torch.bool)
    for unit_id, i in index.items():
        seen[i, i] = True
        for context_id in llm.encoder.context_of(bound.layout.units[unit_id]):
            if context_id in index:
                seen[i, index[context_id]] = True
    owner = torch.tensor([index[u] for u in owners], dtype=torch.int64)
    earlier = positions[None, :] <= positions[:, None]
    return seen[owner][:, owner] & earlier


@torch.no_grad()
def _teacher(model: torch.nn.Module, plain: torch.Tensor, tail: int, answer_tokens: int,
             end_ids: set[int]) -> tuple[torch.Tensor, list[int]]:
    """The full prefill's log-probabilities after each of the last `tail` tokens and after
    each token of its greedy answer (at most `answer_tokens`, the end token included when
    it comes): ([tail + len(answer), V], answer)."""
    cache = DynamicCache(config=model.config)
    out = model(input_ids=plain[None], cache=cache, use_cache=True, logits_to_keep=tail)
    rows = [torch.log_softmax(out.logits[0].float(), dim=-1)]
    answer: list[int] = []
    position = len(plain)
    for _ in range(answer_tokens):
        token = int(rows[-1][-1].argmax())
        answer.append(token)
        out = model(input_ids=torch.tensor([[token]]), position_ids=torch.tensor([[position]]),
                    cache=cache, use_cache=True)
        rows.append(torch.log_softmax(out.logits[0].float(), dim=-1))
        position += 1
        if token in end_ids:
            break
    return torch.cat(rows), answer


@torch.no_grad()
def _teacher_reading(model: torch.nn.Module, plain: torch.Tensor, tail: int,
                     answer: list[int]) -> torch.Tensor:
    """The full prefill's log-probabilities after each of the last `tail` tokens and after
    each token of `answer`, read after them in the same pass: [tail + len(answer), V]."""
    ids = torch.cat([plain, torch.tensor(answer, dtype=plain.dtype)])
    out = model(input_ids=ids[None], use_cache=False, logits_to_keep=tail + len(answer))
    return torch.log_softmax(out.logits[0].float(), dim=-1)


def student_logprobs(model: torch.nn.Module, sample: Sample,
                     adapter: SeamLoRA | None) -> torch.Tensor:
    """The student's log-probabilities [R, V] after each of `sample.ids`: the documents'
    cached KV as the past (then the adapter's link tokens, where it has them: lora.py), the
    ids computed at their positions (each sees every cached token and the ids before it),
    with the adapter attached (None: the base model)."""
    if adapter is not None and adapter.shape.encodes:
        return _encoding_student(model, sample, adapter)
    rows = len(sample.ids)
    dtype = next(model.parameters()).dtype
    keys = sample.cached_keys.to(dtype)
    values = sample.cached_values.to(dtype)
    if adapter is not None and adapter.link_keys is not None:   # after the documents
        link_keys, link_values = adapter.link_kv(model, int(sample.positions[0]) - 1, dtype)
        keys = torch.cat([keys, link_keys], dim=2)
        values = torch.cat([values, link_values], dim=2)
    past = keys.shape[2]
    allowed = torch.ones(rows, past + rows, dtype=torch.bool)
    allowed[:, past:] = torch.tril(torch.ones(rows, rows, dtype=torch.bool))
    mask = torch.zeros(rows, past + rows, dtype=dtype)
    mask.masked_fill_(~allowed, float("-inf"))
    cache = DynamicCache(config=model.config)
    for layer in range(keys.shape[0]):
        cache.update(keys[layer][None], values[layer][None], layer)
    inputs = dict(input_ids=sample.ids[None], position_ids=sample.positions[None],
                  attention_mask=mask[None, None], cache=cache, use_cache=True)
    if adapter is None:
        logits = model(**inputs).logits[0]
    else:
        with attached(model, adapter):
            logits = model(**inputs).logits[0]
    return torch.log_softmax(logits.float(), dim=-1)


def _encoding_student(model: torch.nn.Module, sample: Sample,
                      adapter: SeamLoRA) -> torch.Tensor:
    """`student_logprobs` for an adapter that encodes: the cached tokens and `sample.ids`
    in one pass with the adapter attached, each cached token seeing what the encoder lets
    it see, each of the ids every cached token and the ids before it."""
    if sample.cached_sees is None:
        raise InvalidArgumentError("this sample keeps no cached tokens to encode again")
    cached = len(sample.cached_ids)
    rows = len(sample.ids)
    dtype = next(model.parameters()).dtype
    allowed = torch.zeros(cached + rows, cached + rows, dtype=torch.bool)
    allowed[:cached, :cached] = sample.cached_sees
    allowed[cached:, :cached] = True
    allowed[cached:, cached:] = torch.tril(torch.ones(rows, rows, dtype=torch.bool))
    mask = torch.zeros(cached + rows, cached + rows, dtype=dtype)
    mask.masked_fill_(~allowed, float("-inf"))
    ids = torch.cat([sample.cached_ids, sample.ids])
    positions = torch.cat([sample.cached_positions, sample.positions])
    with attached(model, adapter):
        logits = model(input_ids=ids[None], position_ids=positions[None],
                       attention_mask=mask[None, None], use_cache=False,
                       logits_to_keep=rows).logits[0]
    return torch.log_softmax(logits.float(), dim=-1)


def kl_per_row(teacher: torch.Tensor, student: torch.Tensor) -> torch.Tensor:
    """KL(teacher || student) of each row [R] (both log-probabilities [R, V])."""
    return (teacher.exp() * (teacher - student)).sum(dim=-1)


def answer_logprob(sample: Sample, logprobs: torch.Tensor) -> float:
    """The summed log-probability of the teacher's answer under `logprobs` [R, V]."""
    k = sample.answer_length
    if k == 0:
        return 0.0
    rows = logprobs[len(sample.ids) - k - 1:len(sample.ids) - 1]
    picked = rows[torch.arange(k), sample.ids[len(sample.ids) - k:]]
    return float(picked.sum())
