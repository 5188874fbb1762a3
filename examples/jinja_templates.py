"""Jinja2 prompt templates served from cached modules: RAG, a chat assistant, a tool agent.

    python examples/jinja_templates.py [--fast]

The three templates in examples/jinja/ are compiled with `from_template`, statically:
each retrieved document, each system-text variant and each tool description becomes a
module, encoded once. Each request here takes a combination no earlier request took
(4 of 8 documents, a persona with a safety policy, 2 of 3 tools) under the default
`exact` policy: its answer is the plain prompt's, the full prefill of the same tokens
(the documents a request leaves out leave gaps in the schema's positions; `exact` numbers
everything after the first gap contiguously and computes it again). The baseline computes
the same tokens with no reuse at all.
"""

from __future__ import annotations

import json
from pathlib import Path

from _shared import fast_mode, model, report_ttft

from promptlang import from_template

HERE = Path(__file__).resolve().parent / "jinja"


def templates():
    """The three examples compiled: (name, TemplatePrompt, the call's variables)."""
    corpus = json.loads((HERE / "documents.json").read_text())
    rag = from_template(HERE / "rag.j2", documents={"docs": corpus})
    chat = from_template(HERE / "chat.j2")
    tools = from_template(HERE / "tools.j2")
    return [
        ("rag", rag, {"docs": [corpus[i] for i in (6, 2, 0, 5)],
                      "question": "How often do most coasts see high tide?"}),
        ("chat", chat, {"assistant_name": "Ada", "persona": "teacher", "safe_mode": True,
                        "language": "English",
                        "history": [{"role": "user", "content": "Hi!"},
                                    {"role": "assistant", "content": "Hello! How can I help?"}],
                        "message": "What is a prime number?"}),
        ("tools", tools, {"tools": ["weather", "search"],
                          "request": "Will it rain in Lisbon tomorrow?"}),
    ]


def main(llm=None, fast: bool | None = None) -> dict:
    fast = fast_mode(fast)
    llm = model(llm)
    max_tokens = 6 if fast else 60
    results = {}
    for name, template, variables in templates():
        prompt = template(variables)
        llm.encode(prompt.schema)                  # every module, once
        cached = llm.generate(prompt, max_new_tokens=max_tokens)
        baseline = llm.generate(prompt, max_new_tokens=max_tokens, baseline=True)
        print(f"[{name}] {cached.text.strip()!r}")
        report_ttft(cached.timings.first_token, baseline.timings.first_token)
        results[name] = {
            "answer": cached.text, "baseline_answer": baseline.text,
            "answer_ids": list(cached.token_ids), "bound": llm.bind(prompt),
            "cached_tokens": cached.cached_tokens, "prefill_tokens": cached.prefill_tokens,
            "baseline_prefill_tokens": baseline.prefill_tokens,
            "modules": [m[-1] for m in llm.bind(prompt).modules if m],
            "rendered": prompt.render(llm.tokenizer), "variables": prompt.arguments,
        }
    return results


if __name__ == "__main__":
    main()
