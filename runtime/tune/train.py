"""`promptlang tune`'s loop: the seam adapter learned by self-distillation.

Each round draws a new combination (a schema of `schema_docs` training documents, a prompt
importing 2-4 of them and asking one's question; a `same_shape` share of rounds instead a
schema of same-shaped records, corpus.same_shape_group), makes its teacher and student
(samples.py), and takes one AdamW step on KL(teacher || student) over the tokens after the
documents (the rows that predict the answer weighted `answer_weight`), then `replay` steps
on samples of earlier rounds (a sample costs several steps to make). Documents are split
once into training and held-out ones; the held-out combinations (and, where records are
trained on, records built on held-out documents, measured apart) measure the KL and the
teacher's answer log-probability with the adapter and without (the untrained student is
the runtime's `none` policy). Checkpoints (adapter, optimizer, step, random state) are
written every `checkpoint_minutes`; `resume` continues from the last one. Everything lands
in one folder (`adapter_dir`): the adapter, its log (one JSON line per step and per
evaluation) and the corpus it was trained on.
"""

from __future__ import annotations

import copy
import functools
import json
import math
import random
import statistics
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Callable

import torch

from promptlang.errors import TuneError
from promptlang.home import ADAPTER_FILE, private_dir, write_private
from promptlang.runtime.tune import corpus as corpus_mod
from promptlang.runtime.model.lora import SeamLoRA, shape_of
from promptlang.runtime.tune.samples import (Sample, answer_logprob, kl_per_row, make_sample,
                                             rag_prompt, rag_schema, student_logprobs)

STATE_FILE = "checkpoint.pt"
LOG_FILE = "tune-log.jsonl"
CORPUS_FILE = "corpus.json"
# each held-out set (held_out_sets) -> its field of TuneReport, the log and the adapter's meta
EVALUATION_FIELDS = {"documents": "evaluation", "records": "same_shape_evaluation",
                     "gapless": "gapless_evaluation"}


@dataclass(frozen=True, kw_only=True)
class TuneOptions:
    minutes: float = 60.0            # the training budget (corpus and evaluation not counted)
    seed: int = 0
    rank: int = 8
    alpha: float = 16.0
    lr: float = 1e-3
    link_tokens: int = 0             # learned link tokens after the modules (lora.py; 0: none)
    link_lr: float = 1e-2            # their learning rate
    encodes: bool = False            # the adapter also encodes the modules (lora.py)
    written_docs: int = 48           # documents the model writes for the corpus
    doc_tokens: int = 160            # the longest document it writes, in tokens
    schema_docs: int = 8             # documents in each step's schema
    docs_per_request: tuple[int, ...] = (2, 3, 4)
    answer_tokens: int = 16          # the teacher's greedy answer, at most
    answer_weight: float = 1.0       # the loss's weight on rows that predict the answer
    replay: int = 0                  # steps on earlier samples after each new one
    replay_samples: int = 32         # the most recent samples those are drawn from
    same_shape: float = 0.0          # the share of rounds on same-shaped records
    quote: float = 0.0               # the share of rounds that quote a document's sentence
    gapless: float = 0.0             # the share of rounds whose schema holds only the
                                     # documents the prompt imports (no position gaps)
    tail_as_served: bool = False     # a round with gaps trains the tokens after its documents
                                     # where `tuned` serves them (right after the last); by
                                     # default after the gaps, where `none` serves them (a
                                     # harder draw that carries over better, measured: the
                                     # held-out sets are always measured as `tuned` serves)
    held_out: int = 16               # held-out combinations for the evaluation (of each kind
                                     # trained on: the corpus's, records where same_shape,
                                     # combinations without gaps where gapless)
    checkpoint_minutes: float = 5.0
    max_steps: int | None = None     # stop after this many steps (tests); None: the budget
    resume: bool = False


@dataclass(kw_only=True)
class Evaluation:
    """The held-out combinations measured with and without the adapter."""

    kl_before: float                 # mean next-token KL from the teacher, no adapter
    kl_after: float
    answer_gap_before: float         # mean teacher - student answer log-prob (nats)
    answer_gap_after: float

    @property
    def kl_recovered(self) -> float:
        """The fraction of the KL the adapter removed (0 with no KL to remove)."""
        if self.kl_before <= 0:
            return 0.0
        return 1.0 - self.kl_after / self.kl_before


