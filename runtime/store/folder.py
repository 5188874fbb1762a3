"""The disk tier's folder: which folder the store may use, and which files in it are its own.

Folder: private (0700), marked with a `.promptlang-kv-store` file when the store creates it
or adopts an empty folder or one holding only promptlang KV files (`open_dir`); any other
unmarked folder is refused, by `clear_disk` and `list_disk_entries` too (which adopt the KV
home as a store would).

Files: only regular files (lstat first, never followed) whose header carries the
promptlang-kv tag (`kvfile.peek_header`) are listed, counted, evicted or deleted; anything
else is left alone -- except what a crash left of ours (`kvfile.crash_leftover`: a file of
the user's, at one of our KV or temporary names, empty, zero-filled or cut short inside its
header), which `cache clear` deletes, a store replaces, and a store deletes at start when it
is a temporary file over an hour old (`remove_stale_temporaries`). `list_disk_entries` and
`clear_disk` are what `promptlang cache ls` and `cache clear` run.
"""

from __future__ import annotations

import os
import re
import stat
import time
from pathlib import Path

from promptlang.errors import CacheError, CorruptFileError
from promptlang.home import kv_dir, private_dir, untrusted_reason, write_private
from promptlang.inputs import read_bytes
from promptlang.runtime.store.key import SUFFIX, file_name
from promptlang.runtime.store.kvfile import check_header, crash_leftover, dtype_name, peek_header

MARKER = ".promptlang-kv-store"

_MARKER_TEXT = b"promptlang-kv-store 1\n"
_TMP_RE = re.compile(r"\.[0-9A-Za-z_.-]+\.tmp\Z")  # write_private's temporary names (and v1's)
_KV_NAME = r"[0-9A-Za-z_-]{1,128}\.[0-9A-Za-z_]+" + re.escape(SUFFIX)   # <key>.<stored><SUFFIX>
_KV_NAME_RE = re.compile(_KV_NAME + r"\Z")
_KV_TMP_RE = re.compile(r"\." + _KV_NAME + r"\.[0-9A-Za-z_]+\.tmp\Z")    # write_private's
STALE_TMP_S = 3600       # a temporary KV file this old is a dead writer's (deleted at start)


# ---- listing and clearing (`promptlang cache ls` / `cache clear`) ----------------------------

def list_disk_entries(disk_dir: str | os.PathLike | None = None) -> list[dict]:
    """Every promptlang KV file in `disk_dir` (default the KV home), sorted by key.

    Each dict: key, path, stored (the store dtype, or "put"), file_bytes, nbytes (tensor
    bytes), modified (mtime, seconds), meta (the caller's meta), put_dtype, length (tokens),
    error (None, or why the file is not one this promptlang reads). Only headers are read:
    checksums are verified on load. Files without the promptlang-kv tag are not listed; a
    folder without the store's marker raises CacheError (a missing one lists nothing).
    """
    directory = _existing_dir(disk_dir, "list")
    if directory is None:
        return []
    result = []
    for path, info, header, data_start in _our_files(directory):
        md = header["__metadata__"]
        key = str(md.get("key", ""))
        stored = str(md.get("stored", ""))
        item = {"key": key, "path": str(path), "stored": stored, "file_bytes": info.st_size,
                "nbytes": 0, "modified": info.st_mtime, "meta": {}, "put_dtype": "",
                "length": 0, "error": None}
        try:
            checked = check_header(header, key, stored, info.st_size - data_start)
            if path.name != file_name(key, stored):
                raise CorruptFileError("its name does not match its key and store dtype")
            item.update(nbytes=checked["data_bytes"], meta=checked["meta"],
                        put_dtype=dtype_name(checked["put_dtype"]), length=checked["length"])
        except FileNotFoundError:
            continue
        except (CorruptFileError, OSError) as err:
            item["error"] = str(err)
        result.append(item)
    return sorted(result, key=lambda item: (item["key"], item["stored"], item["path"]))


def clear_disk(disk_dir: str | os.PathLike | None = None) -> int:
    """Delete every promptlang KV file (and leftover temporary one) in `disk_dir`; returns the
    number of KV files removed. Other files stay; a folder without the store's marker raises
    CacheError and nothing in it is deleted (a missing folder: 0)."""
    directory = _existing_dir(disk_dir, "delete")
    if directory is None:
        return 0
    removed = sum(unlink_same(path, info) for path, info, _, _ in _our_files(directory))
    for path, info, _, _ in _our_files(directory, temporary=True):
        unlink_same(path, info)
    for path, info in _leftovers(directory):
        unlink_same(path, info)
    return removed


def remove_stale_temporaries(directory: Path, older_than_s: float = STALE_TMP_S) -> int:
    """Delete the temporary KV files of ours (tagged, or crash leftovers) in `directory`
    last written over `older_than_s` ago: a writer that died. Returns how many."""
    cutoff = time.time() - older_than_s
    removed = 0
    for entry in listdir(directory):
        if not _KV_TMP_RE.match(entry.name):
            continue
        info = regular_stat(entry)
        if info is None or info.st_mtime > cutoff or info.st_uid != os.getuid():
            continue
        path = Path(entry.path)
        if peek_header(path, info) is not None or crash_leftover(path, info) is not None:
            removed += unlink_same(path, info)
    return removed


# ---- the folder and the files in it ---------------------------------------------------------

