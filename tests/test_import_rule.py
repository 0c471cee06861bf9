"""The package's import rule (docs/architecture.md, Package layout), read from the source with `ast`:
`models/` and `net/` import no other p2pfusion package but `errors`, `dht/` builds on `net/`, and
`peer/` and `client/` build on those three and never import each other, `api/` builds on `client/`
(never `peer/`). Only `cli/` and `sim/` import both. Inside `client/`, each room imports only the rooms
below it (`ROOMS`), and no module of the package imports itself back through others."""

import ast
from dataclasses import dataclass
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "p2pfusion"

# what each part may import besides itself; a part missing here (cli, the package root) is unrestricted
ALLOWED = {
    "errors": set(),
    "models": {"errors"},
    "net": {"errors"},
    "dht": {"errors", "net"},
    "peer": {"errors", "net", "dht", "models"},
    "client": {"errors", "net", "dht", "models"},
    "api": {"errors", "net", "dht", "models", "client"},
}
# `importlib.import_module("p2pfusion.x")` and `__import__` count as imports too
DYNAMIC_IMPORTERS = {"import_module", "__import__"}
# client/'s rooms and what each may import of the others; "" is the modules at client/'s top
# (options, core, loop, survey), which assemble a client from routes and checks
ROOMS = {
    "route": set(),
    "checks": {"route"},
    "": {"route", "checks"},
    "tune": {"", "route", "checks"},
    "run": {"", "route"},
    "generate": {"", "route", "checks", "tune"},
}


@dataclass(frozen=True)
class Violation:
    file: str
    line: int
    imported: str

    def __str__(self) -> str:
        return f"{self.file}:{self.line} imports {self.imported}"


def part_of(module: str, package_dir: Path) -> str:
    """The top-level part of the package a dotted name inside it belongs to ('' for the root itself)."""
    parts = module.split(".")[1:]
    if not parts:
        return ""
    head = parts[0]
    if (package_dir / head).is_dir() or (package_dir / f"{head}.py").is_file():
        return head
    return ""  # a name defined in the root package (`from p2pfusion import __version__`)


def module_name(path: Path, package_dir: Path) -> tuple[list[str], bool]:
    """The dotted parts of a file's module name, and whether it is a package's `__init__`."""
    parts = [package_dir.name, *path.relative_to(package_dir).with_suffix("").parts]
    if parts[-1] == "__init__":
        return parts[:-1], True
    return parts, False


def _typing_only(tree: ast.AST) -> set[int]:
    """Ids of the import nodes under `if TYPE_CHECKING:`, which run only for type checkers."""
    hidden = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and getattr(node.test, "id", getattr(node.test, "attr", None)) == "TYPE_CHECKING":
            hidden.update(id(inner) for stmt in node.body for inner in ast.walk(stmt))
    return hidden


def imported_names(tree: ast.AST, module: list[str], is_package: bool, typing_too: bool = True, names: bool = False):
    """(line, absolute dotted name) of every import anywhere in a module, functions included
    (those only type checkers run too, unless `typing_too` is False); with `names`, `from x import
    y` gives x.y (a module, or else a name in x)."""
    hidden = set() if typing_too else _typing_only(tree)
    for node in ast.walk(tree):
        if id(node) in hidden:
            continue
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                here = module if is_package else module[:-1]
                base = ".".join(here[: len(here) - (node.level - 1)])
                source = f"{base}.{node.module}" if node.module else base
            else:
                source = node.module or ""
            for alias in node.names:
                # `from p2pfusion import client` names a subpackage; `from x import y` is x's
                yield node.lineno, f"{source}.{alias.name}" if names or source == module[0] else source
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
            if name in DYNAMIC_IMPORTERS and isinstance(node.args[0].value, str):
                yield node.lineno, node.args[0].value


def violations(package_dir: Path, allowed: dict[str, set[str]] = ALLOWED) -> list[Violation]:
    found = []
    root = package_dir.name
    for path in sorted(package_dir.rglob("*.py")):
        module, is_package = module_name(path, package_dir)
        own = module[1] if len(module) > 1 else ""
        if own not in allowed:
            continue
        tree = ast.parse(path.read_text(), filename=str(path))
        for line, name in imported_names(tree, module, is_package):
            if name != root and not name.startswith(root + "."):
                continue  # the standard library and third-party packages are free
            target = part_of(name, package_dir)
            if target != own and target not in allowed[own]:
                found.append(Violation(str(path.relative_to(package_dir.parent)), line, name))
    return sorted(found, key=lambda v: (v.file, v.line))


def room_of(name: str, package_dir: Path = PACKAGE) -> str | None:
    """The room of client/ a dotted module name is in ("" for client's top modules), None outside client/."""
    parts = name.split(".")
    if parts[:2] != [package_dir.name, "client"]:
        return None
    if len(parts) > 2 and (package_dir / "client" / parts[2]).is_dir():
        return parts[2]
    return ""


