"""Study (not a test): what a 16-bit KV store costs in answers.

    python tests/studies/kv_rounding.py

12 texts of the `bench accuracy` kinds (seed 31, 2 per kind, up to 1,200 tokens): the
default model encodes each text but its last 64 tokens, the past's keys and values are
rounded to float16 or bfloat16 (what a 16-bit store holds), and the last 64 tokens are
computed over it; the next-token distributions' KL divergence from the float32 past's,
and how often the top token is the same. docs/BENCHMARKS.md (session 17) has a run.
"""
import torch, promptlang
from promptlang.runtime.model import Past
from promptlang.bench import qa
torch.set_num_threads(2)
llm = promptlang.load()
ad = llm.adapter
texts = []
for kind in qa.KINDS:
    for item in qa.generate(2, seed=31, kind=kind):
        texts.append(" ".join(d.text for d in item.documents) + " " + item.question)
kl = {"float16": [], "bfloat16": []}
same = {"float16": 0, "bfloat16": 0}
n = 0
for text in texts:
    ids = torch.tensor(llm.tokenizer.encode(text)[:1200])
    split = len(ids) - 64
    keys, values = ad.empty_kv(len(ids))
    ad.forward(ids[:split], torch.arange(split), Past(keys, values, torch.arange(0)), None, None)
    pk, pv = keys[:, :, :split].clone(), values[:, :, :split].clone()
    outs = {}
    for name, dt in (("float32", None), ("float16", torch.float16), ("bfloat16", torch.bfloat16)):
        k2, v2 = ad.empty_kv(len(ids))
        k2[:, :, :split] = pk if dt is None else pk.to(dt).float()
        v2[:, :, :split] = pv if dt is None else pv.to(dt).float()
        step = ad.forward(ids[split:], torch.arange(split, len(ids)), Past(k2, v2, torch.arange(split)), None, torch.arange(64))
        outs[name] = torch.log_softmax(step.logits.double(), -1)
    for name in kl:
        p = outs["float32"]
        kl[name].append(float((p.exp() * (p - outs[name])).sum(-1).mean()))
        same[name] += int((p.argmax(-1) == outs[name].argmax(-1)).sum())
    n += 64
for name in kl:
    print(name, "KL mean", f"{sum(kl[name]) / len(kl[name]):.2e}", "same top", f"{100 * same[name] / n:.2f}%", "texts", len(kl[name]), "positions", n)
