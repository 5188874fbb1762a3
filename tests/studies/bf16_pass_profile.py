"""Study (not a test): where a cold encode of one long module spends its time, by PyTorch op.

    python tests/studies/bf16_pass_profile.py [WORDS] [float32|bfloat16]

Loads the default model with `compute=` the given side, encodes a module of about WORDS
words (its text new each time: nothing cached) under `exact` twice untimed and timed, then
once under torch.profiler, and prints the ops by self CPU time.
"""

from __future__ import annotations

import sys
import time

from torch.profiler import ProfilerActivity, profile

from promptlang.pml import nodes
from promptlang.runtime import engine


def encode_once(llm, words: str, tag: str) -> tuple[float, int]:
    """Seconds to serve a prompt of one new module holding `words`, and its token count."""
    fresh = f"{tag} {time.time_ns()}"          # never cached, in any earlier run either
    name = f"p{tag}"
    module = nodes.Module("doc", (nodes.Text(f"{fresh} " + words),))
    llm.add_schema(nodes.Schema(name, (nodes.RoleOpen("user"), module)))
    prompt = nodes.PromptDoc(name, (nodes.ModuleRef("doc"), nodes.Text("Summary?"),
                                    nodes.RoleClose("user")))
    began = time.perf_counter()
    out = llm.prefill(prompt, recompute="exact", all_logits=False)
    seconds = time.perf_counter() - began
    llm.remove_schema(name)
    return seconds, len(out.token_ids)


def main(n_words: int, side: str) -> None:
    llm = engine.load(None, compute=side, exact_reuse=False, seam_adapter=False)
    words = " ".join(f"word{i % 97} item{i % 13}." for i in range(n_words // 3))
    print("warm", encode_once(llm, words, "w0"))
    print("timed", encode_once(llm, words, "w1"))
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        print("profiled", encode_once(llm, words, "w2"))
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 2400,
         sys.argv[2] if len(sys.argv) > 2 else "bfloat16")
