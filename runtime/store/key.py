"""The store's key, and the disk file name it maps to.

A key is an opaque digest made by the encoder from everything that determines a unit's KV
(model fingerprint, encoding rule, token ids, positions, context units' keys), so a key names
its content: two puts of one key carry the same tensors. The store only checks its spelling,
which also keeps it safe as a file name: `<key>.<stored><SUFFIX>`, where <stored> is the store
dtype (`float32`, `bfloat16`, ...) or `put` for a store that keeps KV as put.
"""

from __future__ import annotations

import re

from promptlang.errors import InvalidArgumentError

SUFFIX = ".safetensors"

KEY_RE = re.compile(r"[0-9A-Za-z_-]{1,128}\Z")


def check_key(key: str) -> None:
    """ValueError unless `key` is 1-128 characters of [0-9A-Za-z_-]."""
    if not isinstance(key, str) or not KEY_RE.match(key):
        raise InvalidArgumentError(f"store key must be 1-128 characters of [0-9A-Za-z_-], "
                                   f"got {key!r}")


def file_name(key: str, stored: str) -> str:
    """The disk file name of `key` in a store whose dtype is named `stored`."""
    return f"{key}.{stored}{SUFFIX}"


def key_of_file(name: str, stored: str) -> str | None:
    """The key of file `name` if it is one of the names of a store with dtype `stored`."""
    tail = f".{stored}{SUFFIX}"
    key = name[:-len(tail)] if name.endswith(tail) else ""
    return key if KEY_RE.match(key) else None
