"""One-way data flow, enforced: checkpoint -> convert -> converted dir -> runtime -> verify/server."""

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parents[1] / "backfit"
LEAVES = {"config", "inventory", "checkpoint", "quant", "formats"}
# package part -> backfit modules it may import (runtime's own rule lives in tests/runtime)
ALLOWED = {
    "leaf": LEAVES,
    "synthetic": LEAVES,
    "convert": LEAVES | {"convert"},
    "verify": LEAVES | {"runtime", "verify"},
}


def _part(path: Path) -> str:
    rel = path.relative_to(PKG).with_suffix("")
    first = rel.parts[0]
    return "leaf" if first in LEAVES else first


def _backfit_imports(path: Path):
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module]
        else:
            continue
        for n in names:
            if n.startswith("backfit."):
                yield n.split(".")[1]


def test_import_edges():
    checked = 0
    for path in sorted(PKG.rglob("*.py")):
        part = _part(path)
        if part not in ALLOWED:
            continue                                  # cli, demo (import everything), runtime
        for target in _backfit_imports(path):
            assert target in ALLOWED[part], f"{path.relative_to(PKG)} imports backfit.{target}"
            checked += 1
    assert checked > 20


def test_nothing_imports_cli_server_or_verify_from_below():
    for path in sorted(PKG.rglob("*.py")):
        part = _part(path)
        if part in ("verify", "cli", "demo"):
            continue
        bad = ({"cli", "demo", "server", "verify"} - {part}) & set(_backfit_imports(path))
        assert not bad, f"{path.relative_to(PKG)} imports {bad}"
