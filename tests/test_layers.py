"""The shape of the code, checked: genie_core imports nothing from genie_jupyter, no module
imports itself back through others (no cycles), and each layer uses only the ones below it
(docs/ARCHITECTURE.md). Imports inside functions count; those under `if TYPE_CHECKING:` do not."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# What each part may import from genie_core (besides itself and the shared base modules).
BASE = {
    "errors",
    "config",
    "events",
    "nodes",
    "gpus",
    "serialize",
    "loop",
    "lifeline",
    "crash_record",
    "version",
    "threads",
    "encryption",
    "monitoring",
    "protocol",
    "versions",
    "partfiles",
    "torch_compat",
}
ALLOWED = {
    "protocol": {"errors", "threads"},
    "dataplane": BASE,
    "monitoring": {"errors", "config", "events", "nodes", "gpus", "threads"},
    "worker": BASE | {"dataplane"},
    "remote_tensor": BASE,
    "sandbox": BASE | {"dataplane"},
    "server": BASE | {"dataplane", "sandbox"},
    "client": BASE | {"dataplane"},
    "cluster": BASE | {"client", "local_server", "remote_tensor", "server", "dataplane"},
    # its session actors run a server; `genie pool status` asks the pool as a client does
    "pool": BASE | {"server", "client", "sandbox"},
}


def _modules() -> dict[str, Path]:
    found = {}
    for path in (ROOT / "genie_core").rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = path
    return found


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    tree = ast.parse(path.read_text())
    typing_only = {
        id(n)
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
        for n in ast.walk(node)
    }
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    out: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = package.split(".")[: len(package.split(".")) - node.level + 1] if node.level else []
            target = ".".join(base + ([node.module] if node.module else []))
            subs = {f"{target}.{a.name}" for a in node.names if f"{target}.{a.name}" in modules}
            # `from . import sibling` imports the sibling; the parent package is Python's to import first
            out |= subs if subs and name.startswith(target + ".") else {target} | subs
    resolved = set()
    for target in out:
        while target and target not in modules and not target.startswith("genie_jupyter"):
            target = target.rsplit(".", 1)[0] if "." in target else ""
        if target and target != name:
            resolved.add(target)
    return resolved


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def test_genie_core_never_imports_genie_jupyter():
    offenders = sorted((m, t) for m, targets in _graph().items() for t in targets if t.startswith("genie_jupyter"))
    assert not offenders


def test_there_are_no_import_cycles():
    graph = _graph()
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph.get(v, ()):
            if w not in graph:
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    assert not cycles


def test_each_layer_uses_only_the_ones_below_it():
    def part(module: str) -> str:
        return module.split(".")[1] if module.count(".") else ""

    broken = []
    for module, targets in _graph().items():
        rules = ALLOWED.get(part(module))
        if rules is None:
            continue
        for target in targets:
            if target.startswith("genie_core.") and part(target) not in rules | {part(module)}:
                broken.append(f"{module} imports {target}")
    assert not broken, "\n".join(sorted(broken))


def test_genie_jupyter_uses_only_the_public_api():
    """genie_jupyter is the first user of genie_core: it imports `genie_core` or names from its
    `__all__`, and uses no attribute of it outside `__all__` (docs/ARCHITECTURE.md)."""
    import genie_core

    public = set(genie_core.__all__)
    reaching = []
    for path in sorted((ROOT / "genie_jupyter").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            where = f"{path.relative_to(ROOT)}:{getattr(node, 'lineno', 0)}"
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("genie_core"):
                names = {a.name for a in node.names}
                if node.module != "genie_core" or not names <= public:
                    reaching.append(f"{where} from {node.module} import {', '.join(sorted(names))}")
            elif isinstance(node, ast.Import):
                reaching += [f"{where} import {a.name}" for a in node.names if a.name.startswith("genie_core.")]
            elif isinstance(node, ast.Attribute) and ast.unparse(node.value) == "genie_core":
                reaching += [f"{where} genie_core.{node.attr}"] * (node.attr not in public)
    assert not reaching, "\n".join(reaching)


def test_no_class_passes_350_lines():
    """One concept per class: a class that passes ~350 lines is split (docs/ARCHITECTURE.md)."""
    big = []
    for path in sorted([*(ROOT / "genie_core").rglob("*.py"), *(ROOT / "genie_jupyter").rglob("*.py")]):
        for node in ast.walk(ast.parse(path.read_text())):
            lines = node.end_lineno - node.lineno + 1 if isinstance(node, ast.ClassDef) and node.end_lineno else 0
            if lines > 350:
                big.append(f"{path.relative_to(ROOT)}:{node.lineno} {getattr(node, 'name', '?')}: {lines} lines")
    assert not big, "\n".join(big)
