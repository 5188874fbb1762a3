"""Hostile inputs end in a located diagnostic with a stable code (or simply work where Python
accepts the file), never in a traceback: through `promptlang check`/`compile` and through
@prompt itself."""

from __future__ import annotations

import json
import os
import sys
import textwrap

import pytest

from promptlang.compiler import CompileError, MaxTokens, gen
from promptlang.compiler import pyfile as cli
from promptlang.compiler.markers import MAX_TOKENS_CAP
from promptlang.errors import PromptLangError
from promptlang.pml.parser import parse_schema
from promptlang.tokenizer import WordTokenizer

from .support import load
from .test_cli import run, write


def check(tmp_path, capsys, name: str, source: str | bytes) -> tuple[int, str, str]:
    """(exit status, stdout, path) of `promptlang check` on `source` saved as `name`."""
    path = tmp_path / name
    if isinstance(source, bytes):
        path.write_bytes(source)
    else:
        path.write_text(textwrap.dedent(source), encoding="utf-8")
    status = run("check", str(path))
    captured = capsys.readouterr()
    assert "Traceback" not in captured.out + captured.err
    return status, captured.out + captured.err, str(path)


def codes(error: CompileError) -> list[tuple[str, int]]:
    return [(d.code, d.span.line) for d in error.diagnostics]


# -- too deep: long expressions, nested blocks -------------------------------------------


def test_an_expression_too_long_for_python_is_PL004_at_its_line(tmp_path, capsys):
    terms = "+".join(["x"] * 5000)
    status, out, path = check(tmp_path, capsys, "long_app.py", (
        "from promptlang import prompt\n\n@prompt\ndef f(x):\n    f'{" + terms + "}'\n"))
    assert status == 1
    assert out.startswith(f"{path}:5:5: error: ") and "[PL004]" in out


def test_an_expression_too_long_for_the_analysis_is_PL004_at_its_line():
    terms = "+".join(["x"] * 600)      # CPython compiles it; libcst's visitors run out of stack
    with pytest.raises(CompileError) as error:
        load("from promptlang import prompt\n\n@prompt\ndef f(x):\n    f'{" + terms + "}'\n")
    assert codes(error.value) == [("PL004", 5)]


NESTED_IFS = "from promptlang import prompt\n\n@prompt\ndef f(x):\n" + "".join(
    "    " * (i + 1) + f"if x > {i}:\n" for i in range(21)) + "    " * 22 + "'deep'\n"


def test_21_nested_ifs_compile_although_cpython_allows_20_nested_blocks():
    function = load(NESTED_IFS).f
    assert "deep" in function.schema_pml()
    assert function(100).prompt_pml().count("<x-gt-") == 21
    assert function(5).prompt_pml().count("<x-gt-") == 5
    assert "<x-gt-" not in function(-1).prompt_pml()


def test_21_nested_ifs_pass_check(tmp_path, capsys):
    status, out, _ = check(tmp_path, capsys, "nested_app.py", NESTED_IFS)
    assert status == 0 and "no errors" in out


def test_deeply_nested_match_compiles():
    source = "from promptlang import prompt\n\n@prompt\ndef f(x):\n" + "".join(
        "  " * (2 * i + 1) + "match x:\n" + "  " * (2 * i + 2) + f"case {i} | {i + 100} | _:\n"
        for i in range(25)) + "  " * 51 + "'deep'\n"
    function = load(source).f
    assert "deep" in function.schema_pml()
    assert function(3).prompt_pml().count("<") > 25


def test_an_early_return_inside_nested_arms_closes_their_modules():
    module = load("""\
        from promptlang import prompt

        @prompt
        def g(x):
            "g"
            if x:
                "a"
                if x > 1:
                    "b"
                    return

        @prompt
        def h(x):
            g(x)
            "after"
        """)
    assert module.g(2).prompt_pml() == '<prompt schema="{}"><g><x><x-gt-1/></x></g></prompt>' \
        .format(module.g.schema_name)
    assert module.h(2).prompt_pml() == (
        f'<prompt schema="{module.h.schema_name}"><h><g><x><x-gt-1/></x></g></h></prompt>')


