"""Synthetic multi-document question answering, shipped with the project.

This file: the items (QAItem), answer matching, `generate`, and the items as PML schema
and prompt; qa_kinds.py: the invented people, their facts, the documents about them and
the builder of each kind (its names are re-exported here).

Every item is a handful of short documents about invented people, one question
and a one- or two-word answer for exact-match scoring. Kinds:

- ``single``: the answer is stated in one document, next to the person's name;
  the other documents are distractors about other people.
- ``cross``: a bridge across two self-contained documents. Document A names a
  person with a key fact ("Ilsa Varnell lives in Velmora."), document B names
  the same person with the asked fact ("Ilsa Varnell plays the oboe."); the
  question identifies the person only by the key fact ("Which instrument does
  the person who lives in Velmora play?").
- ``dependent``: document B does not name the person at all; it continues
  document A by pronoun ("She plays the oboe."), and B is placed right after A.
  The question names the person, so only a model that reads B in the light of
  A can answer. This is the case modular encoding makes hard: B's cached
  states were computed without A.
- ``needle``: long documents of filler; one fact hidden at a random depth of a
  random document.
- ``same-shape``: every document has one template: one person with a job and a town,
  the two facts at the same places among the same neutral sentences; only the name,
  the job and the town differ. The question asks one person's job or town; the other
  documents hold the answers to the same question about other people, so a model
  that confuses documents answers with a distractor's value.

Distractor answers. ``distractor_answers`` lists the values the other people of the
item have for the asked attribute (their names, for a "Who ...?" question), each
stated in some document. `answer_in_output` counts an output as right only when the
gold answer occurs in it before any distractor answer does.

For every item the answer is stated in ``answer_docs[-1]`` and in no document
outside ``answer_docs``; ``answer_docs[0]`` of a cross/dependent item is the
document that identifies the person. Value pools are disjoint and each value is
used at most once per item, so this holds by construction; `generate` checks it
anyway and raises AssertionError if it ever fails.

Determinism: item i of `generate(n, seed)` depends only on (seed, i, knobs),
through `random.Random` seeded with a string (hashed with SHA-512 by Python, not
`hash()`), so every process yields the same items for one Python version.

Length: ``doc_words`` is the minimum number of whitespace-separated words per
document; filler sentences (about ten words each, no people, digits or pool
words) are added until it is reached. Expect roughly 1.3 tokens per word.
"""

from __future__ import annotations

import random
import re
import unicodedata
from dataclasses import asdict, dataclass
from typing import Literal, Sequence

from promptlang.errors import InvalidArgumentError
from promptlang.pml import nodes

# the people and kinds, re-exported: qa.SURNAMES, qa.ATTRIBUTES, ...
from promptlang.bench.qa_kinds import (_BUILDERS, _Draw, _Person, FEMALE_NAMES, MALE_NAMES,
                                       SURNAMES, ANIMALS, CITIES, OCCUPATIONS, INSTRUMENTS,
                                       COLOURS, PET_NAMES, HOUSE_NUMBERS, BIRTH_YEARS,
                                       _FILLER_SUBJECTS, _FILLER_PREDICATES, _FILLER_TAILS,
                                       filler_sentence, Attribute, ATTRIBUTES, SAME_SHAPE_KEYS)

KINDS = ("single", "cross", "dependent", "needle", "same-shape", "argument")
Kind = Literal["single", "cross", "dependent", "needle", "same-shape", "argument"]
DEFAULT_DOC_WORDS = {"single": 60, "cross": 60, "dependent": 60, "needle": 300, "same-shape": 60,
                     "argument": 60}
ARGUMENT_PARAM = "who"       # the parameter of an "argument" item's documents
ARGUMENT_TOKENS = 12         # its slot's length in tokens (names take 3-7 here)

SYSTEM_PROMPT = ("You answer questions about the documents you are given. Reply with the "
                 "answer only: one or two words copied from the documents.")


