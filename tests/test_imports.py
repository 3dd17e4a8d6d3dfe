"""One-way data flow, enforced: checkpoint -> convert -> converted dir -> runtime -> verify/server.

Every `import` / `from ... import` in backfit/ (lazy ones inside functions included, relative
ones resolved) is checked against RULES. To add a rule (engine, server), append a Rule: the
files it covers (globs relative to backfit/) and the backfit modules they may import and/or
must not import (dotted prefixes). Every rule that covers a file applies to it. The runtime's own layering
lives in tests/runtime/test_static.py.
"""

import ast
from dataclasses import dataclass
from fnmatch import fnmatch
from pathlib import Path

PKG = Path(__file__).resolve().parents[1] / "backfit"
LEAVES = ("backfit.config", "backfit.inventory", "backfit.checkpoint", "backfit.quant",
          "backfit.formats")
LEAF_FILES = tuple(m.split(".")[1] + ".py" for m in LEAVES)
# the independent FP32 reference: sharing runtime code would let one bug hide in both sides
REFERENCE_FILES = ("verify/reference.py", "verify/ref_attention.py", "verify/ref_blocks.py",
                   "verify/ref_drafters.py", "verify/qat.py", "verify/ref_vision.py")


@dataclass(frozen=True)
class Rule:
    name: str
    files: tuple[str, ...]                    # globs relative to backfit/ ("*" crosses "/")
    may_import: tuple[str, ...] | None = None  # dotted module prefixes; None = any
    must_not: tuple[str, ...] = ()            # dotted module prefixes, never
    except_files: tuple[str, ...] = ()        # globs the rule skips

    def covers(self, rel: str) -> bool:
        return any(fnmatch(rel, g) for g in self.files) and \
            not any(fnmatch(rel, g) for g in self.except_files)

    def allows(self, target: str) -> bool:
        return (self.may_import is None or _matches(target, self.may_import)) and \
            not _matches(target, self.must_not)


TOP = ("backfit.cli", "backfit.demo", "backfit.server", "backfit.verify")
# engine files that are plain Python over ints (no torch, no runtime): style.md §b
TORCH_FREE = ("engine/sequence.py", "engine/block_manager.py", "engine/scheduler.py",
              "engine/sampling_params.py", "engine/tokenizer.py")
RULES = [
    Rule("leaves import only stdlib, torch, safetensors", LEAF_FILES, LEAVES),
    Rule("synthetic builds checkpoints from the leaves", ("synthetic.py", "synthetic_vision.py"),
         LEAVES + ("backfit.synthetic_vision",)),
    Rule("convert never imports runtime", ("convert/*",), LEAVES + ("backfit.convert",)),
    # image preprocessing sits upstream of runtime, engine and server: torch, Pillow, the leaves
    Rule("vision preprocessing is a leaf package", ("vision/*",), LEAVES + ("backfit.vision",)),
    Rule("verify consumes runtime", ("verify/*",),
         LEAVES + ("backfit.runtime", "backfit.verify", "backfit.vision")),
    Rule("the reference is independent of runtime", REFERENCE_FILES,
         LEAVES + ("backfit.vision",)
         + tuple("backfit." + f[:-3].replace("/", ".") for f in REFERENCE_FILES)),
    Rule("nothing imports cli, demo, server or verify from below", ("*",), must_not=TOP,
         except_files=("cli.py", "demo.py", "verify/*", "server/*")),
    Rule("server never imports cli, demo or verify", ("server/*",), must_not=TOP[:2] + TOP[3:]),
    # backfit.vision (image preprocessing, the block layout, the count check) is upstream of
    # all three: the server prepares images, the engine schedules spans, the runtime checks them
    Rule("runtime never imports engine, convert or the planner", ("runtime/*",),
         LEAVES + ("backfit.runtime", "backfit.vision")),
    Rule("engine imports runtime and the leaves", ("engine/*",),
         LEAVES + ("backfit.runtime", "backfit.engine", "backfit.vision")),
    Rule("the scheduling side never touches the runtime", TORCH_FREE,
         LEAVES + ("backfit.engine",), must_not=("backfit.engine.engine",
                                                 "backfit.engine.async_engine")),
    Rule("server reaches the engine only through bridge.py", ("server/*",),
         LEAVES + ("backfit.server", "backfit.vision"), except_files=("server/bridge.py",)),
    Rule("bridge.py: the server's one door to the engine", ("server/bridge.py",),
         LEAVES + ("backfit.server", "backfit.engine", "backfit.vision")),
    Rule("kernels import the leaves, each other and the runtime's streams, never the model",
         ("runtime/kernels/*",), LEAVES + ("backfit.runtime.kernels", "backfit.runtime.streams")),
    Rule("the model reaches a kernel room through its package, not a room's module",
         ("runtime/model/*", "runtime/layers.py", "runtime/cache/*", "runtime/batch.py"),
         must_not=tuple(f"backfit.runtime.kernels.{room}.{mod}" for room, mods in (
             ("linear", ("gemm", "gemv", "gemv_fma", "gemv_tiles")),
             ("moe", ("common", "int8", "int8_decode", "mx4", "mx4_decode")),
             ("attention", ("decode", "prefill", "prefill_cd", "tiles", "indexer")),
             ("mhc", ("core", "decode", "tile")), ("cache", ("decode", "prefill")))
             for mod in mods)),
    Rule("drafters build on the blocks, never on the tower", ("runtime/model/draft/*",),
         must_not=("backfit.runtime.model.transformer",)),
]


