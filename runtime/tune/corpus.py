"""The seam adapter's training text: the user's own documents and the model's own writing.

No labels and no downloads. Documents come from the schemas the user passes (each cached
module's text) and from the model itself, asked to write short factual paragraphs about
subjects drawn from the word lists below; questions are the model's own, asked of each
document. The word lists and phrasings are tune's own: nothing here comes from the
benchmarks' items (tests/runtime/test_tune.py checks that no 8 words in a row are shared).
"""

from __future__ import annotations

import json
import random
import re
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Iterable

from promptlang.pml import nodes

_SENTENCE_END = re.compile(r"(?<=[.!?])\s+")

PLACES = ("a harbour town", "a mountain village", "an island ferry line", "a desert observatory",
          "a river delta", "a railway junction", "a market square", "a coastal lighthouse",
          "a university library", "a city zoo", "a wind farm", "a botanical garden",
          "a ski resort", "a fishing cooperative", "a monastery", "a textile mill")
THINGS = ("a bakery", "a chess club", "a bicycle workshop", "a choir", "a weather station",
          "a small airline", "a pottery studio", "a football team", "a printing press",
          "a bee farm", "a museum of clocks", "a radio station", "a vineyard", "a bridge",
          "a theatre company", "a shipyard", "a hospital ward", "a recycling plant")
ASPECTS = ("its history", "the people who run it", "how it works day to day", "its finances",
           "a problem it faced", "its busiest season", "the equipment it uses",
           "an unusual event there", "its rules", "what visitors notice first")
SYSTEMS = ("You answer questions using only the documents the user gives you.",
           "You are a careful assistant. Read the notes and answer briefly.",
           "Answer from the provided context. Be short and precise.")
LABELS = ("Documents:\n\n", "Here are some notes.\n\n", "Context:\n\n")
QUESTION_FORMS = ("Question: {q}", "{q}", "Using the notes above: {q}")
QUOTE_FORMS = ('Which sentence of the notes begins "{start}"? Write it out.',
               'Copy out the sentence from the notes that starts with "{start}".')
QUOTE_START_WORDS = 4            # the words of a quoted sentence the request gives

# Same-shaped records: one group's documents say the same things in the same words about
# different places (a made-up name, a kind from THINGS), so only the names and the facts tell
# them apart.
NAME_HEADS = ("Bram", "Cask", "Del", "Ferr", "Gorse", "Hask", "Lum", "Marl", "Nock", "Pell",
              "Rook", "Sedge", "Tarn", "Wold", "Yew", "Quarn")
NAME_TAILS = ("by", "field", "hithe", "ing", "low", "mouth", "ney", "shaw", "ton", "wardine")
MANAGERS = ("Agathe Brennock", "Bartholomew Sley", "Constance Irwell", "Desmond Hay",
            "Eugenie Tarrant", "Fitzroy Amble", "Gwendolyn Pask", "Horace Quenby",
            "Imelda Rusk", "Jasper Oldroyd", "Leopold Finch", "Marguerite Cobb",
            "Oswin Thackeray", "Philippa Dunstable", "Reginald Moss", "Sybil Harrow")
WEEKDAYS = ("Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday")


@dataclass(frozen=True)
class RecordField:
    """One fact a record states: its phrasings (`{s}` the subject, `{v}` the value), the
    question that asks it, and how a value is drawn."""

    phrasings: tuple[str, ...]
    question: str
    draw: Callable[[random.Random], str]


RECORD_FIELDS = (
    RecordField(("{s} opened its doors in {v}.", "The year {s} was set up was {v}."),
                "In which year did {s} open?", lambda rng: str(rng.randint(1850, 2019))),
    RecordField(("{s} keeps {v} people on its payroll.", "A staff of {v} works at {s}."),
                "How many people work at {s}?", lambda rng: str(rng.randint(3, 480))),
    RecordField(("{s} is managed by {v}.", "The person in charge of {s} is {v}."),
                "Who is in charge of {s}?", lambda rng: rng.choice(MANAGERS)),
    RecordField(("{s} stays shut every {v}.", "Each week {s} closes on {v}."),
                "On which day of the week is {s} closed?", lambda rng: rng.choice(WEEKDAYS)),
)


@dataclass(frozen=True)
class Record:
    """A same-shaped document and the questions its facts answer."""

    text: str
    questions: tuple[str, ...]