@dataclass(frozen=True)
class Doc:
    name: str      # unique across items: usable as a PML module name
    text: str      # as the baseline sees it (the argument in its place)
    argument: str = ""   # passed per request into parameter ARGUMENT_PARAM ("": none)
    at: int = 0          # where the argument starts in `text`

    def parts(self) -> tuple[str, str, str]:
        """(text before the argument, the argument, text after it)."""
        end = self.at + len(self.argument)
        return self.text[:self.at], self.argument, self.text[end:]


@dataclass(frozen=True)
class QAItem:
    id: str
    kind: str
    documents: tuple[Doc, ...]
    question: str
    answer: str
    answer_docs: tuple[int, ...]   # documents needed; the answer is stated in the last one
    distractor_answers: tuple[str, ...] = ()   # other people's values for the asked attribute

    @property
    def distractors(self) -> tuple[int, ...]:
        return tuple(i for i in range(len(self.documents)) if i not in self.answer_docs)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "QAItem":
        return cls(data["id"], data["kind"], tuple(Doc(**d) for d in data["documents"]),
                   data["question"], data["answer"], tuple(data["answer_docs"]),
                   tuple(data.get("distractor_answers", ())))


# --- scoring ---------------------------------------------------------------------------

_ARTICLES = frozenset({"a", "an", "the"})


def normalize(text: str) -> list[str]:
    """Words of `text` for exact match: NFKC, lower case, every Unicode punctuation
    character replaced by a space, the articles a/an/the dropped, split on whitespace
    (so leading/trailing whitespace never matters)."""
    text = unicodedata.normalize("NFKC", text).lower()
    text = "".join(" " if unicodedata.category(ch).startswith("P") else ch for ch in text)
    return [word for word in text.split() if word not in _ARTICLES]


def exact_match(prediction: str, answer: str) -> bool:
    """True when the normalized answer is the first words of the normalized prediction:
    "Velmora." and "velmora, a small town" match "Velmora"; "It is Velmora" does not.
    An answer that normalizes to nothing matches nothing."""
    want = normalize(answer)
    return bool(want) and normalize(prediction)[:len(want)] == want


def first_mention(text: str, phrase: str) -> int | None:
    """Where `phrase` first occurs in `text` as whole words, ignoring case (None: nowhere)."""
    found = re.search(rf"(?<!\w){re.escape(phrase)}(?!\w)", text, re.IGNORECASE)
    return None if found is None else found.start()


def mentions(text: str, phrase: str) -> bool:
    """Whether `phrase` occurs in `text` as whole words, ignoring case."""
    return first_mention(text, phrase) is not None


def first_distractor(text: str, distractors: Sequence[str]) -> int | None:
    """Where the earliest of `distractors` first occurs in `text` (None: none does)."""
    found = [at for at in (first_mention(text, d) for d in distractors) if at is not None]
    return min(found, default=None)


def answer_in_output(text: str, answer: str, distractors: Sequence[str] = ()) -> bool:
    """The answer counts as found when it occurs in `text` as whole words and no
    distractor answer occurs before its first occurrence: "Velmora" is right, "Brastow,
    not Velmora" (a distractor first) and "Brastow" (a distractor only) are wrong, and
    "Velmora; Brastow is another town" is right (the distractor comes after)."""
    at = first_mention(text, answer)
    if at is None:
        return False
    before = first_distractor(text, distractors)
    return before is None or at < before


def distracted(text: str, answer: str, distractors: Sequence[str]) -> bool:
    """A distractor answer occurs in `text` before the gold answer, or without it."""
    before = first_distractor(text, distractors)
    if before is None:
        return False
    at = first_mention(text, answer)
    return at is None or before < at


def _distractor_answers(people: Sequence[_Person], answer: str) -> tuple[str, ...]:
    """What the other people have where the asked person has `answer`: their values of
    the asked attribute, or their names when the answer is a name."""
    for person in people:
        if person.name == answer:
            return tuple(p.name for p in people if p is not person)
        key = next((k for k, v in person.values.items() if v == answer), None)
        if key is not None:
            return tuple(p.values[key] for p in people if p is not person and key in p.values)
    raise AssertionError(f"answer {answer!r} belongs to nobody drawn")


