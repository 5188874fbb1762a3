"""The module store: tiers, budgets, the disk format and its checks, concurrency."""

from __future__ import annotations

import json
import os
import re
import struct
import threading

import pytest
import torch
from safetensors.torch import load_file, save_file

from promptlang.errors import CacheError
from promptlang.runtime.kv import ModuleKV
from promptlang.runtime.store import (MARKER, CacheWarning, ModuleStore, clear_disk,
                                      list_disk_entries)

L, H, S, D = 2, 2, 16, 8


def make_kv(seed: int, length: int = S, dtype: torch.dtype = torch.float32) -> ModuleKV:
    g = torch.Generator().manual_seed(seed)
    return ModuleKV(
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


def assert_same(a: ModuleKV, b: ModuleKV) -> None:
    for name in ("keys", "values", "positions", "token_ids", "placeholder"):
        x, y = getattr(a, name), getattr(b, name)
        assert x.dtype == y.dtype and x.shape == y.shape, name
        assert torch.equal(x.cpu(), y.cpu()), name


ENTRY_BYTES = make_kv(0).nbytes


def memory_store(**kw) -> ModuleStore:
    return ModuleStore(disk_budget_bytes=0, **kw)


def tiers_of(store: ModuleStore) -> dict[str, tuple[str, ...]]:
    return {e.key: e.tiers for e in store.entries()}


# ---- disk round trip and format ------------------------------------------------------------

def test_disk_round_trip_in_a_new_store_is_bit_identical(tmp_path):
    kvs = {key_of(i): make_kv(i) for i in range(3)}
    first = ModuleStore(disk_dir=tmp_path)
    for key, kv in kvs.items():
        first.put(key, kv, {"unit": f"doc{key[-1]}", "schema": "travel"})
    del first

    restarted = ModuleStore(disk_dir=tmp_path)
    for key, kv in kvs.items():
        got = restarted.get(key)
        assert got is not None
        assert_same(got, kv)
    stats = restarted.stats
    assert (stats.disk_hits, stats.disk_loads, stats.misses, stats.corrupt_files) == (3, 3, 0, 0)
    assert restarted.get(key_of(0)) is not None
    assert restarted.stats.device_hits == 1 and restarted.stats.disk_loads == 3


def test_disk_file_is_plain_safetensors_with_meta_and_checksum(tmp_path):
    kv = make_kv(7)
    ModuleStore(disk_dir=tmp_path).put(key_of(7), kv, {"unit": "trip-plan", "tokens": 16})
    path = file_of(tmp_path, key_of(7))
    tensors = load_file(path)  # the reference implementation reads our files
    assert set(tensors) == {"keys", "values", "positions", "token_ids", "placeholder"}
    assert torch.equal(tensors["values"], kv.values)
    with open(path, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        md = json.loads(f.read(length))["__metadata__"]
    assert md["key"] == key_of(7) and md["format_version"] == "2" and md["stored"] == "put"
    assert json.loads(md["meta"]) == {"unit": "trip-plan", "tokens": "16"}
    assert json.loads(md["tensors"])["keys"] == {"dtype": "float32", "shape": [L, H, S, D]}
    assert re.fullmatch(r"[0-9a-f]{64}", md["sha256"])
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]


def test_unknown_key_is_a_miss(tmp_path):
    store = ModuleStore(disk_dir=tmp_path)
    assert store.get(key_of(1)) is None
    assert not store.contains(key_of(1))
    assert store.stats.misses == 1


def _flip_middle(path):
    data = bytearray(path.read_bytes())
    mid = len(data) // 2
    for i in range(mid, mid + 4):
        data[i] ^= 0xFF
    path.write_bytes(bytes(data))


def _truncate(path):
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 100])


def _not_safetensors(path):
    path.write_bytes(b"this is not a tensor file, just text\n" * 40)


def _foreign_safetensors(path):
    save_file({"weight": torch.zeros(3, 3)}, str(path), metadata={"format": "pt"})


def _other_keys_file(path):
    other = file_of(path.parent, key_of(99))
    ModuleStore(disk_dir=path.parent).put(key_of(99), make_kv(99))
    os.replace(other, path)  # a valid file of ours, but for another key


def _wrong_shape_declared(path):
    data = bytearray(path.read_bytes())
    (length,) = struct.unpack("<Q", data[:8])
    header = data[8:8 + length].replace(b'\\"shape\\": [2, 2, 16, 8]', b'\\"shape\\": [2, 2, 16, 9]', 1)
    assert header != data[8:8 + length]
    path.write_bytes(bytes(data[:8] + header + data[8 + length:]))


