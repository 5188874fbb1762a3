"""The synthetic QA generator: determinism, answer placement, scoring, and its PML."""

import json
import os
import re
import subprocess
import sys

import pytest

from promptlang.pml import nodes as n
from promptlang.pml.binding import bind
from promptlang.pml.layout import lay_out
from promptlang.bench import qa
from promptlang.tokenizer import WordTokenizer

ANY_NAME = re.compile(r"\b(?:%s)\b" % "|".join(qa.FEMALE_NAMES + qa.MALE_NAMES + qa.SURNAMES))


def words_in(text, phrase):
    return re.search(r"(?<!\w)" + re.escape(phrase) + r"(?!\w)", text, re.I) is not None


def dump(items):
    return json.dumps([item.to_dict() for item in items])


@pytest.fixture(scope="module")
def items_by_kind():
    return {kind: qa.generate(25, seed=11, kind=kind, docs_per_item=4) for kind in qa.KINDS}


# --- determinism ------------------------------------------------------------------------

def test_same_seed_gives_same_items_and_another_seed_does_not():
    first = qa.generate(8, seed=5, kind="mixed")
    assert first == qa.generate(8, seed=5, kind="mixed")
    assert dump(first) != dump(qa.generate(8, seed=6, kind="mixed"))


def test_item_does_not_depend_on_how_many_items_are_generated():
    assert qa.generate(3, seed=9, kind="mixed") == qa.generate(7, seed=9, kind="mixed")[:3]


def test_another_process_with_another_hash_seed_generates_the_same_items():
    code = ("import json; from promptlang.bench import qa; "
            "print(json.dumps([i.to_dict() for i in qa.generate(6, seed=4, kind='mixed')]))")
    env = dict(os.environ, PYTHONHASHSEED="12345")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                         text=True, check=True).stdout
    assert out.strip() == dump(qa.generate(6, seed=4, kind="mixed"))


def test_items_survive_a_dict_round_trip():
    items = qa.generate(4, seed=1, kind="mixed")
    assert [qa.QAItem.from_dict(json.loads(json.dumps(i.to_dict()))) for i in items] == items


# --- what each item promises ----------------------------------------------------------

def test_mixed_produces_every_kind_and_a_kind_produces_only_itself(items_by_kind):
    assert {item.kind for item in qa.generate(8, seed=0, kind="mixed")} == set(qa.KINDS)
    for kind, items in items_by_kind.items():
        assert {item.kind for item in items} == {kind}


def test_answer_is_in_its_answer_document_and_in_no_distractor(items_by_kind):
    for items in items_by_kind.values():
        for item in items:
            assert words_in(item.documents[item.answer_docs[-1]].text, item.answer), item.id
            assert item.distractors, item.id
            for i in item.distractors:
                assert not words_in(item.documents[i].text, item.answer), (item.id, i)
            assert not words_in(item.question, item.answer), item.id


def test_answers_are_one_or_two_words(items_by_kind):
    for items in items_by_kind.values():
        for item in items:
            assert 1 <= len(item.answer.split()) <= 2, item.answer


PERSON = re.compile(r"\b(?:%s) (?:%s)\b" % ("|".join(qa.FEMALE_NAMES + qa.MALE_NAMES),
                                             "|".join(qa.SURNAMES)))


def people(text):
    return set(PERSON.findall(text))


def test_dependent_second_document_follows_the_first_and_names_nobody(items_by_kind):
    for item in items_by_kind["dependent"]:
        intro, follow = item.answer_docs
        assert follow == intro + 1
        text = item.documents[follow].text
        first_sentence = text.split(".")[0]
        assert re.search(r"\b(she|he|her|his)\b", first_sentence, re.I), first_sentence
        assert not ANY_NAME.search(text), item.id
        # the asked person is named in the first document and in no other
        (asked,) = people(item.question)
        assert [i for i, d in enumerate(item.documents) if asked in people(d.text)] == [intro]


