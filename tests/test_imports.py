"""Import structure of the jaxspec package: no import cycles, kernels below callers.

The graph is read statically with `ast`, so the test needs no JAX and imports
nothing. An import anywhere in a module counts as an edge, function-level
(lazy) ones included: a lazy import hides a cycle from the interpreter but not
from the reader, and it is the usual way cycles creep back in.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE_DIR = Path(__file__).resolve().parents[1] / "jaxspec"

# Strongly connected components (sets of modules that import one another)
# tolerated for now, each with its reason. An entry must match a component
# exactly: if the component grows, or is broken, the test says so.
ALLOWED_CYCLES: dict[frozenset[str], str] = {}


# --------------------------------------------------------------------------
# Graph
# --------------------------------------------------------------------------


def package_modules(pkg_dir: Path) -> dict[str, Path]:
    """Dotted module name -> file, for every .py under pkg_dir (a package)."""
    root = pkg_dir.parent
    mods = {}
    for path in sorted(pkg_dir.rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        mods[".".join(parts)] = path
    return mods


def _resolve_relative(module: str, is_package: bool, level: int, target: str | None) -> str:
    base = module.split(".")
    if not is_package:
        base = base[:-1]
    if level > 1:
        base = base[: len(base) - (level - 1)]
    return ".".join(base + ([target] if target else []))


def _known(name: str, mods: dict[str, Path]) -> str | None:
    """The longest prefix of `name` that is a module of the package, or None."""
    parts = name.split(".")
    for k in range(len(parts), 0, -1):
        cand = ".".join(parts[:k])
        if cand in mods:
            return cand
    return None


def imports_of(module: str, path: Path, mods: dict[str, Path]) -> set[str]:
    """Package modules that `module` imports, at any nesting level."""
    tree = ast.parse(path.read_text(), filename=str(path))
    is_package = path.name == "__init__.py"
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = _resolve_relative(module, is_package, node.level, node.module)
            # `from pkg import name` imports pkg.name when that is a submodule.
            names = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base
                     for a in node.names]
        else:
            continue
        for name in names:
            hit = _known(name, mods)
            if hit is not None and hit != module:
                out.add(hit)
    return out


def import_graph(pkg_dir: Path) -> dict[str, set[str]]:
    mods = package_modules(pkg_dir)
    return {m: imports_of(m, p, mods) for m, p in mods.items()}


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One concrete cycle [a, b, ..., a] per strongly connected component of
    size > 1, sorted so reports are stable."""
    return sorted(_cycle_in(comp, graph) for comp in strongly_connected(graph))