def generate(n_items: int, seed: int = 0, kind: str = "single", docs_per_item: int = 4,
             doc_words: int | None = None) -> list[QAItem]:
    """`n_items` items of `kind` ("single", "cross", "dependent", "needle", "same-shape",
    or "mixed": the kinds in turn), each with `docs_per_item` documents of at least
    `doc_words` words (default: DEFAULT_DOC_WORDS[kind]). Item i depends only on (seed, i,
    kind, knobs)."""
    if kind != "mixed" and kind not in KINDS:
        raise InvalidArgumentError(f"unknown kind {kind!r}: choose from {', '.join(KINDS)} "
                                   "or 'mixed'")
    if docs_per_item < 1:
        raise InvalidArgumentError("docs_per_item must be at least 1")
    items = []
    for index in range(n_items):
        item_kind = KINDS[index % len(KINDS)] if kind == "mixed" else kind
        words = DEFAULT_DOC_WORDS[item_kind] if doc_words is None else doc_words
        rng = random.Random(f"promptlang.bench.qa:{seed}:{index}:{item_kind}")
        draw = _Draw(rng)
        texts, question, answer, answer_docs, checks = _BUILDERS[item_kind](
            rng, draw, docs_per_item, words)
        item_id = f"{item_kind}-s{seed}-{index:04d}"
        documents = tuple(_doc(f"{item_id}-doc{j}", text) for j, text in enumerate(texts))
        item = QAItem(item_id, item_kind, documents, question, answer, answer_docs,
                      _distractor_answers(draw.people, answer))
        _verify(item, checks)
        items.append(item)
    return items


def _doc(name: str, text: "str | tuple[str, str, str]") -> Doc:
    if isinstance(text, str):
        return Doc(name, text)
    head, argument, tail = text
    return Doc(name, head + argument + tail, argument, len(head))


def _verify(item: QAItem, checks: list[tuple[str, tuple[int, ...]]]) -> None:
    """The construction's promises, checked: raises AssertionError naming the item."""
    def fail(message: str) -> None:
        raise AssertionError(f"{item.id}: {message}")

    words = item.answer.split()
    if not 1 <= len(words) <= 2 or any(w.lower() in _ARTICLES for w in words):
        fail(f"answer {item.answer!r} is not one or two article-free words")
    if not mentions(item.documents[item.answer_docs[-1]].text, item.answer):
        fail(f"answer {item.answer!r} missing from document {item.answer_docs[-1]}")
    if mentions(item.question, item.answer):
        fail("the question gives the answer away")
    # (phrase, documents it must be confined to): the answer, plus per-kind promises
    for phrase, allowed in [(item.answer, item.answer_docs)] + checks:
        for i, doc in enumerate(item.documents):
            if i not in allowed and mentions(doc.text, phrase):
                fail(f"{phrase!r} appears in document {i}, outside {allowed}")
    for other in item.distractor_answers:
        if normalize(other) == normalize(item.answer) or mentions(item.answer, other):
            fail(f"distractor answer {other!r} cannot be told from the answer")
        if not any(mentions(doc.text, other) for doc in item.documents):
            fail(f"distractor answer {other!r} is stated in no document")


# --- PML -------------------------------------------------------------------------------

Mode = Literal["modules", "unions", "scaffold"]
DocsRole = Literal["user", "system"]


def scaffold_name(item: QAItem) -> str:
    return f"{item.id}-docs"