@dataclass(kw_only=True)
class TuneReport:
    adapter_path: Path
    steps: int
    seconds: float
    evaluation: Evaluation
    same_shape_evaluation: Evaluation | None = None   # held-out records, where trained on
    gapless_evaluation: Evaluation | None = None      # held-out, no gaps, where trained on
    losses: list[float] = field(default_factory=list)


def plain_copy(hf_model: torch.nn.Module) -> torch.nn.Module:
    """A fresh, unmodified instance of the model's class with a copy of its weights (the
    runtime's own may carry promptlang's attention); frozen, sdpa attention."""
    import transformers

    config = copy.deepcopy(hf_model.config)
    dtype = next(hf_model.parameters()).dtype
    name = "sdpa" if type(hf_model)._supports_sdpa else "eager"
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation=name,
                                                          dtype=dtype)
    model.load_state_dict(hf_model.state_dict())
    model.eval()
    for parameter in model.parameters():
        parameter.requires_grad_(False)
    return model


def tune(llm, adapter_dir: Path, options: TuneOptions, *, schemas=(),
         say: Callable[[str], None] = print, bar=None,
         writing: Callable[[int, int], None] | None = None) -> TuneReport:
    """Train the seam adapter of `llm`'s model and write it to `adapter_dir`. `bar(step,
    loss, seconds, budget)` hears of every step; `writing(done, total)` of every corpus
    document written."""
    private_dir(adapter_dir)
    rng = random.Random(options.seed)
    torch.manual_seed(options.seed)
    docs = _corpus(llm, adapter_dir, options, schemas, say, writing)
    val_docs, train_docs = split_corpus(docs, rng, options)
    engine = private_engine(llm)
    model = plain_copy(llm.adapter.model)
    end_ids = set(llm.tokenizer.eos_ids)
    held_out = held_out_sets(engine, model, val_docs, options, end_ids)
    adapter = SeamLoRA(shape_of(model, options.rank, options.alpha, options.link_tokens,
                                options.encodes), seed=options.seed)
    optimizer = _optimizer(adapter, options)
    step = 0
    spent = 0.0
    state_path = adapter_dir / STATE_FILE
    if options.resume and state_path.exists():
        state = torch.load(state_path, weights_only=False)
        adapter.load_state_dict(state["adapter"])
        optimizer.load_state_dict(state["optimizer"])
        step = state["step"]
        spent = state["seconds"]
        rng.setstate(state["rng"])
        say(f"promptlang tune: resumed at step {step} ({spent / 60:.1f} of "
            f"{options.minutes:g} minutes spent)")
    log = _private_log(adapter_dir / LOG_FILE)
    losses: list[float] = []
    replay = Replay(options.replay_samples, random.Random(options.seed + 1 + step))
    budget = options.minutes * 60
    started = time.perf_counter() - spent
    saved = time.perf_counter()
    try:
        while time.perf_counter() - started < budget:
            if options.max_steps is not None and step >= options.max_steps:
                break
            draw = _draw
            if options.same_shape > 0 and rng.random() < options.same_shape:
                draw = _draw_same_shape
            elif options.quote > 0 and rng.random() < options.quote:
                draw = functools.partial(_draw, quoting=True)
            if options.gapless > 0 and rng.random() < options.gapless:
                draw = functools.partial(draw, gapless=True)
            sample = draw(engine, model, train_docs, rng, options, end_ids, f"tune-{step}",
                          served=options.tail_as_served)
            earlier = replay.draw(options.replay)
            replay.add(sample)
            for trained in (sample, *earlier):
                if options.max_steps is not None and step >= options.max_steps:
                    break
                loss = weighted_kl(sample=trained,
                                   student=student_logprobs(model, trained, adapter),
                                   answer_weight=options.answer_weight)
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
                step += 1
                losses.append(float(loss.detach()))
                log.write(json.dumps({"step": step, "loss": float(loss.detach()),
                                      "replayed": trained is not sample,
                                      "records": trained.records,
                                      "quoted": trained.quoted,
                                      "gapless": trained.gapless,
                                      "seconds": round(time.perf_counter() - started, 2)})
                          + "\n")
                if bar is not None:
                    bar(step, float(loss.detach()), time.perf_counter() - started, budget)
            if time.perf_counter() - saved > options.checkpoint_minutes * 60:
                _checkpoint(state_path, adapter, optimizer, step,
                            time.perf_counter() - started, rng)
                saved = time.perf_counter()
        seconds = time.perf_counter() - started
        _checkpoint(state_path, adapter, optimizer, step, seconds, rng)
        evaluations = {EVALUATION_FIELDS[name]: evaluate(model, samples, adapter)
                       for name, samples in held_out.items()}
        line = {**{field_: asdict(e) for field_, e in evaluations.items()}, "steps": step}
        log.write(json.dumps(line) + "\n")
    finally:
        log.close()
    path = adapter_dir / ADAPTER_FILE
    meta = {"model_fingerprint": llm.adapter.weights_fingerprint, "seed": str(options.seed),
            "steps": str(step), "minutes": f"{seconds / 60:.1f}",
            "options": json.dumps(asdict(options), default=str),
            **{field_: json.dumps(asdict(e)) for field_, e in evaluations.items()}}
    adapter.save(path, meta)
    return TuneReport(adapter_path=path, steps=step, seconds=seconds, losses=losses,
                      **evaluations)


