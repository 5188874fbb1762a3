"""Study (not a test): do text runs tokenized apart change the answer?

    python tests/studies/boundary_tokens.py OUT.json

promptlang tokenizes each text run of a prompt on its own (a module's text, an argument, the
text between them). The examples/jinja templates, over every 4-of-8 document combination of
rag.j2, 12 variants of chat.j2 and 6 of tools.j2: promptlang's token ids against the whole
rendered text (the same characters) tokenized at once, and the unmodified transformers
model's greedy answers (32 tokens) and first-token distributions from each. The default
model; no cache is involved (both sides are full passes of the same model). Run from the
repository root.
"""

from __future__ import annotations

import itertools
import json
import sys
import time
from pathlib import Path

import torch

import promptlang
from promptlang import from_template
from promptlang.runtime.model.loading import load_hf_model

HERE = Path("examples/jinja")
NEW_TOKENS = 32


def items(corpus: list[dict]) -> list[tuple[str, object, dict]]:
    rag = from_template(HERE / "rag.j2", documents={"docs": corpus})
    chat = from_template(HERE / "chat.j2")
    tools = from_template(HERE / "tools.j2")
    found = []
    for combo in itertools.combinations(range(8), 4):
        found.append(("rag", rag, {"docs": [corpus[i] for i in combo],
                                   "question": "How often do most coasts see high tide?"}))
    for persona, safe, name in itertools.product(("teacher", "expert", "friend"), (True, False),
                                                 ("Ada", "Bo")):
        found.append(("chat", chat, {"assistant_name": name, "persona": persona,
                                     "safe_mode": safe, "language": "English", "history": [],
                                     "message": "What is a prime number?"}))
    for pair in itertools.combinations(["weather", "search", "calculator"], 2):
        for request in ("Will it rain in Lisbon tomorrow?", "What is 17 times 23?"):
            found.append(("tools", tools, {"tools": list(pair), "request": request}))
    return found


def greedy(model, ids: list[int]) -> tuple[list[int], torch.Tensor]:
    """The greedy answer and the first token's log-probabilities."""
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False,
                             output_scores=True, return_dict_in_generate=True, pad_token_id=0)
    answer = out.sequences[0, len(ids):].tolist()
    first = torch.log_softmax(out.scores[0][0].float(), -1)
    return answer, first


def main(out_path: str) -> None:
    llm = promptlang.load()
    tokenizer = llm.tokenizer.tokenizer
    model, _ = load_hf_model(None)
    model.eval()
    corpus = json.loads((HERE / "documents.json").read_text())
    rows = []
    started = time.time()
    for kind, template, variables in items(corpus):
        prompt = template(variables)
        ours = llm.bind(prompt).token_ids()
        text = prompt.render(llm.tokenizer)
        whole = tokenizer(text, add_special_tokens=False)["input_ids"]
        assert tokenizer.decode(ours) == text, kind          # the same characters
        answer_ours, first_ours = greedy(model, ours)
        answer_whole, first_whole = greedy(model, whole)
        kl = float((first_whole.exp() * (first_whole - first_ours)).sum())
        rows.append({"kind": kind, "ours_tokens": len(ours), "whole_tokens": len(whole),
                     "same_tokens": ours == whole, "same_answer": answer_ours == answer_whole,
                     "first_token_kl": kl, "same_first": answer_ours[:1] == answer_whole[:1]})
    by_kind: dict[str, list[dict]] = {}
    for row in rows:
        by_kind.setdefault(row["kind"], []).append(row)
    for kind, group in by_kind.items():
        n = len(group)
        ours_mean = sum(r["ours_tokens"] for r in group) / n
        whole_mean = sum(r["whole_tokens"] for r in group) / n
        kls = [r["first_token_kl"] for r in group]
        same_tokens = sum(r["same_tokens"] for r in group)
        same_answer = sum(r["same_answer"] for r in group)
        same_first = sum(r["same_first"] for r in group)
        parts = [f"{n} prompts",
                 f"same tokens {same_tokens}/{n}",
                 f"tokens ours/whole {ours_mean:.1f}/{whole_mean:.1f} (mean)",
                 f"same {NEW_TOKENS}-token greedy answer {same_answer}/{n}",
                 f"same first token {same_first}/{n}",
                 f"first-token KL(whole||ours) mean {sum(kls) / n:.4f}, max {max(kls):.4f}"]
        print(f"{kind}: " + "; ".join(parts))
    print(f"wall {time.time() - started:.0f} s")
    Path(out_path).write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main(sys.argv[1])
