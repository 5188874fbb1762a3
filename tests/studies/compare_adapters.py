"""Study (not a test): two seam adapters on the same benchmark items, paired.

    python tests/studies/compare_adapters.py NEW-items.json OLD-items.json OUT.json

Each argument is the `accuracy-items.json` of a `promptlang bench accuracy` run with
`--recompute tuned` (the same items, seed and command; one run per adapter, the adapter in
place). Prints, per question kind, the mean of (NEW - OLD) in the gold answer's
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
    old = json.loads(open(old_path).read())
    if [i["id"] for i in new] != [i["id"] for i in old]:
        sys.exit("compare_adapters: the two runs hold different items")
    items = []
    for a, b in zip(new, old):
        if a["settings"]["baseline"]["token_ids"] != b["settings"]["baseline"]["token_ids"]:
            sys.exit(f"compare_adapters: item {a['id']}: the baselines differ")
        items.append({"id": a["id"], "kind": a["kind"],
                      "baseline": a["settings"]["baseline"]["gold_logprob"],
                      "none": a["settings"]["cached"]["gold_logprob"],
                      "new": a["settings"][SETTING]["gold_logprob"],
                      "old": b["settings"][SETTING]["gold_logprob"]})
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


if __name__ == "__main__":
    if len(sys.argv) != 4:
        sys.exit(__doc__)
    main(*sys.argv[1:])
