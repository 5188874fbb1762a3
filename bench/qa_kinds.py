"""The invented people of the QA items: value pools, filler sentences, attributes and how a
fact is stated, the documents about people, and the builder of each item kind (qa.py's
`generate` calls `_BUILDERS[kind]`). Pools are disjoint and each value is drawn at most
once per item (`_Draw`), so an answer is stated only where the item says it is.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Callable, Sequence

from promptlang.errors import InvalidArgumentError


FEMALE_NAMES = ("Ilsa", "Mirela", "Tova", "Anouk", "Brisa", "Calla", "Dagny", "Elowen", "Fenna",
                "Greta", "Halla", "Isolde", "Jorunn", "Kaia", "Liesel", "Maren", "Nadia", "Odile",
                "Perla", "Quilla", "Rhea", "Sunniva", "Talia", "Una", "Vesna", "Wren", "Xenia",
                "Yara", "Zelda", "Amira", "Bettina", "Cosima")
MALE_NAMES = ("Anders", "Bastian", "Corin", "Dario", "Emrys", "Falk", "Gideon", "Halvard", "Ivo",
              "Jarek", "Kasimir", "Lorcan", "Matteo", "Niall", "Osric", "Piet", "Quentin",
              "Rasmus", "Sten", "Tobin", "Ulric", "Viggo", "Wendel", "Yannick", "Zoran", "Aurel",
              "Benno", "Cyprian", "Dorian", "Elias", "Florin", "Gustav")
SURNAMES = ("Varnell", "Quillon", "Abernathy", "Blackthorn", "Castellan", "Dunmore", "Everhart",
            "Fairweather", "Galloway", "Hargrove", "Ingleby", "Jessop", "Kettering", "Lindqvist",
            "Montague", "Northcott", "Oakhurst", "Pemberton", "Quarrie", "Ravenscroft",
            "Thornbury", "Underhill", "Vance", "Whitlock", "Yardley", "Zimmer", "Ashdown",
            "Brightwell", "Coldwell", "Drummond", "Ellery", "Fenwick", "Greaves", "Hollis",
            "Ivers", "Jardine", "Kinloch", "Lockridge", "Merriweather", "Nettles", "Ormsby",
            "Pryce", "Quimby", "Rowntree", "Stanhope", "Tolliver", "Upton", "Voss", "Wexley",
            "Yelland")
ANIMALS = ("dog", "cat", "parrot", "tortoise", "rabbit", "ferret", "hamster", "pony", "lizard",
           "goose", "canary", "goat", "hedgehog", "iguana", "donkey")
CITIES = ("Velmora", "Brastow", "Quenhall", "Dorrinford", "Ashmere", "Elmsgate", "Farrowby",
          "Glimmerholt", "Harrowmere", "Ilvane", "Jastrow", "Kelmarsh", "Lornwick", "Marrowdale",
          "Nethercombe", "Orlanth", "Pellmoor", "Quarrystone", "Rivenmouth", "Saltmarch",
          "Tessaly", "Umberfell", "Vantmoor", "Wyndlow", "Yarrowby", "Zennor", "Alderwyck",
          "Blythmoor", "Corvane", "Dunhallow", "Estermere", "Fennick", "Grisholm", "Halvergate",
          "Islemont", "Jorvale", "Kestmoor", "Lanthorne", "Mirefield", "Norrowgate",
          "Oakenfold", "Pennwick", "Ravensholm", "Stormhaven", "Thistlebury", "Ulverdale",
          "Westerholt")
OCCUPATIONS = ("pilot", "baker", "architect", "nurse", "carpenter", "librarian", "dentist",
               "plumber", "florist", "surveyor", "chemist", "tailor", "jeweller", "locksmith",
               "beekeeper", "cartographer", "glassblower", "veterinarian", "astronomer",
               "blacksmith", "translator", "geologist", "pharmacist", "welder", "potter",
               "sculptor", "electrician", "firefighter", "journalist", "photographer",
               "accountant", "botanist", "mechanic", "lawyer", "engineer", "butcher", "optician",
               "zoologist", "courier", "shepherd", "goldsmith", "bookbinder", "winemaker",
               "economist", "surgeon", "barber", "cobbler")
INSTRUMENTS = ("oboe", "cello", "harp", "flute", "trumpet", "clarinet", "banjo", "accordion",
               "bassoon", "viola", "mandolin", "trombone", "ukulele", "harmonica", "piccolo",
               "tuba", "sitar", "xylophone", "saxophone", "lute", "marimba", "zither", "dulcimer",
               "harpsichord", "bagpipes", "glockenspiel")
COLOURS = ("crimson", "teal", "amber", "violet", "indigo", "scarlet", "ochre", "maroon",
           "turquoise", "magenta", "lilac", "beige", "cyan", "lavender", "emerald", "silver",
           "mauve", "saffron", "cobalt", "ivory", "coral", "navy", "khaki", "burgundy",
           "charcoal", "vermilion")
PET_NAMES = ("Kiko", "Biscuit", "Pip", "Mochi", "Zephyr", "Noodle", "Pepper", "Juniper",
             "Waffles", "Sprocket", "Tansy", "Bramble", "Clover", "Fudge", "Gizmo", "Inky",
             "Jasper", "Kipper", "Loki", "Marble", "Nutmeg", "Oswin", "Pickle", "Quince", "Rolo",
             "Truffle", "Velvet", "Widget", "Yoyo", "Ziggy", "Acorn", "Bumble", "Cricket",
             "Dumpling", "Ember", "Figaro", "Gumdrop", "Huckle", "Izzy", "Jellybean", "Kumquat",
             "Lentil", "Muffin", "Nibbles", "Pretzel", "Sushi", "Tofu")
HOUSE_NUMBERS = tuple(str(n) for n in range(100, 1000))    # three digits: never inside a year
BIRTH_YEARS = tuple(str(n) for n in range(1931, 2005))      # four digits

_FILLER_SUBJECTS = ("The old harbour", "The northern road", "The morning market",
                    "A narrow bridge", "The river valley", "The town library", "The council hall",
                    "The eastern forest", "The stone lighthouse", "The railway station",
                    "The village square", "The hill path", "The central park",
                    "The winter festival", "The local museum", "The coastal trail",
                    "The public garden", "The western district", "The weekly fair",
                    "The mountain pass")
_FILLER_PREDICATES = ("was quiet for most of the season", "drew visitors from distant towns",
                      "changed little over the years", "was repaired after a long storm",
                      "stayed open late during the summer", "appeared in several old paintings",
                      "was busy on most weekends", "was covered in fog each morning",
                      "needed fresh paint by the end of autumn", "became a popular meeting place",
                      "was mentioned in a travel guide", "looked different after the rain",
                      "was lit by lanterns at night", "attracted walkers and cyclists",
                      "was described as peaceful by many travellers")
_FILLER_TAILS = ("", " according to local records", " despite the long winter",
                 " for reasons nobody recorded", " as the seasons turned",
                 " in the years that followed", " without much attention",
                 " during the early spring")


def filler_sentence(rng: random.Random) -> str:
    """One sentence about no one: no names, pronouns, digits or pool words."""
    return (f"{rng.choice(_FILLER_SUBJECTS)} {rng.choice(_FILLER_PREDICATES)}"
            f"{rng.choice(_FILLER_TAILS)}.")


@dataclass(frozen=True)
class Attribute:
    """One kind of fact about a person. Templates use {Subj} (name or She/He), {subj}
    (name or she/he), {Poss} (name's or Her/His), {value}, {a} (the value's article),
    {animal}, {a_animal}; questions use {who} (a name or a description) and {animal}."""

    key: str
    pool: tuple[str, ...]
    statements: tuple[str, ...]
    question: str          # asks for the value, about {who}
    who: str               # asks for the person who has {value}
    description: str       # "the person who ..." identifies the person by {value}


ATTRIBUTES = (
    Attribute("city", CITIES,
              ("{Subj} lives in {value}.", "{Subj} moved to {value} some years ago."),
              "In which city does {who} live?", "Who lives in {value}?",
              "the person who lives in {value}"),
    Attribute("occupation", OCCUPATIONS,
              ("{Subj} works as {a} {value}.", "By trade, {subj} is {a} {value}."),
              "What is the occupation of {who}?", "Who works as {a} {value}?",
              "the person who works as {a} {value}"),
    Attribute("pet", PET_NAMES,
              ("{Poss} {animal} is called {value}.", "{Subj} owns {a_animal} named {value}."),
              "What is the name of the {animal} owned by {who}?",
              "Whose {animal} is called {value}?",
              "the person whose {animal} is called {value}"),
    Attribute("instrument", INSTRUMENTS,
              ("{Subj} plays the {value}.", "In the evenings, {subj} practises the {value}."),
              "Which instrument does {who} play?", "Who plays the {value}?",
              "the person who plays the {value}"),
    Attribute("house_number", HOUSE_NUMBERS,
              ("{Poss} house number is {value}.", "{Subj} lives at house number {value}."),
              "What is the house number of {who}?", "Whose house number is {value}?",
              "the person whose house number is {value}"),
    Attribute("birth_year", BIRTH_YEARS,
              ("{Subj} was born in {value}.", "{Subj} was born in the year {value}."),
              "In which year was {who} born?", "Who was born in {value}?",
              "the person born in {value}"),
    Attribute("colour", COLOURS,
              ("{Poss} favourite colour is {value}.", "{Subj} likes the colour {value} best."),
              "What is the favourite colour of {who}?", "Whose favourite colour is {value}?",
              "the person whose favourite colour is {value}"),
)
_BY_KEY = {attr.key: attr for attr in ATTRIBUTES}


def _article(word: str) -> str:
    return "an" if word[0].lower() in "aeiou" else "a"


@dataclass
class _Person:
    first: str
    last: str
    female: bool
    animal: str
    values: dict[str, str]      # attribute key -> value, in the order they were drawn

    @property
    def name(self) -> str:
        return f"{self.first} {self.last}"


class _Draw:
    """Draws people and values for one item; every name and value is used at most once."""

    def __init__(self, rng: random.Random):
        self.rng = rng
        self.used: dict[tuple[str, ...], set[str]] = {}
        self.people: list[_Person] = []     # everyone drawn, in order

    def _take(self, pool: tuple[str, ...]) -> str:
        used = self.used.setdefault(pool, set())
        if len(used) == len(pool):
            raise InvalidArgumentError("too many people or facts for one item: lower docs_per_item")
        while True:   # pools are much larger than what one item uses: few retries
            value = self.rng.choice(pool)
            if value not in used:
                used.add(value)
                return value

    def _left(self, pool: tuple[str, ...]) -> int:
        return len(pool) - len(self.used.get(pool, ()))

    def person(self) -> _Person:
        female = self.rng.random() < 0.5
        first = self._take(FEMALE_NAMES if female else MALE_NAMES)
        person = _Person(first, self._take(SURNAMES), female, self.rng.choice(ANIMALS), {})
        self.people.append(person)
        return person

    def give(self, person: _Person, key: str) -> None:
        """Give `person` a value for attribute `key`."""
        person.values[key] = self._take(_BY_KEY[key].pool)

    def facts(self, person: _Person, count: int) -> list[str]:
        """Give `person` values for `count` attributes it has none for yet; their keys."""
        keys = [a.key for a in ATTRIBUTES if a.key not in person.values and self._left(a.pool)]
        if len(keys) < count:
            raise InvalidArgumentError("value pools exhausted: lower docs_per_item")
        chosen = self.rng.sample(keys, count)
        for key in chosen:
            self.give(person, key)
        return chosen


def _statement(rng: random.Random, person: _Person, key: str, pronoun: bool = False) -> str:
    return _render(rng.choice(_BY_KEY[key].statements), person, key, pronoun)


def _render(template: str, person: _Person, key: str, pronoun: bool = False) -> str:
    value = person.values[key]
    if pronoun:
        subj, poss = ("she", "her") if person.female else ("he", "his")
    else:
        subj = person.name
        poss = f"{person.name}'s"
    sentence = template.format(Subj=subj.capitalize() if pronoun else subj, subj=subj,
                               Poss=poss.capitalize() if pronoun else poss, value=value,
                               a=_article(value), animal=person.animal,
                               a_animal=f"{_article(person.animal)} {person.animal}")
    return sentence[0].upper() + sentence[1:]


def _question(person_or_desc: str, person: _Person, key: str) -> str:
    return _BY_KEY[key].question.format(who=person_or_desc, animal=person.animal)


def _description(person: _Person, key: str) -> str:
    value = person.values[key]
    return _BY_KEY[key].description.format(value=value, a=_article(value), animal=person.animal)


def _document(rng: random.Random, facts: Sequence[str], words: int,
              first: str | None = None) -> str:
    """`facts` at random places among filler sentences, at least `words` words long;
    `first` (if given) opens the document."""
    sentences: list[str] = []
    count = sum(len(s.split()) for s in facts) + (len(first.split()) if first else 0)
    while count < words:
        sentence = filler_sentence(rng)
        sentences.append(sentence)
        count += len(sentence.split())
    for fact in facts:
        sentences.insert(rng.randint(0, len(sentences)), fact)
    if first:
        sentences.insert(0, first)
    return " ".join(sentences)


def _people_document(rng: random.Random, draw: _Draw, words: int) -> tuple[str, list[_Person]]:
    """A document about one or two people, each with two or three named facts."""
    people = [draw.person() for _ in range(rng.randint(1, 2))]
    facts = [_statement(rng, p, key) for p in people for key in draw.facts(p, rng.randint(2, 3))]
    return _document(rng, facts, words), people


# --- the kinds: each returns (texts, question, answer, answer_docs, checks) -------------
# A text is a document's text, or (head, argument, tail): a document whose `argument` is
# passed per request into a parameter slot between `head` and `tail`.

_Text = "str | tuple[str, str, str]"
_Built = tuple[list, str, str, tuple[int, ...], list[tuple[str, tuple[int, ...]]]]


def _single(rng: random.Random, draw: _Draw, n_docs: int, words: int) -> _Built:
    docs = [_people_document(rng, draw, words) for _ in range(n_docs)]
    target = rng.randrange(n_docs)
    person = rng.choice(docs[target][1])
    key = rng.choice(list(person.values))
    if rng.random() < 0.25:   # "Who lives in Velmora?": the answer is a name
        attr = _BY_KEY[key]
        value = person.values[key]
        question = attr.who.format(value=value, a=_article(value), animal=person.animal)
        answer = person.name
    else:
        question = _question(person.name, person, key)
        answer = person.values[key]
    return [text for text, _ in docs], question, answer, (target,), []


def _cross(rng: random.Random, draw: _Draw, n_docs: int, words: int) -> _Built:
    if n_docs < 2:
        raise InvalidArgumentError("a cross item needs docs_per_item >= 2")
    key_doc, answer_doc = rng.sample(range(n_docs), 2)
    person = draw.person()
    key, asked = draw.facts(person, 2)
    a_keys = [key] + draw.facts(person, rng.randint(0, 1))
    b_keys = [asked] + draw.facts(person, rng.randint(0, 1))
    texts = []
    for i in range(n_docs):
        if i in (key_doc, answer_doc):
            keys = a_keys if i == key_doc else b_keys
            facts = [_statement(rng, person, k) for k in keys]
            if rng.random() < 0.5:    # a second person in the same document
                other = draw.person()
                facts += [_statement(rng, other, k) for k in draw.facts(other, 2)]
            texts.append(_document(rng, facts, words))
        else:
            texts.append(_people_document(rng, draw, words)[0])
    question = _question(_description(person, key), person, asked)
    checks = [(person.values[key], (key_doc,)), (person.name, (key_doc, answer_doc))]
    return texts, question, person.values[asked], (key_doc, answer_doc), checks


def _dependent(rng: random.Random, draw: _Draw, n_docs: int, words: int) -> _Built:
    if n_docs < 2:
        raise InvalidArgumentError("a dependent item needs docs_per_item >= 2")
    intro = rng.randrange(n_docs - 1)
    person = draw.person()
    a_keys = draw.facts(person, rng.randint(1, 2))
    b_keys = draw.facts(person, rng.randint(1, 2))
    asked = rng.choice(b_keys)
    texts = []
    for i in range(n_docs):
        if i == intro:
            texts.append(_document(rng, [_statement(rng, person, k) for k in a_keys], words))
        elif i == intro + 1:     # continues the previous document by pronoun only
            lead, *rest = [_statement(rng, person, k, pronoun=True) for k in b_keys]
            texts.append(_document(rng, rest, words, first=lead))
        else:
            texts.append(_people_document(rng, draw, words)[0])
    checks = [(person.name, (intro,))]
    return texts, _question(person.name, person, asked), person.values[asked], \
        (intro, intro + 1), checks


def _needle(rng: random.Random, draw: _Draw, n_docs: int, words: int) -> _Built:
    target = rng.randrange(n_docs)
    person = draw.person()
    (key,) = draw.facts(person, 1)
    texts = [_document(rng, [_statement(rng, person, key)] if i == target else [], words)
             for i in range(n_docs)]
    return texts, _question(person.name, person, key), person.values[key], (target,), []


SAME_SHAPE_KEYS = ("occupation", "city")     # the facts every same-shape document states


def _same_shape(rng: random.Random, draw: _Draw, n_docs: int, words: int) -> _Built:
    if n_docs < 2:
        raise InvalidArgumentError("a same-shape item needs docs_per_item >= 2")
    templates = [rng.choice(_BY_KEY[key].statements) for key in SAME_SHAPE_KEYS]
    facts_words = sum(len(t.split()) for t in templates) + 2 * len(templates)
    filler: list[str] = []
    while facts_words + sum(len(f.split()) for f in filler) < words:
        filler.append(filler_sentence(rng))
    slots = sorted(rng.randint(0, len(filler)) for _ in templates)   # the same in every doc
    people = [draw.person() for _ in range(n_docs)]
    texts = []
    for person in people:
        sentences = list(filler)
        for key in SAME_SHAPE_KEYS:
            draw.give(person, key)
        for shift, (slot, template, key) in enumerate(zip(slots, templates, SAME_SHAPE_KEYS)):
            sentences.insert(slot + shift, _render(template, person, key))
        texts.append(" ".join(sentences))
    target = rng.randrange(n_docs)
    person = people[target]
    key = rng.choice(SAME_SHAPE_KEYS)
    checks = [(person.name, (target,))]
    return texts, _question(person.name, person, key), person.values[key], (target,), checks


def _argument(rng: random.Random, draw: _Draw, n_docs: int, words: int) -> _Built:
    """Profiles whose subject is an argument: "Profile of <param who/>. She works as ...".
    The facts name no one (pronouns only), so only the argument ties them to a name: what
    a module's tokens after its parameter miss when encoded against placeholders."""
    people = [draw.person() for _ in range(n_docs)]
    texts = []
    for person in people:
        facts = [_statement(rng, person, key, pronoun=True)
                 for key in draw.facts(person, rng.randint(2, 3))]
        texts.append(("Profile of ", person.name, ". " + _document(rng, facts, words)))
    target = rng.randrange(n_docs)
    person = people[target]
    key = rng.choice(list(person.values))
    checks = [(person.name, (target,))]
    return texts, _question(person.name, person, key), person.values[key], (target,), checks


_BUILDERS: dict[str, Callable[[random.Random, _Draw, int, int], _Built]] = {
    "single": _single, "cross": _cross, "dependent": _dependent, "needle": _needle,
    "same-shape": _same_shape, "argument": _argument}
