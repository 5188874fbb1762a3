"""What loading a converted copy computed once, kept beside it for the next load.

A converted copy (loading.py: the default model's, or a GGUF's) is a folder promptlang wrote
and never changes. A load computes things from its files that the next load would compute
again to the same value: the model's fingerprint (a hash of every weight), the tokenizer's
(a canonical dump of its whole vocabulary), which of a GGUF's blocks equal the float weights
bit for bit (every weight read twice). `LoadRecord` keeps them in one JSON file in the
folder, stamped with every other file's size, modification and change times and inode: a
value is handed back only while that stamp still holds, so a copy whose files were replaced
computes afresh.

The file is private (0600, in the copy's 0700 folder), written whole to a temporary file
and renamed, so a reader sees the old record or the new one. It is a cache: a record that
cannot be read or written costs time, never an answer, and is said nowhere else.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

RECORD = "promptlang-load.json"
RECORD_VERSION = 1
MAX_RECORD_BYTES = 1 << 20       # larger is not a record this module wrote


class LoadRecord:
    """The record of the converted copy in `folder` (see the module doc)."""

    def __init__(self, folder: str | os.PathLike):
        self.folder = Path(folder)
        self.path = self.folder / RECORD
        self._stamp = _stamp(self.folder)
        self._values = self._read()

    def get(self, key: str) -> Any:
        """The value kept under `key` for these files, or None."""
        return self._values.get(key)

    def put(self, key: str, value: Any) -> None:
        """Keep `value` (JSON) under `key`; a folder that cannot be written keeps nothing."""
        self._values[key] = value
        text = json.dumps({"version": RECORD_VERSION, "stamp": self._stamp,
                           "values": self._values}, sort_keys=True)
        try:
            handle, temporary = tempfile.mkstemp(prefix=".record-", dir=self.folder)
        except OSError:
            return
        try:
            with os.fdopen(handle, "w", encoding="utf-8") as out:
                out.write(text)
            os.replace(temporary, self.path)
        except OSError:
            try:
                os.unlink(temporary)
            except OSError:
                pass

    def _read(self) -> dict[str, Any]:
        try:
            if self.path.stat().st_size > MAX_RECORD_BYTES:
                return {}
            data = json.loads(self.path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return {}
        if not isinstance(data, dict) or data.get("version") != RECORD_VERSION:
            return {}
        if data.get("stamp") != self._stamp or not isinstance(data.get("values"), dict):
            return {}
        return dict(data["values"])


def _stamp(folder: Path) -> list[list[Any]]:
    """[name, size, modification and change times (ns), inode] of every file in `folder` but
    the record (and its temporary files), sorted by name. A file written again has a new
    change time, which no call can set back."""
    stamp = []
    try:
        entries = sorted(os.scandir(folder), key=lambda entry: entry.name)
    except OSError:
        return []
    for entry in entries:
        if entry.name == RECORD or entry.name.startswith(".record-"):
            continue
        try:
            info = entry.stat()
        except OSError:
            continue
        stamp.append([entry.name, info.st_size, info.st_mtime_ns, info.st_ctime_ns,
                      info.st_ino])
    return stamp