def _matches(target: str, prefixes: tuple[str, ...]) -> bool:
    return any(target == p or target.startswith(p + ".") for p in prefixes)


def backfit_imports(source: str, module: str) -> list[str]:
    """Dotted backfit modules imported by `source` (the text of module `module`, e.g.
    "backfit.verify.run"); relative imports resolved, `from backfit.x import y` -> x.y when
    y is a module, else x."""
    package = module.rsplit(".", 1)[0]
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            out += [a.name for a in node.names if a.name.startswith("backfit")]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:                                   # from .x / from .. import y
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            if not (base == "backfit" or base.startswith("backfit.")):
                continue
            for a in node.names:
                sub = f"{base}.{a.name}"
                is_mod = (PKG.parent / (sub.replace(".", "/") + ".py")).exists() or \
                    (PKG.parent / sub.replace(".", "/")).is_dir()
                out.append(sub if is_mod else base)
    return [m for m in out if m != "backfit"]


def _files():
    for path in sorted(PKG.rglob("*.py")):
        rel = path.relative_to(PKG).as_posix()
        module = "backfit." + rel[:-3].replace("/", ".").removesuffix(".__init__")
        if rel.endswith("__init__.py"):
            module += ".__init__"                            # relative imports resolve inside it
        yield rel, module, path


def test_rules_cover_their_files():
    """Each rule matches at least one file (a renamed file must not silently drop a rule)."""
    rels = [rel for rel, _, _ in _files()]
    for rule in RULES:
        assert any(rule.covers(r) for r in rels), rule.name
    for f in REFERENCE_FILES:
        assert f in rels, f


def test_import_edges():
    checked = 0
    for rel, module, path in _files():
        rules = [r for r in RULES if r.covers(rel)]
        for target in backfit_imports(path.read_text(), module):
            for rule in rules:
                assert rule.allows(target), f"{rel} imports {target}: breaks '{rule.name}'"
                checked += 1
    assert checked > 40


def test_the_scanner_sees_every_import_form():
    """The checker itself: lazy, relative and `from backfit import x` imports are all seen."""
    src = ("import torch\nfrom . import ref_blocks\nfrom ..runtime.layers import Linear\n"
           "from backfit import runtime\nimport backfit.quant\n"
           "def f():\n    from backfit.runtime.loader import load_model\n")
    got = backfit_imports(src, "backfit.verify.reference")
    assert sorted(got) == ["backfit.quant", "backfit.runtime", "backfit.runtime.layers",
                           "backfit.runtime.loader", "backfit.verify.ref_blocks"]
    rule = next(r for r in RULES if r.files == REFERENCE_FILES)
    assert [t for t in got if not rule.allows(t)] == \
        ["backfit.runtime.layers", "backfit.runtime", "backfit.runtime.loader"]


def _module_graph() -> dict[str, set[str]]:
    """backfit module -> the backfit modules it imports (a package's __init__ as the package)."""
    graph: dict[str, set[str]] = {}
    for _, module, path in _files():
        name = module.removesuffix(".__init__")
        graph.setdefault(name, set()).update(
            t for t in backfit_imports(path.read_text(), module) if t != name)
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every strongly connected set of two or more modules (an import circle), Tarjan."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in graph:
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_circles():
    """No two backfit modules import each other, directly or around a loop (lazy imports in
    functions included: a circle is a design knot whether or not Python tolerates it). A
    package's own submodules are not counted as importing their package back."""
    graph = _module_graph()
    for mod, targets in graph.items():                 # a submodule -> its package's __init__
        targets -= {t for t in targets if mod.startswith(t + ".")}
    assert len(graph) > 80
    assert _cycles(graph) == []


def test_the_circle_finder_sees_a_circle():
    g = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _cycles(g) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_scheduling_side_imports_no_torch():
    """sequence, block manager, scheduler, sampling params and tokenizer run without torch."""
    for rel in TORCH_FREE:
        tree = ast.parse((PKG / rel).read_text())
        for node in ast.walk(tree):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            assert not any(n == "torch" or n.startswith(("torch.", "triton")) for n in names), \
                f"{rel} imports {names}"


def test_test_module_basenames_are_unique():
    # pytest imports test files by basename (pythonpath = tests, no packages): two files of one
    # name make collection fail with "import file mismatch" on a clean clone
    seen: dict[str, Path] = {}
    for p in sorted((PKG.parent / "tests").rglob("test_*.py")):
        assert p.name not in seen, f"{p} and {seen[p.name]} share a basename: rename one"
        seen[p.name] = p
