"""`promptlang cache`: list or empty the module store's disk tier (`ls` also lists the seam
adapters `promptlang tune` wrote).

    promptlang cache ls [--dir DIR]
    promptlang cache clear [--dir DIR]
"""

from __future__ import annotations

import argparse
import time
from typing import Any

from promptlang.sizes import format_size


def register(subparsers: Any) -> None:
    cache = subparsers.add_parser("cache", help="inspect or empty the KV store on disk",
                                  description="The module store's disk tier.")
    cache.set_defaults(group_parser=cache)
    commands = cache.add_subparsers(title="commands", metavar="COMMAND")
    ls = commands.add_parser("ls", help="list stored units")
    ls.add_argument("--dir", metavar="DIR", help="store folder (default: the KV home)")
    ls.set_defaults(func=_cache_ls)
    clear = commands.add_parser("clear", help="delete every stored unit",
                                description="Delete the KV files promptlang wrote; other files "
                                            "stay. A folder the store did not create (it has no "
                                            ".promptlang-kv-store marker) is refused.")
    clear.add_argument("--dir", metavar="DIR", help="store folder (default: the KV home)")
    clear.set_defaults(func=_cache_clear)


def _cache_ls(args: argparse.Namespace) -> int:
    from promptlang.runtime.store import list_disk_entries

    entries = list_disk_entries(args.dir)
    total = 0
    for e in entries:
        total += e["file_bytes"]
        if e["error"]:
            print(f"{e['key'][:16]}  unreadable: {e['error']}")
            continue
        meta = e["meta"]
        modified = time.strftime("%Y-%m-%d %H:%M", time.localtime(e["modified"]))
        print(f"{e['key'][:16]}  {e['length']:>6} tokens  {format_size(e['file_bytes']):>9}  "
              f"{e['stored']:>8}  {modified}  {meta.get('schema', '?')}:{meta.get('unit', '?')}")
    print(f"{len(entries)} entries, {format_size(total)}")
    if args.dir is None:
        _list_adapters()
    return 0


def _list_adapters() -> None:
    """The seam adapters `promptlang tune` wrote, one line each (home's adapters/)."""
    from promptlang.home import ADAPTER_FILE, adapters_dir

    files = sorted(adapters_dir().glob(f"*/{ADAPTER_FILE}"))
    if not files:
        return
    from promptlang.errors import AdapterFileError
    from promptlang.runtime.model.lora import SeamLoRA

    print("seam adapters:")
    for path in files:
        try:
            adapter, meta = SeamLoRA.load(path)
        except AdapterFileError as e:
            print(f"  {path.parent.name}  unreadable: {e}")
            continue
        form = f"LoRA rank {adapter.shape.rank}"
        if adapter.shape.link_tokens:
            form += f" + {adapter.shape.link_tokens} link tokens"
        if adapter.shape.encodes:
            form += ", also encoding the modules"
        print(f"  {path.parent.name}  model {meta.get('model_fingerprint', '?')[:16]}  {form}  "
              f"{meta.get('steps', '?')} steps, {meta.get('minutes', '?')} min  "
              f"{format_size(path.stat().st_size)}  {path}")


def _cache_clear(args: argparse.Namespace) -> int:
    from promptlang.runtime.store import clear_disk

    print(f"removed {clear_disk(args.dir)} entries")
    return 0

