"""The disk tier touches only its own files: foreign files survive clear and eviction, FIFOs
never block, files are private, and planted or foreign-owned KV is never loaded."""

from __future__ import annotations

import os
import stat
import threading

import pytest
import torch
from safetensors.torch import save_file

from promptlang.errors import CacheError
from promptlang.runtime.store import kvfile, tier
from promptlang.runtime.store import (MARKER, CacheWarning, ModuleStore, clear_disk,
                                      list_disk_entries)
from .test_store import assert_same, file_of, key_of, make_kv


@pytest.fixture(autouse=True)
def fresh_warnings(monkeypatch):
    """Each test sees the store's once-per-process warnings afresh."""
    monkeypatch.setattr(tier, "_warned", set())


def plant_foreign_files(folder) -> dict[str, bytes]:
    """Files a user might keep next to the store; returns name -> content of those files."""
    existing = {p.name for p in folder.iterdir()}
    save_file({"weight": torch.arange(4096, dtype=torch.float32)},
              str(folder / "model.safetensors"), metadata={"format": "pt"})
    (folder / "notes.txt").write_text("mine")
    (folder / f"{key_of(77)}.put.safetensors").write_bytes(b"not a KV file, same name shape")
    (folder / f".{key_of(78)}.put.safetensors.abcdef.tmp").write_bytes(b"someone's partial")
    return {p.name: p.read_bytes() for p in folder.iterdir() if p.name not in existing}


def assert_survive(folder, files: dict[str, bytes]) -> None:
    for name, content in files.items():
        assert (folder / name).read_bytes() == content, name


def finishes(fn, fifos=(), seconds: float = 120.0):
    """fn()'s result; fails (rather than hangs) if fn blocks, e.g. in an open() of a FIFO.
    A blocked reader is released by opening the FIFOs for writing before failing."""
    result, errors = [], []

    def run():
        try:
            result.append(fn())
        except BaseException as err:  # noqa: BLE001 - re-raised in the test's thread
            errors.append(err)

    worker = threading.Thread(target=run, daemon=True)
    worker.start()
    worker.join(seconds)
    if worker.is_alive():
        for fifo in fifos:
            try:
                os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
            except OSError:
                pass
        pytest.fail(f"{fn} blocked (a FIFO was opened)")
    if errors:
        raise errors[0]
    return result[0]


# ---- only our files ----------------------------------------------------------------------------

def test_clear_keeps_foreign_files_and_deletes_only_ours(tmp_path):
    store = ModuleStore(disk_dir=tmp_path)
    for i in range(3):
        store.put(key_of(i), make_kv(i))
    foreign = plant_foreign_files(tmp_path)
    assert clear_disk(tmp_path) == 3
    assert_survive(tmp_path, foreign)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([MARKER, *foreign])


def test_cli_cache_clear_keeps_a_model_safetensors_next_to_the_store(tmp_path, capsys):
    from promptlang import cli
    ModuleStore(disk_dir=tmp_path).put(key_of(1), make_kv(1), {"schema": "s", "unit": "u"})
    foreign = plant_foreign_files(tmp_path)
    assert cli.main(["cache", "ls", "--dir", str(tmp_path)]) == 0
    listed = capsys.readouterr().out
    assert "1 entries" in listed and "s:u" in listed and "model" not in listed
    assert cli.main(["cache", "clear", "--dir", str(tmp_path)]) == 0
    assert "removed 1 entries" in capsys.readouterr().out
    assert_survive(tmp_path, foreign)
    assert not file_of(tmp_path, key_of(1)).exists()


def test_cli_cache_clear_refuses_an_unmarked_folder_and_deletes_nothing(tmp_path, capsys):
    from promptlang import cli
    store_dir = tmp_path / "kv"
    ModuleStore(disk_dir=store_dir).put(key_of(1), make_kv(1))
    other = tmp_path / "downloads"
    other.mkdir()
    foreign = plant_foreign_files(other)
    ours_copied = file_of(other, key_of(1))
    ours_copied.write_bytes(file_of(store_dir, key_of(1)).read_bytes())  # even a KV file of ours
    before = {p.name: p.read_bytes() for p in other.iterdir()}

    assert cli.main(["cache", "clear", "--dir", str(other)]) == 1
    err = capsys.readouterr().err
    assert str(other) in err and MARKER in err and "nothing was changed" in err
    assert "Traceback" not in err
    assert {p.name: p.read_bytes() for p in other.iterdir()} == before
    assert_survive(other, foreign)
    assert cli.main(["cache", "ls", "--dir", str(other)]) == 1
    with pytest.raises(CacheError, match="does not delete"):
        clear_disk(other)


