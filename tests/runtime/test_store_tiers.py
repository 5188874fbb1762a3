"""The store's parts on their own: the eviction policy over a chain of tiers, the disk LRU
order, and the key's file names."""

from __future__ import annotations

import os

from promptlang.runtime.store.key import file_name, key_of_file
from promptlang.runtime.store.memory import MemoryTier
from promptlang.runtime.store.eviction import oldest_first, place, trim_to_budget
from promptlang.runtime.store.tier import Entry

from .test_store import ENTRY_BYTES, key_of, make_kv


def entry(i: int) -> Entry:
    kv = make_kv(i)
    return Entry(kv, {}, kv.nbytes, kv.keys.dtype)


def test_a_third_memory_tier_takes_what_the_second_evicts():
    chain = [MemoryTier(name, 2 * ENTRY_BYTES) for name in ("device", "host", "third")]
    for i in range(7):
        place(chain, key_of(i), entry(i))
    assert [list(tier.entries) for tier in chain] == [
        [key_of(5), key_of(6)], [key_of(3), key_of(4)], [key_of(1), key_of(2)]]
    assert [tier.evictions for tier in chain] == [5, 3, 1]    # key 0 fell off the end
    assert all(tier.used == 2 * ENTRY_BYTES for tier in chain)


def test_placing_a_key_again_moves_it_to_the_top_without_duplicates():
    chain = [MemoryTier("device", ENTRY_BYTES), MemoryTier("host", None)]
    for i in range(3):
        place(chain, key_of(i), entry(i))
    place(chain, key_of(0), chain[1].entries[key_of(0)])
    assert list(chain[0].entries) == [key_of(0)]
    assert list(chain[1].entries) == [key_of(1), key_of(2)]


def test_an_entry_too_big_for_every_tier_is_placed_nowhere():
    chain = [MemoryTier("device", ENTRY_BYTES - 1), MemoryTier("host", 0)]
    assert place(chain, key_of(1), entry(1)) is None
    assert all(not tier.entries and tier.used == 0 for tier in chain)


def test_disk_order_takes_the_later_of_mtime_and_this_process_use(tmp_path):
    files = {}
    for name, mtime in (("a", 10), ("b", 20), ("c", 30)):
        (tmp_path / name).write_bytes(b"x")
        os.utime(tmp_path / name, ns=(mtime, mtime))
        files[name] = os.lstat(tmp_path / name)
    used = {"a": (40, 0)}                      # a was used here after c's file was written
    assert oldest_first(files, lambda n: used.get(n, (0, -1))) == ["b", "c", "a"]


def test_trim_stops_once_within_budget_and_skips_what_it_could_not_remove():
    removed = []

    def remove(name: str) -> int:
        removed.append(name)
        return 0 if name == "stuck" else 10

    trim_to_budget(35, 20, ["stuck", "x", "y", "z"], remove)
    assert removed == ["stuck", "x", "y"]


def test_file_names_map_back_to_their_key_for_their_store_dtype_only():
    name = file_name(key_of(7), "bfloat16")
    assert name == f"{key_of(7)}.bfloat16.safetensors"
    assert key_of_file(name, "bfloat16") == key_of(7)
    assert key_of_file(name, "put") is None
    assert key_of_file("../x.put.safetensors", "put") is None
