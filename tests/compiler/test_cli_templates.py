"""`promptlang compile` of Jinja2 templates and PML files, and `--plan`: outputs, notes and
exit codes (0 ok, 1 diagnostics, 2 usage), through the `promptlang` command's parser."""

from __future__ import annotations

import json
import os

from promptlang.pml import nodes
from promptlang.pml.parser import parse_prompt, parse_schema
from tests.compiler.test_cli import run

EXAMPLES = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "jinja")
DOCS = os.path.join(EXAMPLES, "documents.json")


def test_template_compiles_to_an_indented_schema_and_a_call_to_its_prompt(capsys):
    rag = os.path.join(EXAMPLES, "rag.j2")
    assert run("compile", rag, "--documents", f"docs={DOCS}",
               "--call", 'rag(docs=[3, 1], question="When?")') == 0
    captured = capsys.readouterr()
    schema_text, prompt_text = captured.out.split("\n<prompt")
    schema = parse_schema(schema_text)
    prompt = parse_prompt("<prompt" + prompt_text)
    assert schema.name == "rag" and "\n    <module name=\"docs-0\">" in schema_text
    assert [r.name for r in prompt.children[0].children] == ["docs-1", "docs-3"]
    assert "rag.j2:12:11: note: cached up to here" in captured.err
    assert "`question` has no length bound" in captured.err


def test_template_options_and_their_usage_errors(tmp_path, capsys):
    template = tmp_path / "t.j2"
    template.write_text("Hello {{ name }}.\n{% for d in docs %}{{ d }}\n{% endfor %}")
    docs = tmp_path / "docs.json"
    docs.write_text(json.dumps(["first", "second"]))
    assert run("compile", str(template), "--documents", f"docs={docs}", "--param", "name=4",
               "--role", "none", "--compact") == 0
    out = capsys.readouterr().out.strip()
    assert out.startswith('<schema name="t"><module name="t">Hello <param')   # no indentation
    assert parse_schema(out).children[0].children[1] == nodes.Param("name", 4)
    for bad in (["--param", "name=0"], ["--param", "name"], ["--documents", "docs"],
                ["--documents", f"docs={tmp_path / 'missing.json'}"]):
        assert run("compile", str(template), *bad) == 2, bad
        assert capsys.readouterr().err.startswith("promptlang compile: ")
    docs.write_text('{"not": "a list"}')
    assert run("compile", str(template), "--documents", f"docs={docs}") == 2
    assert "takes a JSON list" in capsys.readouterr().err
    docs.write_text('["a", ')
    assert run("compile", str(template), "--documents", f"docs={docs}") == 2
    assert "docs.json:1:7: not JSON" in capsys.readouterr().err


def test_template_errors_are_located_diagnostics_with_exit_status_one(tmp_path, capsys):
    template = tmp_path / "t.j2"
    template.write_text("Intro {{ q | maxlen(4) }}.\n{{ now() }}\n{% for d in docs %}{% endfor %}")
    assert run("compile", str(template)) == 1
    err = capsys.readouterr().err
    assert f"{template}:2:4: error: a call in `{{{{ ... }}}}` cannot be cached [PL402]" in err
    assert run("compile", str(template), "--lenient") == 0
    assert run("compile", str(tmp_path / "none.j2")) == 2
    assert "no such template file" in capsys.readouterr().err


def test_pml_file_is_written_back_indented(tmp_path, capsys):
    path = tmp_path / "s.pml"
    path.write_text('<schema name="s"><module name="m">Hi <param name="x" len="2"/>.</module>'
                    '</schema>')
    assert run("compile", str(path)) == 0
    out = capsys.readouterr().out
    assert out == ('<schema name="s">\n  <module name="m">\n    Hi \n    <param name="x" '
                   'len="2"/>\n    .\n  </module>\n</schema>\n')
    assert parse_schema(out) == parse_schema(path.read_text())
    assert run("compile", str(path), "--call", "f()") == 2


def test_plan_prints_every_unit_with_its_bytes_and_time(tmp_path, capsys, monkeypatch,
                                                       tiny_model_dir):
    monkeypatch.setenv("PROMPTLANG_HOME", str(tmp_path / "home"))
    template = tmp_path / "t.j2"
    template.write_text("{% block system %}Be brief.{% if long %} Or not.{% endif %}"
                        "{% endblock %}{% block user %}{% for d in docs %}{{ d }}\n{% endfor %}"
                        "{{ q }}{% endblock %}")
    docs = tmp_path / "docs.json"
    docs.write_text(json.dumps(["A first document.", "A second, longer document here."]))
    assert run("compile", str(template), "--documents", f"docs={docs}", "--plan",
               "--model", str(tiny_model_dir)) == 0
    captured = capsys.readouterr()
    assert "measuring this machine's encode rate" in captured.err
    lines = captured.out.splitlines()
    assert lines[0] == "Cache plan of schema t"
    units = [line.split()[0] for line in lines[3:] if line.startswith("module:")]
    assert units == ["module:t", "module:t/long", "module:t/docs-0", "module:t/docs-1"]
    assert "combinations of modules a prompt may import: 9" in captured.out
    assert run("compile", str(template), "--documents", f"docs={docs}", "--plan",
               "--model", str(tiny_model_dir)) == 0
    assert "measuring" not in capsys.readouterr().err       # kept from the first run


def test_check_reads_templates_beside_other_files(tmp_path, capsys):
    good = os.path.join(EXAMPLES, "tools.j2")
    bad = tmp_path / "bad.j2"
    bad.write_text('x {{ f() }} {% include "a.j2" %}')
    assert run("check", good) == 0
    assert "tools.j2: schema tools, 7 modules under its root, no errors" in capsys.readouterr().out
    assert run("check", good, str(bad)) == 1
    out = capsys.readouterr().out
    assert f"{bad}:1:6: error: a call in `{{{{ ... }}}}` cannot be cached [PL402]" in out
    assert "PL403" not in out                      # no cascade from the first error
