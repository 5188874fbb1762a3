"""The layer rules of docs/COMPILER.md, docs/DESIGN.md and docs/ARCHITECTURE.md, read from
the code with `ast`.

Every import counts: top-level and lazy (inside a function), `import x` and
`from x import y`, relative imports resolved, `importlib.import_module("literal")`.
Files map to layers by the package-dir table of pyproject.toml:

    pml       promptlang.pml.*, and its foundations promptlang.errors, .inputs, .tokenizer
    compiler  promptlang.compiler.*  (compiler/)
    runtime   promptlang.runtime.*   (runtime/)
    bench     promptlang.bench.*         (bench/)
    face      every other promptlang module (promptlang/__init__, the CLI, programs.py, ...)

Rules: pml imports only pml; the compiler imports only pml and the compiler; the
runtime never imports the compiler; pml and the compiler never import torch, and the
face imports it only lazily. No import cycles among promptlang modules, lazy imports
included, with one decided exception: the public face joins compiler and runtime in
`promptlang.programs`, and `fn.run` reaches it by a lazy import inside a compiler
function (the only edge from the compiler up to the face). Python resolves that import
when it runs, after both sides are loaded, so a cycle closed only by it is allowed.
"""

from __future__ import annotations

import ast
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:      # Python 3.10: the dev extra installs tomli
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]
JOIN = "promptlang.programs"          # the public face's join of compiler and runtime
PML_BASE = ("promptlang.errors", "promptlang.inputs", "promptlang.tokenizer")
FORBIDDEN = {"pml": {"compiler", "runtime", "bench", "face"},
             "compiler": {"runtime", "bench", "face"},
             "runtime": {"compiler"}}
NO_TORCH = {"pml", "compiler"}        # not even lazily; the face: not at import time


@dataclass(frozen=True)
class Import:
    source: str          # the importing module
    target: str          # a module name (a promptlang module when one matches)
    lazy: bool           # inside a function: runs when the function does
    line: int


def layer(name: str) -> str | None:
    if name in PML_BASE or name == "promptlang.pml" or name.startswith("promptlang.pml."):
        return "pml"
    for prefix, part in (("promptlang.compiler", "compiler"), ("promptlang.runtime.bench", "bench"),
                         ("promptlang.bench", "bench"), ("promptlang.runtime", "runtime")):
        if name == prefix or name.startswith(prefix + "."):
            return part
    return "face" if name == "promptlang" or name.startswith("promptlang.") else None


def find_modules(root: Path) -> dict[str, Path]:
    """Module name -> file, by pyproject's package-dir (a nested mapping wins)."""
    config = tomllib.loads((root / "pyproject.toml").read_text())
    dirs = config.get("tool", {}).get("setuptools", {}).get("package-dir") or {
        "promptlang": "promptlang"}
    modules: dict[str, tuple[Path, str]] = {}
    for package, folder in dirs.items():
        for path in sorted((root / folder).rglob("*.py")):
            parts = [p for p in path.relative_to(root / folder).with_suffix("").parts
                     if p != "__init__"]
            name = ".".join([package, *parts])
            if name not in modules or len(package) > len(modules[name][1]):
                modules[name] = (path, package)
    return {name: path for name, (path, _) in modules.items()}


def imports_of(name: str, path: Path, known) -> list[Import]:
    """Every import in `path` (module `name`); `from pkg import sub` names the submodule
    when `sub` is one of `known`, else the package."""
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: list[Import] = []

    def visit(node: ast.AST, lazy: bool) -> None:
        if isinstance(node, ast.Import):
            found.extend(Import(name, a.name, lazy, node.lineno) for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([base] if base else []))
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                found.append(Import(name, sub if sub in known else base, lazy, node.lineno))
        elif (isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant)
              and getattr(node.func, "attr", getattr(node.func, "id", "")) == "import_module"):
            found.append(Import(name, str(node.args[0].value), lazy, node.lineno))
        inner = lazy or isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
        for child in ast.iter_child_nodes(node):
            visit(child, inner)

    visit(tree, False)
    return found


