"""`promptlang pml check`: a schema and a prompt given together are bound; warnings and
hostile inputs print as located lines, never a traceback."""

from __future__ import annotations

import os

import pytest

from promptlang import cli

SCHEMA = ('<schema name="travel">\n<system>You are a travel agent.</system>\n'
          '<module name="trip">Plan <param name="days" len="4"/> days.\n'
          '  # keep 0 <= days < 30\n</module>\n</schema>\n')
PROMPT = '<prompt schema="travel"><trip days="3"/><user>Go?</user></prompt>\n'


@pytest.fixture
def tokenizer_dir(default_tokenizer):
    from promptlang.default_model import default_tokenizer_dir

    return str(default_tokenizer_dir())


def check(argv, capsys):
    status = cli.main(["pml", "check", *map(str, argv)])
    out, err = capsys.readouterr()
    return status, out, err


def write(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


def test_schema_and_prompt_in_one_call_are_bound(tmp_path, tokenizer_dir, capsys):
    schema, prompt = write(tmp_path, "s.pml", SCHEMA), write(tmp_path, "p.pml", PROMPT)
    for argv in ([schema, prompt], [prompt, schema]):
        status, out, err = check(["--tokenizer", tokenizer_dir, *argv], capsys)
        assert status == 0, err
        assert "imports: (root), trip" in out and "uncached tokens:" in out


def test_a_prompt_naming_another_schema_than_the_only_one_given_is_an_error(tmp_path,
                                                                             tokenizer_dir,
                                                                             capsys):
    schema = write(tmp_path, "s.pml", SCHEMA)
    prompt = write(tmp_path, "p.pml", PROMPT.replace('"travel"', '"other"'))
    status, _, err = check(["--tokenizer", tokenizer_dir, schema, prompt], capsys)
    assert status == 1
    assert "prompt names schema 'other'" in err and "Traceback" not in err


def test_a_prompt_alone_is_parsed_and_says_how_to_bind_it(tmp_path, tokenizer_dir, capsys):
    prompt = write(tmp_path, "p.pml", PROMPT)
    status, out, _ = check(["--tokenizer", tokenizer_dir, prompt], capsys)
    assert status == 0 and "not bound: no schema 'travel' in this call" in out


def test_warnings_print_as_file_line_col_warning(tmp_path, capsys):
    schema = write(tmp_path, "s.pml", SCHEMA)
    status, out, err = check(["--no-layout", schema], capsys)
    assert status == 0 and "valid" in out
    lines = err.splitlines()
    assert lines[0].startswith(f"{schema}:4:12: warning: '<' followed by '='")
    assert lines[1].startswith(f"{schema}:4:20: warning: '<' followed by whitespace")


@pytest.mark.parametrize("length, message", [
    ("999999999", "len=999999999 is too large"),
    ("99999999999", "len=99999999999 is too large"),
    ("9" * 4300, "len (4300 digits) is too large"),
    ("8000000", "parameter 'days' reserves 8000000 positions"),
])
def test_huge_len_is_one_located_error_line(tmp_path, tokenizer_dir, capsys, length, message):
    schema = write(tmp_path, "s.pml", SCHEMA.replace('len="4"', f'len="{length}"'))
    status, out, err = check(["--tokenizer", tokenizer_dir, schema], capsys)
    assert status == 1
    assert any(line.startswith(f"{schema}:3:") and message in line
               for line in err.splitlines())
    assert "Traceback" not in err
    assert "valid" not in out          # a schema whose layout fails is never called valid


def test_devices_and_fifos_are_refused_without_reading(tmp_path, capsys):
    fifo = tmp_path / "fifo.pml"
    os.mkfifo(fifo)
    status, _, err = check(["--no-layout", "/dev/zero", fifo], capsys)
    assert status == 1
    assert "/dev/zero: not a regular file" in err and f"{fifo}: not a regular file" in err


def test_invalid_utf8_prints_line_and_column(tmp_path, capsys):
    path = tmp_path / "bad.pml"
    path.write_bytes(b'<schema name="s">\n<module name="m">\xff</module></schema>')
    status, _, err = check(["--no-layout", path], capsys)
    assert status == 1 and err.startswith(f"{path}:2:18: invalid UTF-8")
