"""The examples/jinja templates token for token: the tokens promptlang binds for a prompt
equal the default model's tokenizer run over the whole text that Jinja2 renders and the
model's own chat template wraps (the oracle: jinja2 and transformers, not promptlang)."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import jinja2
import pytest

from promptlang.compiler.jinja import from_template
from promptlang.pml.binding import bind
from promptlang.pml.layout import lay_out

HERE = Path(__file__).parents[2] / "examples" / "jinja"
CORPUS = json.loads((HERE / "documents.json").read_text())


def rendered_by_jinja2(name: str, variables: dict) -> list[dict]:
    """The chat messages of examples/jinja/NAME.j2 as Jinja2 renders them: each role block
    rendered alone after the template's top level ran (an identity `maxlen` filter)."""
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(str(HERE)))
    env.filters["maxlen"] = lambda value, tokens: value
    template = env.get_template(f"{name}.j2")
    context = template.new_context(dict(variables))
    "".join(template.root_render_func(context))
    return [{"role": role, "content": "".join(template.blocks[role](context))}
            for role in ("system", "user") if role in template.blocks]


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
        text = hf.apply_chat_template(rendered_by_jinja2(name, prompt.arguments),
                                      tokenize=False, add_generation_prompt=True)
        assert bound.render() == text, (name, variables)
        assert bound.token_ids() == hf(text, add_special_tokens=False).input_ids, (
            name, variables)
        counted[name] = counted.get(name, 0) + 1
    assert counted == {"rag": 70, "chat": 25, "tools": 6}