def scan(root: Path) -> dict[str, list[Import]]:
    modules = find_modules(root)
    return {name: imports_of(name, path, modules) for name, path in modules.items()}


def violations(graph: dict[str, list[Import]]) -> list[str]:
    """Each import that breaks a layer rule, as `source:line imports target (why)`."""
    found = []
    for source, imports in graph.items():
        mine = layer(source)
        for i in imports:
            theirs = layer(i.target)
            where = f"{source}:{i.line} imports {i.target}"
            if i.target.split(".")[0] == "torch":
                if mine in NO_TORCH or (mine == "face" and not i.lazy):
                    found.append(f"{where} ({mine} must not import torch)")
            elif theirs in FORBIDDEN.get(mine, ()):
                if mine == "compiler" and i.lazy and _is_join(i.target):
                    continue      # fn.run: the compiler reaches the public face's join lazily
                found.append(f"{where} ({mine} must not import {theirs})")
    return found


def cycles(graph: dict[str, list[Import]]) -> list[list[str]]:
    """Strongly connected groups of promptlang modules (lazy imports included), minus the
    compiler's lazy edges to the join point."""
    edges = {source: {i.target for i in imports if i.target in graph and i.target != source
                      and not (layer(source) == "compiler" and i.lazy and _is_join(i.target))}
             for source, imports in graph.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    groups: list[list[str]] = []

    def strong(v: str) -> None:        # Tarjan's algorithm
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(edges[v]):
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                groups.append(sorted(group))

    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(max(limit, 10_000))
    try:
        for v in sorted(edges):
            if v not in index:
                strong(v)
    finally:
        sys.setrecursionlimit(limit)
    return sorted(groups)


def _is_join(target: str) -> bool:
    return target == JOIN or target.startswith(JOIN + ".")


# -- the tree as it is --------------------------------------------------------------------------


def test_the_scan_reads_every_layer_and_lazy_imports():
    graph = scan(ROOT)
    assert {layer(name) for name in graph} >= {"pml", "compiler", "runtime", "bench", "face"}
    assert JOIN in {i.target for i in graph["promptlang.compiler.decorator"] if i.lazy}
    assert all(layer(name) == "compiler" for name in graph
               if name.startswith("promptlang.compiler"))


def test_the_layers_import_only_what_their_rules_allow():
    assert violations(scan(ROOT)) == []


def test_promptlang_modules_have_no_import_cycles():
    assert cycles(scan(ROOT)) == []


def test_the_compiler_imports_nothing_but_pml_and_itself_at_import_time():
    graph = scan(ROOT)
    upward = [f"{i.source}:{i.line} {i.target}" for name, imports in graph.items()
              if layer(name) == "compiler" for i in imports
              if layer(i.target) not in (None, "pml", "compiler") and not i.lazy]
    assert upward == []


# Inside the runtime, each room imports only the rooms after it in this list (lazy imports
# included): docs/ARCHITECTURE.md, "The runtime's rooms".
RUNTIME_ROOMS = ("tune", "top", "conversation", "decoding", "passes", "recompute", "store", "kv",
                 "model", "fast")


def runtime_room(name: str) -> str | None:
    prefix = "promptlang.runtime"
    if name != prefix and not name.startswith(prefix + "."):
        return None
    parts = name[len(prefix) + 1:].split(".")
    return parts[0] if parts[0] in RUNTIME_ROOMS else "top"


def upward_runtime_imports(graph: dict[str, list[Import]]) -> list[str]:
    found = []
    for name, imports in graph.items():
        source = runtime_room(name)
        if source is None or name == "promptlang.runtime":
            continue
        for i in imports:
            target = runtime_room(i.target)
            if target is None or i.target == "promptlang.runtime":
                continue
            if RUNTIME_ROOMS.index(target) < RUNTIME_ROOMS.index(source):
                found.append(f"{i.source}:{i.line} ({source}) imports {i.target} ({target})")
    return found


def test_the_runtime_s_rooms_import_only_rooms_below_them():
    assert upward_runtime_imports(scan(ROOT)) == []


def test_an_upward_runtime_import_is_caught():
    edge = Import("promptlang.runtime.kv.assembler", "promptlang.runtime.recompute.plan", True, 3)
    graph = {"promptlang.runtime.kv.assembler": [edge]}
    assert upward_runtime_imports(graph) == [
        "promptlang.runtime.kv.assembler:3 (kv) imports promptlang.runtime.recompute.plan "
        "(recompute)"]


# -- the checker catches what it must -----------------------------------------------------------


def test_a_violation_planted_in_a_copy_of_a_compiler_file_is_caught(tmp_path):
    copy = tmp_path / "plan.py"
    shutil.copy(ROOT / "compiler" / "plan.py", copy)
    name = "promptlang.compiler.plan"
    modules = find_modules(ROOT)
    assert violations({name: imports_of(name, copy, modules)}) == []
    copy.write_text(copy.read_text() + "\n\ndef planted():\n"
                    "    from ..runtime.conversation.session import Session\n    return Session\n")
    found = violations({name: imports_of(name, copy, modules)})
    assert len(found) == 1
    assert "promptlang.runtime.conversation.session" in found[0]
    assert "compiler must not import runtime" in found[0]


def test_a_cycle_planted_in_copies_of_two_files_is_caught(tmp_path):
    modules = find_modules(ROOT)
    names = {"promptlang.compiler.plan": "plan.py", "promptlang.compiler.ir": "ir.py"}
    for file in names.values():
        shutil.copy(ROOT / "compiler" / file, tmp_path / file)
    (tmp_path / "ir.py").write_text((tmp_path / "ir.py").read_text()
                                    + "\n\ndef planted():\n    from . import plan\n")
    graph = {name: imports_of(name, tmp_path / file, modules) for name, file in names.items()}
    assert cycles(graph) == [sorted(names)]


def test_the_checker_catches_each_rule_on_a_synthetic_graph():
    def graph(*edges):
        out: dict[str, list[Import]] = {}
        for source, target, lazy in edges:
            out.setdefault(source, []).append(Import(source, target, lazy, 1))
            if target.startswith("promptlang"):
                out.setdefault(target, [])
        return out

    assert violations(graph(("promptlang.pml.nodes", "promptlang.compiler.ir", True)))
    assert violations(graph(("promptlang.pml.nodes", "promptlang.cli", True)))
    assert violations(graph(("promptlang.compiler.trace", "promptlang.runtime.conversation.session", True)))
    assert violations(graph(("promptlang.compiler.trace", "promptlang.runtime.bench.qa", False)))
    assert violations(graph(("promptlang.compiler.trace", "promptlang.bench.qa", False)))
    assert violations(graph(("promptlang.runtime.conversation.agent", "promptlang.compiler.prompt", True)))
    assert violations(graph(("promptlang.compiler.ir", "torch", True)))
    assert violations(graph(("promptlang.cli", "torch", False)))
    assert violations(graph(("promptlang.compiler.decorator", JOIN, False)))     # top level
    assert violations(graph(("promptlang.compiler.decorator", "promptlang.cli", True)))
    assert not violations(graph(("promptlang.compiler.decorator", JOIN, True)))
    assert not violations(graph(("promptlang.cli", "torch", True)))
    assert not violations(graph(("promptlang.runtime.engine", "promptlang.pml.nodes", False)))
    assert not violations(graph(("promptlang.runtime.conversation.agent", "promptlang.pml.prompt", False)))

    engine = "promptlang.runtime.engine"
    session = "promptlang.runtime.conversation.session"
    lazy_cycle = graph((engine, session, True), (session, engine, False))
    assert cycles(lazy_cycle) == [sorted([engine, session])]
    join_cycle = graph(("promptlang.compiler.decorator", JOIN, True),
                       (JOIN, "promptlang.compiler.decorator", False))
    assert cycles(join_cycle) == []
    eager_join_cycle = graph(("promptlang.compiler.decorator", JOIN, False),
                             (JOIN, "promptlang.compiler.decorator", False))
    assert cycles(eager_join_cycle) == [sorted(["promptlang.compiler.decorator", JOIN])]
