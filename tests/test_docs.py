"""The docs cannot drift from the code they describe.

Where README.md or a doc under docs/ restates a constant, it names it and gives the value in
parentheses: `SCREEN_CONCURRENCY` (64), `RECORD_TTL` (30 s), `COMPUTE_TOLERANCE[torch.float32]`
(2e-4), `PeerOptions.max_sessions` (256); a command-line default likewise: `--max-sessions N`
(256). Every such pair is checked here against the code, with the units docs use (ms, s, min,
KiB, MiB, GiB, %). docs/benchmarks.md holds measurements, not constants, and is not read.
"""

from __future__ import annotations

import ast
import importlib
import math
import re
from pathlib import Path

import pytest

from p2pfusion.cli.main import build_parser

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "p2pfusion"
DOCS = [ROOT / "README.md", *sorted(p for p in (ROOT / "docs").glob("*.md") if p.name != "benchmarks.md")]
# `NAME`, `NAME[key]`, `Class.attr` or `module.NAME`, then its value in parentheses
# the value is read ahead, not consumed, so a citation inside another's parenthesis is read too
CONSTANT = re.compile(r"`((?:[a-z_]+\.)*[A-Z][A-Za-z0-9_]*(?:\.[a-z_][a-z0-9_]*)?(?:\[[^\]`]+\])?)`\s+\((?=([^)]*)\))")
FLAG = re.compile(r"`(--[a-z][a-z-]*)(?: [A-Z][A-Z|.]*)?`\s+\((?=([^)]*)\))")
NUMBER = re.compile(r"^(-?\d[\d,]*(?:\.\d+)?(?:e-?\d+)?)\s*(ms|s|min|KiB|MiB|GiB|%)?(?![\w.])")
LITERAL = re.compile(r"^`[^`/ ]+`(?::|$)")  # a value, not a path
UNITS = {None: 1.0, "ms": 1e-3, "s": 1.0, "min": 60.0, "KiB": 2.0 ** 10, "MiB": 2.0 ** 20, "GiB": 2.0 ** 30, "%": 0.01}


