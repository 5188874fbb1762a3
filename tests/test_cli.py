"""The `promptlang` command: help, exit codes, located errors, the layout table."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from promptlang import cli
from promptlang.errors import PromptLangError

SCHEMA = textwrap.dedent("""\
    <schema name="travel">
      <system>You are a travel agent.</system>
      <module name="trip-plan">Plan a trip lasting <param name="duration" len="4"/>.
        <union>
          <module name="tokyo">about Tokyo</module>
          <module name="paris">all about lovely Paris</module>
        </union>
      </module>
      <module name="extra" cache="false">Live prices follow.</module>
      <scaffold name="docs">
        <module name="doc-a">A one two</module>
        <module name="doc-b">B three</module>
      </scaffold>
    </schema>
    """)

PROMPT = textwrap.dedent("""\
    <prompt schema="travel">
      <trip-plan duration="3 days"><paris/></trip-plan>
      <user>What should I see first?</user>
    </prompt>
    """)

# line 3 opens a module with no name
BROKEN = textwrap.dedent("""\
    <schema name="broken">
      <system>Hi</system>
      <module>text</module>
    </schema>
    """)


@pytest.fixture
def files(tmp_path):
    paths = {}
    for name, text in (("travel.pml", SCHEMA), ("prompt.pml", PROMPT), ("broken.pml", BROKEN)):
        paths[name] = tmp_path / name
        paths[name].write_text(text)
    return paths


def run(argv, capsys):
    status = cli.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return status, out, err


# --- help, version, usage ---------------------------------------------------------

def test_help_exits_zero_and_names_the_pml_command(capsys):
    status, out, _ = run(["--help"], capsys)
    assert status == 0
    assert "pml" in out and "usage: promptlang" in out


def test_pml_check_help_documents_its_options(capsys):
    status, out, _ = run(["pml", "check", "--help"], capsys)
    assert status == 0
    for option in ("--tokenizer", "--no-layout", "--schema"):
        assert option in out


def test_version_prints_the_package_version(capsys):
    from importlib.metadata import version

    status, out, _ = run(["--version"], capsys)
    assert status == 0 and out.strip() == f"promptlang {version('promptlang')}"


@pytest.mark.parametrize("argv", [[], ["pml"], ["pml", "check"], ["no-such-command"],
                                  ["pml", "check", "x.pml", "--bogus"]])
def test_usage_errors_exit_two(argv, capsys):
    status, _, err = run(argv, capsys)
    assert status == 2
    assert "usage:" in err


def test_console_script_runs_without_a_traceback():
    result = subprocess.run(["promptlang", "--help"], capture_output=True, text=True,
                            stdin=subprocess.DEVNULL)
    assert result.returncode == 0, result.stderr
    assert "pml" in result.stdout


def test_importing_the_cli_does_not_import_torch():
    code = "import sys, promptlang.cli; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


# --- command groups ------------------------------------------------------------------

def test_help_lists_every_command_with_one_line_each(capsys):
    status, out, _ = run(["--help"], capsys)
    assert status == 0
    listed = [line.split()[0] for line in out.splitlines()
              if line.startswith("    ") and len(line.split()) > 1]
    assert listed == ["check", "compile", "pml", "run", "serve", "tune", "cache", "bench"]


def test_registered_command_runs_and_its_errors_print_without_traceback(tmp_path, monkeypatch,
                                                                      capsys):
    (tmp_path / "hello_cli_mod.py").write_text(textwrap.dedent("""\
        from promptlang.errors import ModelError

        def register(subparsers):
            hello = subparsers.add_parser("hello")
            hello.add_argument("--fail", action="store_true")
            hello.set_defaults(func=run)

        def run(args):
            if args.fail:
                raise ModelError("no model here")
            print("hello ran")
            return 3
        """))
    monkeypatch.syspath_prepend(str(tmp_path))
    import hello_cli_mod

    monkeypatch.setattr(cli, "GROUPS", (hello_cli_mod,))
    assert run(["hello"], capsys)[:2] == (3, "hello ran\n")
    status, _, err = run(["hello", "--fail"], capsys)
    assert status == 1
    assert err.strip() == "no model here" and "Traceback" not in err


# --- pml check: parsing only --------------------------------------------------------------

def test_check_valid_files_without_layout_exits_zero(files, capsys):
    status, out, err = run(["pml", "check", "--no-layout", files["travel.pml"],
                            files["prompt.pml"]], capsys)
    assert status == 0, err
    assert f"{files['travel.pml']}: schema 'travel': valid" in out
    assert f"{files['prompt.pml']}: prompt for schema 'travel': valid" in out
    assert err == ""


def test_check_invalid_file_prints_a_located_error_and_exits_one(files, capsys):
    status, out, err = run(["pml", "check", "--no-layout", files["broken.pml"]], capsys)
    assert status == 1
    assert err.startswith(f"{files['broken.pml']}:3:")
    assert "<module>text</module>" in err and "^" in err
    assert "Traceback" not in err and "valid" not in out


def test_check_reports_every_file_and_fails_if_any_fails(files, capsys):
    status, out, err = run(["pml", "check", "--no-layout", files["broken.pml"],
                            files["travel.pml"]], capsys)
    assert status == 1
    assert "schema 'travel': valid" in out
    assert f"{files['broken.pml']}:3:" in err


def test_check_missing_file_is_an_error_not_a_traceback(tmp_path, capsys):
    missing = tmp_path / "nowhere.pml"
    status, _, err = run(["pml", "check", "--no-layout", missing], capsys)
    assert status == 1
    assert str(missing) in err and "Traceback" not in err


def test_check_with_an_unknown_tokenizer_is_an_error(files, tmp_path, capsys):
    status, _, err = run(["pml", "check", "--tokenizer", tmp_path / "no-tokenizer",
                          files["travel.pml"]], capsys)
    assert status == 1
    assert "not found locally" in err and "Traceback" not in err


# --- pml check: layout and binding (need the parser, layout and binder) ---------------------

def test_format_layout_table_with_positions_worked_out_by_hand(wordtok):
    from promptlang.pml.layout import lay_out
    from promptlang.pml.parser import parse_schema

    schema = parse_schema('<schema name="s">Hello world<module name="a">one two '
                          '<param name="x" len="3"/> three</module><union>'
                          '<module name="b">b1 b2</module><module name="c">c1</module>'
                          '</union></schema>')
    rows = {line.split()[0]: line.split() for line in
            cli.format_layout(lay_out(schema, wordtok), wordtok).splitlines()[2:]}
    # root "Hello world" = 2 tokens; a = "one", " two", then the slot: the space before
    # the parameter and its 3 positions, then " three"
    assert rows["a"][1:5] == ["2", "9", "(7)", "7"]
    assert rows["a"][-1] == "x@4+4"
    # union members share start 9; the union reserves the longest member (2 tokens)
    assert rows["b"][1:6] == ["9", "11", "(2)", "2", "0@9"]
    assert rows["c"][1:6] == ["9", "10", "(1)", "1", "0@9"]
    assert rows["(root)"][1] == "0"
    assert cli.format_layout(lay_out(schema, wordtok), wordtok).splitlines()[0].startswith(
        "  11 positions of 4096")


def test_check_prints_the_layout_table_of_a_schema(files, default_tokenizer, capsys):
    from promptlang.default_model import default_tokenizer_dir
    from promptlang.pml.layout import lay_out
    from promptlang.pml.parser import parse_file

    status, out, err = run(["pml", "check", "--tokenizer", default_tokenizer_dir(),
                            files["travel.pml"]], capsys)
    assert status == 0, err
    layout = lay_out(parse_file(files["travel.pml"]), default_tokenizer)
    lines = out.splitlines()
    header = next(line for line in lines if line.split()[:3] == ["module", "start", "end"])
    assert header.split() == ["module", "start", "end", "(len)", "own", "union", "scaffold",
                              "cache", "params"]
    table = {line.split()[0]: line.split() for line in lines[lines.index(header) + 1:]}
    assert set(table) == {"/".join(p) or "(root)" for p in layout.modules}
    paris = layout.module(("trip-plan", "paris"))
    assert table["trip-plan/paris"][1:3] == [str(paris.start), str(paris.end)]
    assert table["trip-plan/paris"][5] == f"{paris.union}@{layout.unions[paris.union].start}"
    slot = layout.module(("trip-plan",)).params[0]
    assert table["trip-plan"][-1] == f"duration@{slot.start}+5"     # 4, and the space before
    assert table["extra"][7] == "no"
    assert table["doc-a"][6] == "docs"
    assert f"{layout.end} positions of 8192" in out


def test_check_binds_a_prompt_against_its_schema(files, default_tokenizer, capsys):
    from promptlang.default_model import default_tokenizer_dir
    from promptlang.pml.binding import bind
    from promptlang.pml.layout import lay_out
    from promptlang.pml.parser import parse_file

    status, out, err = run(["pml", "check", "--tokenizer", default_tokenizer_dir(),
                            "--schema", files["travel.pml"], files["prompt.pml"]], capsys)
    assert status == 0, err
    assert "imports: (root), trip-plan, trip-plan/paris" in out
    layout = lay_out(parse_file(files["travel.pml"]), default_tokenizer)
    bound = bind(parse_file(files["prompt.pml"]), layout, default_tokenizer)
    uncached = sum(len(s.token_ids) for s in bound.uncached)
    assert f"uncached tokens: {uncached} " in out
    assert uncached >= len(default_tokenizer.encode("What should I see first?"))


def test_check_reports_a_binding_error_with_its_location(files, tmp_path, capsys):
    from promptlang.default_model import default_tokenizer_dir

    bad = tmp_path / "bad-prompt.pml"
    bad.write_text('<prompt schema="travel">\n  <trip-plan duration="3 days"><rome/>'
                   '</trip-plan>\n</prompt>\n')
    status, _, err = run(["pml", "check", "--tokenizer", default_tokenizer_dir(),
                          "--schema", files["travel.pml"], bad], capsys)
    assert status == 1
    assert err.startswith(f"{bad}:2:") and "rome" in err and "Traceback" not in err


def test_schema_option_must_name_a_schema(files, capsys):
    status, _, err = run(["pml", "check", "--schema", files["prompt.pml"],
                          files["prompt.pml"]], capsys)
    assert status == 1
    assert "--schema needs a <schema> file" in err


def test_check_default_tokenizer_is_the_default_models(files, default_tokenizer, capsys,
                                                       monkeypatch):
    from promptlang import hf_tokenizer

    seen = []
    real = hf_tokenizer.load_tokenizer
    monkeypatch.setattr(hf_tokenizer, "load_tokenizer",
                        lambda name=None: seen.append(name) or real(name))
    status, out, err = run(["pml", "check", files["travel.pml"], files["travel.pml"]], capsys)
    assert status == 0, err
    assert seen == [None]                       # loaded once, the default
    assert out.count("positions of 8192") == 2
    assert os.path.basename(str(files["travel.pml"])) in out


# --- one `check`, by kind of file ---------------------------------------------------------

APP = textwrap.dedent("""\
    from promptlang import prompt

    @prompt
    def greet(name: str):
        "Hello, "
        name
    """)


def test_check_of_pml_files_is_pml_check(files, default_tokenizer, capsys):
    from promptlang.default_model import default_tokenizer_dir

    argv = ["--tokenizer", default_tokenizer_dir(), files["travel.pml"], files["prompt.pml"]]
    alias = run(["pml", "check", *argv], capsys)
    assert alias[0] == 0, alias[2]
    assert run(["check", *argv], capsys) == alias
    assert "imports: (root), trip-plan, trip-plan/paris" in alias[1]


def test_check_of_a_broken_pml_file_exits_one_with_a_located_error(files, capsys):
    status, out, err = run(["check", "--no-layout", files["broken.pml"]], capsys)
    assert status == 1 and err.startswith(f"{files['broken.pml']}:3:") and "valid" not in out


def test_check_of_a_python_file_prints_its_prompt_diagnostics(tmp_path, capsys):
    app = tmp_path / "greet_app.py"
    app.write_text(APP)
    status, out, _ = run(["check", app], capsys)
    assert status == 0 and out.strip() == f"{app}: 1 @prompt function, no errors"


def test_check_of_mixed_files_checks_each_and_returns_the_worst_status(files, tmp_path,
                                                                      capsys):
    app = tmp_path / "greet_app.py"
    app.write_text(APP)
    status, out, err = run(["check", "--no-layout", app, files["travel.pml"],
                            files["broken.pml"]], capsys)
    assert status == 1
    assert f"{app}: 1 @prompt function, no errors" in out
    assert "schema 'travel': valid" in out and f"{files['broken.pml']}:3:" in err
    status, _, err = run(["check", tmp_path / "missing_app.py", files["travel.pml"],
                          "--no-layout"], capsys)
    assert status == 2 and "missing_app.py" in err


def test_check_help_documents_both_kinds_and_the_pml_options(capsys):
    status, out, _ = run(["check", "--help"], capsys)
    assert status == 0
    for words in (".py", "PML", "--tokenizer", "--no-layout", "--schema"):
        assert words in out


def test_run_says_where_the_load_s_time_went():
    from promptlang.cli.run import load_parts

    assert load_parts({"file": 0.31, "weights": 1.04, "blocks": 0.2}) == \
        " (file 0.3, weights 1.0, blocks 0.2)"
    assert load_parts({}) == ""