def test_cache_clear_adopts_a_kv_home_from_before_markers_but_not_a_dir_argument(
        tmp_path, monkeypatch, capsys):
    from promptlang import cli
    monkeypatch.setenv("PROMPTLANG_HOME", str(tmp_path / "home"))
    home_kv = tmp_path / "home" / "kv"
    ModuleStore(disk_dir=home_kv).put(key_of(1), make_kv(1))
    (home_kv / MARKER).unlink()                    # as an earlier promptlang left it
    assert cli.main(["cache", "clear", "--dir", str(home_kv)]) == 1
    assert file_of(home_kv, key_of(1)).exists()
    assert cli.main(["cache", "clear"]) == 0
    assert "removed 1 entries" in capsys.readouterr().out
    assert sorted(p.name for p in home_kv.iterdir()) == [MARKER]
    (home_kv / MARKER).unlink()
    (home_kv / "notes.txt").write_text("mine")     # not only ours: refused even as the home
    assert cli.main(["cache", "clear"]) == 1 and (home_kv / "notes.txt").exists()


def test_a_store_refuses_an_unmarked_folder_that_holds_other_files(tmp_path):
    foreign = plant_foreign_files(tmp_path)
    with pytest.raises(CacheError, match="not a promptlang KV folder.*model.safetensors"):
        ModuleStore(disk_dir=tmp_path)
    assert_survive(tmp_path, foreign)
    assert not (tmp_path / MARKER).exists()


def test_a_store_adopts_a_folder_holding_only_promptlang_kv_files(tmp_path):
    ModuleStore(disk_dir=tmp_path).put(key_of(1), make_kv(1))
    (tmp_path / MARKER).unlink()                    # a KV folder from before the marker
    store = ModuleStore(disk_dir=tmp_path)
    assert (tmp_path / MARKER).is_file()
    assert_same(store.get(key_of(1)), make_kv(1))


