"""Study (not a test): two seam adapters on the same benchmark items, paired.

    python tests/studies/compare_adapters.py NEW-items.json OLD-items.json OUT.json

Each argument is the `accuracy-items.json` of a `promptlang bench accuracy` run with
`--recompute tuned` (the same items, seed and command; one run per adapter, the adapter in
place). OLD may instead be an earlier OUT of this study with the column to take,
`OUT.json:new` or `OUT.json:old` (a published run's per-item numbers, when the items file
was not kept); its items must then hold the same ids and the same full-prefill and `none`
log-probabilities as NEW's, to 1e-4 nats, or the runs are not the same items and code. Prints, per question kind, the mean of (NEW - OLD) in the gold answer's
teacher-forced log-probability under `cached+tuned`, with a 95% paired bootstrap interval
(2,000 resamples of the items, seed 0): whether the benchmark tells the two adapters apart.
OUT gets those rows and, per item, the gold log-probabilities the rows come from.
"""

from __future__ import annotations

import json
import random
import sys

SETTING = "cached+tuned"
KINDS = ("single", "cross", "dependent", "needle", "same-shape", "argument", "all")


def paired(differences: list[float], resamples: int = 2000, seed: int = 0) -> dict:
    """The mean of `differences` and its 95% bootstrap interval."""
    rng = random.Random(seed)
    n = len(differences)
    means = sorted(sum(rng.choice(differences) for _ in range(n)) / n for _ in range(resamples))
    return {"mean": sum(differences) / n, "low": means[int(0.025 * resamples)],
            "high": means[int(0.975 * resamples) - 1], "n": n}


def main(new_path: str, old_path: str, out_path: str) -> None:
    new = json.loads(open(new_path).read())
    if old_path.endswith((".json:new", ".json:old")):
        items = _against_published(new, *old_path.rsplit(":", 1))
    else:
        items = _against_run(new, json.loads(open(old_path).read()))
    rows = {}
    for kind in KINDS:
        chosen = [i for i in items if kind == "all" or i["kind"] == kind]
        rows[kind] = paired([i["new"] - i["old"] for i in chosen])
        row = rows[kind]
        print(f"{kind:10s} n={row['n']:3d}  new - old {row['mean']:+.2f} "
              f"[{row['low']:+.2f}, {row['high']:+.2f}] nats")
    with open(out_path, "w") as out:
        json.dump({"new": new_path, "old": old_path, "setting": SETTING, "rows": rows,
                   "items": items}, out, indent=1)


def _row(a: dict) -> dict:
    """An items file's item as this study's row, `old` left to fill."""
    return {"id": a["id"], "kind": a["kind"],
            "baseline": a["settings"]["baseline"]["gold_logprob"],
            "none": a["settings"]["cached"]["gold_logprob"],
            "new": a["settings"][SETTING]["gold_logprob"]}


def _against_run(new: list, old: list) -> list[dict]:
    if [i["id"] for i in new] != [i["id"] for i in old]:
        sys.exit("compare_adapters: the two runs hold different items")
    items = []
    for a, b in zip(new, old):
        if a["settings"]["baseline"]["token_ids"] != b["settings"]["baseline"]["token_ids"]:
            sys.exit(f"compare_adapters: item {a['id']}: the baselines differ")
        items.append({**_row(a), "old": b["settings"][SETTING]["gold_logprob"]})
    return items


def _against_published(new: list, path: str, column: str) -> list[dict]:
    published = json.loads(open(path).read())["items"]
    if [i["id"] for i in new] != [i["id"] for i in published]:
        sys.exit(f"compare_adapters: {path} holds other items")
    items = []
    for a, b in zip(new, published):
        row = _row(a)
        for name in ("baseline", "none"):
            if abs(row[name] - b[name]) > 1e-4:
                sys.exit(f"compare_adapters: item {a['id']}: {name} {row[name]:.6f} here, "
                         f"{b[name]:.6f} in {path}: not the same items and code")
        items.append({**row, "old": b[column]})
    return items


if __name__ == "__main__":
    if len(sys.argv) != 4:
        sys.exit(__doc__)
    main(*sys.argv[1:])