def test_cross_documents_share_exactly_one_person_found_nowhere_else(items_by_kind):
    for item in items_by_kind["cross"]:
        key_doc, answer_doc = item.answer_docs
        (shared,) = people(item.documents[key_doc].text) & people(item.documents[answer_doc].text)
        assert not any(shared in people(item.documents[i].text) for i in item.distractors)
        assert not words_in(item.documents[key_doc].text, item.answer)
        assert not people(item.question)        # the question never names the person


def test_needle_distractors_are_pure_filler(items_by_kind):
    for item in items_by_kind["needle"]:
        for i in item.distractors:
            text = item.documents[i].text
            assert not re.search(r"\d", text)
            assert not ANY_NAME.search(text)


def test_doc_words_sets_the_length_of_filler_documents():
    for words in (50, 400):
        item = qa.generate(1, seed=3, kind="needle", docs_per_item=3, doc_words=words)[0]
        for i in item.distractors:
            count = len(item.documents[i].text.split())
            assert words <= count < words + 20


def test_value_pools_names_and_filler_share_no_word():
    pools = {attr.key: attr.pool for attr in qa.ATTRIBUTES}
    pools.update(female=qa.FEMALE_NAMES, male=qa.MALE_NAMES, surnames=qa.SURNAMES,
                 animals=qa.ANIMALS)
    filler = " ".join(qa._FILLER_SUBJECTS + qa._FILLER_PREDICATES + qa._FILLER_TAILS)
    pools["filler"] = tuple(set(filler.lower().split()))
    seen = {}
    for name, pool in pools.items():
        assert len(set(pool)) == len(pool), name
        for word in {w.lower() for value in pool for w in value.split()}:
            assert seen.setdefault(word, name) == name, (word, seen[word], name)


def test_generate_rejects_impossible_requests():
    with pytest.raises(ValueError, match="unknown kind"):
        qa.generate(1, kind="trivia")
    with pytest.raises(ValueError, match="docs_per_item"):
        qa.generate(1, kind="cross", docs_per_item=1)
    with pytest.raises(ValueError, match="docs_per_item"):
        qa.generate(1, kind="single", docs_per_item=60)


# --- scoring ----------------------------------------------------------------------------

@pytest.mark.parametrize("prediction, answer, expected", [
    ("Velmora", "Velmora", True),
    ("  velmora. \n", "Velmora", True),
    ("VELMORA", "velmora", True),
    ("Velmora, a small town.", "Velmora", True),
    ("«Velmora»", "Velmora", True),
    ("a pilot.", "pilot", True),
    ("The oboe", "oboe", True),
    ("Ilsa Varnell lives there", "Ilsa Varnell", True),
    ("417!", "417", True),
    ("Ilsa", "Ilsa Varnell", False),
    ("It is Velmora", "Velmora", False),
    ("Velmoras", "Velmora", False),
    ("4170", "417", False),
    ("", "Velmora", False),
    ("anything", "", False),
])
def test_exact_match(prediction, answer, expected):
    assert qa.exact_match(prediction, answer) is expected


# --- PML --------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def items():
    return qa.generate(3, seed=7, kind="mixed", docs_per_item=3)


def test_modules_mode_schema_and_prompt_structure(items):
    item = items[0]
    schema, prompt = qa.to_pml(item, "qa")
    assert schema.name == "qa" and prompt.schema == "qa"
    assert schema.children[:4] == (n.RoleOpen("system"), n.Text(qa.SYSTEM_PROMPT),
                                   n.RoleClose("system"), n.RoleOpen("user"))
    modules = [c for c in schema.children if isinstance(c, n.Module)]
    assert [m.name for m in modules] == [d.name for d in item.documents]
    assert [m.children for m in modules] == [(n.Text(d.text + "\n\n"),) for d in item.documents]
    refs = [c for c in prompt.children if isinstance(c, n.ModuleRef)]
    assert [r.name for r in refs] == [d.name for d in item.documents]
    assert prompt.children[-2:] == (n.RoleClose("user"), n.RoleOpen("assistant"))
    texts = [c.text for c in prompt.children if isinstance(c, n.Text)]
    assert any(item.question in t for t in texts)


