"""The module store: memory tiers and budgets, the disk budget, store dtype, prefetch,
concurrency, CUDA. The disk files' format and checks are in test_store_files.py."""

from __future__ import annotations

import os
import threading

import pytest
import torch
from safetensors.torch import load_file

from promptlang.runtime.kv.unit import UnitKV
from promptlang.runtime.store import MARKER, ModuleStore

L, H, S, D = 2, 2, 16, 8


def make_kv(seed: int, length: int = S, dtype: torch.dtype = torch.float32) -> UnitKV:
    g = torch.Generator().manual_seed(seed)
    return UnitKV(
        keys=torch.randn(L, H, length, D, generator=g).to(dtype),
        values=torch.randn(L, H, length, D + 1, generator=g).to(dtype),  # D_v may differ from D_k
        positions=torch.arange(length, dtype=torch.int64) + 3 * seed,
        token_ids=torch.randint(0, 50_000, (length,), generator=g),
        placeholder=torch.rand(length, generator=g) < 0.25,
    )


def key_of(i: int) -> str:
    return f"{i:064x}"


def file_of(folder, key: str, stored: str = "put"):
    """The disk file of `key` in a store of dtype `stored` ("put": no store dtype)."""
    return folder / f"{key}.{stored}.safetensors"


def keys_on_disk(folder) -> list[str]:
    return sorted(p.name.split(".")[0] for p in folder.glob("*.safetensors"))


def assert_same(a: UnitKV, b: UnitKV) -> None:
    for name in ("keys", "values", "positions", "token_ids", "placeholder"):
        x, y = getattr(a, name), getattr(b, name)
        assert x.dtype == y.dtype and x.shape == y.shape, name
        assert torch.equal(x.cpu(), y.cpu()), name


ENTRY_BYTES = make_kv(0).nbytes


def memory_store(**kw) -> ModuleStore:
    return ModuleStore(disk_budget_bytes=0, **kw)


def tiers_of(store: ModuleStore) -> dict[str, tuple[str, ...]]:
    return {e.key: e.tiers for e in store.entries()}


@pytest.fixture(autouse=True)
def fresh_warnings(monkeypatch):
    """Each test sees the store's once-per-process warnings afresh."""
    from promptlang.runtime.store import tier
    monkeypatch.setattr(tier, "_warned", set())


# ---- memory tiers and budgets ----------------------------------------------------------------

def test_device_tier_evicts_least_recently_used_first():
    store = memory_store(device_budget_bytes=3 * ENTRY_BYTES)
    for i in (1, 2, 3):
        store.put(key_of(i), make_kv(i))
    store.get(key_of(1))                     # 2 is now the least recently used
    store.put(key_of(4), make_kv(4))
    assert store.get(key_of(2)) is None
    store.put(key_of(5), make_kv(5))         # then 3 (1 was used after it)
    assert sorted(tiers_of(store)) == [key_of(1), key_of(4), key_of(5)]
    stats = store.stats
    assert stats.device_evictions == 2 and stats.device_bytes == 3 * ENTRY_BYTES


def test_on_cpu_the_host_tier_is_off_and_the_device_budget_governs():
    store = memory_store(device_budget_bytes=ENTRY_BYTES, host_budget_bytes=10 * ENTRY_BYTES)
    store.put(key_of(1), make_kv(1))
    store.put(key_of(2), make_kv(2))
    assert tiers_of(store) == {key_of(2): ("device",)}
    assert store.stats.host_bytes == 0


def test_device_evictions_move_down_to_the_host_tier():
    store = memory_store(device_budget_bytes=2 * ENTRY_BYTES, host_budget_bytes=2 * ENTRY_BYTES,
                         host_tier=True)
    for i in (1, 2, 3):
        store.put(key_of(i), make_kv(i))
    assert tiers_of(store) == {key_of(1): ("host",), key_of(2): ("device",), key_of(3): ("device",)}

    assert_same(store.get(key_of(1)), make_kv(1))   # promoted; 2 goes down in its place
    assert tiers_of(store) == {key_of(1): ("device",), key_of(2): ("host",), key_of(3): ("device",)}
    assert store.stats.host_hits == 1

    store.put(key_of(4), make_kv(4))                # 3 down to host
    store.put(key_of(5), make_kv(5))                # 1 down to host, which drops its LRU: 2
    assert tiers_of(store) == {key_of(1): ("host",), key_of(3): ("host",),
                               key_of(4): ("device",), key_of(5): ("device",)}
    stats = store.stats
    assert (stats.device_evictions, stats.host_evictions) == (4, 1)
    assert (stats.device_bytes, stats.host_bytes) == (2 * ENTRY_BYTES, 2 * ENTRY_BYTES)


