"""`promptlang pml check`: parse PML files, lay out schemas, bind prompts.

    promptlang pml check FILE... [--tokenizer NAME_OR_PATH] [--no-layout] [--schema FILE]

A schema is laid out with the tokenizer and printed as a table of its modules' positions;
a prompt is bound against the schema of the same call that it names (or `--schema`); parse
warnings print as `file:line:col: warning: ...`. `promptlang check FILE.pml` is the same
check (check.py dispatches here). Needs only a tokenizer: no torch.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any, Sequence

from promptlang.errors import DocumentKindError, PromptLangError

DESCRIPTION = ("Parse each FILE. A schema is laid out with the tokenizer and its modules' "
               "positions are printed; a prompt is bound against --schema, else against the "
               "schema among the FILEs that it names (e.g. `promptlang pml check SCHEMA "
               "PROMPT`). Warnings go to stderr as file:line:col: warning: message.")


def register(commands: Any) -> None:
    group = commands.add_parser("pml", help="PML files: `pml check` (= `check` for .pml files)",
                                description="Work with Prompt Markup Language (PML) files.")
    group.set_defaults(group_parser=group)
    pml_commands = group.add_subparsers(title="commands", metavar="COMMAND")
    check = pml_commands.add_parser(
        "check", help="parse PML files; lay out schemas and bind prompts",
        description=DESCRIPTION + " The same as `promptlang check` given PML files.")
    check.add_argument("files", nargs="+", metavar="FILE", help="schema or prompt files")
    add_options(check)
    check.set_defaults(func=check_files)


def add_options(parser: argparse.ArgumentParser) -> None:
    """The PML check's options (shared with `promptlang check`)."""
    parser.add_argument("--tokenizer", metavar="NAME_OR_PATH",
                        help="tokenizer (model id or folder) for the layout; default: the "
                             "default model's")
    parser.add_argument("--no-layout", action="store_true",
                        help="only parse (no tokenizer, no layout, no binding)")
    parser.add_argument("--schema", metavar="FILE",
                        help="schema to bind every prompt file against (default: the schema "
                             "among the FILEs that the prompt names)")


class _LazyTokenizer:
    """Loads the tokenizer the first time a file needs it; remembers a failure."""

    def __init__(self, name_or_path: str | None):
        self.name_or_path = name_or_path
        self._tokenizer: Any = None
        self._error: PromptLangError | None = None

    def __call__(self) -> Any:
        if self._error is not None:
            raise self._error
        if self._tokenizer is None:
            from promptlang.hf_tokenizer import load_tokenizer

            try:
                self._tokenizer = load_tokenizer(self.name_or_path)
            except PromptLangError as err:
                self._error = err
                raise
        return self._tokenizer


