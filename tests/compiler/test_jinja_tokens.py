"""The examples/jinja templates token for token: the tokens promptlang binds for a prompt
equal the default model's tokenizer run over the whole text that Jinja2 renders and the
model's own chat template wraps (the oracle: jinja2 and transformers, not promptlang)."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest

from promptlang.compiler.jinja import from_template
from promptlang.pml.binding import bind
from promptlang.pml.layout import lay_out
from tests.examples.test_examples import _jinja_messages

HERE = Path(__file__).parents[2] / "examples" / "jinja"
CORPUS = json.loads((HERE / "documents.json").read_text())


def prompts():
    for combo in itertools.combinations(range(8), 4):
        yield "rag", {"docs": [CORPUS[i] for i in combo],
                      "question": "How often do most coasts see high tide?"}
    for persona, safe, name, language in itertools.product(
            ("teacher", "expert", "friend"), (True, False), ("Ada", "Bo"),
            ("English", "French")):
        yield "chat", {"assistant_name": name, "persona": persona, "safe_mode": safe,
                       "language": language, "history": [],
                       "message": "What is a prime number?"}
    yield "chat", {"assistant_name": "Ada", "persona": "friend", "safe_mode": False,
                   "language": "English", "message": "And a prime gap?",
                   "history": [{"role": "user", "content": "Hi.\n\n"},
                               {"role": "assistant", "content": "Hello! Ask away."}]}
    for pair in itertools.combinations(["weather", "search", "calculator"], 2):
        for request in ("Will it rain in Lisbon tomorrow?", "What is 17 times 23?"):
            yield "tools", {"tools": list(pair), "request": request}


@pytest.fixture(scope="module")
def templates():
    return {"rag": from_template(HERE / "rag.j2", documents={"docs": CORPUS}),
            "chat": from_template(HERE / "chat.j2"),
            "tools": from_template(HERE / "tools.j2")}


def test_every_prompt_binds_the_tokens_of_its_whole_rendered_text(templates,
                                                                    default_tokenizer):
    tok = default_tokenizer
    hf = tok.tokenizer
    counted = {}
    for name, variables in prompts():
        template = templates[name]
        prompt = template(variables)
        layout = lay_out(template.schema, tok)
        bound = bind(prompt.doc, layout, tok, add_generation_prompt=True)
        text = hf.apply_chat_template(_jinja_messages(name, prompt.arguments),
                                      tokenize=False, add_generation_prompt=True)
        assert bound.render() == text, (name, variables)
        assert bound.token_ids() == hf(text, add_special_tokens=False).input_ids, (
            name, variables)
        counted[name] = counted.get(name, 0) + 1
    assert counted == {"rag": 70, "chat": 25, "tools": 6}
