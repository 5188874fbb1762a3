"""Byte sizes (promptlang/sizes.py), the store budgets `serve` starts with, and `load`'s
budgets reaching the store."""

from __future__ import annotations

import pytest

from promptlang.cli import main
from promptlang.cli.serve import store_budgets
from promptlang.errors import InvalidArgumentError
from promptlang.sizes import (DISK_CAP, MEMORY_CAP, default_disk_budget, default_memory_budget,
                              format_size, parse_size)


@pytest.mark.parametrize("text, expected", [("2GiB", 2 << 30), ("512 MiB", 512 << 20),
                                            ("1.5G", 3 << 29), ("0", 0), ("100", 100),
                                            ("3kb", 3072), ("none", None), (" Unlimited ", None)])
def test_sizes_read_as_people_write_them(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["", "lots", "-1G", "2 GiBs", "1e9", "G", "x" * 100])
def test_a_text_that_is_not_a_size_is_a_clear_error(text):
    with pytest.raises(InvalidArgumentError, match="--memory-budget"):
        parse_size(text, "--memory-budget")


def test_sizes_print_with_a_binary_unit():
    assert format_size(100) == "100 B"
    assert format_size(1536) == "1.5 KiB"
    assert format_size(5 << 30) == "5.0 GiB"
    assert format_size(None) == "none"


def test_the_default_budgets_are_a_share_of_this_machine_and_capped(tmp_path):
    memory = default_memory_budget()
    disk = default_disk_budget(tmp_path / "not" / "made" / "yet")
    assert 0 < memory <= MEMORY_CAP
    assert 0 < disk <= DISK_CAP
    budgets = store_budgets(None, None)
    assert budgets["memory_budget_bytes"] == memory
    assert 0 < budgets["disk_budget_bytes"] <= DISK_CAP
    assert store_budgets("1GiB", "none") == {"memory_budget_bytes": 1 << 30,
                                             "disk_budget_bytes": None}


def test_serve_refuses_a_bad_budget_before_loading_anything(capsys):
    assert main(["serve", "--memory-budget", "lots"]) == 2
    assert "--memory-budget 'lots' is not a size" in capsys.readouterr().err
    assert main(["serve", "--ray", "--disk-budget", "lots"]) == 2     # before Ray starts
    assert "--disk-budget 'lots' is not a size" in capsys.readouterr().err
    assert main(["serve", "--ray", "--replica-memory", "-1"]) == 2
    assert "--replica-memory must be >= 0, not -1" in capsys.readouterr().err


def test_load_s_budgets_bound_the_store(tiny_model_dir, tmp_path, monkeypatch):
    from promptlang.runtime import engine

    monkeypatch.setenv("PROMPTLANG_HOME", str(tmp_path / "home"))
    llm = engine.load(tiny_model_dir, memory_budget_bytes=4096, disk_budget_bytes=0)
    assert llm.store.memory_budget_bytes == 4096
    assert llm.store.disk_dir is None                   # 0: no disk tier
    bounded = engine.load(tiny_model_dir, disk_budget_bytes=1 << 20)
    assert bounded.store.disk_dir == tmp_path / "home" / "kv"
    free = engine.load(tiny_model_dir)
    assert free.store.memory_budget_bytes is None
