"""Reading the files a user hands promptlang: regular files only, size-capped, UTF-8.

PML schemas and prompts, `src=` documents and Python sources all come through
`read_text`. A FIFO, a device (`/dev/zero`) or a folder is refused before anything is
read, a file over the cap before it is loaded, and bytes that are not UTF-8 get the
line and column where they start.

The cap is `PROMPTLANG_MAX_INPUT_BYTES` (default 64 MiB), or the `max_bytes` argument; a
Python file compiled for its @prompt functions has a lower one of its own
(`max_python_bytes`, checked by the compiler).
"""

from __future__ import annotations

import os
import stat

from promptlang.errors import ConfigError, InputFileError, PromptLangError, Span, span_in

DEFAULT_MAX_INPUT_BYTES = 64 * 1024 * 1024
DEFAULT_MAX_PYTHON_BYTES = 4 * 1024 * 1024


def max_input_bytes() -> int:
    """The input-file cap in bytes: `PROMPTLANG_MAX_INPUT_BYTES`, else 64 MiB."""
    return _bytes_setting("PROMPTLANG_MAX_INPUT_BYTES", DEFAULT_MAX_INPUT_BYTES)


def max_python_bytes() -> int:
    """The cap on a Python file compiled for its @prompt functions, in bytes:
    `PROMPTLANG_MAX_PYTHON_BYTES`, else 4 MiB. Each function is analysed on its own, at
    a cost per byte far above CPython's compile of the file (docs/SECURITY.md)."""
    return _bytes_setting("PROMPTLANG_MAX_PYTHON_BYTES", DEFAULT_MAX_PYTHON_BYTES)


def _bytes_setting(name: str, default: int) -> int:
    text = os.environ.get(name, "").strip()
    if not text:
        return default
    if not text.isdigit() or len(text) > 18 or int(text) <= 0:
        raise ConfigError(f"{name} must be a positive whole number of bytes, not {text!r}")
    return int(text)


def read_bytes(path: str | os.PathLike, *, max_bytes: int | None = None,
               error: type[PromptLangError] = InputFileError,
               span: Span | None = None) -> bytes:
    """The bytes of the regular file at `path`, at most `max_bytes` (default: the cap).

    Raises `error` (located at `span` when given) for anything else: a missing file, a
    FIFO, device or folder (checked without blocking), or a file over the cap.
    """
    cap = max_input_bytes() if max_bytes is None else max_bytes
    name = os.fspath(path)
    try:
        fd = os.open(name, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except FileNotFoundError:
        raise error(f"{name}: no such file", span) from None
    except OSError as err:
        raise error(f"{name}: cannot open ({err.strerror})", span) from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            kind = "a folder" if stat.S_ISDIR(info.st_mode) else "not a regular file"
            raise error(f"{name}: {kind}; only regular files are read", span)
        if info.st_size > cap:
            raise error(f"{name}: {info.st_size} bytes is over the input cap of {cap} bytes "
                        "(set PROMPTLANG_MAX_INPUT_BYTES to change it)", span)
        chunks = []
        total = 0
        while True:                     # read at most cap + 1 bytes: the file may grow
            chunk = os.read(fd, min(1 << 20, cap + 1 - total))
            if not chunk:
                break
            chunks.append(chunk)
            total += len(chunk)
            if total > cap:
                raise error(f"{name}: grew past the input cap of {cap} bytes while read", span)
        return b"".join(chunks)
    finally:
        os.close(fd)


def decode_utf8(data: bytes, file: str, *, error: type[PromptLangError] = InputFileError) -> str:
    """`data` as text (a leading UTF-8 BOM dropped); invalid bytes raise a located `error`."""
    if data.startswith(b"\xef\xbb\xbf"):
        data = data[3:]
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        before = data[:err.start].decode("utf-8")
        line_end = data.find(b"\n", err.start)
        rest = data[err.start:len(data) if line_end == -1 else line_end]
        text = before + rest.decode("utf-8", errors="replace")
        span = span_in(text, len(before), file)
        raise error(f"invalid UTF-8 (byte 0x{data[err.start]:02x}); "
                    "input files must be UTF-8 text", span) from None


def read_text(path: str | os.PathLike, *, max_bytes: int | None = None,
              error: type[PromptLangError] = InputFileError, span: Span | None = None,
              file: str | None = None) -> str:
    """The UTF-8 text of the regular file at `path` (see `read_bytes` and `decode_utf8`).

    `file` is the name errors inside the text are located in (default: `path`).
    """
    data = read_bytes(path, max_bytes=max_bytes, error=error, span=span)
    return decode_utf8(data, os.fspath(path) if file is None else file, error=error)