def test_scaffold_mode_puts_the_documents_in_one_scaffold(items):
    item = items[1]
    schema, prompt = qa.to_pml(item, "qa", mode="scaffold")
    (scaffold,) = [c for c in schema.children if isinstance(c, n.Scaffold)]
    assert [m.name for m in scaffold.members] == [d.name for d in item.documents]
    assert prompt.children[0] == n.ScaffoldRef(scaffold.name)


def test_unions_mode_makes_one_union_per_document_slot(items):
    schema = qa.build_schema(items, "qa", mode="unions")
    unions = [c for c in schema.children if isinstance(c, n.Union)]
    assert len(unions) == 3
    for j, union in enumerate(unions):
        assert [m.name for m in union.members] == [item.documents[j].name for item in items]


@pytest.mark.parametrize("mode", ["modules", "unions", "scaffold"])
@pytest.mark.parametrize("docs_role", ["user", "system"])
def test_prompt_binds_and_renders_only_its_own_documents_in_order(items, mode, docs_role):
    tok = WordTokenizer(max_positions=None)
    layout = lay_out(qa.build_schema(items, "qa", mode, docs_role), tok)
    item = items[1]
    bound = bind(qa.build_prompt(item, "qa", mode, docs_role), layout, tok)
    text = bound.render()
    starts = [text.index(doc.text) for doc in item.documents]
    assert starts == sorted(starts)
    assert text.index(item.question) > starts[-1]
    assert text.endswith("[assistant]")
    for other in (items[0], items[2]):
        assert not any(doc.text in text for doc in other.documents)


@pytest.mark.parametrize("mode", ["modules", "unions", "scaffold"])
@pytest.mark.parametrize("docs_role", ["user", "system"])
def test_schema_and_prompt_survive_write_then_parse(items, mode, docs_role):
    writer = pytest.importorskip("promptlang.pml.writer")
    parser = pytest.importorskip("promptlang.pml.parser")
    schema = qa.build_schema(items, "qa", mode, docs_role)
    prompt = qa.build_prompt(items[2], "qa", mode, docs_role)
    assert parser.parse_schema(writer.write(schema)) == schema
    assert parser.parse_prompt(writer.write(prompt)) == prompt


