"""One error hierarchy for the whole project.

Every error a user can cause is a `PromptLangError`. When it knows where the
problem is, it carries a `Span` and prints as

    file:line:col: message
        the offending source line
        ^

Errors pickle (their constructor arguments are kept in `args`).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Span:
    """A place in a source file: 1-based line and column, plus that line's text."""

    file: str
    line: int
    col: int
    line_text: str = ""

    def __str__(self) -> str:
        return f"{self.file}:{self.line}:{self.col}"


def span_in(source: str, offset: int, file: str) -> Span:
    """The Span of character `offset` in `source`."""
    line = source.count("\n", 0, offset) + 1
    line_start = source.rfind("\n", 0, offset) + 1
    line_end = source.find("\n", offset)
    if line_end == -1:
        line_end = len(source)
    return Span(file, line, offset - line_start + 1, source[line_start:line_end])


class PromptLangError(Exception):
    """Base class of every error promptlang reports to its users."""

    def __init__(self, message: str, span: Span | None = None):
        super().__init__(message, span)
        self.message = message
        self.span = span

    def __str__(self) -> str:
        if self.span is None:
            return self.message
        text = f"{self.span}: {self.message}"
        if self.span.line_text:
            line, caret = _excerpt(self.span.line_text.expandtabs(1), self.span.col - 1)
            text += f"\n    {line}\n    {' ' * caret}^"
        return text


EXCERPT_WIDTH = 100   # characters of a long source line shown around the error's column


