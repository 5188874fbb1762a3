"""A disk tier shared by processes (the cluster's replicas, docs/SCALING.md): writers of the
same keys, readers and evictions at once never let a reader see a partial or foreign file."""

from __future__ import annotations

import multiprocessing
import random

import torch

from tests.runtime.test_store import key_of, make_kv

KEYS = 6
STEPS = 150
PROCESSES = 3


def _hammer(folder: str, seed: int) -> tuple[int, int, int, int]:
    """One process: put, get (from disk: no memory tier) and evict the shared keys in an
    order of its own. Returns (reads that found the KV, reads that found something else,
    files counted corrupt, files counted untrusted)."""
    from promptlang.runtime.store import ModuleStore

    torch.set_num_threads(1)
    store = ModuleStore(disk_dir=folder, device_budget_bytes=0)
    expected = {key_of(i): make_kv(i, length=64) for i in range(KEYS)}
    rng = random.Random(seed)
    found = wrong = 0
    for _ in range(STEPS):
        key = rng.choice(list(expected))
        action = rng.random()
        if action < 0.4:
            store.put(key, expected[key])
        elif action < 0.9:
            got = store.get(key)
            if got is not None:
                same = all(torch.equal(getattr(got, name), getattr(expected[key], name))
                           for name in ("keys", "values", "positions", "token_ids",
                                        "placeholder"))
                found += same
                wrong += not same
        else:
            store.evict(key, tiers=["disk"])
    stats = store.stats
    return found, wrong, stats.corrupt_files, stats.untrusted_files


def test_processes_sharing_a_disk_tier_read_only_whole_files(tmp_path):
    context = multiprocessing.get_context("spawn")
    with context.Pool(PROCESSES) as pool:
        results = pool.starmap(_hammer, [(str(tmp_path), seed) for seed in range(PROCESSES)],
                               chunksize=1)
    found = sum(r[0] for r in results)
    assert found > 0, "no read ever found a file: the test exercised nothing"
    assert [r[1:] for r in results] == [(0, 0, 0)] * PROCESSES
    leftovers = [p.name for p in tmp_path.iterdir()
                 if not p.name.endswith(".safetensors") and not p.name.startswith(".")]
    assert leftovers == [], leftovers              # no temporary file left behind
