"""Document question answering, RAG style: a union of documents and a question.

    python examples/document_qa.py [--fast] ["your question"]

The documents are the members of one union in the @prompt function (a `match`, one
case per document), so each is encoded once, at the same position, and whichever is
retrieved is served from the cache. A tiny retriever reads the same documents from the
schema and picks the one that shares the most words with the question. Only the
question and the answer are computed per request.
"""

from __future__ import annotations

import re
import sys

from _shared import fast_mode, model, report_ttft

from promptlang import assistant, gen, prompt, system, user
from promptlang.pml import nodes


@prompt
def answer(document: str, question: str, max_tokens: int):
    """Answers `question` from the retrieved `document`."""
    with system():
        "Answer the question using only the document. Be brief.\n\nDocument:\n"
        match document:
            case "bees":
                """
                Honey bees live in colonies of up to sixty thousand workers, one queen and a
                few hundred drones. Workers are female; they clean the hive, feed larvae, make
                wax and forage for nectar and pollen. A forager tells others where flowers are
                with the waggle dance: the angle of the dance gives the direction relative to
                the sun, its length the distance. Bees turn nectar into honey by adding
                enzymes and fanning it until most of the water evaporates.
                """
            case "volcanoes":
                """
                A volcano forms where magma reaches the surface. Shield volcanoes, like Mauna
                Loa in Hawaii, have gentle slopes built by runny basalt lava. Stratovolcanoes,
                like Mount Fuji, are steep cones of alternating lava and ash layers and erupt
                explosively because their magma is thick and traps gas. Most volcanoes lie
                along plate boundaries, in particular around the Pacific Ring of Fire.
                """
            case "tides":
                """
                Tides are the regular rise and fall of the sea. They are caused mainly by the
                Moon's gravity, which pulls the ocean into two bulges: one facing the Moon and
                one on the opposite side of the Earth. As the Earth turns, most coasts pass
                through both bulges each day, so they see two high tides and two low tides
                about twelve hours and twenty-five minutes apart. Spring tides, the largest,
                happen when the Sun and Moon line up.
                """
            case "bridges":
                """
                The Golden Gate Bridge in San Francisco opened in 1937. It is a suspension
                bridge: its deck hangs from vertical cables attached to two main cables, each
                made of 27,572 wires, that run over two towers 227 metres tall. Its main span
                is 1,280 metres long, the longest in the world until 1964. The colour,
                international orange, was chosen to stand out in fog.
                """
    with user():
        question
    with assistant():
        gen("answer", max_tokens=max_tokens, stop="\n\n")


def documents() -> dict[str, str]:
    """The documents by name, read from the schema: the union members' text."""
    return {path[-1]: "".join(c.text for c in module.children if isinstance(c, nodes.Text))
            for path, module in nodes.iter_modules(answer.schema) if len(path) == 2}


def retrieve(question: str) -> str:
    """The document sharing the most words (of 4+ letters) with the question."""
    def words(text: str) -> set[str]:
        return {w for w in re.findall(r"[a-z]+", text.lower()) if len(w) >= 4}

    asked = words(question)
    corpus = documents()
    return max(corpus, key=lambda name: len(asked & words(corpus[name] + " " + name)))


def main(llm=None, fast: bool | None = None, question: str | None = None) -> dict:
    fast = fast_mode(fast)
    llm = model(llm)
    if question is None:
        args = [a for a in sys.argv[1:] if a != "--fast"] if __name__ == "__main__" else []
        question = args[0] if args else "Why do tides happen twice a day?"
    document = retrieve(question)
    max_tokens = 4 if fast else 80
    llm.encode(answer.schema)                      # every document, once
    with answer.run(llm, document, question, max_tokens) as run:
        with answer.runner(llm, baseline=True)(document, question, max_tokens) as baseline:
            print(f"retrieved: {document}\nQ: {question}\nA: {run['answer'].strip()}")
            report_ttft(run.ttft, baseline.ttft, opening=run.opening,
                        baseline_opening=baseline.opening)
            return {"answer": run["answer"], "document": document,
                    "cached_ttft": run.ttft, "baseline_ttft": baseline.ttft,
                    "cached_tokens": run.opening.cached_tokens,
                    "prefill_tokens": run.opening.prefill_tokens,
                    "baseline_prefill_tokens": baseline.opening.prefill_tokens,
                    "modules": [m[-1] for m in llm.bind(run.prompt).modules if m]}


if __name__ == "__main__":
    main()