def _excerpt(line: str, col: int) -> tuple[str, int]:
    """At most EXCERPT_WIDTH characters of `line` around `col`, and the caret's offset in them."""
    if len(line) <= EXCERPT_WIDTH:
        return line, col
    start = max(0, min(col - EXCERPT_WIDTH // 2, len(line) - EXCERPT_WIDTH))
    piece = line[start:start + EXCERPT_WIDTH]
    head = "..." if start > 0 else ""
    tail = "..." if start + EXCERPT_WIDTH < len(line) else ""
    return head + piece + tail, col - start + len(head)


class PMLSyntaxError(PromptLangError):
    """Malformed PML: bad tags, attributes, entities, DOCTYPE, unbalanced elements."""


class UnknownSchemaError(PromptLangError):
    """A prompt names a schema that is not the one it is bound against."""


class UnknownModuleError(PromptLangError):
    """A prompt imports a module (or scaffold) the schema does not declare there."""


class UnknownParameterError(PromptLangError):
    """A prompt passes an argument the module does not declare."""


class MissingArgumentError(PromptLangError):
    """A prompt imports a module without an argument for one of its parameters."""


class ArgumentTooLongError(PromptLangError):
    """An argument has more tokens than its parameter reserves."""

    def __init__(self, message: str, span: Span | None = None, *, parameter: str = "",
                 bound: int = 0, count: int = 0):
        super().__init__(message, span)
        self.parameter, self.bound, self.count = parameter, bound, count

    def __reduce__(self):
        state = (self.message, self.span, self.parameter, self.bound, self.count)
        return (_rebuild_too_long, state)


def _rebuild_too_long(message, span, parameter, bound, count):
    return ArgumentTooLongError(message, span, parameter=parameter, bound=bound, count=count)


class UnionConflictError(PromptLangError):
    """A prompt imports two members of one union."""


class TextNotAllowedError(PromptLangError):
    """Text where the language allows none (inside a union, a scaffold, a module reference)."""


class SourceFileError(PromptLangError):
    """A `src=` file that is missing, unreadable, or outside the schema's folder."""


class InputFileError(PromptLangError):
    """An input file that is not a regular file, is over the size cap, or is not UTF-8; or
    an input file or folder without what it should hold (no .pml files, no measured costs)."""


class ContextLengthError(PromptLangError):
    """A layout or a request that needs more positions than the model has."""


class SchemaError(PromptLangError):
    """A well-formed schema that breaks a structural rule (duplicate names, misplaced params...)."""


class RoleError(PromptLangError):
    """Role blocks that do not pair up: a role opened inside another, or closed without opening."""


class ModelError(PromptLangError):
    """A model that cannot be loaded or used (unsupported architecture, missing files...)."""


class TokenizerMismatchError(PromptLangError):
    """A layout made for one tokenizer used with a model that has another."""


class CacheError(PromptLangError):
    """A problem with the module store that the user must know about."""


# --- errors of the Python API, the runtime and the tools around it -------------------------
# Where the code once raised a builtin, the class subclasses that builtin too, so that
# `except ValueError` (or TypeError, RuntimeError) keeps catching what it caught before.


class InvalidArgumentError(PromptLangError, ValueError):
    """A Python call got an argument value it cannot use (out of range, an unknown name...)."""


class InvalidArgumentTypeError(PromptLangError, TypeError):
    """A Python call got an argument of a kind it does not take (not a function, not a node...)."""


class ConfigError(PromptLangError, ValueError):
    """A setting promptlang cannot use: an environment variable, a `serve --ray` cluster setting."""


class UnsupportedModelError(ModelError, ValueError):
    """A model that cannot serve what is asked of it (parallel contexts, a RoPE-only policy...)."""


class ChatTemplateError(ModelError, TypeError):
    """A model's chat template that renders something other than text."""


class DocumentKindError(PromptLangError):
    """A PML file or text that holds a prompt where a schema is wanted, or the reverse."""


class DuplicateNameError(PromptLangError):
    """A name used twice where it must be unique: a module imported twice, two served functions."""


class EmptyPromptError(PromptLangError):
    """A prompt with nothing to compute: it imports no module and adds no text."""


class PMLWriteError(PromptLangError):
    """A PML tree that cannot be written as PML text (a bad name, role, comment or length)."""


class TraceError(PromptLangError):
    """A @prompt function that at run time does what its compiled plan does not allow."""


class StateError(PromptLangError):
    """A call where it has no meaning: gen()/select() outside a @prompt call, a closed session."""


class InternalError(PromptLangError, RuntimeError):
    """A broken invariant inside promptlang, or a kernel's failure status: a bug to report."""


class ServerStartError(PromptLangError, RuntimeError):
    """A server that promptlang starts itself (the benchmarks', a peer's) did not come up."""


class AdapterFileError(PromptLangError, ValueError):
    """A seam adapter file that is missing, damaged or made for another model."""


class TuneError(PromptLangError, ValueError):
    """`promptlang tune` cannot run with what it was given (too few documents, a bad option)."""


class RecomputeSpecError(PromptLangError):
    """A recompute policy's text is malformed (the message says what is expected; located
    at a schema's attribute when it came from one)."""


class ConstraintError(PromptLangError):
    """A regex, JSON Schema or grammar that cannot be used (the message says why), or a
    tokenizer llguidance cannot read."""


class NativeKernelsError(PromptLangError):
    """PROMPTLANG_REQUIRE_NATIVE is set and the CPU kernels cannot be built or loaded."""


class CompileError(PromptLangError):
    """A @prompt function the compiler cannot turn into a schema; carries every diagnostic.

    A diagnostic is the compiler's `Diagnostic`: it has `span`, `code`, `message`,
    `severity` and `format()`."""

    def __init__(self, diagnostics):
        self.diagnostics = tuple(sorted(set(diagnostics), key=diagnostic_order))
        first = self.diagnostics[0] if self.diagnostics else None
        count = sum(1 for d in self.diagnostics if d.severity == "error")
        summary = (f"{first.message} [{first.code}]" if first is not None else "compile error")
        if count > 1:
            summary += f" (and {count - 1} more error{'s' if count > 2 else ''})"
        super().__init__(summary, first.span if first is not None else None)
        self.args = (self.diagnostics,)

    def __str__(self) -> str:
        return "\n".join(d.format() for d in self.diagnostics)

    def __reduce__(self):
        return (CompileError, (self.diagnostics,))


def diagnostic_order(d):
    """Diagnostics sort by place (file, line, column), then code; unplaced ones first."""
    s = d.span
    return (s.file, s.line, s.col, d.code) if s is not None else ("", 0, 0, d.code)


# --- errors of the command line and the server ----------------------------------------------


class UsageError(PromptLangError):
    """A command line the command cannot run: printed as one line, exit status 2."""


class RequestError(PromptLangError):
    """A request that names something unknown or is malformed (HTTP 400)."""


class QueueFullError(PromptLangError):
    """The server's engine queue holds its limit of waiting requests (HTTP 429)."""


class HTTPError(PromptLangError):
    """A request the server answers with an error status: `status`, an OpenAI-style error
    `kind` and `param`; `close` ends the connection (the body was not read to its end)."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error",
                 param: str | None = None, close: bool = False):
        super().__init__(message)
        self.args = (status, message, kind, param, close)
        self.status = status
        self.kind = kind
        self.param = param
        self.close = close


# --- the store's checks of its own files (caught inside the store, never shown to users) ----


class UntrustedFileError(CacheError):
    """A disk file that must not be read (a link, not the user's, not private...)."""


class CorruptFileError(CacheError):
    """A disk file that failed a check; the store drops it and computes the module again."""

    identity: tuple[int, int] | None = None  # (inode, mtime ns) of the file that failed
    ours = True                               # False: no promptlang-kv tag, so not deleted