def test_entry_larger_than_a_tier_skips_it(tmp_path):
    store = ModuleStore(disk_dir=tmp_path, device_budget_bytes=ENTRY_BYTES - 1)
    store.put(key_of(1), make_kv(1))
    assert tiers_of(store) == {key_of(1): ("disk",)}
    for _ in range(2):
        assert_same(store.get(key_of(1)), make_kv(1))
    assert store.stats.disk_loads == 2 and store.stats.device_bytes == 0

    hosted = memory_store(device_budget_bytes=ENTRY_BYTES - 1, host_tier=True)
    hosted.put(key_of(2), make_kv(2))
    assert tiers_of(hosted) == {key_of(2): ("host",)}
    assert_same(hosted.get(key_of(2)), make_kv(2))
    assert tiers_of(hosted) == {key_of(2): ("host",)}


def test_returned_kv_is_unchanged_by_later_evictions_and_puts(tmp_path):
    store = ModuleStore(disk_dir=tmp_path, device_budget_bytes=ENTRY_BYTES, dtype=torch.float16)
    store.put(key_of(1), make_kv(1))
    got = store.get(key_of(1))
    snapshot = UnitKV(*(t.clone() for t in (got.keys, got.values, got.positions,
                                             got.token_ids, got.placeholder)))
    for i in range(2, 6):
        store.put(key_of(i), make_kv(i))
        store.get(key_of(1))
    assert_same(got, snapshot)


# ---- disk budget ---------------------------------------------------------------------------

def _file_bytes(tmp_path) -> int:
    probe = tmp_path / "probe"
    ModuleStore(disk_dir=probe).put(key_of(0), make_kv(0))
    return file_of(probe, key_of(0)).stat().st_size