def open_dir(directory: Path) -> None:
    """Make `directory` this store's folder: created 0700 and marked, or an existing folder of
    the user's that is marked, empty, or holds nothing but promptlang KV files (marked now)."""
    if os.path.lexists(directory) and not directory.is_dir():
        raise CacheError(f"KV cache directory {directory} is not a directory")
    try:
        private_dir(directory)
    except OSError as err:
        raise CacheError(f"KV cache directory {directory} cannot be created: {err}") from None
    if not os.access(directory, os.R_OK | os.W_OK | os.X_OK):
        raise CacheError(f"KV cache directory {directory} is not readable and writable "
                         "(set PROMPTLANG_HOME or pass disk_dir= to use another place)")
    info = os.stat(directory)
    if info.st_uid != os.getuid() or info.st_mode & 0o022:
        whose = (f"belongs to uid {info.st_uid}" if info.st_uid != os.getuid()
                 else "is writable by others")
        raise CacheError(f"KV cache directory {directory} {whose}: promptlang keeps KV only in "
                         "a folder private to the user (pass disk_dir= another place)")
    problem = _marker_problem(directory)
    if problem is None:
        return
    if os.path.lexists(directory / MARKER):
        raise CacheError(f"KV cache directory {directory} cannot be used: {problem}")
    ours = {path.name for path, _, _, _ in _our_files(directory)}
    ours |= {path.name for path, _, _, _ in _our_files(directory, temporary=True)}
    ours |= {path.name for path, _ in _leftovers(directory)}
    others = sorted(entry.name for entry in listdir(directory)
                    if entry.name not in ours and not entry.name.startswith(f".{MARKER}."))
    if others:
        shown = ", ".join(others[:3]) + (f" and {len(others) - 3} more" if len(others) > 3 else "")
        raise CacheError(f"KV cache directory {directory} is not a promptlang KV folder: it has "
                         f"no {MARKER} marker and holds other files ({shown}); pass disk_dir= "
                         "an empty or new folder")
    try:
        write_private(directory / MARKER, _MARKER_TEXT)
    except OSError as err:
        raise CacheError(f"KV cache directory {directory} cannot be marked: {err}") from None


def _marker_problem(directory: Path) -> str | None:
    """Why `directory` is not marked as a folder the store created, or None when it is."""
    marker = directory / MARKER
    reason = untrusted_reason(marker)
    if reason is not None:
        return f"{marker}: {reason}"
    try:
        text = read_bytes(marker, max_bytes=4096, error=CacheError)
    except CacheError as err:
        return str(err)
    return None if text == _MARKER_TEXT else f"{marker} is not promptlang's marker"


def _existing_dir(disk_dir: str | os.PathLike | None, action: str) -> Path | None:
    """The marked folder `disk_dir` names, or None if there is none. The KV home (None) is
    adopted as a store would adopt it, so a KV home from before markers can be listed and
    cleared; any other folder without the marker is refused."""
    if disk_dir is None:
        directory = kv_dir()
        if not os.path.lexists(directory):
            return None
        open_dir(directory)
        return directory
    directory = Path(disk_dir)
    if not os.path.lexists(directory):
        return None
    problem = _marker_problem(directory)
    if problem is not None:
        raise CacheError(f"promptlang does not {action} files in {directory}: it is not a folder "
                         f"promptlang's KV store created ({problem}); nothing was changed")
    return directory


def listdir(directory: Path) -> list[os.DirEntry]:
    try:
        with os.scandir(directory) as entries:
            return list(entries)
    except FileNotFoundError:
        return []
    except OSError as err:
        raise CacheError(f"KV cache directory {directory} cannot be read: {err}") from None


def _our_files(directory: Path, temporary: bool = False):
    """(path, lstat, header, data start) of each regular file in `directory` whose header
    carries the promptlang-kv tag: KV files, or with `temporary` write_private's leftovers.
    Names are filtered and types checked with lstat before anything is opened."""
    for entry in sorted(listdir(directory), key=lambda e: e.name):
        name = entry.name
        if temporary:
            if not _TMP_RE.match(name) or name.startswith(f".{MARKER}."):
                continue
        elif name.startswith(".") or not name.endswith(SUFFIX):
            continue
        info = regular_stat(entry)
        if info is None:
            continue
        peeked = peek_header(Path(entry.path), info)
        if peeked is not None:
            yield Path(entry.path), info, *peeked


def _leftovers(directory: Path):
    """(path, lstat) of each file at one of our KV or temporary names that a crash left of
    ours (`kvfile.crash_leftover`; a file with our tag is not one: `_our_files` has it)."""
    for entry in sorted(listdir(directory), key=lambda e: e.name):
        if not (_KV_NAME_RE.match(entry.name) or _KV_TMP_RE.match(entry.name)):
            continue
        info = regular_stat(entry)
        if info is not None and crash_leftover(Path(entry.path), info) is not None:
            yield Path(entry.path), info


def regular_stat(entry: os.DirEntry) -> os.stat_result | None:
    """The entry's lstat when it is a regular file (never a link, FIFO or device), else None."""
    try:
        info = entry.stat(follow_symlinks=False)
    except FileNotFoundError:
        return None
    return info if stat.S_ISREG(info.st_mode) else None


def is_regular(path: Path) -> bool:
    try:
        return stat.S_ISREG(os.lstat(path).st_mode)
    except OSError:
        return False


def unlink_same(path: Path, info: os.stat_result) -> bool:
    """Delete `path` if it is still the file `info` describes (not one put there since)."""
    try:
        now = os.lstat(path)
        if (now.st_dev, now.st_ino) != (info.st_dev, info.st_ino):
            return False
        path.unlink()
        return True
    except FileNotFoundError:
        return False


def unlink_ours(path: Path) -> bool:
    """Delete `path` if it is a regular file carrying our tag."""
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return False
    if not stat.S_ISREG(info.st_mode) or peek_header(path, info) is None:
        return False
    return unlink_same(path, info)


def touch(path: Path) -> None:
    try:
        os.utime(path, follow_symlinks=False)
    except (OSError, NotImplementedError):
        pass  # evicted meanwhile, or a read-only file: only the disk LRU order is affected