def check_files(args: argparse.Namespace) -> int:
    """Check the PML files `args.files` (see the `pml check` help); the exit status."""
    from promptlang.pml import nodes
    from promptlang.pml.parser import parse_file

    tokenizer = _LazyTokenizer(args.tokenizer)
    failed = False

    def parse(path: str) -> Any:
        """The parsed document, or the error (printed once, when its file is reported)."""
        try:
            return parse_file(path)
        except PromptLangError as err:
            return err

    documents = {path: parse(path) for path in dict.fromkeys(args.files)}
    explicit = None                 # --schema: what every prompt is bound against
    if args.schema and not args.no_layout:
        explicit = documents.get(args.schema) or parse(args.schema)
        if isinstance(explicit, nodes.PromptDoc):
            explicit = DocumentKindError(f"{args.schema}: --schema needs a <schema> file, "
                                         "not a <prompt>")
        if isinstance(explicit, PromptLangError):
            print(explicit, file=sys.stderr)
            failed = True
            explicit = None
    schemas = [(path, doc) for path, doc in documents.items() if isinstance(doc, nodes.Schema)]
    layouts: dict[str, Any] = {}    # schema file -> its layout, or the error it raised

    def layout_of(path: str, schema: Any) -> Any:
        if path not in layouts:
            from promptlang.pml.layout import lay_out

            try:
                layouts[path] = lay_out(schema, tokenizer())
            except PromptLangError as err:
                layouts[path] = err
        return layouts[path]

    def schema_for(prompt: Any) -> tuple[str, Any] | None:
        """--schema; else the schema in this call that the prompt names; else the only
        schema in this call (binding then says the names differ)."""
        if explicit is not None:
            return args.schema, explicit
        named = [(path, doc) for path, doc in schemas if doc.name == prompt.schema]
        return (named or (schemas if len(schemas) == 1 else [None]))[0]

    for path in args.files:
        document = documents[path] if path in documents else parse(path)
        try:
            if isinstance(document, PromptLangError):
                raise document
            for warning in document.warnings:
                print(warning, file=sys.stderr)
            if isinstance(document, nodes.Schema):
                layout = None if args.no_layout else layout_of(path, document)
                if isinstance(layout, PromptLangError):
                    raise layout
                print(f"{path}: schema {document.name!r}: valid")      # laid out, when asked
                if layout is not None:
                    print(format_layout(layout, tokenizer()))
                continue
            if args.no_layout:
                print(f"{path}: prompt for schema {document.schema!r}: valid")
                continue
            found = schema_for(document)
            if found is None:
                print(f"{path}: prompt for schema {document.schema!r}: valid")
                print(f"  (not bound: no schema {document.schema!r} in this call; pass its "
                      "file too, or --schema FILE)")
                continue
            layout = layout_of(*found)
            if isinstance(layout, PromptLangError):
                print(f"{path}: prompt for schema {document.schema!r}: parses")
                print(f"  (not bound: schema file {found[0]} has errors)")
                failed = True
                continue
            from promptlang.pml.binding import bind

            binding = format_binding(bind(document, layout, tokenizer()))
            print(f"{path}: prompt for schema {document.schema!r}: valid")
            print(binding)
        except PromptLangError as err:
            print(err, file=sys.stderr)
            failed = True
    return 1 if failed else 0


def format_layout(layout: Any, tokenizer: Any) -> str:
    """A schema layout as a table: one row per module (the root first)."""
    header = ("module", "start", "end", "(len)", "own", "union", "scaffold", "cache", "params")
    rows = []
    for path, module in layout.modules.items():
        own = sum(len(segment.token_ids) for segment in module.segments)
        if module.union is None:
            union = "-"
        else:
            union = f"{module.union}@{layout.unions[module.union].start}"
        params = " ".join(f"{p.name}@{p.start}+{p.length}" for p in module.params) or "-"
        rows.append(("/".join(path) or "(root)", str(module.start), str(module.end),
                     f"({module.end - module.start})", str(own), union, module.scaffold or "-",
                     "yes" if module.cache else "no", params))
    numeric = {1, 2, 3, 4}
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]

    def line(row: Sequence[str]) -> str:
        cells = [cell.rjust(widths[i]) if i in numeric else cell.ljust(widths[i])
                 for i, cell in enumerate(row)]
        return "  " + "  ".join(cells).rstrip()

    limit = tokenizer.max_positions
    name = getattr(tokenizer, "name", type(tokenizer).__name__)
    title = (f"  {layout.end} positions" + (f" of {limit}" if limit else "") + "; " +
             ", ".join(_count(n, what) for n, what in ((len(layout.modules) - 1, "module"),
                                                       (len(layout.unions), "union"),
                                                       (len(layout.scaffolds), "scaffold"))) +
             f"; tokenizer {name}")
    return "\n".join([title, line(header), *(line(row) for row in rows)])


def _count(n: int, what: str) -> str:
    return f"{n} {what}" + ("" if n == 1 else "s")


def format_binding(bound: Any) -> str:
    """What a bound prompt imports and how many tokens it computes per request."""
    imported = ", ".join("/".join(path) or "(root)" for path in bound.modules)
    uncached = sum(len(segment.token_ids) for segment in bound.uncached)
    return (f"  imports: {imported}\n"
            f"  uncached tokens: {uncached} (request ends at position {bound.end})")
