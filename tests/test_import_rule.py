"""The package's import rule (docs/architecture.md, Package layout), read from the source with `ast`:
`models/` and `net/` import no other p2pfusion package but `errors`, `dht/` builds on `net/`, and
`peer/` and `client/` build on those three and never import each other, `api/` builds on `client/`
(never `peer/`). Only `cli/` imports both."""

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


def imported_names(tree: ast.AST, module: list[str], is_package: bool):
    """(line, absolute dotted name) of every import anywhere in a module, functions included."""
    for node in ast.walk(tree):
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
                yield node.lineno, f"{source}.{alias.name}" if source == module[0] else source
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
