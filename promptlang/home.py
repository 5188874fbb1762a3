"""Where promptlang keeps files between runs: the default model, converted models, the KV disk tier.

`PROMPTLANG_HOME` overrides the location (default: `$XDG_CACHE_HOME/promptlang`,
else `~/.cache/promptlang`).
"""

from __future__ import annotations

import os
from pathlib import Path


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