def test_bench_modules_that_run_no_model_import_without_torch():
    code = ("import sys; import promptlang.bench.qa, promptlang.bench.memory, "
            "promptlang.bench.report, promptlang.bench.accuracy, "
            "promptlang.bench.run, promptlang.bench.settings, promptlang.cli.bench; "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout
    assert out.strip() == "False"


# --- distractor answers and the answer-in-output rule -------------------------------------

@pytest.mark.parametrize("text, right, wrong", [
    ("Velmora", True, False),
    ("She lives in Velmora.", True, False),
    ("Velmora; Brastow is another town.", True, False),    # a distractor after the gold
    ("Brastow, not Velmora.", False, True),                # a distractor first
    ("Brastow", False, True),                              # a distractor instead
    ("Brastowe and Velmora", True, False),                 # not a whole-word distractor
    ("somewhere else", False, False),
    ("", False, False),
])
def test_answer_counts_only_when_no_distractor_comes_first(text, right, wrong):
    assert qa.answer_in_output(text, "Velmora", ("Brastow", "Quenhall")) is right
    assert qa.distracted(text, "Velmora", ("Brastow", "Quenhall")) is wrong


def test_without_distractors_the_rule_is_a_whole_word_mention():
    assert qa.answer_in_output("It is Velmora.", "Velmora")
    assert not qa.answer_in_output("Velmoras", "Velmora")
    assert qa.first_mention("a pilot, the pilot", "pilot") == 2
    assert qa.first_distractor("x Brastow y Quenhall", ("Quenhall", "Brastow")) == 2


def test_distractor_answers_are_other_peoples_values_for_the_asked_attribute(items_by_kind):
    for kind, items in items_by_kind.items():
        for item in items:
            assert item.answer not in item.distractor_answers
            assert len(set(item.distractor_answers)) == len(item.distractor_answers)
            for other in item.distractor_answers:      # each stated in some document
                assert any(words_in(d.text, other) for d in item.documents), (item.id, other)
            if kind == "needle":                       # one person per item
                assert item.distractor_answers == ()
    single = [i for i in items_by_kind["single"] if i.answer.count(" ") == 1 and
              PERSON.fullmatch(i.answer)]              # "Who ...?" items: names
    assert single and all(PERSON.fullmatch(d) for i in single for d in i.distractor_answers)


# --- same-shape -------------------------------------------------------------------------

def test_same_shape_documents_share_one_template_and_differ_in_person_job_and_town():
    for item in qa.generate(10, seed=8, kind="same-shape", docs_per_item=4):
        assert len(item.documents) == 4 and item.answer_docs != ()
        named = [people(d.text) for d in item.documents]
        assert all(len(p) == 1 for p in named)
        everyone = [next(iter(p)) for p in named]
        assert len(set(everyone)) == 4                       # distinct people
        jobs = [[w for w in qa.OCCUPATIONS if words_in(d.text, w)] for d in item.documents]
        towns = [[c for c in qa.CITIES if words_in(d.text, c)] for d in item.documents]
        assert all(len(j) == 1 for j in jobs) and all(len(t) == 1 for t in towns)
        assert len({j[0] for j in jobs}) == 4 and len({t[0] for t in towns}) == 4
        # one shape: masking the name, the job (and its article) and the town leaves the
        # same text
        masked = {d.text.replace(who, "P").replace(job[0], "J").replace(town[0], "T")
                  .replace(" an J", " a J")
                  for d, who, job, town in zip(item.documents, everyone, jobs, towns)}
        assert len(masked) == 1
        # the question names the answer document's person; distractors: the others' values
        (target,) = item.answer_docs
        assert people(item.question) == named[target]
        asked = jobs if item.answer in qa.OCCUPATIONS else towns
        assert item.answer == asked[target][0]
        assert set(item.distractor_answers) == {a[0] for i, a in enumerate(asked) if i != target}


def test_same_shape_is_deterministic_asks_both_attributes_and_needs_two_documents():
    items = qa.generate(12, seed=4, kind="same-shape")
    assert items == qa.generate(12, seed=4, kind="same-shape")
    assert dump(items) != dump(qa.generate(12, seed=5, kind="same-shape"))
    assert {i.answer in qa.OCCUPATIONS for i in items} == {True, False}
    with pytest.raises(ValueError, match="docs_per_item"):
        qa.generate(1, kind="same-shape", docs_per_item=1)


@pytest.mark.parametrize("mode", ["modules", "unions", "scaffold"])
def test_argument_items_pass_each_profiles_name_as_an_argument_the_cached_text_lacks(mode):
    """"argument" items: the subject of each profile is an argument in a parameter slot,
    the facts use pronouns, so the cached text names no one; the request renders the
    documents as the baseline sees them."""
    items = qa.generate(4, seed=3, kind="argument", docs_per_item=3)
    tok = WordTokenizer(max_positions=None)
    schema = qa.build_schema(items, "qa", mode)
    layout = lay_out(schema, tok)
    for item in items:
        people = [doc.argument for doc in item.documents]
        assert all(people) and len(set(people)) == len(people)
        assert people[item.answer_docs[-1]] in item.question
        for doc in item.documents:
            head, argument, tail = doc.parts()
            assert head + argument + tail == doc.text and argument == doc.argument
            assert not ANY_NAME.search(head + tail)         # only the argument names anyone
        bound = bind(qa.build_prompt(item, "qa", mode), layout, tok)
        text = bound.render()
        assert all(doc.text in text for doc in item.documents)
        arguments = [seg for seg in bound.uncached if seg.kind == "argument"]
        # the space before a parameter is tokenized with the argument
        assert [seg.text.removeprefix(" ") for seg in arguments] == people
    params = [c for m in qa.build_schema(items[:1], "qa").children if isinstance(m, n.Module)
              for c in m.children if isinstance(c, n.Param)]
    assert [(p.name, p.length) for p in params] == [(qa.ARGUMENT_PARAM, qa.ARGUMENT_TOKENS)] * 3
