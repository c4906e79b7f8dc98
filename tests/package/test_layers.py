"""The package's layers point one way: every import goes down, never up, never round.

The engine is a stack, each layer importing only the ones below it::

    quota._core → quota._sql → quota._stores → quota._wrappers → quota._limiter

and above it, the wings: `quota.http`, then `quota.admin`, `quota._tools`, `quota.contrib`,
`quota.alembic`, the package itself (`quota/__init__.py`), and the command line (``cli/``,
loaded as ``quota._cli``) on top. This test reads the sources (no
import) and fails, naming the file, the line and the arrow, when

* a module imports from a layer above its own: imports under ``if TYPE_CHECKING:`` and
  imports inside functions count too, they are arrows of the design all the same;
* a module outside a wing package (`quota.http`, `quota.admin`, each `quota.contrib.*`)
  imports one of its private modules (a path segment starting with ``_`` below the
  package's top). The engine layers are quota's own internals: every wing may use them;
* the module-level imports form a cycle.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

#: The layers, lowest first; a module belongs to the longest prefix that names it.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("quota._core",),
    ("quota._sql",),
    ("quota._stores",),
    ("quota._wrappers",),
    ("quota._limiter",),
    ("quota.http",),
    ("quota.admin",),
    ("quota._tools",),
    ("quota.contrib",),
    ("quota.alembic",),
    ("quota", "quota._checkout", "quota._migrations"),
    ("quota._cli",),
)
#: The packages whose ``_private`` modules are theirs alone.
WINGS = ("quota.http", "quota.admin", "quota.contrib")


@dataclass(frozen=True, slots=True)
class Arrow:
    """One import: `source` (a file, from the repository root) imports `target` at `line`."""

    source: str
    line: int
    module: str
    target: str
    top_level: bool

    def __str__(self) -> str:
        return f"{self.source}:{self.line}: {self.module} → {self.target}"


def module_name(path: Path) -> str:
    """The dotted name of a source file (``cli/`` is ``quota._cli``)."""
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[0] == "cli":
        parts[0:1] = ["quota", "_cli"]
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def sources() -> Iterator[Path]:
    for folder in ("quota", "cli"):
        yield from sorted((ROOT / folder).rglob("*.py"))


def _known_modules() -> set[str]:
    return {module_name(path) for path in sources()}


def _resolve(module: str, is_package: bool, level: int, name: str | None) -> str:
    if not level:
        return name or ""
    base = module.split(".") if is_package else module.split(".")[:-1]
    if level > 1:
        base = base[: len(base) - (level - 1)]
    return ".".join([*base, name] if name else base)


def arrows(path: Path, known: set[str]) -> Iterator[Arrow]:
    """Every import of the quota package in `path`, with the module it reaches."""
    module = module_name(path)
    is_package = path.name == "__init__.py"
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    source = str(path.relative_to(ROOT))

    def visit(node: ast.AST, top_level: bool) -> Iterator[Arrow]:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.Import):
                for alias in child.names:
                    if alias.name == "quota" or alias.name.startswith("quota."):
                        yield Arrow(source, child.lineno, module, alias.name, top_level)
            elif isinstance(child, ast.ImportFrom):
                base = _resolve(module, is_package, child.level, child.module)
                if not (base == "quota" or base.startswith("quota.")):
                    continue
                for alias in child.names:
                    # ``from quota.http import shedding``: the submodule, when it is one.
                    sub = f"{base}.{alias.name}"
                    yield Arrow(
                        source, child.lineno, module, sub if sub in known else base, top_level
                    )
            elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)) or (
                isinstance(child, ast.If) and _type_checking(child.test)
            ):
                yield from visit(child, False)
            else:
                yield from visit(child, top_level)

    yield from visit(tree, True)


def _type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def layer(module: str) -> int:
    """The rank of `module`'s layer (the longest prefix of `LAYERS` naming it)."""
    best, rank = -1, -1
    for index, prefixes in enumerate(LAYERS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > best:
                best, rank = len(prefix), index
    assert rank >= 0, f"{module} is in no layer: add it to LAYERS"
    return rank


def wing(module: str) -> str | None:
    """The wing package `module` belongs to (``quota.contrib.django`` for its modules)."""
    for top in WINGS:
        if module == top or module.startswith(top + "."):
            if top == "quota.contrib":
                parts = module.split(".")
                return ".".join(parts[:3]) if len(parts) > 2 else None
            return top
    return None


def private_inside(target: str) -> bool:
    """Whether `target` is a private module of a wing package (below the package's top)."""
    package = wing(target)
    if package is None:
        return False
    below = target[len(package) + 1 :].split(".") if target != package else []
    return any(part.startswith("_") for part in below)


def violations() -> list[tuple[Arrow, str]]:
    known = _known_modules()
    found: list[tuple[Arrow, str]] = []
    for path in sources():
        for arrow in dict.fromkeys(arrows(path, known)):
            if layer(arrow.target) > layer(arrow.module):
                found.append((arrow, "imports from a layer above its own"))
            elif private_inside(arrow.target) and wing(arrow.module) != wing(arrow.target):
                found.append((arrow, "imports a private module of another package"))
    return found


def cycles() -> list[list[Arrow]]:
    """The cycles of module-level imports: the arrows among each group of modules that
    import each other (a strongly connected component of more than one module)."""
    known = _known_modules()
    graph: dict[str, set[str]] = {name: set() for name in known}
    edges: dict[tuple[str, str], Arrow] = {}
    for path in sources():
        for arrow in arrows(path, known):
            if arrow.top_level and arrow.target in known and arrow.target != arrow.module:
                graph[arrow.module].add(arrow.target)
                edges.setdefault((arrow.module, arrow.target), arrow)
    found: list[list[Arrow]] = []
    seen: set[tuple[str, ...]] = set()
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()

    def connect(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph[node]):
            if nxt not in index:
                connect(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component: list[str] = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                key = tuple(sorted(component))
                if key not in seen:
                    seen.add(key)
                    found.append([edges[a, b] for a in key for b in key if (a, b) in edges])

    for node in sorted(graph):
        if node not in index:
            connect(node)
    return found


def test_imports_point_down() -> None:
    """No module imports from a layer above it, nor another package's private module."""
    found = [f"{arrow}: {why}" for arrow, why in violations()]
    assert not found, "imports against the layers:\n" + "\n".join(found)


def test_no_import_cycles() -> None:
    """Module-level imports form no cycle."""
    found = cycles()
    assert not found, "import cycles:\n" + "\n\n".join(
        "\n".join(map(str, cycle)) for cycle in found
    )


@pytest.mark.parametrize(
    ("module", "target", "bad"),
    [
        ("quota._core.url", "quota._stores.base", True),
        ("quota._stores.redis", "quota._sql.statements", False),
        ("quota._tools.bench", "quota.http._runtime", True),
        ("quota.http.asgi", "quota.http._runtime", False),
        ("quota._cli.main", "quota._limiter.base", False),
    ],
)
def test_rules(module: str, target: str, bad: bool) -> None:
    """The rules themselves, on made-up arrows."""
    upward = layer(target) > layer(module)
    private = private_inside(target) and wing(module) != wing(target)
    assert (upward or private) is bad
