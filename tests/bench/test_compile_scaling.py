"""bench/compile_scaling.py: the files it writes compile, each row is measured in a process
of its own, a file over the cap is reported as refused, and the goals read the rows."""

from __future__ import annotations

import ast
import json

from promptlang.bench import compile_scaling


def test_the_written_files_are_python_of_the_asked_size():
    text = "".join(compile_scaling.prompt_blocks(0.01))
    assert 10_000 <= len(text) < 10_400
    ast.parse(text)
    chain = compile_scaling.chain_file(3)
    assert "f1()" in chain and "f2()" in chain and "f3()" not in chain
    ast.parse(chain)


def test_a_run_measures_both_compilers_and_reports_the_refused_size(tmp_path, monkeypatch,
                                                                   capsys):
    monkeypatch.setenv("PROMPTLANG_MAX_PYTHON_BYTES", "30000")
    out = tmp_path / "scaling.json"
    assert compile_scaling.main(["--sizes", "0.005,0.02,0.05", "--chains", "3",
                                 "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    result = json.loads(out.read_text())
    rows = {row["what"]: row for row in result["rows"]}
    assert list(rows) == ["0.005 MB", "0.02 MB", "0.05 MB", "chain of 3"]
    assert result["cap_bytes"] == 30000
    for what in ("0.005 MB", "0.02 MB", "chain of 3"):
        assert rows[what]["ours"]["status"] == 0 and rows[what]["python"]["status"] == 0, what
        assert rows[what]["ours"]["seconds"] > 0 and rows[what]["ours"]["peak_mb"] > 0
    refused = rows["0.05 MB"]
    assert refused["ours"]["status"] == 1 and compile_scaling.rejected(refused)
    assert refused["python"]["status"] == 0
    assert "refused: the file is" in printed
    goals = [line for line in printed.splitlines() if line[:4] in ("PASS", "FAIL")]
    assert goals[0].split()[1:4] == ["compile", "time", "linear"]
    assert "0.05 MB compiled or refused" in goals[1] and "located PL006" in goals[1]