def room_violations(package_dir: Path = PACKAGE) -> list[Violation]:
    found = []
    for path in sorted((package_dir / "client").rglob("*.py")):
        module, is_package = module_name(path, package_dir)
        own = room_of(".".join(module), package_dir)
        tree = ast.parse(path.read_text(), filename=str(path))
        for line, name in imported_names(tree, module, is_package):
            target = room_of(name, package_dir)
            if target is not None and target != own and target not in ROOMS[own]:
                found.append(Violation(str(path.relative_to(package_dir.parent)), line, name))
    return found


def import_cycles(package_dir: Path = PACKAGE) -> list[list[str]]:
    """Cycles among the package's modules (imports that only type checkers run left out)."""
    graph: dict[str, set[str]] = {}
    for path in sorted(package_dir.rglob("*.py")):
        module, is_package = module_name(path, package_dir)
        name = ".".join(module)
        tree = ast.parse(path.read_text(), filename=str(path))
        graph[name] = {imported for _, imported in imported_names(tree, module, is_package, False, names=True)}
    modules = set(graph)
    for name in graph:  # `from p2pfusion.x import y` names x.y when y is a module, else x
        graph[name] = {target if target in modules else target.rpartition(".")[0] for target in graph[name]}
        graph[name] = {target for target in graph[name] if target in modules and target != name}
    cycles, state = [], {}

    def visit(name: str, path: list[str]) -> None:
        state[name] = "open"
        for target in sorted(graph[name]):
            if state.get(target) == "open":
                cycles.append(path[path.index(target):] + [target])
            elif target not in state:
                visit(target, [*path, target])
        state[name] = "done"

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])
    return cycles


def test_client_rooms_import_only_rooms_below_them():
    broken = room_violations()
    assert not broken, "a room of client/ imports one above it (tests/test_import_rule.py, ROOMS):\n" + "\n".join(map(str, broken))


def test_no_import_cycle():
    cycles = import_cycles()
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(cycle) for cycle in cycles)


def test_package_keeps_its_import_rule():
    broken = violations(PACKAGE)
    assert not broken, "import rule broken (see docs/architecture.md, Package layout):\n" + "\n".join(map(str, broken))


def test_rule_catches_every_form_of_import(tmp_path):
    pkg = tmp_path / "p2pfusion"
    for part in ("peer", "client", "net", "dht", "models", "cli"):
        (pkg / part).mkdir(parents=True)
        (pkg / part / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "errors.py").write_text("")
    (pkg / "peer" / "server.py").write_text(
        "from p2pfusion.net import framing\n"  # allowed
        "from . import compute\n"  # its own package
        "def late():\n"
        "    from ..client import session\n"  # relative, inside a function
        "    return session\n"
    )
    (pkg / "client" / "session.py").write_text("import p2pfusion.peer.server\nfrom p2pfusion import peer\n")
    (pkg / "net" / "__init__.py").write_text("from .. import errors\nfrom ..dht import records\n")
    (pkg / "models" / "stage.py").write_text("import importlib\nimportlib.import_module('p2pfusion.net.codecs')\n")
    (pkg / "dht" / "swarm.py").write_text("from p2pfusion.net import transport\nfrom p2pfusion import __version__\n")
    (pkg / "cli" / "main.py").write_text("from p2pfusion.peer import server\nfrom p2pfusion.client import session\n")
    assert [str(v) for v in violations(pkg)] == [
        "p2pfusion/client/session.py:1 imports p2pfusion.peer.server",
        "p2pfusion/client/session.py:2 imports p2pfusion.peer",
        "p2pfusion/dht/swarm.py:2 imports p2pfusion.__version__",
        "p2pfusion/models/stage.py:2 imports p2pfusion.net.codecs",
        "p2pfusion/net/__init__.py:2 imports p2pfusion.dht",
        "p2pfusion/peer/server.py:4 imports p2pfusion.client",
    ]


def test_rooms_and_cycles_are_caught(tmp_path):
    pkg = tmp_path / "p2pfusion"
    for part in ("client/route", "client/generate", "client/checks"):
        (pkg / part).mkdir(parents=True)
        (pkg / part / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "client" / "__init__.py").write_text("")
    (pkg / "client" / "core.py").write_text("from p2pfusion.client.route import session\n")  # allowed
    (pkg / "client" / "route" / "session.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from p2pfusion.client.route import pieces\n"
        "from p2pfusion.client.generate import engine\n"
    )
    (pkg / "client" / "route" / "pieces.py").write_text("from p2pfusion.client.route import session\n")
    (pkg / "client" / "generate" / "engine.py").write_text("from p2pfusion.client import core\n")
    (pkg / "client" / "checks" / "verifier.py").write_text("import p2pfusion.client.generate.engine\n")
    assert [str(v) for v in room_violations(pkg)] == [
        "p2pfusion/client/checks/verifier.py:1 imports p2pfusion.client.generate.engine",
        "p2pfusion/client/route/session.py:4 imports p2pfusion.client.generate",
    ]
    # session -> engine -> core -> session; pieces -> session -> pieces only for type checkers
    assert import_cycles(pkg) == [["p2pfusion.client.generate.engine", "p2pfusion.client.core",
                                   "p2pfusion.client.route.session", "p2pfusion.client.generate.engine"]]