# -- the import: any BaseException, located ------------------------------------------------


@pytest.mark.parametrize("statement, column, name", [
    ("raise KeyboardInterrupt", 1, "KeyboardInterrupt"),
    ("raise SystemExit(3)", 1, "SystemExit: 3"),
    ("raise GeneratorExit", 1, "GeneratorExit"),
    ("import sys; sys.exit('bye')", 13, "SystemExit: bye"),
])
def test_whatever_the_import_raises_is_PL003_at_the_files_line(tmp_path, capsys, statement,
                                                               column, name):
    status, out, path = check(tmp_path, capsys, "raise_app.py",
                              f"from promptlang import prompt\n\n{statement}\n")
    assert status == 1
    assert out.startswith(f"{path}:3:{column}: error: importing the file raised {name} [PL003]")


def test_an_exception_whose_str_raises_is_still_reported_by_its_type(tmp_path, capsys):
    status, out, path = check(tmp_path, capsys, "str_app.py", """\
        class Odd(Exception):
            def __str__(self):
                raise RuntimeError("no")

        raise Odd()
        """)
    assert status == 1 and f"{path}:5:1: error: importing the file raised Odd [PL003]" in out


def test_a_ctrl_c_of_the_command_itself_is_not_swallowed(tmp_path, monkeypatch):
    path = write(tmp_path, "fine_app.py", "from promptlang import prompt\n")

    def interrupted(functions):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "_same_names", interrupted)
    with pytest.raises(KeyboardInterrupt):
        run("check", path)


def test_a_file_named_like_a_loaded_module_does_not_replace_it(tmp_path, capsys):
    status, _, _ = check(tmp_path, capsys, "json.py", """\
        from promptlang import prompt

        @prompt
        def f():
            "x"
        """)
    assert status == 0
    assert sys.modules["json"] is json


def test_a_call_that_raises_keyboard_interrupt_exits_1_located(tmp_path, capsys):
    path = write(tmp_path, "call_kbd_app.py", """\
        from promptlang import prompt

        @prompt
        def f(x):
            if x.boom():
                "x"

        class Boom:
            def boom(self):
                raise KeyboardInterrupt
        """)
    assert run("compile", path, "--call", "f(x=1)") == 1
    assert f"{path}:5:" in capsys.readouterr().err


# -- reading the file ------------------------------------------------------------------------


def test_a_utf8_bom_file_compiles_as_python_runs_it(tmp_path, capsys):
    status, out, _ = check(tmp_path, capsys, "bom_app.py", (
        "\ufefffrom promptlang import prompt\n\n@prompt\ndef f():\n    'hi'\n").encode("utf-8"))
    assert status == 0 and "1 @prompt function, no errors" in out


def test_bytes_that_are_not_utf8_are_PL005_at_their_line_and_column(tmp_path, capsys):
    status, out, path = check(tmp_path, capsys, "latin_app.py",
                              b"from promptlang import prompt\nx = 'caf\xe9'\n")
    assert status == 1 and out.startswith(f"{path}:2:9: error: invalid UTF-8") and "[PL005]" in out


def test_a_declared_coding_is_read_as_python_reads_it(tmp_path, capsys):
    status, out, _ = check(tmp_path, capsys, "coding_app.py", (
        "# -*- coding: latin-1 -*-\nfrom promptlang import prompt\n\n@prompt\ndef f():\n"
        "    'caf\xe9'\n").encode("latin-1"))
    assert status == 0, out


def test_a_nul_byte_is_PL001_at_its_place(tmp_path, capsys):
    status, out, path = check(tmp_path, capsys, "nul_app.py", b"x = 1\ny = 2\0\n")
    assert status == 1 and out.startswith(f"{path}:2:6: error: ") and "[PL001]" in out


