"""A Python file's @prompt functions, compiled, with every diagnostic located.

`compile_file(path)` imports the file (as the module its package folders make it): its
top-level code RUNS, as `python FILE` would run it. @prompt collects analysis errors instead
of raising them; then every @prompt function defined in the file is planned and every
diagnostic kept, sorted, with the file named as the command line named it. Whatever the file
raises while it is imported (SystemExit and KeyboardInterrupt included) is a diagnostic
located at the file's line in the traceback. promptlang/cli/compile.py and the server's loader
use it.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import io
import os
import stat
import sys
import tokenize
import traceback
from dataclasses import dataclass, field

from promptlang.compiler.decorator import PromptFunction, collecting
from promptlang.compiler.diagnostics import Diagnostic
from promptlang.compiler.source import deepest_span, module_name_for_file
from promptlang.errors import CompileError, InputFileError, Span, diagnostic_order, span_in
from promptlang.inputs import decode_utf8, max_python_bytes, read_bytes


@dataclass
class Compiled:
    functions: list[PromptFunction] = field(default_factory=list)
    diagnostics: list[Diagnostic] = field(default_factory=list)
    module: object = None


def compile_file(path: str) -> Compiled:
    compiled = Compiled()
    source = _read_source(path, compiled)
    if source is None or not _compiles(source, path, compiled):
        return compiled
    name = module_name_for_file(path)
    root = os.path.abspath(path)
    for _ in name.split("."):
        root = os.path.dirname(root)
    here = os.path.abspath(path)
    shadowed = sys.modules.get(name)      # a file named like a loaded module (json.py)
    sys.path.insert(0, root)
    try:
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        with collecting() as found:
            imported = False
            try:
                spec.loader.exec_module(module)
                imported = True
            except CompileError as e:
                compiled.diagnostics.extend(e.diagnostics)
            except BaseException as e:    # noqa: BLE001 - the file's own code: report it, located
                compiled.diagnostics.append(_import_failure(e, path))
            finally:
                if shadowed is not None:
                    sys.modules[name] = shadowed
                elif not imported:
                    sys.modules.pop(name, None)
        compiled.module = module
        compiled.functions = [f for f in found if _defined_in(f, here)]
        for function in compiled.functions:
            compiled.diagnostics.extend(function.analysis.diagnostics)
            if function.analysis.ir is None:
                continue
            try:
                function.plan()
            except CompileError as e:
                compiled.diagnostics.extend(e.diagnostics)
            except Exception as e:       # noqa: BLE001 - user code run while resolving names
                compiled.diagnostics.append(Diagnostic(
                    "PL003", f"compiling {function.__qualname__} ran code of the file that "
                             f"raised {type(e).__name__}: {e}",
                    _frame_span(e, path) or function.analysis.ir.span))
            else:
                compiled.diagnostics.extend(function.diagnostics)
        compiled.diagnostics.extend(_same_names(compiled.functions))
    finally:
        sys.path.remove(root)
    compiled.diagnostics = sorted({_as_given(d, here, path) for d in compiled.diagnostics},
                                  key=diagnostic_order)
    return compiled


def _read_source(path: str, compiled: Compiled) -> str | None:
    """The file's text, decoded as Python decodes it (UTF-8, a BOM dropped, or the
    encoding its coding line declares); None, with a PL005 diagnostic, when it is not.
    A file over the cap for Python sources is a PL006 before it is read. A file that cannot
    be read at all raises InputFileError."""
    cap = max_python_bytes()
    size = _regular_file_size(path)
    if size is not None and size > cap:
        compiled.diagnostics.append(Diagnostic(
            "PL006", f"the file is {size:,} bytes; Python files are compiled up to "
                     f"{cap:,} bytes (PROMPTLANG_MAX_PYTHON_BYTES sets the cap)",
            Span(path, 1, 1)))
        return None
    data = read_bytes(path)          # InputFileError: the caller's to report
    try:
        encoding, _ = tokenize.detect_encoding(io.BytesIO(data).readline)
    except SyntaxError as e:          # an unknown codec, or a BOM with another coding line
        compiled.diagnostics.append(Diagnostic("PL005", e.msg, Span(path, e.lineno or 1, 1)))
        return None
    try:
        if encoding in ("utf-8", "utf-8-sig"):
            return decode_utf8(data, path)
        return data.decode(encoding)
    except InputFileError as e:
        compiled.diagnostics.append(Diagnostic("PL005", e.message, e.span))
    except UnicodeDecodeError as e:
        span = span_in(data[:e.start].decode(encoding, "replace"), e.start, path)
        compiled.diagnostics.append(Diagnostic(
            "PL005", f"not valid {encoding}, as its coding line declares", span))
    return None


def _regular_file_size(path: str) -> int | None:
    """The size of the regular file at `path`; None for anything else (read_bytes then
    says what it is)."""
    try:
        info = os.stat(path)
    except OSError:
        return None
    return info.st_size if stat.S_ISREG(info.st_mode) else None


def _compiles(source: str, path: str, compiled: Compiled) -> bool:
    """Whether CPython compiles the file; else a located diagnostic says why not."""
    try:
        compile(source, path, "exec", dont_inherit=True)
    except (SyntaxError, ValueError) as e:     # ValueError: a NUL character, in some versions
        if not isinstance(e, SyntaxError) or e.lineno is None:
            span = span_in(source, max(source.find("\0"), 0), path)
            message = e.msg if isinstance(e, SyntaxError) else str(e)
        else:
            span = Span(path, e.lineno, e.offset or 1, (e.text or "").rstrip("\r\n"))
            message = e.msg
        compiled.diagnostics.append(Diagnostic("PL001", message, span))
    except (RecursionError, MemoryError):
        compiled.diagnostics.append(Diagnostic(
            "PL004", "Python cannot compile this file: an expression or block nests too "
                     "deeply", deepest_span(source, path)))
    else:
        return True
    return False


def _defined_in(function: PromptFunction, here: str) -> bool:
    """Whether the file defines `function`: its code is in the file, or it was made by code
    that has no file of its own (exec) which the file ran."""
    file = function.__wrapped__.__code__.co_filename
    if os.path.abspath(file) == here:
        return True
    where = function.defined_at
    return (not os.path.isfile(file) and where is not None
            and os.path.abspath(where.file) == here)


def _same_names(functions: list[PromptFunction]) -> list[Diagnostic]:
    """A warning for each function whose schema name an earlier one already has."""
    first: dict[str, PromptFunction] = {}
    found = []
    for function in functions:
        earlier = first.setdefault(function.schema_name, function)
        if earlier is function:
            continue
        before = _def_span(earlier)
        where = f"at line {before.line}" if before is not None else "earlier"
        found.append(Diagnostic(
            "PL302", f"schema {function.schema_name!r} is also the schema of the @prompt "
                     f"function defined {where}", _def_span(function)))
    return found


def _def_span(function: PromptFunction) -> Span | None:
    ir = function.analysis.ir
    return ir.span if ir is not None else function.defined_at


def _as_given(diagnostic: Diagnostic, here: str, path: str) -> Diagnostic:
    """The diagnostic with the file named as the user named it on the command line."""
    span = diagnostic.span
    if span is None or span.file == path or os.path.abspath(span.file) != here:
        return diagnostic
    return dataclasses.replace(diagnostic, span=dataclasses.replace(span, file=path))


def _import_failure(error: BaseException, path: str) -> Diagnostic:
    return Diagnostic("PL003", f"importing the file raised {_describe(error)}",
                      _frame_span(error, path) or Span(path, 1, 1))


def located(error: BaseException, path: str, what: str) -> str:
    span = _frame_span(error, path)
    where = f"{span}: " if span is not None else ""
    return f"{where}error: {what} {_describe(error)}"


def _describe(error: BaseException, limit: int = 300) -> str:
    """`Type: message`, the message's first line cut at `limit` characters; a message
    that cannot be made (a __str__ that raises) is left out."""
    try:
        message = str(error)
    except Exception:      # noqa: BLE001 - the user's __str__ failed: the type says enough
        message = ""
    lines = message.strip().splitlines()
    message = lines[0] if lines else ""
    if len(message) > limit or len(lines) > 1:
        message = message[:limit] + " ..."
    name = type(error).__name__
    return f"{name}: {message}" if message else name


def _frame_span(error: BaseException, path: str) -> Span | None:
    """Where in `path` the exception passed last."""
    here = os.path.abspath(path)
    found = None
    for frame in traceback.extract_tb(error.__traceback__):
        if os.path.abspath(frame.filename) == here:
            found = frame
    if found is None:
        return None
    return Span(path, found.lineno or 1, (found.colno or 0) + 1, found.line or "")


def print_diagnostics(diagnostics, stream) -> None:
    for d in diagnostics:
        print(d.format(), file=stream)