def test_disk_eviction_counts_and_deletes_only_our_files(tmp_path):
    probe = ModuleStore(disk_dir=tmp_path / "probe")
    probe.put(key_of(0), make_kv(0))
    size = file_of(tmp_path / "probe", key_of(0)).stat().st_size
    disk = tmp_path / "kv"
    ModuleStore(disk_dir=disk)                      # creates and marks the folder
    foreign = plant_foreign_files(disk)
    assert (disk / "model.safetensors").stat().st_size > 2 * size   # would be evicted first
    store = ModuleStore(disk_dir=disk, disk_budget_bytes=2 * size + size // 2)
    for i in range(1, 5):
        store.put(key_of(i), make_kv(i))
    assert_survive(disk, foreign)
    assert store.stats.disk_evictions == 2
    kept = sorted(p.name.split(".")[0] for p in disk.glob(f"*{'.put.safetensors'}")
                  if p.name.split(".")[0] != key_of(77))
    assert kept == [key_of(3), key_of(4)]
    for i in (3, 4):
        assert_same(ModuleStore(disk_dir=disk).get(key_of(i)), make_kv(i))


def test_evict_of_a_key_whose_name_holds_a_foreign_file_leaves_it(tmp_path):
    store = ModuleStore(disk_dir=tmp_path)
    path = file_of(tmp_path, key_of(5))
    path.write_bytes(b"a file someone put here")
    assert not store.evict(key_of(5))
    assert path.read_bytes() == b"a file someone put here"


# ---- FIFOs -------------------------------------------------------------------------------------

@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs on this platform")
def test_a_fifo_in_the_folder_blocks_no_listing_lookup_put_eviction_or_clear(tmp_path, capsys):
    from promptlang import cli
    store = ModuleStore(disk_dir=tmp_path, disk_budget_bytes=10**9)
    store.put(key_of(1), make_kv(1))
    fifos = [file_of(tmp_path, key_of(2)), tmp_path / "pipe.safetensors",
             tmp_path / f".{key_of(3)}.put.safetensors.zzz.tmp"]
    for fifo in fifos:
        os.mkfifo(fifo)

    fresh = ModuleStore(disk_dir=tmp_path, disk_budget_bytes=10**9)
    with pytest.warns(CacheWarning, match="not a regular file"):
        assert finishes(lambda: fresh.get(key_of(2)), fifos) is None      # a lookup
    assert finishes(lambda: fresh.prefetch([key_of(2)]), fifos) == 0
    assert finishes(lambda: fresh.contains(key_of(2)) is False, fifos)
    finishes(lambda: fresh.put(key_of(4), make_kv(4)), fifos)             # scans for eviction
    with pytest.warns(CacheWarning, match="is in the way"):
        finishes(lambda: fresh.put(key_of(2), make_kv(2)), fifos)         # FIFO at its name
    listed = finishes(lambda: [e.key for e in fresh.entries()], fifos)
    assert listed == [key_of(i) for i in (1, 2, 4)]
    assert finishes(lambda: cli.main(["cache", "ls", "--dir", str(tmp_path)]), fifos) == 0
    assert "2 entries" in capsys.readouterr().out
    assert finishes(lambda: clear_disk(tmp_path), fifos) == 2
    assert all(stat.S_ISFIFO(os.lstat(f).st_mode) for f in fifos)         # left alone
    assert finishes(lambda: ModuleStore(disk_dir=tmp_path), fifos) is not None


# ---- private files, untrusted files ------------------------------------------------------------

def test_files_are_0600_and_folders_0700_whatever_the_umask(tmp_path):
    old = os.umask(0o002)
    try:
        folder = tmp_path / "a" / "kv"
        ModuleStore(disk_dir=folder).put(key_of(1), make_kv(1))
        loose = tmp_path / "loose"
        loose.mkdir(mode=0o775)
        loose.chmod(0o775)
        ModuleStore(disk_dir=loose).put(key_of(1), make_kv(1))
    finally:
        os.umask(old)
    for directory in (folder, folder.parent, loose):
        assert stat.S_IMODE(directory.stat().st_mode) == 0o700, directory
    for path in (file_of(folder, key_of(1)), folder / MARKER, file_of(loose, key_of(1))):
        assert stat.S_IMODE(path.stat().st_mode) == 0o600, path


def _plant(folder, key: str, kv) -> None:
    """A self-consistent KV file for `key` written by someone else (group-writable)."""
    elsewhere = folder.parent / "elsewhere"
    ModuleStore(disk_dir=elsewhere).put(key, kv)
    planted = file_of(folder, key)
    planted.write_bytes(file_of(elsewhere, key).read_bytes())
    planted.chmod(0o664)


def test_a_planted_group_writable_file_is_not_loaded_but_re_encoded_with_one_warning(tmp_path):
    folder = tmp_path / "kv"
    ModuleStore(disk_dir=folder)
    real = {i: make_kv(i) for i in (1, 2)}
    for i in real:
        _plant(folder, key_of(i), make_kv(100 + i))     # KV that is not what the key names

    store = ModuleStore(disk_dir=folder)
    with pytest.warns(CacheWarning, match="others can write to it") as caught:
        assert store.get(key_of(1)) is None
        assert store.get(key_of(2)) is None
    assert len([w for w in caught if "not loading" in str(w.message)]) == 1  # once per reason
    assert store.stats.untrusted_files == 2 and store.stats.disk_loads == 0
    for i, kv in real.items():                            # the caller re-encodes and puts
        store.put(key_of(i), kv)
        assert stat.S_IMODE(file_of(folder, key_of(i)).stat().st_mode) == 0o600
    restarted = ModuleStore(disk_dir=folder)
    for i, kv in real.items():
        assert_same(restarted.get(key_of(i)), kv)
    assert restarted.stats.untrusted_files == 0


def test_a_foreign_owned_file_is_not_loaded_but_re_encoded(tmp_path, monkeypatch):
    folder = tmp_path / "kv"
    ModuleStore(disk_dir=folder).put(key_of(1), make_kv(1))
    victim = file_of(folder, key_of(1))
    real_reason = kvfile.untrusted_reason

    def reason(path):
        if os.fspath(path) == os.fspath(victim) and os.lstat(path).st_ino == planted_inode:
            return "it is owned by uid 4242, not by the current user"
        return real_reason(path)

    planted_inode = victim.stat().st_ino
    monkeypatch.setattr(kvfile, "untrusted_reason", reason)
    store = ModuleStore(disk_dir=folder)
    with pytest.warns(CacheWarning, match="owned by uid 4242"):
        assert store.get(key_of(1)) is None
    store.put(key_of(1), make_kv(1))
    assert victim.stat().st_ino != planted_inode         # replaced by a file of this user's
    assert_same(ModuleStore(disk_dir=folder).get(key_of(1)), make_kv(1))


def test_a_folder_of_another_user_is_refused(tmp_path, monkeypatch):
    folder = tmp_path / "kv"
    folder.mkdir()
    real_getuid = os.getuid
    monkeypatch.setattr(os, "getuid", lambda: real_getuid() + 4242)
    with pytest.raises(CacheError, match="belongs to uid"):
        ModuleStore(disk_dir=folder)
    assert list(folder.iterdir()) == []


def test_listing_shows_each_store_dtype_and_nothing_is_corrupted(tmp_path):
    kv = make_kv(9)
    for dtype in (None, torch.bfloat16, torch.float16):
        ModuleStore(disk_dir=tmp_path, dtype=dtype).put(key_of(9), kv, {"unit": "u"})
    items = list_disk_entries(tmp_path)
    assert sorted(i["stored"] for i in items) == ["bfloat16", "float16", "put"]
    assert all(i["error"] is None and i["key"] == key_of(9) for i in items)
    for dtype in (None, torch.bfloat16, torch.float16):
        got = ModuleStore(disk_dir=tmp_path, dtype=dtype).get(key_of(9))
        expected = kv.keys if dtype is None else kv.keys.to(dtype).float()
        assert torch.equal(got.keys, expected)


def _rewrite_header(path, edit) -> None:
    """Rewrite a safetensors file's JSON header through `edit(header) -> header`."""
    import json
    import struct

    data = path.read_bytes()
    (length,) = struct.unpack("<Q", data[:8])
    header = edit(json.loads(data[8:8 + length]))
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data[8 + length:])


