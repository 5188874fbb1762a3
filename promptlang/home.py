"""Where promptlang keeps files between runs, and the rules that keep them private.

`PROMPTLANG_HOME` overrides the location (default: `$XDG_CACHE_HOME/promptlang`,
else `~/.cache/promptlang`). It holds the default model, converted models, the KV
disk tier, the compiled CPU kernels and tuned seam adapters.

Everything promptlang writes there is private to the user: folders 0700, files 0600,
written to a temporary name and renamed into place. Everything it loads from there
(a kernel library, a KV file) is first checked with `untrusted_reason`: a file that
another user owns, or that others could have written, is never loaded.
"""

from __future__ import annotations

import os
import stat
import tempfile
from pathlib import Path
from typing import Iterable

DIR_MODE = 0o700
FILE_MODE = 0o600


def promptlang_home() -> Path:
    env = os.environ.get("PROMPTLANG_HOME")
    if env:
        return Path(env).expanduser()
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(cache) / "promptlang"


def models_dir() -> Path:
    return promptlang_home() / "models"


def kv_dir() -> Path:
    return promptlang_home() / "kv"


ADAPTER_FILE = "seam-lora.safetensors"     # a seam adapter's file, in its model's folder


def adapters_dir() -> Path:
    return promptlang_home() / "adapters"


def adapter_folder(fingerprint: str) -> Path:
    """Where `promptlang tune` keeps the seam adapter of the model with `fingerprint`."""
    return adapters_dir() / fingerprint[:16]


def compute_dir() -> Path:
    """Where measurements of this machine are kept, per CPU and model: the switch point of
    bfloat16 compute, the encode rate `compile --plan` estimates with."""
    return promptlang_home() / "compute"


def native_dir() -> Path:
    return promptlang_home() / "native"


def private_dir(path: str | os.PathLike) -> Path:
    """Create `path` (and missing parents) with mode 0700; tighten it if it is ours and looser.

    Parents that already exist are left as they are (they may be the user's ~/.cache);
    folders this call creates get 0700 whatever the umask.
    """
    path = Path(path)
    missing = []
    probe = path
    while not probe.exists():
        missing.append(probe)
        if probe.parent == probe:
            break
        probe = probe.parent
    for folder in reversed(missing):
        try:
            folder.mkdir(mode=DIR_MODE)
        except FileExistsError:
            pass
        _tighten(folder)
    if not missing:
        _tighten(path)
    return path


def _tighten(folder: Path) -> None:
    try:
        info = folder.stat()
        if info.st_uid == os.getuid() and stat.S_IMODE(info.st_mode) & 0o077:
            folder.chmod(stat.S_IMODE(info.st_mode) & ~0o077)
    except OSError:
        pass                      # the caller's next write says what is wrong


def write_private(path: str | os.PathLike, data: bytes | Iterable[bytes | memoryview]) -> None:
    """Write `data` to `path` as a 0600 file, atomically and durably: under a temporary name
    in the same folder (`.<name>.<random>.tmp`), fsynced, renamed into place, then the folder
    fsynced (the rename itself survives a crash). The temporary file is removed on any error.

    `data` may also be a sequence of byte chunks, written in order (no joined copy)."""
    path = Path(path)
    private_dir(path.parent)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as handle:     # mkstemp creates it 0600
            for chunk in ((data,) if isinstance(data, (bytes, bytearray, memoryview)) else data):
                handle.write(chunk)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    fsync_dir(path.parent)


def fsync_dir(directory: str | os.PathLike) -> None:
    """fsync a folder, so the names just created or renamed in it survive a crash (a no-op
    where folders cannot be opened, e.g. Windows)."""
    flags = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(directory, flags)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:           # a file system that cannot sync folders: nothing more to do
        pass
    finally:
        os.close(fd)


MISSING = "it does not exist"      # untrusted_reason's answer for a path with no file


def untrusted_reason(path: str | os.PathLike) -> str | None:
    """Why the file at `path` must not be loaded, or None when it may be.

    A file may be loaded when it is a regular file (not a link, FIFO or device), owned by
    the current user, and neither it nor its folder is writable by group or others.
    """
    path = Path(path)
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return MISSING
    except OSError as err:
        return f"it cannot be read ({err.strerror})"
    if not stat.S_ISREG(info.st_mode):
        return "it is not a regular file"
    if info.st_uid != os.getuid():
        return f"it is owned by uid {info.st_uid}, not by the current user"
    if info.st_mode & 0o022:
        return "others can write to it"
    try:
        folder = os.stat(path.parent)
    except OSError as err:
        return f"its folder cannot be read ({err.strerror})"
    if folder.st_uid != os.getuid():
        return f"its folder is owned by uid {folder.st_uid}, not by the current user"
    if folder.st_mode & 0o022:
        return "others can write to its folder"
    return None
