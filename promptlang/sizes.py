"""Byte sizes as people write them ("2GiB", "512 MiB", "1.5G", "0", "none") and as
promptlang prints them, and the store budgets `serve` starts with on this machine.

Units are powers of 1024 whether or not the "i" is written (KiB = K = KB); a bare number
is bytes. "none" (or "unlimited") is no budget at all.
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

from promptlang.errors import InvalidArgumentError

_UNITS = {"": 1, "b": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(?:i?b)?\s*$", re.IGNORECASE)
MAX_TEXT = 32                   # longer size text is refused before it is read
UNLIMITED = ("none", "unlimited")

# serve's defaults: a share of the machine, capped (a server shares it with the OS and others)
MEMORY_SHARE = 0.25             # of the machine's RAM, for the store's memory tier
MEMORY_CAP = 8 << 30
DISK_SHARE = 0.10               # of the free space where the store's folder is
DISK_CAP = 20 << 30


def parse_size(text: str, what: str = "size") -> int | None:
    """The byte count `text` names (None: "none"); InvalidArgumentError naming `what`."""
    if not isinstance(text, str) or len(text) > MAX_TEXT:
        raise InvalidArgumentError(f"{what} must be a size like 2GiB, 512MiB or 0 (or none)")
    if text.strip().lower() in UNLIMITED:
        return None
    match = _SIZE.match(text)
    if match is None:
        raise InvalidArgumentError(f"{what} {text!r} is not a size: write e.g. 2GiB, 512MiB, "
                                   f"1.5G, a number of bytes, or none")
    number, unit = match.groups()
    return int(float(number) * _UNITS[unit.lower()])


def format_size(n: int | None) -> str:
    """`n` bytes as a short text with a binary unit ("none" for None)."""
    if n is None:
        return "none"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n} B" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def total_memory() -> int | None:
    """This machine's RAM in bytes (None where the OS does not say)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def default_memory_budget() -> int:
    """A quarter of the RAM, at most MEMORY_CAP (1 GiB where the RAM is unknown)."""
    ram = total_memory()
    return 1 << 30 if ram is None else min(MEMORY_CAP, int(ram * MEMORY_SHARE))


def default_disk_budget(folder: Path) -> int:
    """A tenth of the free space where `folder` is (or its nearest existing parent), at most
    DISK_CAP."""
    place = Path(folder)
    while not place.exists() and place != place.parent:
        place = place.parent
    try:
        free = shutil.disk_usage(place).free
    except OSError:
        return 1 << 30
    return min(DISK_CAP, int(free * DISK_SHARE))