def test_a_fifo_or_a_file_over_the_cap_is_a_usage_error(tmp_path, capsys, monkeypatch):
    fifo = tmp_path / "pipe_app.py"
    os.mkfifo(fifo)
    assert run("check", str(fifo)) == 2
    assert "not a regular file" in capsys.readouterr().err
    path = write(tmp_path, "big_app.py", "x = 1\n" * 100)
    monkeypatch.setenv("PROMPTLANG_MAX_INPUT_BYTES", "64")
    assert run("check", path) == 2
    assert "over the input cap" in capsys.readouterr().err


def test_a_python_file_over_its_cap_is_PL006_at_line_1_before_it_runs(tmp_path, capsys,
                                                                      monkeypatch):
    marker = tmp_path / "ran"
    source = f"open({str(marker)!r}, 'w').close()\n" + "x = 1\n" * 100
    monkeypatch.setenv("PROMPTLANG_MAX_PYTHON_BYTES", "256")
    status, out, path = check(tmp_path, capsys, "big_prompts.py", source)
    assert status == 1 and out.startswith(f"{path}:1:1: error: the file is ")
    assert "up to 256 bytes" in out and "[PL006]" in out
    assert not marker.exists()                       # refused before it was imported
    monkeypatch.setenv("PROMPTLANG_MAX_PYTHON_BYTES", str(len(source)))
    status, out, _ = check(tmp_path, capsys, "big_prompts.py", source)
    assert status == 0 and marker.exists()            # at the cap: compiled


def test_a_malformed_python_cap_is_a_clear_error(tmp_path, capsys, monkeypatch):
    from promptlang.cli import main

    monkeypatch.setenv("PROMPTLANG_MAX_PYTHON_BYTES", "4MiB")
    assert main(["check", write(tmp_path, "small_app.py", "x = 1\n")]) == 1
    err = capsys.readouterr().err
    assert err.startswith("PROMPTLANG_MAX_PYTHON_BYTES must be a positive whole number of "
                          "bytes, not '4MiB'") and "Traceback" not in err


# -- functions that cannot be compiled, located ---------------------------------------------


def test_a_lambda_is_PL101_at_the_lambda():
    with pytest.raises(CompileError) as error:
        load("from promptlang import prompt\n\nf = prompt(lambda: 'x')\n")
    (diagnostic,) = error.value.diagnostics
    assert (diagnostic.code, diagnostic.span.line, diagnostic.span.col) == ("PL101", 3, 12)


def test_a_prompt_function_made_by_exec_is_PL002_at_the_exec(tmp_path, capsys):
    status, out, path = check(tmp_path, capsys, "exec_app.py", """\
        from promptlang import prompt

        exec('@prompt\\ndef g():\\n    "hi"\\n')
        """)
    assert status == 1 and out.startswith(f"{path}:3:1: error: cannot read the source of g")
    assert "[PL002]" in out


def test_prompt_applied_twice_is_PL111_at_the_outer_decorator(tmp_path, capsys):
    status, out, path = check(tmp_path, capsys, "twice_app.py", """\
        from promptlang import prompt

        @prompt
        @prompt
        def f():
            "x"
        """)
    assert status == 1 and out.startswith(f"{path}:3:2: error: @prompt is applied twice")


def test_two_functions_with_one_schema_name_warn_PL302_at_the_second(tmp_path, capsys):
    status, out, path = check(tmp_path, capsys, "twin_app.py", """\
        from promptlang import prompt

        @prompt
        def f():
            "a"

        @prompt(name="twin_app.f")
        def g():
            "b"
        """)
    assert status == 0
    assert out.startswith(f"{path}:8:5: warning: schema 'twin_app.f' is also the schema of the "
                          "@prompt function defined at line 4 [PL302]")