def _definitions() -> dict[str, list[str]]:
    """Module-level names (constants, classes) -> the modules that define them."""
    found: dict[str, list[str]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        module = ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
        for node in ast.parse(path.read_text()).body:
            targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
            names = [t.id for t in targets if isinstance(t, ast.Name)]
            if isinstance(node, ast.ClassDef):
                names = [node.name]
            for name in names:
                found.setdefault(name, []).append(module)
    return found


DEFINED = _definitions()


def _value(expression: str):
    """The value of `expression` (`NAME`, `NAME[key]`, `Class.attr`, each maybe after a module's
    last names: `messages.PROTOCOL`) in the module that defines its name."""
    head, bracket, rest = expression.partition("[")
    parts = head.split(".")
    first = next(i for i, part in enumerate(parts) if part[:1].isupper())
    qualifier, name, attributes = ".".join(parts[:first]), parts[first], parts[first + 1:]
    modules = [m for m in DEFINED.get(name, []) if not qualifier or m.endswith("." + qualifier)]
    if len(modules) != 1:
        raise LookupError(f"`{expression}` names {len(modules)} definitions ({', '.join(modules) or 'none'}): qualify it")
    namespace = vars(importlib.import_module(modules[0]))
    value = namespace[name]
    for attribute in attributes:
        value = getattr(value, attribute)
    return eval(f"_value[{rest}", {**namespace, "_value": value}) if bracket else value  # noqa: S307 (the docs' own key)


def _number(text: str) -> float | None:
    match = NUMBER.match(text.strip())
    if match is None:
        return None
    return float(match.group(1).replace(",", "")) * UNITS[match.group(2)]


def _agrees(stated: str, actual) -> bool:
    number = _number(stated)
    if isinstance(actual, bool) or number is None:
        return stated.strip().split(":")[0].split(",")[0].strip().strip("`\"'") == str(getattr(actual, "value", actual))
    return math.isclose(number, float(actual), rel_tol=1e-6)


def _defaults() -> dict[str, set]:
    """Each flag's defaults, across the commands that take it."""
    parser = build_parser()
    found: dict[str, set] = {}
    for command in parser._subparsers._group_actions[0].choices.values():
        for action in command._actions:
            for flag in action.option_strings:
                if action.default is not None and action.nargs != 0:
                    found.setdefault(flag, set()).add(action.default)
    return found


def _cited(name: str, stated: str) -> bool:
    """Whether a parenthesis after a name states its value: it starts with a number, or is a
    `literal` alone (or before a colon); and the name is one of the package's (a constant-like
    name with an underscore always counts, so a misspelt one fails instead of passing unread)."""
    if not (NUMBER.match(stated.strip()) or LITERAL.match(stated)):
        return False
    base = re.sub(r"^(?:[a-z_]+\.)*", "", name).split(".")[0].split("[")[0]
    return name.startswith("--") or base in DEFINED or "_" in base


def _citations(pattern: re.Pattern) -> list[tuple[str, str, str]]:
    """(where, name, stated value) of each citation of a name with its value."""
    return [
        (f"{path.name}:{text[:match.start()].count(chr(10)) + 1}", match.group(1), match.group(2))
        for path in DOCS for text in (path.read_text(),) for match in pattern.finditer(text)
        if _cited(match.group(1), match.group(2))
    ]


@pytest.mark.parametrize("where, name, stated", _citations(CONSTANT))
def test_a_constant_the_docs_cite_has_the_value_they_give(where, name, stated):
    assert _agrees(stated, _value(name)), f"{where}: `{name}` is {_value(name)!r} in the code, the doc says ({stated})"


@pytest.mark.parametrize("where, flag, stated", _citations(FLAG))
def test_a_default_the_docs_cite_is_the_parsers(where, flag, stated):
    defaults = _defaults().get(flag)
    assert defaults, f"{where}: no command takes {flag} with a default"
    assert any(_agrees(stated, value) for value in defaults), f"{where}: {flag} defaults to {defaults}, the doc says ({stated})"


def test_the_checker_catches_a_stale_number(tmp_path):
    assert _agrees("64", _value("SCREEN_CONCURRENCY")) and not _agrees("128", _value("SCREEN_CONCURRENCY"))
    assert _agrees("30 s", _value("RECORD_TTL")) and _agrees("1 MiB", 1 << 20) and _agrees("8 ms", 0.008)
    assert _agrees("2e-4", _value("COMPUTE_TOLERANCE[torch.float32]"))
    assert _agrees("256", _value("PeerOptions.max_sessions"))
    assert _agrees("`p2pfusion.inference.v4`", "p2pfusion.inference.v4")
    with pytest.raises(LookupError, match="qualify it"):
        _value("PROTOCOL")  # the inference and the training-run protocol both have one
    assert _value("messages.PROTOCOL").startswith("p2pfusion.inference")
    assert any(_agrees("256", value) for value in _defaults()["--max-sessions"])
    nested = "`FILE.tls` (mode 0600; made anew within `CERT_MIN_LIFE.days` (7) of expiry)"
    assert [m.group(1) for m in CONSTANT.finditer(nested) if _cited(m.group(1), m.group(2))] == ["CERT_MIN_LIFE.days"]


PYTHON_BLOCK = re.compile(r"```python\n(.*?)```", re.S)


def test_users_import_from_the_package_root_only():
    """What the docs show users imports only `p2pfusion`'s exports, never an inner module (whose
    path may change), and every export resolves."""
    import p2pfusion

    inner = [
        f"{path.name}: {line.strip()}"
        for path in DOCS for block in PYTHON_BLOCK.findall(path.read_text()) for line in block.splitlines()
        if re.match(r"\s*(from|import) p2pfusion\.", line)
    ]
    assert not inner, "the docs import inner modules:\n" + "\n".join(inner)
    names = {name for path in DOCS for block in PYTHON_BLOCK.findall(path.read_text())
             for found in re.findall(r"from p2pfusion import ([\w, ]+)", block) for name in found.split(", ")}
    assert names and names <= set(p2pfusion.__all__), names - set(p2pfusion.__all__)
    assert all(getattr(p2pfusion, name) is not None for name in p2pfusion.__all__)


def test_importing_the_package_loads_neither_torch_nor_transformers():
    """Its exports load on first use: `import p2pfusion` (and the CLI's argument parsing) stays fast."""
    import subprocess
    import sys

    code = "import sys, p2pfusion; print(sorted({'torch', 'transformers'} & set(sys.modules)))"
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert loaded == "[]"
