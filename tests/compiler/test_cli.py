"""`promptlang compile` and `promptlang check` of Python files: outputs, files and exit codes
(0 ok, 1 diagnostics, 2 usage), driven through the `promptlang` command's parser."""

from __future__ import annotations

import os
import textwrap

import pytest

from promptlang.cli import build_parser
from promptlang.pml.parser import parse_prompt, parse_schema
from promptlang.pml.writer import write_pretty

DEMO = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "compile_demo.py")


def run(*argv: str) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:
        return int(e.code)
    return args.func(args)


def write(tmp_path, name: str, source: str) -> str:
    path = tmp_path / name
    path.write_text(textwrap.dedent(source))
    return str(path)


def test_compile_prints_one_schema_per_prompt_function(capsys):
    assert run("compile", DEMO) == 0
    lines = capsys.readouterr().out.strip().split("\n<schema")
    schemas = [parse_schema(("<schema" if i else "") + text) for i, text in enumerate(lines)]
    assert [s.name for s in schemas] == ["compile_demo.greeting", "demo.support"]


def test_compile_writes_files_and_the_prompt_of_a_call(tmp_path, capsys):
    out = tmp_path / "pml"
    call = ('support(product="camera", plan="basic", customer="Ada", question="Is it on?", '
            'formal=True)')
    assert run("compile", DEMO, "-o", str(out), "--call", call) == 0
    assert sorted(os.listdir(out)) == ["compile_demo.greeting.pml", "demo.support.pml",
                                       "demo.support.prompt.pml"]
    schema = parse_schema((out / "demo.support.pml").read_text())
    prompt = parse_prompt((out / "demo.support.prompt.pml").read_text())
    assert prompt.schema == schema.name
    compact = ('<prompt schema="demo.support"><support><camera-or-doorbell/><plan-basic/>'
               '<greeting><formal name="Ada"/></greeting></support>Is it on?</user></prompt>')
    assert (out / "demo.support.prompt.pml").read_text() == write_pretty(parse_prompt(compact))
    assert capsys.readouterr().out == ""
    assert run("compile", DEMO, "--call", call, "--compact") == 0
    assert capsys.readouterr().out.strip().split("\n")[-1] == compact


def test_check_reports_no_errors_for_the_demo(capsys):
    assert run("check", DEMO) == 0
    assert "2 @prompt functions, no errors" in capsys.readouterr().out


def test_a_syntax_error_is_a_located_message_not_a_traceback(tmp_path, capsys):
    path = write(tmp_path, "broken_app.py", """\
        from promptlang import prompt

        @prompt
        def f(:
            "x"
        """)
    assert run("compile", path) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"{path}:4:7: error: ")
    assert "[PL001]" in err and "Traceback" not in err
    assert run("check", path) == 1


def test_check_prints_every_diagnostic_of_the_file_and_exits_1(tmp_path, capsys):
    path = write(tmp_path, "loops_app.py", """\
        from promptlang import prompt

        @prompt
        def f(items):
            for item in items:
                item
            "cached"

        @prompt
        def g(x):
            "x"
            return x
        """)
    assert run("check", path) == 1
    out = capsys.readouterr().out
    assert f"{path}:5:5: error: this `for` loop emits text" in out
    assert f"{path}:12:5: error: a @prompt function cannot return a value" in out
    assert out.index("[PL201]") < out.index("[PL102]")


def test_a_module_that_fails_to_import_is_reported_where_it_failed(tmp_path, capsys):
    path = write(tmp_path, "raising_app.py", """\
        from promptlang import prompt

        VALUE = 1 / 0
        """)
    assert run("check", path) == 1
    assert f"{path}:3:" in capsys.readouterr().out


@pytest.mark.parametrize("argv", [
    ("compile", "no/such/file.py"),
    ("check", "no/such/file.py"),
    ("compile", DEMO, "--call", "support("),
    ("compile", DEMO, "--call", "support(product=open('x'))"),
    ("compile", DEMO, "--call", "nothing_here()"),
    ("compile",),
])
def test_usage_errors_exit_2(argv, capsys):
    assert run(*argv) == 2


def test_a_call_that_raises_exits_1_with_its_location(tmp_path, capsys):
    path = write(tmp_path, "call_app.py", """\
        from promptlang import prompt

        @prompt
        def f(x):
            if x.missing:
                "x"
        """)
    assert run("compile", path, "--call", "f(x=1)") == 1
    assert f"{path}:5:" in capsys.readouterr().err


EXAMPLES = os.path.join(os.path.dirname(__file__), "..", "..", "examples")


@pytest.mark.parametrize("name", sorted(f for f in os.listdir(EXAMPLES)
                                        if f.endswith(".py") and not f.startswith("_")))
def test_every_example_compiles_and_its_schemas_parse(name, capsys):
    assert run("compile", os.path.join(EXAMPLES, name)) == 0
    out = capsys.readouterr().out
    for chunk in out.split("<schema ")[1:]:
        schema = "<schema " + chunk[:chunk.index("</schema>") + len("</schema>")]
        parse_schema(schema)


@pytest.mark.parametrize("command", ["check", "compile"])
def test_help_says_the_file_is_imported_and_run(command, capsys):
    assert run(command, "--help") == 0
    assert "top-level code runs" in " ".join(capsys.readouterr().out.split())


def test_a_file_with_a_utf8_bom_compiles_to_its_schema(tmp_path, capsys):
    path = tmp_path / "bom_demo.py"
    path.write_bytes(b"\xef\xbb\xbffrom promptlang import prompt\n\n@prompt\ndef f():\n"
                     b'    "Doc."\n    "Hello"\n')
    assert run("compile", str(path)) == 0
    assert parse_schema(capsys.readouterr().out).name == "bom_demo.f"


def test_diagnostics_name_the_file_as_the_command_line_does(tmp_path, capsys, monkeypatch):
    write(tmp_path, "relative_app.py", """\
        from promptlang import prompt

        @prompt
        def f(items):
            for item in items:
                item
            "cached"
        """)
    monkeypatch.chdir(tmp_path)
    assert run("check", "relative_app.py") == 1
    assert capsys.readouterr().out.startswith("relative_app.py:5:5: error: ")


NAMED = """
from promptlang import prompt, user

@prompt(name=NAME)
def f(q: str):
    with user():
        q
"""


@pytest.mark.parametrize("name", ["../../escaped", "a/b", "x" * 300, ".hidden"])
def test_compile_output_names_that_are_not_plain_file_names_write_nothing(tmp_path, capsys,
                                                                            name):
    source = write(tmp_path, "named.py", NAMED.replace("NAME", repr(name)))
    out = tmp_path / "out" / "a"
    assert run("compile", source, "-o", str(out)) == 2
    err = capsys.readouterr().err
    assert "is not a plain file name" in err and "Traceback" not in err
    assert not (tmp_path / "out").exists()
    assert not list(tmp_path.rglob("escaped*")) and not list(tmp_path.rglob("*.pml"))


def test_compile_into_an_unwritable_output_is_one_clear_line(tmp_path, capsys):
    source = write(tmp_path, "named.py", NAMED.replace("NAME", repr("fine")))
    blocker = tmp_path / "afile"
    blocker.write_text("")
    assert run("compile", source, "-o", str(blocker)) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"promptlang compile: cannot write {blocker}") and "Traceback" not in err
