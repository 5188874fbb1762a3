"""The disk tier's files: round trip, format, damaged and foreign files, listing and clearing."""

from __future__ import annotations

import json
import os
import re
import struct

import pytest
import torch
from safetensors.torch import load_file, save_file

from promptlang.errors import CacheError
from promptlang.runtime.kv.unit import UnitKV
from promptlang.runtime.store import (MARKER, CacheWarning, ModuleStore, clear_disk,
                                      list_disk_entries)

from .test_store import (ENTRY_BYTES, D, H, L, S, assert_same, file_of, key_of, make_kv,
                         memory_store, tiers_of)


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
    bad = UnitKV(kv.keys, kv.values, kv.positions[:-1], kv.token_ids, kv.placeholder)
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


# ---- durable writes, and what a crash leaves ---------------------------------------------

def test_a_write_is_fsynced_renamed_then_its_folder_fsynced(tmp_path, monkeypatch):
    import stat

    from promptlang.runtime.store import kvfile

    events = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        events.append(("fsync", "folder" if stat.S_ISDIR(os.fstat(fd).st_mode) else "file"))
        return real_fsync(fd)

    def replace(source, target):
        events.append(("rename", os.path.basename(target)))
        return real_replace(source, target)

    monkeypatch.setattr(kvfile.os, "fsync", fsync)
    monkeypatch.setattr(kvfile.os, "replace", replace)
    store = ModuleStore(disk_dir=tmp_path)                          # writes its marker
    assert events == [("fsync", "file"), ("rename", MARKER), ("fsync", "folder")]
    events.clear()
    store.put(key_of(1), make_kv(1))
    name = file_of(tmp_path, key_of(1)).name
    assert events == [("fsync", "file"), ("rename", name), ("fsync", "folder")]
    assert_same(ModuleStore(disk_dir=tmp_path).get(key_of(1)), make_kv(1))


def _empty(path):
    path.write_bytes(b"")


def _zero_filled(path):                      # what a crash can leave of a file not yet synced
    path.write_bytes(bytes(path.stat().st_size))


def _cut_in_header(path):
    path.write_bytes(path.read_bytes()[:40])


def _cut_in_length(path):
    path.write_bytes(path.read_bytes()[:5])


LEFTOVERS = [(_empty, "empty"), (_zero_filled, "zero bytes"), (_cut_in_header, "cut short"),
             (_cut_in_length, "cut short")]


@pytest.mark.parametrize("leftover, reason", LEFTOVERS,
                         ids=[d.__name__.strip("_") for d, _ in LEFTOVERS])
def test_what_a_crash_left_at_our_name_is_replaced_by_the_next_put(tmp_path, leftover, reason):
    key = key_of(5)
    ModuleStore(disk_dir=tmp_path).put(key, make_kv(5))
    path = file_of(tmp_path, key)
    leftover(path)
    store = ModuleStore(disk_dir=tmp_path)
    store.put(key, make_kv(5))                         # not "a file in the way"
    assert store.stats.disk_write_errors == 0
    assert_same(ModuleStore(disk_dir=tmp_path).get(key), make_kv(5))


@pytest.mark.parametrize("leftover, reason", LEFTOVERS,
                         ids=[d.__name__.strip("_") for d, _ in LEFTOVERS])
def test_what_a_crash_left_at_our_name_is_discarded_when_read(tmp_path, leftover, reason):
    key = key_of(5)
    ModuleStore(disk_dir=tmp_path).put(key, make_kv(5))
    path = file_of(tmp_path, key)
    leftover(path)
    store = ModuleStore(disk_dir=tmp_path)
    with pytest.warns(CacheWarning, match="discarded corrupt .*" + reason):
        assert store.get(key) is None
    assert not path.exists() and store.stats.corrupt_files == 1
    store.put(key, make_kv(5))
    assert_same(ModuleStore(disk_dir=tmp_path).get(key), make_kv(5))


def test_cache_clear_and_a_new_store_treat_crash_leftovers_as_ours(tmp_path):
    store = ModuleStore(disk_dir=tmp_path)
    store.put(key_of(1), make_kv(1))
    data = file_of(tmp_path, key_of(1)).read_bytes()
    empty = file_of(tmp_path, key_of(2))
    empty.write_bytes(b"")
    partial = tmp_path / f".{file_of(tmp_path, key_of(3)).name}.k2j3h4.tmp"
    partial.write_bytes(data[:30])
    (tmp_path / MARKER).unlink()              # a folder from before the marker: adopted, as
    ModuleStore(disk_dir=tmp_path)            # it holds nothing but ours and crash leftovers
    assert (tmp_path / MARKER).is_file()
    foreign = tmp_path / f".{file_of(tmp_path, key_of(4)).name}.abcdef.tmp"
    foreign.write_bytes(b"someone's partial")
    assert clear_disk(tmp_path) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([MARKER, foreign.name])


def test_a_new_store_deletes_a_dead_writers_temporary_files_only(tmp_path):
    import time

    ModuleStore(disk_dir=tmp_path).put(key_of(1), make_kv(1))
    data = file_of(tmp_path, key_of(1)).read_bytes()
    hour_ago = time.time() - 2 * 3600
    names = {"old_partial": (data[:100], hour_ago), "old_whole": (data, hour_ago),
             "old_empty": (b"", hour_ago), "new_partial": (data[:100], time.time()),
             "old_foreign": (b"someone's partial", hour_ago)}
    paths = {}
    for i, (label, (content, mtime)) in enumerate(names.items()):
        path = tmp_path / f".{file_of(tmp_path, key_of(10 + i)).name}.x{i}y.tmp"
        path.write_bytes(content)
        os.utime(path, (mtime, mtime))
        paths[label] = path
    ModuleStore(disk_dir=tmp_path)
    assert {label for label, path in paths.items() if path.exists()} == {"new_partial",
                                                                          "old_foreign"}