def _optimizer(adapter: SeamLoRA, options: TuneOptions) -> torch.optim.Optimizer:
    """AdamW over the LoRA's matrices at `lr` and the link tokens (where any) at `link_lr`."""
    links = [p for p in (adapter.link_keys, adapter.link_values) if p is not None]
    lora = [p for p in adapter.parameters() if all(p is not q for q in links)]
    groups = [{"params": lora, "lr": options.lr}]
    if links:
        groups.append({"params": links, "lr": options.link_lr})
    return torch.optim.AdamW(groups, weight_decay=0.0)


def split_corpus(docs: list[corpus_mod.Document], rng: random.Random,
                 options: TuneOptions) -> tuple[list, list]:
    """The held-out documents (a sixth, at least a schema's worth) and the training ones,
    drawn with `rng`; TuneError where too few are left to train on."""
    order = list(range(len(docs)))
    rng.shuffle(order)
    held = max(options.schema_docs, len(docs) // 6)
    if len(docs) - held < options.schema_docs:
        raise TuneError(f"the corpus has {len(docs)} documents; tune needs at least "
                        f"{options.schema_docs + held} (--written-docs or more sources)")
    return [docs[i] for i in order[:held]], [docs[i] for i in order[held:]]


def private_engine(llm):
    """An engine on `llm`'s model for tune's own combinations: a bounded store in memory
    only (every round's schema is new and thrown away: on disk they would fill the user's
    KV cache, tens of GB in 45 minutes), no exact entries, no tails."""
    from promptlang.runtime.engine import LLM
    from promptlang.runtime.store import ModuleStore

    store = ModuleStore(device=llm.adapter.device, device_budget_bytes=512 << 20,
                        disk_budget_bytes=0)
    return LLM(llm.adapter, llm.tokenizer, store, recompute="none", exact_reuse=False,
               tail_budget_bytes=0)


def held_out_sets(engine, model, val_docs: list[corpus_mod.Document], options: TuneOptions,
                  end_ids: set[int]) -> dict[str, list[Sample]]:
    """The held-out sets, by name: "documents", the combinations of `val_docs`; where
    `options.same_shape`, "records", as many of same-shaped records built on them; where
    `options.gapless`, "gapless", the same draws as "documents" with schemas of only the
    imported documents. Each combination drawn with a seed of its own, its student as
    `tuned` serves it."""
    sets = {"documents": [_draw(engine, model, val_docs, random.Random(options.seed + 7 + i),
                                options, end_ids, f"tune-val-{i}", served=True)
                          for i in range(options.held_out)]}
    if options.same_shape > 0:
        sets["records"] = [_draw_same_shape(engine, model, val_docs,
                                            random.Random(options.seed + 700 + i), options,
                                            end_ids, f"tune-val-shaped-{i}", served=True)
                           for i in range(options.held_out)]
    if options.gapless > 0:
        sets["gapless"] = [_draw(engine, model, val_docs, random.Random(options.seed + 7 + i),
                                 options, end_ids, f"tune-val-gapless-{i}", gapless=True,
                                 served=True)
                           for i in range(options.held_out)]
    return sets


class Replay:
    """The most recent `size` samples, of which each step after a new one draws some again: a
    sample (a teacher's full prefill and greedy answer, the documents served as encoded
    apart) costs several times a student's step, so each is trained on more than once.
    Not checkpointed: a resumed run starts with none."""

    def __init__(self, size: int, rng: random.Random):
        self.size = size
        self.rng = rng
        self.samples: list[Sample] = []

    def add(self, sample: Sample) -> None:
        if self.size <= 0:
            return
        self.samples.append(sample)
        if len(self.samples) > self.size:
            self.samples.pop(0)

    def draw(self, count: int) -> list[Sample]:
        """Up to `count` distinct samples held (none when empty)."""
        return self.rng.sample(self.samples, min(count, len(self.samples)))


def weighted_kl(*, sample: Sample, student: torch.Tensor, answer_weight: float) -> torch.Tensor:
    """KL(teacher || student) per row, averaged with `answer_weight` on the rows that predict
    the teacher's answer (the row after the prompt's last token, then each answer token's
    but the last) and 1 on the rest (the question's and the assistant affix's rows)."""
    rows = kl_per_row(sample.teacher, student)
    weights = torch.ones_like(rows)
    k = sample.answer_length
    if k:
        first = len(sample.ids) - k - 1
        weights[first:first + k] = answer_weight
    return (rows * weights).sum() / weights.sum()


@torch.no_grad()
def evaluate(model: torch.nn.Module, samples: list[Sample], adapter: SeamLoRA) -> Evaluation:
    """KL and answer log-prob gaps of held-out samples, without and with the adapter."""
    kl = {False: [], True: []}
    gap = {False: [], True: []}
    for sample in samples:
        teacher_answer = answer_logprob(sample, sample.teacher)
        for tuned in (False, True):
            student = student_logprobs(model, sample, adapter if tuned else None)
            kl[tuned].append(float(kl_per_row(sample.teacher, student).mean()))
            gap[tuned].append(teacher_answer - answer_logprob(sample, student))
    return Evaluation(kl_before=_mean(kl[False]), kl_after=_mean(kl[True]),
                      answer_gap_before=_mean(gap[False]), answer_gap_after=_mean(gap[True]))


def _mean(values: list[float]) -> float:
    return statistics.fmean(values) if values else math.nan


def _draw(engine, model, docs: list[corpus_mod.Document], rng: random.Random,
          options: TuneOptions, end_ids: set[int], name: str, *,
          quoting: bool = False, gapless: bool = False, served: bool = True) -> Sample:
    """One combination: a schema of `schema_docs` documents, a prompt importing k of them
    (schema order) and asking one's question; its teacher and student. `quoting`: the
    request asks instead for a sentence of an imported document by its first words
    (corpus.quote), the answer that sentence, so the teacher reads the document's own words
    and the rows that predict them say what the full prefill takes from that document (a
    document with no such sentence is asked its question). `gapless`: the same draw, with
    a schema of only the k imported documents. `served`: the student's tokens after the
    documents where `tuned` serves them (make_sample's `close_tail`)."""
    chosen = rng.sample(docs, options.schema_docs)
    return _combination(engine, model, [d.text for d in chosen],
                        [(d.question,) for d in chosen], rng, options, end_ids, name,
                        quoting=quoting, gapless=gapless, served=served)


def _draw_same_shape(engine, model, docs: list[corpus_mod.Document], rng: random.Random,
                     options: TuneOptions, end_ids: set[int], name: str, *,
                     gapless: bool = False, served: bool = True) -> Sample:
    """One combination of same-shaped records (corpus.same_shape_group, one of `docs` as
    their shared sentences): the schema, the prompt and the question as `_draw`'s."""
    records = corpus_mod.same_shape_group(rng, rng.choice(docs).text, options.schema_docs)
    sample = _combination(engine, model, [r.text for r in records],
                          [r.questions for r in records], rng, options, end_ids, name,
                          gapless=gapless, served=served)
    return replace(sample, records=True)


def _combination(engine, model, texts: list[str], questions: list[tuple[str, ...]],
                 rng: random.Random, options: TuneOptions, end_ids: set[int],
                 name: str, quoting: bool = False, gapless: bool = False,
                 served: bool = True) -> Sample:
    """`texts` as a schema's documents, a prompt importing k of them and asking one of an
    imported document's `questions` (`quoting`: for one of its sentences); its teacher and
    student. `gapless`: the schema holds only the k imported texts, so the request's
    positions have no gaps (as a prompt importing every module of its schema), where
    otherwise each text left out leaves one."""
    system = rng.choice(corpus_mod.SYSTEMS)
    label = rng.choice(corpus_mod.LABELS)
    k = min(rng.choice(options.docs_per_request), len(texts))
    imported = sorted(rng.sample(range(len(texts)), k))
    which = rng.choice(imported)
    quoted = corpus_mod.quote(rng, texts[which]) if quoting else None
    if quoted is None:
        asks = questions[which]
        asked = asks[0] if len(asks) == 1 else rng.choice(asks)  # one: the stream as before
        question = rng.choice(corpus_mod.QUESTION_FORMS).format(q=asked)
        answer = None
    else:
        question, answer = quoted
    if gapless:
        texts = [texts[i] for i in imported]
        imported = list(range(k))
    schema = rag_schema(name, system, label, texts)
    engine.add_schema(schema)
    try:
        sample = make_sample(engine, model, rag_prompt(name, imported, question),
                             options.answer_tokens, end_ids, answer, close_tail=served)
    finally:
        engine.remove_schema(name)
    return replace(sample, gapless=gapless)


def _corpus(llm, adapter_dir: Path, options: TuneOptions, schemas, say, writing) -> list:
    path = adapter_dir / CORPUS_FILE
    if options.resume and path.exists():
        return corpus_mod.load_corpus(path)
    user_texts = corpus_mod.user_documents(schemas)
    say(f"promptlang tune: writing the corpus ({len(user_texts)} documents of yours, "
        f"{options.written_docs} the model writes)")

    def generate(instruction: str, max_tokens: int, seed: int) -> str:
        return _reply(llm, instruction, max_tokens, seed)

    docs = corpus_mod.build_corpus(generate, user_texts=user_texts,
                                   written=options.written_docs, seed=options.seed,
                                   doc_tokens=options.doc_tokens, progress=writing)
    corpus_mod.save_corpus(path, docs)
    return docs


def _reply(llm, instruction: str, max_tokens: int, seed: int) -> str:
    """The model's reply to one user turn (sampled at temperature 0.8, seeded)."""
    from promptlang.pml import nodes

    name = "tune-writer"
    llm.add_schema(nodes.Schema(name, ()))
    doc = nodes.PromptDoc(name, (nodes.RoleOpen("user"), nodes.Text(instruction),
                                 nodes.RoleClose("user"), nodes.RoleOpen("assistant")))
    result = llm.generate(doc, max_new_tokens=max_tokens, temperature=0.8, top_p=0.95,
                          seed=seed, recompute="none")
    return result.text


def _private_log(path: Path):
    """The log, opened to append; created private (0600) like every file tune writes."""
    import os

    descriptor = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    return os.fdopen(descriptor, "a")


def _checkpoint(path: Path, adapter: SeamLoRA, optimizer, step: int, seconds: float,
                rng: random.Random) -> None:
    import io

    buffer = io.BytesIO()
    torch.save({"adapter": adapter.state_dict(), "optimizer": optimizer.state_dict(),
                "step": step, "seconds": seconds, "rng": rng.getstate()}, buffer)
    write_private(path, buffer.getvalue())
