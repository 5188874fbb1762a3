"""The C heap's free pages given back after a request that ran a large pass
(runtime/model/heap.py): only then, once, and where requests end."""

from __future__ import annotations

import pytest

from promptlang.runtime.model import heap


@pytest.fixture
def trims(monkeypatch):
    """The calls to malloc_trim, counted instead of made."""
    calls: list[int] = []
    monkeypatch.setattr(heap, "_malloc_trim", lambda: calls.append)
    monkeypatch.setattr(heap, "_grown", False)
    return calls


def test_only_a_large_pass_trims_and_only_once(trims):
    heap.note_pass(heap.LARGE_PASS_ROWS - 1)
    assert heap.release_if_grown() is False and trims == []
    heap.note_pass(heap.LARGE_PASS_ROWS)
    heap.note_pass(3)                           # a decode step after it changes nothing
    assert heap.release_if_grown() is True and trims == [0]
    assert heap.release_if_grown() is False and trims == [0]


def test_without_glibc_nothing_is_done(monkeypatch):
    monkeypatch.setattr(heap, "_malloc_trim", lambda: None)
    monkeypatch.setattr(heap, "_grown", False)
    heap.note_pass(4096)
    assert heap.release_if_grown() is False


def test_the_real_malloc_trim_is_found_on_glibc():
    import platform

    if platform.libc_ver()[0] != "glibc":
        pytest.skip("not a glibc system")
    found = heap._malloc_trim()
    assert found is not None and found(0) in (0, 1)


def test_a_request_with_a_long_prompt_gives_its_pages_back_at_its_end(trims, tiny_model_dir):
    from promptlang.runtime import engine

    llm = engine.load(str(tiny_model_dir), recompute="none")
    schema = '<schema name="h"><system>Short.</system></schema>'
    llm.generate('<prompt schema="h"><user>Hi</user><assistant></prompt>', schema=schema,
                 max_new_tokens=2)
    assert trims == []                          # a short request keeps its heap
    long = " ".join(["word"] * (heap.LARGE_PASS_ROWS + 10))
    llm.generate(f'<prompt schema="h"><user>{long}</user><assistant></prompt>', schema=schema,
                 max_new_tokens=2)
    assert trims == [0]
    llm.prefill(f'<prompt schema="h"><user>{long} more</user><assistant></prompt>',
                schema=schema)
    assert trims == [0, 0]