def _trailing_bytes(path):
    with open(path, "ab") as f:
        f.write(b"\0" * 16)


DAMAGES = [
    (_flip_middle, "checksum mismatch"),
    (_truncate, "truncated"),
    (_trailing_bytes, "data section is"),
    (_other_keys_file, "holds key"),
    (_wrong_shape_declared, "declared dtype/shape"),
]
FOREIGN = [
    (_not_safetensors, "not a safetensors file"),
    (_foreign_safetensors, "not a promptlang KV file"),
]


@pytest.fixture(autouse=True)
def fresh_warnings(monkeypatch):
    """Each test sees the store's once-per-process warnings afresh."""
    from promptlang.runtime.store import tier
    monkeypatch.setattr(tier, "_warned", set())


@pytest.mark.parametrize("damage, reason", DAMAGES, ids=[d.__name__.strip("_") for d, _ in DAMAGES])
def test_damaged_file_is_detected_warned_counted_deleted_and_missed(tmp_path, damage, reason):
    key = key_of(5)
    ModuleStore(disk_dir=tmp_path).put(key, make_kv(5))
    path = file_of(tmp_path, key)
    damage(path)

    store = ModuleStore(disk_dir=tmp_path)
    with pytest.warns(CacheWarning, match=re.escape(str(path)) + ".*" + reason):
        assert store.get(key) is None
    assert not path.exists()
    stats = store.stats
    assert (stats.corrupt_files, stats.misses, stats.disk_loads) == (1, 1, 0)

    store.put(key, make_kv(5))  # the caller re-encodes; the fresh file serves a restart
    assert_same(ModuleStore(disk_dir=tmp_path).get(key), make_kv(5))


@pytest.mark.parametrize("damage, reason", FOREIGN, ids=[d.__name__.strip("_") for d, _ in FOREIGN])
def test_file_without_our_tag_at_our_name_is_missed_but_kept_and_not_overwritten(tmp_path, damage,
                                                                                 reason):
    key = key_of(5)
    ModuleStore(disk_dir=tmp_path).put(key, make_kv(5))
    path = file_of(tmp_path, key)
    damage(path)
    content = path.read_bytes()

    store = ModuleStore(disk_dir=tmp_path)
    with pytest.warns(CacheWarning, match=re.escape(str(path)) + ".*" + reason):
        assert store.get(key) is None
    with pytest.warns(CacheWarning, match="did not write is in the way"):
        store.put(key, make_kv(5))
    assert path.read_bytes() == content
    assert store.stats.corrupt_files == 1 and store.stats.disk_write_errors == 1
    assert_same(store.get(key), make_kv(5))     # served from memory, never from that file
    assert clear_disk(tmp_path) == 0 and path.read_bytes() == content


def test_damaged_file_is_never_served_by_prefetch_either(tmp_path):
    ModuleStore(disk_dir=tmp_path).put(key_of(1), make_kv(1))
    _flip_middle(file_of(tmp_path, key_of(1)))
    store = ModuleStore(disk_dir=tmp_path)
    with pytest.warns(CacheWarning):
        assert store.prefetch([key_of(1)]) == 0
    assert store.stats.corrupt_files == 1 and not store.contains(key_of(1))


def test_unusable_disk_dir_raises_cache_error(tmp_path):
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("x")
    with pytest.raises(CacheError, match="file"):
        ModuleStore(disk_dir=not_a_dir)
    with pytest.raises(CacheError):
        ModuleStore(disk_dir=not_a_dir / "kv")  # cannot be created below a file
    with pytest.raises(CacheError):
        list_disk_entries(not_a_dir)


@pytest.mark.skipif(os.name != "posix" or os.geteuid() == 0, reason="root ignores permissions")
def test_unreadable_disk_dir_raises_cache_error(tmp_path):
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0)
    try:
        with pytest.raises(CacheError, match="readable"):
            ModuleStore(disk_dir=locked)
    finally:
        locked.chmod(0o700)


def test_keys_cannot_name_paths(tmp_path):
    store = ModuleStore(disk_dir=tmp_path)
    for bad in ("../escape", "a/b", "", "x.safetensors"):
        with pytest.raises(ValueError):
            store.put(bad, make_kv(0))


