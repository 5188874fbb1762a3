"""bench peers' side-by-side machinery: llama.cpp's line protocol and the engines' turns."""

from __future__ import annotations

from promptlang.bench.peers import _LlamaLines, _turns


def test_a_session_that_cannot_start_says_why(tmp_path):
    """No llama-cpp-python (CI), or no such GGUF (where it is installed): the child's reason,
    not a session."""
    out = _LlamaLines.start(str(tmp_path / "missing.gguf"), 1, 64)
    assert isinstance(out, str)
    assert "llama-cpp-python is not installed" in out or "missing.gguf" in out


def test_every_engine_goes_first_once_every_len_rounds():
    names = ["a", "b", "c"]
    orders = [_turns(names, r) for r in range(3)]
    assert [o[0] for o in orders] == names
    assert all(sorted(o) == names for o in orders)
