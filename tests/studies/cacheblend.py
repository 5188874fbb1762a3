"""Study (not a test): CacheBlend as published -- does layer-by-layer selection bring the answer back?

    python tests/studies/cacheblend.py --items 30 --seed 21 --ratios 0.15,0.3

CacheBlend (arXiv 2405.16444, section 4.3) recomputes, in every layer, the cached tokens
whose keys and values deviate most from what a full prefill would give them (HKVD tokens),
and serves every other token's stored KV in that layer. The set is found by *gradual
filtering*: layers 0 and 1 computed for every candidate, then the r1 share of them whose
layer-1 KV deviates most is recomputed in layer 2, of those the r2 < r1 share deviating
most in layer 2 goes on to layer 3, and so on, the shares averaging r. The runtime's
`deviation:F` selects once, from layer 1 (as LMCache's implementation, `check_layers=[1]`).

Each setting is a masked pass of the unmodified model (the docs/DESIGN.md oracle's rule,
tests/studies/seam_tokens.py `occurrences`): every cached token once as stored (attending
to its unit, as encoded: one pass per item, the past of every setting's pass) and every
candidate once more as recomputed, with the request's own tokens; an attention
function chooses, per layer, which of the two copies the request's rows read (the
recomputed copy of a token selected for that layer, else the stored one), and scores the
selected copies' deviation there (|dK|^2 / mean|K|^2 + |dV|^2 / mean|V|^2, dK between the
two copies, as `deviation:F`). Settings per item:

    full        every candidate recomputed in every layer (the full prefill's numbers)
    none        nothing recomputed
    once:R      layers 0-1 all candidates, then the R share by layer-1 deviation (fixed)
    blend:R     gradual filtering: shares from 1.25R (layer 2) down to 0.75R (last layer)

Measures, paired against `full` over the items: the gold answer's teacher-forced
log-probability and the first answer token's KL divergence from `full`'s distribution
(bootstrap 95% intervals), and how often the first token is `full`'s. The recomputed
share per layer sets the cost: computing a fraction c of the candidates through every
layer costs about c of their prefill, so CacheBlend at R costs about (2 + R (L - 2)) / L.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

import torch
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "runtime"))
import oracle  # noqa: E402  (the docs/DESIGN.md oracle's reference model)
from seam_tokens import bound_item, occurrences  # noqa: E402

import promptlang  # noqa: E402
from promptlang.bench import qa  # noqa: E402


class Blend:
    """Per-pass state the attention function reads: which copy each request row sees."""

    def __init__(self, allowed: torch.Tensor, causal: torch.Tensor, rows: torch.Tensor,
                 stored: torch.Tensor, fresh: torch.Tensor, layers: int, mode: str, ratio: float):
        self.allowed, self.causal, self.rows = allowed, causal, rows
        self.stored, self.fresh = stored, fresh
        self.layers, self.mode, self.ratio = layers, mode, ratio
        self.selected = torch.ones(stored.shape[0], dtype=torch.bool)
        if mode == "none":
            self.selected[:] = False
        self.computed: list[int] = []           # selected candidates per layer

    def share(self, layer: int) -> float:
        """The share of the candidates layer `layer` (>= 2) recomputes."""
        if self.mode == "once":
            return self.ratio
        span = max(self.layers - 3, 1)
        return self.ratio * (1.25 - 0.5 * (layer - 2) / span)

    def mask(self) -> torch.Tensor:
        allowed = self.allowed.clone()
        off = ~self.selected
        rows = self.rows[:, None]
        allowed[rows, self.fresh[off][None, :]] = False
        allowed[rows, self.stored[off][None, :]] = self.causal[rows, self.stored[off][None, :]]
        return allowed

    def select(self, layer: int, key: torch.Tensor, value: torch.Tensor) -> None:
        """After layer `layer`'s attention: the candidates layer + 1 recomputes."""
        if self.mode in ("full", "none") or layer < 1 or layer + 1 >= self.layers:
            return
        if self.mode == "once" and layer > 1:
            return
        keep = max(1, round(self.share(layer + 1) * self.stored.shape[0]))
        on = torch.nonzero(self.selected)[:, 0]
        if keep >= on.shape[0]:
            return
        k, v = key[0].float(), value[0].float()                    # [H_kv, N, D]
        ks, vs = k[:, self.stored[on]], v[:, self.stored[on]]
        dk = (k[:, self.fresh[on]] - ks).pow(2).sum((0, 2)) / (ks.pow(2).sum((0, 2)).mean() or 1)
        dv = (v[:, self.fresh[on]] - vs).pow(2).sum((0, 2)) / (vs.pow(2).sum((0, 2)).mean() or 1)
        top = on[torch.topk(dk + dv, keep).indices]
        self.selected = torch.zeros_like(self.selected)
        self.selected[top] = True


STATE: dict[str, Blend] = {}


def _blend_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                     **kwargs):
    blend = STATE["pass"]
    layer = module.layer_idx
    blend.computed.append(int(blend.selected.sum()))
    allowed = blend.mask().to(query.device)
    groups = query.shape[1] // key.shape[1]
    k, v = key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1)
    scores = (query @ k.transpose(-1, -2)).float() * scaling
    scores = scores.masked_fill(~allowed[None, None], float("-inf"))
    out = torch.softmax(scores, dim=-1).to(v.dtype) @ v
    blend.select(layer, key, value)
    return out.transpose(1, 2).contiguous(), None


transformers.AttentionInterface.register("study_blend", _blend_attention)


