"""Study (not a test): which cached tokens, recomputed, bring the answer back?

    python tests/studies/seam_tokens.py --kinds single,dependent,same-shape --items 12 --seed 7

For each `promptlang bench accuracy` item (default model, 4 documents as modules), the gold
answer's teacher-forced log-probability in ONE masked pass of the unmodified model (the
docs/DESIGN.md oracle's rule, tests/runtime/oracle.py, with the gold tokens appended as uncached
tokens): the full prefill (every candidate recomputed), `none`, and recompute sets chosen
by different rules. The `none` pass records the attention weights of the request's own
tokens (question and generation prompt), which rank the candidates:

    last K      the K candidates the last token attends to most, over every layer and head
                (what the runtime's query:K recomputes)
    all K       the same, summed over every question row
    deep K      `all K` from the upper half of the layers only
    first16     EPIC's first 16 candidates of every unit (first:16)
    f16+last32  both; last_eq: `last` with as many tokens as f16+last32 recomputes
    primed      (--primer TEXT) every module but the first encoded after TEXT, at the
                positions just before it (cheap conditioning: the module "knows" it is
                not the first); the request never sees TEXT. primed+lastK: and last K.

Prints each item as JSON and, per kind, the mean log-probability minus the full
prefill's. docs/BENCHMARKS.md, "Which cached tokens matter", has a run.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "runtime"))
import oracle  # noqa: E402  (the docs/DESIGN.md oracle's reference model)

import promptlang  # noqa: E402
from promptlang.bench import qa  # noqa: E402
from promptlang.runtime.recompute.deviation import candidates  # noqa: E402

WEIGHTS: dict[int, torch.Tensor] = {}       # layer -> [heads, rows, keys] of the probe pass


def _probing_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                       **kwargs):
    groups = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1)
    scores = query @ key.transpose(-1, -2) * scaling
    if attention_mask is not None:
        scores = scores + attention_mask
    weights = torch.softmax(scores.float(), dim=-1)
    rows = kwargs.get("probe_rows")
    if rows is not None:
        WEIGHTS[module.layer_idx] = weights[0][:, rows]
    return (weights.to(value.dtype) @ value).transpose(1, 2).contiguous(), None


transformers.AttentionInterface.register("study_probe", _probing_attention)


def occurrences(bound, recomputed: set[int], gold: list[int], primer: list[int] = ()):
    """The oracle's token occurrences and mask (tests/runtime/oracle.py) with the gold
    tokens (but the last) appended after the request as uncached tokens. `primer`: token
    ids every module but the first was encoded after (at the positions just before it,
    seeing the schema's text; a context of the module's encoding only -- the request's
    own tokens never see it)."""
    layout, units = bound.layout, []

    def need(unit):
        if unit not in units:
            for context in layout.units[unit].context:
                need(context)
            units.append(unit)
    for unit in bound.units:
        need(unit)
    uncached = len(units)
    ids, pos, owner, placeholder = [], [], [], []
    for i, unit in enumerate(units):
        for seg in layout.units[unit].segments:
            n = len(seg.token_ids)
            ids += seg.token_ids; pos += range(seg.start, seg.start + n)
            owner += [i] * n; placeholder += [seg.kind == "param"] * n
    tail = [(seg.token_ids, seg.start) for seg in bound.uncached]
    tail.append((gold[:-1], bound.end))
    for tokens, start in tail:
        ids += tokens; pos += range(start, start + len(tokens))
        owner += [uncached] * len(tokens); placeholder += [False] * len(tokens)
    primed = []                      # (module's index, its primer's code)
    if primer:
        starts = {i: min(seg.start for seg in layout.units[unit].segments)
                  for i, unit in enumerate(units) if layout.units[unit].context}
        for i in sorted(starts, key=starts.get)[1:]:
            mark = uncached + 1 + len(primed)
            primed.append((i, mark))
            ids += list(primer); pos += range(starts[i] - len(primer), starts[i])
            owner += [mark] * len(primer); placeholder += [False] * len(primer)
    served = {units.index(unit) for unit in bound.units}
    copies = [i for i in range(len(ids))
              if owner[i] in served and not placeholder[i] and pos[i] in recomputed]
    for i in copies:
        ids.append(ids[i]); pos.append(pos[i]); owner.append(uncached); placeholder.append(False)
    request = [i for i in range(len(ids)) if owner[i] == uncached
               or (owner[i] in served and not placeholder[i] and pos[i] not in recomputed)]
    in_request = torch.zeros(len(ids), dtype=torch.bool)
    in_request[request] = True
    position, code = torch.tensor(pos), torch.tensor(owner)
    sees = torch.eye(uncached + 1 + len(primed), dtype=torch.bool)
    for a, unit in enumerate(units):
        for context in layout.units[unit].context:
            sees[a, units.index(context)] = True
    for a, p in primed:              # the module sees its primer; the primer, its contexts
        sees[a, p] = True
        sees[p] = sees[a] & (torch.arange(sees.shape[1]) < uncached)
        sees[p, a], sees[p, p] = False, True
    allowed = sees[code][:, code]
    allowed[code == uncached] = in_request
    allowed &= position[None, :] <= position[:, None]
    return ids, position, code == uncached, allowed


@torch.inference_mode()
def gold_logprob(reference, bound, recomputed: set[int], gold: list[int], probe=False,
                 primer: list[int] = ()):
    ids, position, computed, allowed = occurrences(bound, recomputed, gold, primer)
    rows = torch.nonzero(computed)[:, 0]
    rows = rows[torch.argsort(position[rows])]
    scored = rows[position[rows] >= bound.end - 1]          # the rows predicting gold
    mask = torch.zeros(allowed.shape).masked_fill_(~allowed, float("-inf"))
    extra = {"probe_rows": rows[position[rows] < bound.end]} if probe else {}
    out = reference(input_ids=torch.tensor(ids)[None], position_ids=position[None],
                    attention_mask=mask[None, None], use_cache=False, logits_to_keep=scored,
                    **extra)
    logprobs = torch.log_softmax(out.logits[0].double(), -1)
    return float(logprobs[torch.arange(len(gold)), torch.tensor(gold)].sum()), position, computed


@torch.inference_mode()
def adjacent_logprob(reference, bound, gold: list[int]) -> tuple[float, float]:
    """(none, adjacent) gold log-probabilities by two reference passes per module: each
    module encoded over its guaranteed context as stored (`none`), or at the positions
    right after that context -- as if it were the first module -- with its keys then
    rotated to its own positions (RoPE keys compose: R(p + d) = R(d) R(p)); the request's
    own tokens and the gold ones computed over the modules' KV. Modules without contexts
    (the schema's text) and nested modules are not handled: --adjacent is for the bench's
    flat documents."""
    from transformers.models.llama.modeling_llama import rotate_half

    layout = bound.layout
    root = [u for u in bound.units if not layout.units[u].context]
    assert len(root) == 1, "one schema text unit expected"
    root_ids, root_pos = [], []
    for seg in layout.units[root[0]].segments:
        root_ids += seg.token_ids
        root_pos += range(seg.start, seg.start + len(seg.token_ids))
    base = max(root_pos) + 1
    causal = lambda n: torch.tril(torch.ones(n, n, dtype=torch.bool))  # noqa: E731
    results = []
    for adjacent in (False, True):
        keys, values, positions = [], [], []
        _, k0, v0 = oracle.reference_pass(reference, torch.tensor(root_ids),
                                          torch.tensor(root_pos), causal(len(root_ids)),
                                          torch.tensor([0]))
        keys.append(k0); values.append(v0); positions += root_pos
        for unit in bound.units:
            if unit == root[0]:
                continue
            ids, pos = [], []
            for seg in layout.units[unit].segments:
                ids += seg.token_ids
                pos += range(seg.start, seg.start + len(seg.token_ids))
            shift = (min(pos) - base) if adjacent else 0
            at = [p - shift for p in pos]
            past = (k0, v0, torch.tensor(root_pos))
            allowed = torch.cat([torch.ones(len(ids), len(root_ids), dtype=torch.bool),
                                 causal(len(ids))], dim=1)
            allowed[:, :len(root_ids)] &= torch.tensor(root_pos)[None, :] <= torch.tensor(at)[:, None]
            _, k, v = oracle.reference_pass(reference, torch.tensor(ids), torch.tensor(at),
                                            allowed, torch.tensor([0]), past)
            if shift:
                cos, sin = reference.model.rotary_emb(k, torch.tensor([[shift]]))
                k = k * cos[0] + rotate_half(k) * sin[0]
            keys.append(k); values.append(v); positions += pos
        past_k, past_v = torch.cat(keys, dim=2), torch.cat(values, dim=2)
        past_pos = torch.tensor(positions)
        new_ids = [t for seg in bound.uncached for t in seg.token_ids] + list(gold[:-1])
        new_pos = [p for seg in bound.uncached
                   for p in range(seg.start, seg.start + len(seg.token_ids))]
        new_pos += range(bound.end, bound.end + len(gold) - 1)
        key_pos = torch.cat([past_pos, torch.tensor(new_pos)])
        allowed = key_pos[None, :] <= torch.tensor(new_pos)[:, None]
        rows = torch.tensor([i for i, p in enumerate(new_pos) if p >= bound.end - 1])
        logits, _, _ = oracle.reference_pass(reference, torch.tensor(new_ids),
                                             torch.tensor(new_pos), allowed, rows,
                                             (past_k, past_v, past_pos))
        logprobs = torch.log_softmax(logits.double(), -1)
        results.append(float(logprobs[torch.arange(len(gold)), torch.tensor(gold)].sum()))
    return results[0], results[1]


def bound_item(llm, item):
    """An item's prompt bound over its schema (modules as the bench's), its gold answer's
    token ids, its candidates per unit (deviation.candidates) and all of them, sorted."""
    schema, prompt = qa.to_pml(item, f"qa-{item.id}")
    bound = llm.bind(prompt, schema=schema, add_generation_prompt=True)
    gold = list(llm.tokenizer.encode(item.answer))
    found = candidates(bound, lambda unit: bound.layout.units[unit].context)
    wanted = sorted(p for positions in found.values() for p in positions)
    return bound, gold, found, wanted


def study(kinds, items: int, seed: int, k: int, primer: str = "",
          primer_only: bool = False, adjacent: bool = False) -> list[dict]:
    llm = promptlang.load(exact_reuse=False)
    reference = oracle.reference_model(llm.adapter.model, "study_probe")
    plain = oracle.reference_model(llm.adapter.model)
    primer_ids = list(llm.tokenizer.encode(primer)) if primer else []
    rows = []
    for kind in kinds:
        for item in qa.generate(items, seed=seed, kind=kind):
            bound, gold, found, wanted = bound_item(llm, item)
            full, _, _ = gold_logprob(reference, bound, set(wanted), gold)
            WEIGHTS.clear()
            none, position, computed = gold_logprob(reference, bound, set(), gold, probe=True)
            stored = {int(position[i]): i for i in range(position.shape[0])
                      if not computed[i] and int(position[i]) in set(wanted)}
            layers = len(WEIGHTS)
            last = sum(w[:, -1].sum(0) for w in WEIGHTS.values())
            every = sum(w.sum((0, 1)) for w in WEIGHTS.values())
            deep = sum(w.sum((0, 1)) for layer, w in WEIGHTS.items() if layer >= layers // 2)

            def top(score, n):
                return set(sorted(wanted, key=lambda p: -float(score[stored[p]]))[:n])
            first = lambda n: {p for ps in found.values() for p in ps[:n]}  # noqa: E731
            measure = lambda chosen: gold_logprob(reference, bound, chosen, gold)[0]  # noqa: E731
            both = first(16) | top(last, 2 * k)
            row = {"kind": kind, "id": item.id, "candidates": len(wanted), "full": full,
                   "none": none, f"last{k}": measure(top(last, k))}
            if not primer_only:
                row |= {
                   f"all{k}": measure(top(every, k)), f"deep{k}": measure(top(deep, k)),
                   f"last{2 * k}": measure(top(last, 2 * k)), "first16": measure(first(16)),
                   f"f16+last{2 * k}": measure(both), "last_eq": measure(top(last, len(both)))}
            if adjacent:
                row["none2"], row["adjacent"] = adjacent_logprob(plain, bound, gold)
            if primer_ids:
                row["primed"] = gold_logprob(reference, bound, set(), gold, primer=primer_ids)[0]
                row[f"primed+last{k}"] = gold_logprob(reference, bound, top(last, k), gold,
                                                      primer=primer_ids)[0]
            rows.append(row)
            print(json.dumps({key: round(v, 3) if isinstance(v, float) else v
                              for key, v in row.items()}), flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kinds", default="single,cross,dependent,needle,same-shape")
    parser.add_argument("--items", type=int, default=12)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--k", type=int, default=16)
    parser.add_argument("--primer", default="", help="text every module but the first is "
                        "encoded after (not seen by the request): settings primed, primed+lastK")
    parser.add_argument("--primer-only", action="store_true",
                        help="with --primer: only none, last K and the primed settings")
    parser.add_argument("--adjacent", action="store_true", help="settings none2 (`none` by "
                        "two passes: a check) and adjacent (modules encoded right after their "
                        "context, keys rotated to their positions)")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rows = study(args.kinds.split(","), args.items, args.seed, args.k, args.primer,
                 args.primer_only, args.adjacent)
    settings = [key for key in rows[0] if key not in ("kind", "id", "candidates", "full")]
    for kind in args.kinds.split(",") + ["all"]:
        mine = [r for r in rows if kind in ("all", r["kind"])]
        means = {s: sum(r[s] - r["full"] for r in mine) / len(mine) for s in settings}
        print(f"{kind:11s} n={len(mine):3d} " + " ".join(f"{s} {v:+.3f}" for s, v in means.items()))


if __name__ == "__main__":
    main()