def build_schema(items: Sequence[QAItem], name: str, mode: Mode = "modules",
                 docs_role: DocsRole = "user", system: str = SYSTEM_PROMPT) -> nodes.Schema:
    """One schema serving every item in `items`.

    mode "modules": each document is a top-level module (items one after another, so
    a schema of many items gets long: positions add up). "unions": slot j is a union of
    every item's document j, so all items share positions (the choice for many items).
    "scaffold": each item's documents form one scaffold, encoded jointly.

    docs_role "user": the schema opens the user turn and the documents sit in it; the
    prompt adds the question and closes it (the reference dialect's unbalanced roles).
    "system": the documents sit in the system turn after `system`; the prompt has a
    balanced user turn.
    """
    def module(doc: Doc) -> nodes.Module:
        if not doc.argument:
            return nodes.Module(doc.name, (nodes.Text(doc.text + "\n\n"),))
        head, _, tail = doc.parts()
        return nodes.Module(doc.name, (nodes.Text(head), nodes.Param(ARGUMENT_PARAM,
                                                                     ARGUMENT_TOKENS),
                                       nodes.Text(tail + "\n\n")))

    if docs_role == "user":
        head = [nodes.RoleOpen("system"), nodes.Text(system), nodes.RoleClose("system"),
                nodes.RoleOpen("user"), nodes.Text("Documents:\n\n")]
        tail: list[nodes.SchemaChild] = []
    elif docs_role == "system":
        head = [nodes.RoleOpen("system"), nodes.Text(system + "\n\nDocuments:\n\n")]
        tail = [nodes.RoleClose("system")]
    else:
        raise InvalidArgumentError(f"unknown docs_role {docs_role!r}: 'user' or 'system'")

    body: list[nodes.SchemaChild] = []
    if mode == "modules":
        body = [module(doc) for item in items for doc in item.documents]
    elif mode == "unions":
        slots = max((len(item.documents) for item in items), default=0)
        body = [nodes.Union(tuple(module(item.documents[j]) for item in items
                                  if j < len(item.documents)))
                for j in range(slots)]
    elif mode == "scaffold":
        body = [nodes.Scaffold(scaffold_name(item), tuple(module(d) for d in item.documents))
                for item in items]
    else:
        raise InvalidArgumentError(f"unknown mode {mode!r}: 'modules', 'unions' or 'scaffold'")
    return nodes.Schema(name, tuple(head + body + tail))


def build_prompt(item: QAItem, schema_name: str, mode: Mode = "modules",
                 docs_role: DocsRole = "user") -> nodes.PromptDoc:
    """The prompt for `item` against a `build_schema` schema of the same mode and
    docs_role: import the item's documents, ask the question, open the assistant turn."""
    if mode == "scaffold" and not any(doc.argument for doc in item.documents):
        imports: list[nodes.PromptChild] = [nodes.ScaffoldRef(scaffold_name(item))]
    elif mode in ("modules", "unions", "scaffold"):   # all of a scaffold's modules: joint KV
        imports = [nodes.ModuleRef(doc.name, _arguments(doc)) for doc in item.documents]
    else:
        raise InvalidArgumentError(f"unknown mode {mode!r}: 'modules', 'unions' or 'scaffold'")
    question = [nodes.Text(f"Question: {item.question}"), nodes.RoleClose("user"),
                nodes.RoleOpen("assistant")]
    if docs_role == "system":
        question.insert(0, nodes.RoleOpen("user"))
    elif docs_role != "user":
        raise InvalidArgumentError(f"unknown docs_role {docs_role!r}: 'user' or 'system'")
    return nodes.PromptDoc(schema_name, tuple(imports + question))


def _arguments(doc: Doc) -> tuple[nodes.Argument, ...]:
    return (nodes.Argument(ARGUMENT_PARAM, doc.argument),) if doc.argument else ()


def to_pml(item: QAItem, schema_name: str, mode: Mode = "modules",
           docs_role: DocsRole = "user") -> tuple[nodes.Schema, nodes.PromptDoc]:
    """(schema, prompt) for one item on its own."""
    return (build_schema([item], schema_name, mode, docs_role),
            build_prompt(item, schema_name, mode, docs_role))