def test_recursion_between_prompt_functions_is_PL108(tmp_path, capsys):
    status, out, path = check(tmp_path, capsys, "mutual_app.py", """\
        from promptlang import prompt

        @prompt
        def a():
            "a"
            b()

        @prompt
        def b():
            "b"
            a()
        """)
    assert status == 1 and f"{path}:6:5: error: recursive @prompt call" in out


def test_a_huge_text_literal_compiles(tmp_path, capsys):
    text = "word " * 200_000
    path = write(tmp_path, "huge_app.py", f"from promptlang import prompt\n\n@prompt\n"
                                          f"def f():\n    'Document:'\n    {text!r}\n")
    assert run("compile", path) == 0
    schema = parse_schema(capsys.readouterr().out)
    assert schema.children[0].children[0].text == text     # "Document:" is the docstring


def test_an_integer_too_long_for_str_is_PL109():
    with pytest.raises(CompileError) as error:
        load("from promptlang import prompt\n\n@prompt\ndef f():\n    0x" + "f" * 5000 + "\n")
    assert codes(error.value) == [("PL109", 5)]


# -- numeric bounds ------------------------------------------------------------------------


def test_max_tokens_past_the_cap_is_PL104_at_the_annotation(tmp_path, capsys):
    status, out, path = check(tmp_path, capsys, "bound_app.py", """\
        from typing import Annotated
        from promptlang import prompt, MaxTokens

        @prompt
        def f(x: Annotated[str, MaxTokens(10**9)]):
            x
        """)
    assert status == 1 and out.startswith(f"{path}:5:25: error: MaxTokens(n) must be at most")
    assert "[PL104]" in out


@pytest.mark.parametrize("value", [0, -1, MAX_TOKENS_CAP + 1, 10 ** 100, 2.5, True, "8"])
def test_max_tokens_outside_1_to_the_cap_is_PL104(value):
    with pytest.raises(CompileError) as error:
        MaxTokens(value)
    assert [d.code for d in error.value.diagnostics] == ["PL104"]
    assert error.value.diagnostics[0].span.file == __file__
    assert MaxTokens(MAX_TOKENS_CAP).tokens == MAX_TOKENS_CAP


def test_a_params_bound_past_the_cap_is_PL104():
    with pytest.raises(CompileError) as error:
        load("""\
            from promptlang import prompt

            @prompt(params={"x": 10**9})
            def f(x):
                x
            """).f.plan()
    assert codes(error.value) == [("PL104", 3)]


def test_gen_max_tokens_past_the_cap_is_PL104():
    with pytest.raises(CompileError) as error:
        gen("x", max_tokens=10 ** 9)
    assert error.value.diagnostics[0].code == "PL104"
    assert error.value.diagnostics[0].span.file == __file__


def test_a_bound_longer_than_the_models_context_is_PL104_at_its_hole_when_bound():
    module = load("""\
        from typing import Annotated
        from promptlang import prompt, MaxTokens

        @prompt
        def f(x: Annotated[str, MaxTokens(50)]):
            "Question:"
            x
        """)
    call = module.f("hi")
    call.bind(WordTokenizer(max_positions=100))        # fits: no error
    with pytest.raises(CompileError) as error:
        call.bind(WordTokenizer(max_positions=40))
    assert codes(error.value) == [("PL104", 7)]
    assert isinstance(error.value, PromptLangError)


def test_check_help_says_the_file_is_run(capsys):
    assert run("check", "--help") == 0
    assert "top-level code runs" in capsys.readouterr().out


def test_a_generation_inside_nested_arms_ends_the_static_part_with_them_open():
    module = load("""\
        from promptlang import prompt, gen

        @prompt
        def f(x):
            "a"
            if x:
                "b"
                if x > 1:
                    "c"
                    answer = gen("answer")
                    "after"
        """)
    assert module.f(2).prompt_pml() == (
        f'<prompt schema="{module.f.schema_name}"><f><x><x-gt-1/></x></f></prompt>')