def strongly_connected(graph: dict[str, set[str]]) -> list[frozenset[str]]:
    """Components of more than one module (Tarjan): each member reaches every other."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    sccs: list[set[str]] = []

    def strongconnect(v: str) -> None:
        # Recursion depth is bounded by the module count (~100).
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                strongconnect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.add(w)
                if w == v:
                    break
            if len(comp) > 1:
                sccs.append(comp)

    for v in sorted(graph):
        if v not in index:
            strongconnect(v)
    return [frozenset(c) for c in sccs]


def _cycle_in(comp: set[str], graph: dict[str, set[str]]) -> list[str]:
    # Shortest cycle through the component's smallest member (BFS back to it).
    start = min(comp)
    prev = {start: None}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(graph[v] & comp):
                if w == start:
                    path = [v]
                    while prev[path[-1]] is not None:
                        path.append(prev[path[-1]])
                    return path[::-1] + [start]
                if w not in prev:
                    prev[w] = v
                    nxt.append(w)
        frontier = nxt
    raise AssertionError(f"{comp} is not strongly connected")


def format_cycle(cycle: list[str]) -> str:
    return " -> ".join(cycle)


# --------------------------------------------------------------------------
# The detector itself, on synthetic packages (positive controls)
# --------------------------------------------------------------------------


def _write_package(root: Path, files: dict[str, str]) -> Path:
    for rel, src in files.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(src)
    return root / "toypkg"


def test_detector_finds_module_level_cycle(tmp_path):
    pkg = _write_package(tmp_path, {
        "toypkg/__init__.py": "",
        "toypkg/a.py": "from toypkg.b import f\n",
        "toypkg/b.py": "import toypkg.c\n",
        "toypkg/c.py": "from toypkg import a\n",
        "toypkg/d.py": "import toypkg.a\n",  # depends on the cycle, not in it
    })
    cycles = find_cycles(import_graph(pkg))
    assert cycles == [["toypkg.a", "toypkg.b", "toypkg.c", "toypkg.a"]]


def test_detector_finds_function_level_and_relative_cycle(tmp_path):
    pkg = _write_package(tmp_path, {
        "toypkg/__init__.py": "",
        "toypkg/sub/__init__.py": "",
        "toypkg/sub/kernel.py": "from ..ref import Result\n",
        "toypkg/ref.py": (
            "class Result: ...\n"
            "def run():\n"
            "    if True:\n"
            "        from toypkg.sub.kernel import go\n"
            "    return go()\n"),
    })
    graph = import_graph(pkg)
    assert graph["toypkg.sub.kernel"] == {"toypkg.ref"}
    assert graph["toypkg.ref"] == {"toypkg.sub.kernel"}
    assert find_cycles(graph) == [["toypkg.ref", "toypkg.sub.kernel", "toypkg.ref"]]


def test_components_are_whole_so_an_allowed_cycle_cannot_hide_a_new_one():
    # a <-> b alone, then c joins through b -> c -> a: the component is now
    # {a, b, c}, which an allowance for {a, b} does not cover.
    graph = {"a": {"b"}, "b": {"a"}, "c": set(), "d": {"d"}}
    assert strongly_connected(graph) == [frozenset({"a", "b"})]
    graph["b"].add("c")
    graph["c"].add("a")
    assert strongly_connected(graph) == [frozenset({"a", "b", "c"})]
    assert find_cycles(graph) == [["a", "b", "a"]]


def test_detector_passes_acyclic_package(tmp_path):
    # Negative control: a diamond and a self-import are not cycles.
    pkg = _write_package(tmp_path, {
        "toypkg/__init__.py": "",
        "toypkg/top.py": "import toypkg.left, toypkg.right\n",
        "toypkg/left.py": "from toypkg.base import x\n",
        "toypkg/right.py": "from toypkg import base\n",
        "toypkg/base.py": "import os\nimport toypkg.base\nx = 1\n",
    })
    graph = import_graph(pkg)
    assert graph["toypkg.top"] == {"toypkg.left", "toypkg.right"}
    assert graph["toypkg.right"] == {"toypkg.base"}
    assert find_cycles(graph) == []


# --------------------------------------------------------------------------
# The real package
# --------------------------------------------------------------------------


def test_graph_sees_the_package():
    # Guards against a detector that passes because it parsed nothing.
    graph = import_graph(PACKAGE_DIR)
    assert "jaxspec.pallas.verify" in graph
    assert "jaxspec.pallas.types" in graph["jaxspec.pallas.verify"]
    assert "jaxspec.pallas.verify" in graph["jaxspec.speculative.verify"]  # a lazy import


def test_no_import_cycles():
    graph = import_graph(PACKAGE_DIR)
    comps = strongly_connected(graph)
    unexpected = sorted(_cycle_in(c, graph) for c in comps if c not in ALLOWED_CYCLES)
    assert not unexpected, "import cycles:\n" + "\n".join(
        f"{format_cycle(c)}   (component: {sorted(comp)})"
        for c in unexpected for comp in comps if c[0] in comp)
    stale = [sorted(c) for c in ALLOWED_CYCLES if c not in comps]
    assert not stale, f"no longer a cycle, remove from ALLOWED_CYCLES: {stale}"


# Kernels sit below their callers: a module under jaxspec/pallas imports nothing of the package
# outside jaxspec/pallas (their shared types live in the leaf jaxspec.pallas.types).
@pytest.mark.parametrize("module", sorted(m for m in package_modules(PACKAGE_DIR)
                                          if m.startswith("jaxspec.pallas")))
def test_kernels_import_nothing_above_them(module):
    graph = import_graph(PACKAGE_DIR)
    bad = sorted(m for m in graph[module] if not m.startswith("jaxspec.pallas"))
    assert not bad, f"{module} imports {bad}, above the kernels"


def test_kernel_rule_has_teeth(tmp_path):
    # Positive control for the rule above: the pre-refactor shape is caught.
    pkg = _write_package(tmp_path, {
        "toypkg/__init__.py": "",
        "toypkg/pallas/__init__.py": "",
        "toypkg/pallas/verify.py": "from toypkg.speculative.verify import VerifyResult\n",
        "toypkg/speculative/__init__.py": "",
        "toypkg/speculative/verify.py": "class VerifyResult: ...\n",
    })
    graph = import_graph(pkg)
    assert [m for m in graph["toypkg.pallas.verify"] if not m.startswith("toypkg.pallas")] == ["toypkg.speculative.verify"]


def test_moved_names_keep_their_old_import_paths():
    # Callers outside this refactor still import from the old modules.
    from jaxspec.models import config, gguf_convert, loading
    from jaxspec import paths
    from jaxspec.speculative import tree, types, verify

    assert loading.LoadError is config.LoadError is gguf_convert.LoadError
    assert loading.cache_root is paths.cache_root
    assert tree.TreeInfo is types.TreeInfo and verify.VerifyResult is types.VerifyResult
    assert tree.node_valid is types.node_valid and tree.assemble_tree_info is types.assemble_tree_info