def test_put_rejects_malformed_kv(tmp_path):
    kv = make_kv(0)
    bad = ModuleKV(kv.keys, kv.values, kv.positions[:-1], kv.token_ids, kv.placeholder)
    with pytest.raises(ValueError, match="positions"):
        memory_store().put(key_of(0), bad)


# ---- listing and clearing ------------------------------------------------------------------

def test_entries_list_disk_entries_from_a_fresh_store_with_meta(tmp_path):
    writer = ModuleStore(disk_dir=tmp_path)
    writer.put(key_of(1), make_kv(1), {"unit": "system", "schema": "travel"})
    writer.put(key_of(2), make_kv(2), {"unit": "paris", "schema": "travel"})

    fresh = ModuleStore(disk_dir=tmp_path)
    fresh.get(key_of(2))
    fresh.put(key_of(3), make_kv(3), {"unit": "tokyo"})
    listed = {e.key: e for e in fresh.entries()}
    assert listed[key_of(1)].tiers == ("disk",)
    assert listed[key_of(1)].meta == {"unit": "system", "schema": "travel"}
    assert listed[key_of(1)].nbytes == ENTRY_BYTES
    assert listed[key_of(2)].tiers == ("device", "disk")
    assert listed[key_of(3)].meta == {"unit": "tokyo"}
    assert listed[key_of(3)].file_bytes == file_of(tmp_path, key_of(3)).stat().st_size


def test_list_disk_entries_lists_our_files_reports_bad_ones_and_skips_others(tmp_path):
    ModuleStore(disk_dir=tmp_path).put(key_of(1), make_kv(1), {"unit": "a"})
    ModuleStore(disk_dir=tmp_path).put(key_of(3), make_kv(3))
    data = file_of(tmp_path, key_of(3)).read_bytes()
    later = data.replace(b'"format_version":"2"', b'"format_version":"9"', 1)
    assert later != data
    file_of(tmp_path, key_of(3)).write_bytes(later)              # ours, from a later version
    file_of(tmp_path, key_of(2)).write_bytes(b"garbage" * 10)
    (tmp_path / "README.txt").write_text("not ours")
    items = {d["key"]: d for d in list_disk_entries(tmp_path)}
    assert set(items) == {key_of(1), key_of(3)}
    assert items[key_of(1)]["error"] is None and items[key_of(1)]["meta"] == {"unit": "a"}
    assert items[key_of(1)]["length"] == S and items[key_of(1)]["put_dtype"] == "float32"
    assert items[key_of(1)]["stored"] == "put"
    assert "format version '9'" in items[key_of(3)]["error"]
    assert file_of(tmp_path, key_of(2)).exists() and file_of(tmp_path, key_of(3)).exists()
    assert list_disk_entries(tmp_path / "missing") == []


def test_clear_disk_removes_our_entry_and_temporary_files_only(tmp_path):
    store = ModuleStore(disk_dir=tmp_path)
    store.put(key_of(1), make_kv(1))
    store.put(key_of(2), make_kv(2))
    partial = file_of(tmp_path, key_of(1)).read_bytes()[:-100]     # a write cut short
    (tmp_path / f".{file_of(tmp_path, key_of(3)).name}.abc123.tmp").write_bytes(partial)
    (tmp_path / f".{key_of(4)}.abc123.tmp").write_bytes(b"someone else's partial")
    (tmp_path / "README.txt").write_text("not ours")
    assert clear_disk(tmp_path) == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [MARKER, "README.txt", f".{key_of(4)}.abc123.tmp"])
    assert clear_disk(tmp_path / "missing") == 0


def test_evict_and_clear_by_tier(tmp_path):
    store = ModuleStore(disk_dir=tmp_path)
    store.put(key_of(1), make_kv(1))
    store.put(key_of(2), make_kv(2))
    assert store.evict(key_of(1), tiers=["device"])
    assert tiers_of(store)[key_of(1)] == ("disk",)
    assert_same(store.get(key_of(1)), make_kv(1))
    assert store.stats.disk_loads == 1
    assert store.clear(tiers="device") == 2
    assert all(t == ("disk",) for t in tiers_of(store).values())
    assert store.clear() == 2
    assert store.entries() == [] and not store.contains(key_of(2))
    with pytest.raises(ValueError, match="tier"):
        store.clear(tiers=["gpu"])


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
    snapshot = ModuleKV(*(t.clone() for t in (got.keys, got.values, got.positions,
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
