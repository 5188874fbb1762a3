"""Study (not a test): where a cold encode of one long module spends its time, by PyTorch op.

    python tests/studies/bf16_pass_profile.py [WORDS] [float32|bfloat16]

Loads the default model with `compute=` the given side, encodes a module of about WORDS
words (its text new each time: nothing cached) under `exact` twice untimed and timed, then once
under torch.profiler, and prints the ops by self CPU time.
"""
import sys, time, torch
from torch.profiler import profile, ProfilerActivity
from promptlang.runtime import engine
from promptlang.pml import nodes

n_words = int(sys.argv[1]) if len(sys.argv) > 1 else 2400
side = sys.argv[2] if len(sys.argv) > 2 else "bfloat16"
llm = engine.load(None, compute=side, exact_reuse=False, seam_adapter=False)
words = " ".join(f"word{i % 97} item{i % 13}." for i in range(n_words // 3))
def run(tag):
    fresh = f"{tag} {time.time_ns()}"          # never cached, in any earlier run either
    schema = nodes.Schema(f"p{tag}", (nodes.RoleOpen("user"),
                                      nodes.Module("doc", (nodes.Text(f"{fresh} " + words),)),))
    llm.add_schema(schema)
    prompt = nodes.PromptDoc(f"p{tag}", (nodes.ModuleRef("doc"), nodes.Text("Summary?"), nodes.RoleClose("user")))
    t = time.perf_counter()
    out = llm.prefill(prompt, recompute="exact", all_logits=False)
    dt = time.perf_counter() - t
    llm.remove_schema(f"p{tag}")
    return dt, len(out.token_ids)
print("warm", run("w0"))
print("timed", run("w1"))
with profile(activities=[ProfilerActivity.CPU]) as prof:
    print("profiled", run("w2"))
print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))