class Item:
    """One item's occurrences (seam_tokens.occurrences with every candidate recomputed),
    the stored copies encoded once by the plain reference as the past of every setting's
    pass, and the columns of each candidate's two copies in [past, new] order."""

    @torch.inference_mode()
    def __init__(self, plain, bound, wanted: list[int], gold: list[int]):
        ids, position, computed, allowed = occurrences(bound, set(wanted), gold)
        past = torch.nonzero(~computed)[:, 0]
        new = torch.nonzero(computed)[:, 0]
        order = torch.cat([past, new])
        column = torch.empty_like(order)
        column[order] = torch.arange(order.shape[0])
        _, keys, values = oracle.reference_pass(plain, torch.tensor(ids)[past], position[past],
                                                allowed[past][:, past], torch.tensor([0]))
        self.past = (keys, values, position[past])
        self.ids, self.positions = torch.tensor(ids)[new], position[new]
        self.allowed = allowed[new][:, order]
        self.causal = position[order][None, :] <= self.positions[:, None]
        want, stored_at, fresh_at = set(wanted), {}, {}
        for i in range(len(ids)):
            p = int(position[i])
            if p in want:
                (fresh_at if computed[i] else stored_at).setdefault(p, int(column[i]))
        both = [p for p in wanted if p in stored_at and p in fresh_at]
        self.stored = torch.tensor([stored_at[p] for p in both], dtype=torch.long)
        self.fresh = torch.tensor([fresh_at[p] for p in both], dtype=torch.long)
        ranked = torch.argsort(self.positions)
        self.scored = ranked[self.positions[ranked] >= bound.end - 1]  # rows predicting gold

    @torch.inference_mode()
    def logprobs(self, reference, mode: str, ratio: float = 0.0) -> tuple[torch.Tensor, Blend]:
        """Log-probabilities [len(gold), V] of the rows predicting the gold tokens."""
        rows = torch.arange(self.ids.shape[0])
        blend = Blend(self.allowed, self.causal, rows, self.stored, self.fresh,
                      reference.config.num_hidden_layers, mode, ratio)
        STATE["pass"] = blend
        logits, _, _ = oracle.reference_pass(reference, self.ids, self.positions, self.allowed,
                                             self.scored, self.past)
        return torch.log_softmax(logits.double(), -1), blend


def _interval(values: list[float], rng: random.Random, rounds: int = 2000) -> tuple[float, float]:
    means = sorted(sum(rng.choice(values) for _ in values) / len(values) for _ in range(rounds))
    return means[int(0.025 * rounds)], means[int(0.975 * rounds) - 1]


def study(kinds, items: int, seed: int, ratios: list[float]) -> list[dict]:
    llm = promptlang.load(exact_reuse=False)
    reference = oracle.reference_model(llm.adapter.model, "study_blend")
    plain = oracle.reference_model(llm.adapter.model)
    settings = [("none", 0.0)] + [(m, r) for r in ratios for m in ("once", "blend")]
    rows = []
    for kind in kinds:
        for item in qa.generate(items, seed=seed, kind=kind):
            bound, gold, _, wanted = bound_item(llm, item)
            prepared = Item(plain, bound, wanted, gold)
            full, _ = prepared.logprobs(reference, "full")
            at = torch.arange(len(gold))
            target = torch.tensor(gold)
            row = {"kind": kind, "id": item.id, "candidates": len(wanted),
                   "full": float(full[at, target].sum())}
            for mode, ratio in settings:
                name = mode if mode == "none" else f"{mode}:{ratio:g}"
                got, blend = prepared.logprobs(reference, mode, ratio)
                row[name] = float(got[at, target].sum())
                row[name + " kl"] = float((full[0].exp() * (full[0] - got[0])).sum())
                row[name + " top"] = int(got[0].argmax() == full[0].argmax())
                row[name + " share"] = sum(blend.computed) / (len(blend.computed) * max(len(wanted), 1))
            rows.append(row)
            print(json.dumps({k: round(v, 4) if isinstance(v, float) else v
                              for k, v in row.items()}), flush=True)
    return rows


def summary(rows: list[dict], kinds: list[str]) -> None:
    names = [k for k in rows[0] if k not in ("kind", "id", "candidates", "full")
             and " " not in k]
    rng = random.Random(0)
    print("| setting | kind | items | gold log-prob vs full (nats) [95%] | first-token KL "
          "| same first token | recomputed share per layer |")
    print("|:---|:---|---:|---:|---:|---:|---:|")
    for name in names:
        for kind in kinds + ["all"]:
            mine = [r for r in rows if kind in ("all", r["kind"])]
            diffs = [r[name] - r["full"] for r in mine]
            low, high = _interval(diffs, rng)
            kl = sum(r[name + " kl"] for r in mine) / len(mine)
            top = sum(r[name + " top"] for r in mine) / len(mine)
            share = sum(r[name + " share"] for r in mine) / len(mine)
            print(f"| {name} | {kind} | {len(mine)} | {sum(diffs) / len(diffs):+.3f} "
                  f"[{low:+.3f}, {high:+.3f}] | {kl:.4f} | {100 * top:.0f}% | {share:.3f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kinds", default=",".join(qa.KINDS))
    parser.add_argument("--items", type=int, default=10, help="items per kind")
    parser.add_argument("--seed", type=int, default=21)
    parser.add_argument("--ratios", default="0.15,0.3")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", help="write the items' rows here as JSON lines")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    kinds = args.kinds.split(",")
    rows = study(kinds, args.items, args.seed, [float(r) for r in args.ratios.split(",")])
    if args.out:
        Path(args.out).write_text("".join(json.dumps(r) + "\n" for r in rows))
    summary(rows, kinds)


if __name__ == "__main__":
    main()