def test_disk_tier_evicts_least_recently_used_files(tmp_path):
    size = _file_bytes(tmp_path)
    disk = tmp_path / "kv"
    store = ModuleStore(disk_dir=disk, disk_budget_bytes=2 * size + size // 2)
    store.put(key_of(1), make_kv(1))
    store.put(key_of(2), make_kv(2))
    store.get(key_of(1))                    # a memory hit still counts as a use of the file
    store.put(key_of(3), make_kv(3))
    assert keys_on_disk(disk) == [key_of(1), key_of(3)]
    assert store.stats.disk_evictions == 1


def test_disk_budget_counts_files_of_earlier_runs_by_last_use(tmp_path):
    size = _file_bytes(tmp_path)
    disk = tmp_path / "kv"
    earlier = ModuleStore(disk_dir=disk)
    for i in (1, 2, 3):
        earlier.put(key_of(i), make_kv(i))
    for age, i in ((300, 1), (100, 2), (200, 3)):  # last used 300, 100, 200 s ago
        path = file_of(disk, key_of(i))
        os.utime(path, ns=(path.stat().st_atime_ns, path.stat().st_mtime_ns - age * 10**9))

    store = ModuleStore(disk_dir=disk, disk_budget_bytes=2 * size + size // 2)
    store.put(key_of(4), make_kv(4))        # over budget by two files: the two oldest go
    assert keys_on_disk(disk) == [key_of(2), key_of(4)]
    assert store.stats.disk_evictions == 2


def test_entry_larger_than_the_disk_budget_is_not_written(tmp_path):
    store = ModuleStore(disk_dir=tmp_path, disk_budget_bytes=ENTRY_BYTES // 2)
    store.put(key_of(1), make_kv(1))
    assert [p.name for p in tmp_path.iterdir()] == [MARKER]
    assert tiers_of(store) == {key_of(1): ("device",)}


# ---- store dtype -----------------------------------------------------------------------------

def test_bf16_store_dtype_halves_kv_bytes_and_returns_the_put_dtype(tmp_path):
    kv = make_kv(3)
    kv_bytes = kv.keys.nbytes + kv.values.nbytes
    rest = kv.nbytes - kv_bytes
    full = memory_store()
    full.put(key_of(3), kv)
    half = ModuleStore(disk_dir=tmp_path, dtype=torch.bfloat16)
    half.put(key_of(3), kv)
    assert full.stats.device_bytes == kv.nbytes
    assert half.stats.device_bytes == rest + kv_bytes // 2

    expected_keys = kv.keys.to(torch.bfloat16).float()
    for store in (half, ModuleStore(disk_dir=tmp_path, dtype=torch.bfloat16)):  # and restarted
        got = store.get(key_of(3))
        assert got.keys.dtype == torch.float32 and torch.equal(got.keys, expected_keys)
        assert torch.equal(got.values, kv.values.to(torch.bfloat16).float())
        assert torch.equal(got.positions, kv.positions)
    on_disk = load_file(file_of(tmp_path, key_of(3), "bfloat16"))
    assert on_disk["keys"].dtype == torch.bfloat16

    native = ModuleStore(disk_dir=tmp_path, dtype=torch.bfloat16,
                         compute_dtype=torch.bfloat16).get(key_of(3))
    assert native.keys.dtype == torch.bfloat16
    assert torch.equal(native.keys, kv.keys.to(torch.bfloat16))


def test_without_a_store_dtype_get_returns_the_stored_tensors():
    kv = make_kv(1)
    store = memory_store()
    store.put(key_of(1), kv)
    assert store.get(key_of(1)).keys.data_ptr() == kv.keys.data_ptr()  # no copy per get


# ---- prefetch and concurrency ----------------------------------------------------------------

def test_prefetch_loads_disk_entries_so_gets_hit_memory(tmp_path):
    writer = ModuleStore(disk_dir=tmp_path)
    for i in (1, 2):
        writer.put(key_of(i), make_kv(i))
    store = ModuleStore(disk_dir=tmp_path)
    assert store.prefetch([key_of(1), key_of(2), key_of(9)]) == 2
    assert store.stats.disk_loads == 2 and store.stats.prefetches == 2
    for i in (1, 2):
        assert_same(store.get(key_of(i)), make_kv(i))
    stats = store.stats
    assert (stats.device_hits, stats.disk_loads, stats.disk_hits, stats.misses) == (2, 2, 0, 0)


def test_prefetch_promotes_host_entries():
    store = memory_store(device_budget_bytes=ENTRY_BYTES, host_tier=True)
    store.put(key_of(1), make_kv(1))
    store.put(key_of(2), make_kv(2))
    assert store.prefetch([key_of(1)]) == 1
    assert tiers_of(store) == {key_of(1): ("device",), key_of(2): ("host",)}
    assert store.stats.prefetches == 1 and store.stats.host_hits == 0


def _run_threads(n, target):
    errors, barrier = [], threading.Barrier(n)

    def run(i):
        try:
            barrier.wait()
            target(i)
        except BaseException as err:  # noqa: BLE001 - reported in the main thread
            errors.append(err)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []


def test_concurrent_gets_of_one_disk_entry_load_it_once(tmp_path):
    ModuleStore(disk_dir=tmp_path).put(key_of(1), make_kv(1))
    store = ModuleStore(disk_dir=tmp_path)
    results = [None] * 8
    _run_threads(8, lambda i: results.__setitem__(i, store.get(key_of(1))))
    for got in results:
        assert_same(got, make_kv(1))
    stats = store.stats
    assert stats.disk_loads == 1 and stats.device_hits + stats.disk_hits == 8


def test_eight_threads_mixed_put_get_prefetch_see_exactly_what_was_put(tmp_path):
    expected = {key_of(i): make_kv(i) for i in range(12)}
    keys = list(expected)
    store = ModuleStore(disk_dir=tmp_path, device_budget_bytes=3 * ENTRY_BYTES,
                        host_budget_bytes=2 * ENTRY_BYTES, host_tier=True)
    seen = []

    def work(i):
        for step in range(60):
            key = keys[(i * 5 + step * 7) % len(keys)]
            if step % 3 == 0:
                store.put(key, expected[key], {"unit": key[-2:]})
            elif step % 7 == 0:
                store.prefetch([key, keys[(i + step) % len(keys)]])
            else:
                got = store.get(key)
                if got is not None:
                    assert_same(got, expected[key])
                    seen.append(key)

    _run_threads(8, work)
    assert seen, "the workload never read anything back"
    stats = store.stats
    assert stats.corrupt_files == 0 and stats.disk_write_errors == 0
    assert stats.device_bytes <= 3 * ENTRY_BYTES and stats.host_bytes <= 2 * ENTRY_BYTES
    assert stats.disk_writes == len(list(tmp_path.glob("*.safetensors")))
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]
    fresh = ModuleStore(disk_dir=tmp_path)
    for entry in fresh.entries():
        assert_same(fresh.get(entry.key), expected[entry.key])
        assert entry.meta == {"unit": entry.key[-2:]}


# ---- CUDA: pinned host tier, asynchronous copies ---------------------------------------------

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@cuda
def test_cuda_device_evictions_go_to_pinned_host_memory_and_come_back(tmp_path):
    store = ModuleStore("cuda", device_budget_bytes=ENTRY_BYTES, host_budget_bytes=4 * ENTRY_BYTES,
                        disk_dir=tmp_path)
    store.put(key_of(1), make_kv(1).to("cuda"))
    store.put(key_of(2), make_kv(2))                 # CPU input is moved to the device
    assert tiers_of(store)[key_of(1)] == ("host", "disk")
    host_kv = store._host.entries[key_of(1)].kv
    assert host_kv.keys.is_pinned() and host_kv.values.is_pinned()
    got = store.get(key_of(1))                       # async copy back, stream ordered by get
    assert got.keys.device.type == "cuda"
    assert_same(got, make_kv(1))
    assert store.prefetch([key_of(2)]) == 1
    assert_same(store.get(key_of(2)), make_kv(2))


@cuda
def test_cuda_disk_round_trip_and_half_precision(tmp_path):
    ModuleStore("cuda", disk_dir=tmp_path, dtype=torch.float16).put(key_of(3), make_kv(3).to("cuda"))
    got = ModuleStore("cuda", disk_dir=tmp_path).get(key_of(3))
    assert got.keys.device.type == "cuda" and got.keys.dtype == torch.float32
    assert torch.equal(got.keys.cpu(), make_kv(3).keys.half().float())
