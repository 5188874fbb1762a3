"""Study (not a test): float32 against bfloat16 compute on the same benchmark items, paired.

    python tests/studies/compare_dtypes.py FLOAT32-items.json BFLOAT16-items.json OUT.json

Each argument is the `accuracy-items.json` of a `promptlang bench accuracy` run, the same
command and seed, once as loaded (float32) and once with `--dtype bfloat16`. For every
setting both runs have, prints how many items' greedy answers are the same tokens, the
mean, median and largest |delta| of the gold answer's teacher-forced log-probability
(bfloat16 - float32) and its signed mean with a 95% paired bootstrap interval (2,000
resamples of the items, seed 0), over the items whose gold log-probability both runs
scored. OUT gets those rows.
"""

from __future__ import annotations

import json
import statistics
import sys

from compare_adapters import paired


def main(float32_path: str, bfloat16_path: str, out_path: str) -> None:
    first = {item["id"]: item for item in json.loads(open(float32_path).read())}
    second = {item["id"]: item for item in json.loads(open(bfloat16_path).read())}
    if set(first) != set(second):
        raise SystemExit("the two runs hold different items: not the same command and seed")
    settings = [s for s in next(iter(first.values()))["settings"]
                if all(s in second[i]["settings"] for i in second)]
    rows = {}
    for setting in settings:
        same = 0
        deltas = []
        for key, a in first.items():
            x = a["settings"][setting]
            y = second[key]["settings"][setting]
            same += x["token_ids"] == y["token_ids"]
            if x["gold_logprob"] is not None and y["gold_logprob"] is not None:
                deltas.append(y["gold_logprob"] - x["gold_logprob"])
        sizes = [abs(d) for d in deltas]
        row = {"items": len(first), "scored": len(deltas), "same_answer": same, "abs_mean": statistics.mean(sizes),
               "abs_median": statistics.median(sizes), "abs_max": max(sizes),
               "signed": paired(deltas)}
        rows[setting] = row
        signed = row["signed"]
        print(f"{setting:14s} same greedy answer {same}/{len(first)}; |delta gold log-prob| "
              f"mean {row['abs_mean']:.4f} nats, median {row['abs_median']:.4f}, "
              f"max {row['abs_max']:.3f}; signed mean {signed['mean']:+.4f} "
              f"[{signed['low']:+.4f}, {signed['high']:+.4f}]")
    with open(out_path, "w") as out:
        json.dump({"float32": float32_path, "bfloat16": bfloat16_path, "rows": rows}, out,
                  indent=1)


if __name__ == "__main__":
    main(*sys.argv[1:4])