def test_hostile_headers_in_the_store_folder_are_listed_or_skipped_never_a_crash(tmp_path):
    import struct

    store = ModuleStore(disk_dir=tmp_path)
    store.put(key_of(1), make_kv(1))
    store.put(key_of(2), make_kv(2))
    deep = tmp_path / f"{key_of(3)}.put.safetensors"          # a JSON bomb of nesting
    deep.write_bytes(struct.pack("<Q", 400_000) + b"[" * 200_000 + b"]" * 200_000)
    os.chmod(deep, 0o600)

    def no_rows(header):
        header["positions"]["shape"] = []
        return header

    def deep_meta(header):
        header["__metadata__"]["meta"] = "[" * 100_000 + "]" * 100_000
        return header

    _rewrite_header(file_of(tmp_path, key_of(1)), no_rows)
    _rewrite_header(file_of(tmp_path, key_of(2)), deep_meta)
    listed = {item["key"]: item for item in list_disk_entries(tmp_path)}
    assert set(listed) == {key_of(1), key_of(2)}              # the untagged bomb is not ours
    assert all(item["error"] for item in listed.values())       # listed as unreadable
    assert clear_disk(tmp_path) == 2
    assert deep.exists()                                       # not ours: left alone


def test_an_empty_file_at_our_name_that_is_a_link_or_another_users_is_left_alone(
        tmp_path, monkeypatch):
    """Crash leftovers are replaced only when they are the user's own regular files: a link
    to an empty file, or an empty file of another user's, stays foreign."""
    folder = tmp_path / "kv"
    store = ModuleStore(disk_dir=folder)
    outside = tmp_path / "outside"
    outside.write_bytes(b"")
    link = file_of(folder, key_of(1))
    link.symlink_to(outside)
    with pytest.warns(CacheWarning, match="did not write is in the way"):
        store.put(key_of(1), make_kv(1))
    assert link.is_symlink() and outside.read_bytes() == b""
    theirs = file_of(folder, key_of(2))
    theirs.write_bytes(b"")
    real_getuid = os.getuid
    monkeypatch.setattr(os, "getuid", lambda: real_getuid() + 4242)   # now it is not ours
    store.put(key_of(2), make_kv(2))
    assert theirs.read_bytes() == b"" and store.stats.disk_write_errors == 2
    monkeypatch.setattr(os, "getuid", real_getuid)
    assert clear_disk(folder) == 0 and link.is_symlink()
    assert not theirs.exists()                      # the user's own empty leftover: cleared