def same_shape_group(rng: random.Random, filler: str, count: int,
                     facts: tuple[int, int] = (2, 3)) -> list[Record]:
    """`count` records about different places, all built from one template: the same
    sentences of `filler` (a corpus document) with the same fields, phrased the same way,
    at the same places; only the subjects' names and the facts' values differ."""
    sentences = _sentences(filler)
    fields = rng.sample(RECORD_FIELDS, rng.randint(*facts))
    phrasings = [rng.choice(f.phrasings) for f in fields]
    slots = sorted(rng.randint(0, len(sentences)) for _ in fields)
    kind = rng.choice(THINGS).split(" ", 1)[1]
    names = rng.sample([h + t for h in NAME_HEADS for t in NAME_TAILS], count)
    records = []
    for name in names:
        subject = f"the {name} {kind}"
        text = list(sentences)
        for shift, (slot, field, phrasing) in enumerate(zip(slots, fields, phrasings)):
            text.insert(slot + shift, _capital(phrasing.format(s=subject, v=field.draw(rng))))
        body = " ".join(text)
        records.append(Record(f"About {subject}. {body}",
                              tuple(_capital(f.question.format(s=subject)) for f in fields)))
    return records


def quote(rng: random.Random, text: str) -> tuple[str, str] | None:
    """A sentence of `text` to quote: (a request for it, naming its first words; the
    sentence), or None where no sentence has 4 words more than those."""
    sentences = [s for s in _sentences(text) if len(s.split()) >= QUOTE_START_WORDS + 4]
    if not sentences:
        return None
    sentence = rng.choice(sentences)
    start = " ".join(sentence.split()[:QUOTE_START_WORDS])
    return rng.choice(QUOTE_FORMS).format(start=start), sentence


def _sentences(text: str) -> list[str]:
    """`text`'s sentences (split after ". ", "! ", "? "), each stripped; at least one."""
    parts = [p.strip() for p in _SENTENCE_END.split(text.replace("\n", " ")) if p.strip()]
    return parts or [text.strip()]


def _capital(sentence: str) -> str:
    return sentence[:1].upper() + sentence[1:]


@dataclass(frozen=True)
class Document:
    text: str
    question: str
    source: str                  # "user" (a schema's module) or "model" (written by the model)


def user_documents(schemas: Iterable[nodes.Schema], min_chars: int = 40) -> list[str]:
    """The text of every cached module of `schemas` (nested modules each on their own)."""
    texts: list[str] = []

    def visit(children) -> None:
        for child in children:
            if isinstance(child, nodes.Module):
                own = "".join(c.text for c in child.children if isinstance(c, nodes.Text))
                if child.cache and len(own.strip()) >= min_chars:
                    texts.append(own.strip())
                visit(child.children)
            elif isinstance(child, (nodes.Union, nodes.Scaffold)):
                visit(child.children)

    for schema in schemas:
        visit(schema.children)
    return texts


def subjects(rng: random.Random, count: int) -> list[str]:
    """`count` writing tasks, each a subject and an aspect of it."""
    pool = [f"{what} in {where}" for what in THINGS for where in PLACES]
    rng.shuffle(pool)
    return [f"{pool[i % len(pool)]}, and {rng.choice(ASPECTS)}" for i in range(count)]


def build_corpus(generate: Callable[[str, int, int], str], *, user_texts: list[str],
                 written: int, seed: int, doc_tokens: int = 160,
                 progress: Callable[[int, int], None] | None = None) -> list[Document]:
    """The user's texts and `written` documents the model writes, each with a question the
    model asks of it. `generate(instruction, max_tokens, seed)` is the model's reply."""
    rng = random.Random(seed)
    tasks = subjects(rng, written)
    docs: list[Document] = []
    total = len(user_texts) + len(tasks)
    for i, text in enumerate(user_texts):
        docs.append(Document(text, _question(generate, text, seed + i), "user"))
        if progress:
            progress(len(docs), total)
    for i, task in enumerate(tasks):
        text = generate(f"Write a short factual paragraph about {task}. Use concrete names, "
                        f"numbers and places.", doc_tokens, seed + 1000 + i).strip()
        if len(text) < 20:
            continue
        docs.append(Document(text, _question(generate, text, seed + 2000 + i), "model"))
        if progress:
            progress(len(docs), total)
    return docs


def _question(generate, text: str, seed: int) -> str:
    """A question the model asks of `text`; a fixed one where its reply is no question."""
    reply = generate(f"Text: {text}\n\nWrite a question whose answer is a fact stated in the "
                     f"text. Reply with the question only.", 32, seed)
    line = next((s.strip() for s in reply.splitlines() if s.strip()), "")
    if len(line) < 15 or not line.endswith("?") or "question" in line.lower():
        return "Which names and numbers does the text give?"
    return line


def save_corpus(path: Path, docs: list[Document]) -> None:
    from promptlang.home import write_private

    write_private(path, json.dumps([asdict(d) for d in docs], indent=1).encode())


def load_corpus(path: Path) -> list[Document]:
    return [Document(**d) for d in json.loads(path.read_text())]
