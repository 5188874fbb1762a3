"""`promptlang bench cluster` (a local Ray Serve cluster, three routers) and `bench scaling`
(the projection from its costs), in --quick mode; and the simulation's rule on its own."""

from __future__ import annotations

import json

import pytest

from promptlang.bench.scaling import simulate
from tests.bench.test_bench_cli import bench, goals, read_csv


def test_affinity_keeps_more_in_memory_than_random_choice_when_memory_is_short():
    # 4 replicas, each holding 100 of 1,000 modules: together they could hold 400
    random_choice = simulate("random", 4, 1_000, 100, 3, 0.9, 3_000)
    affinity = simulate("affinity", 4, 1_000, 100, 3, 0.9, 3_000)
    assert affinity["hit_rate"] > random_choice["hit_rate"] + 0.05, (affinity, random_choice)
    assert 1.0 <= random_choice["busiest"] < 1.2
    # everything fits in every replica: both hit always
    assert simulate("random", 2, 50, 100, 3, 0.9, 500)["hit_rate"] == 1.0


@pytest.mark.slow
def test_cluster_quick_compares_the_routers_and_scaling_projects_from_its_costs(
        tmp_path, capsys):
    pytest.importorskip("ray.serve", reason="Ray Serve is not installed: pip install -e "
                                            "'.[cluster]' (CI installs it)")
    out = bench(capsys, "cluster", "--out", str(tmp_path))
    rows = {row["router"]: row for row in read_csv(tmp_path / "cluster.csv")}
    data = json.loads((tmp_path / "cluster.json").read_text())
    assert set(rows) | set(data["missing"]) == {"pow2", "prefix", "affinity"}
    assert {"pow2", "affinity"} <= set(rows)
    for row in rows.values():
        assert int(row["sent"]) == int(row["answered"]) == 8 and int(row["lost"]) == 0
        shares = [float(row[c]) for c in ("memory hits %", "disk hits %", "encoded %")]
        assert abs(sum(shares) - 100) < 0.5 and float(row["ttft p50 ms"]) > 0
    costs = data["costs"]
    assert costs["ttft_encoded_s"] > costs["ttft_memory_s"] > 0 and costs["bytes_per_doc"] > 0
    verdicts = goals(out)
    assert verdicts["no request lost"] == "PASS"
    assert "module affinity keeps more in memory than power-of-two" in verdicts

    out = bench(capsys, "scaling", "--out", str(tmp_path))
    projected = read_csv(tmp_path / "scaling.csv")
    assert {(int(r["replicas"]), int(r["modules"]), r["router"]) for r in projected} == {
        (n, m, router) for n in (2, 4) for m in (1_000, 10_000)
        for router in ("random", "affinity")}
    assert "Where the shared tier becomes the limit" in out
