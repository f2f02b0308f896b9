"""The package's imports run one way: no import cycle between kimi_quant's modules (imports inside functions
count too: a lazy import is a dependency all the same) and no module imports another's private (_name) names."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "kimi_quant"


def _modules() -> dict[str, Path]:
    out = {}
    for p in PACKAGE.rglob("*.py"):
        parts = p.relative_to(PACKAGE.parent).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = p
    return out


def _import_statements(mods: dict[str, Path]):
    """(module, imported module, names) for every import statement of the package, lazy ones too:
    ``from X import a, b`` gives (m, X, [a, b]); ``import X`` gives (m, X, [])."""
    for m, p in mods.items():
        pkg = m if p.name == "__init__.py" else m.rpartition(".")[0]
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    base = pkg.split(".")[: len(pkg.split(".")) - node.level + 1]
                    target = ".".join(base + ([node.module] if node.module else []))
                else:
                    target = node.module or ""
                yield m, target, [a.name for a in node.names]
            elif isinstance(node, ast.Import):
                for a in node.names:
                    yield m, a.name, []


def _imports(mods: dict[str, Path]) -> tuple[dict[str, set[str]], list[tuple[str, str]]]:
    graph: dict[str, set[str]] = {m: set() for m in mods}
    private = []
    for m, target, names in _import_statements(mods):
        if not names:
            if target in mods and target != m:
                graph[m].add(target)
        for name in names:
            full = f"{target}.{name}"
            dep = full if full in mods else target
            if dep in mods and dep != m:
                graph[m].add(dep)
                if name.startswith("_") and not name.startswith("__") and dep == target:
                    private.append((m, full))
    return graph, private


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_cycles():
    graph, _ = _imports(_modules())
    assert _cycles(graph) == []


def test_no_private_names_across_modules():
    _, private = _imports(_modules())
    assert private == []


def test_the_checker_sees_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


#: The data flow, lowest first: a module imports only from its own layer or the layers before it.
#: Shared basics; the codecs' numerics; reading sources; the model's description; recipes; the plan;
#: writing files; the journal; the ascendV1 directory; running units; sizing; the model run on CPU
#: (validation and calibration both use it, neither uses the other); one output run; the two schedulers
#: (calibrated, then the data-free driver that dispatches to it); checking, validating, publishing; tools; the CLI.
LAYERS = [
    {"kimi_quant", "errors", "dtypes", "untrusted", "cache", "lock", "progress", "hashing", "targets", "options",
     "output_files", "mxfp4_a3"},
    {"hub_http"}, {"quant"}, {"source"}, {"model"}, {"recipe"}, {"plan"}, {"write"}, {"journal"}, {"layout"},
    {"executor"}, {"estimate"}, {"runtime"}, {"output_run"}, {"calibrate"}, {"convert"},
    {"verify"}, {"validate"}, {"publish"}, {"synth"}, {"cli"},
]


def _package(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def _upward_imports(graph: dict[str, set[str]], layers: list[set[str]]) -> list[str]:
    rank = {p: i for i, group in enumerate(layers) for p in group}
    found = []
    for m in sorted(graph):
        for d in sorted(graph[m]):
            a, b = _package(m), _package(d)
            if a not in rank or b not in rank:
                found.append(f"{a if a not in rank else b}: in no layer (add it to LAYERS)")
            elif rank[b] > rank[a]:
                found.append(f"{m} -> {d}")
    return found


def test_imports_follow_the_layers():
    graph, _ = _imports(_modules())
    assert _upward_imports(graph, LAYERS) == []


def test_the_layer_checker_sees_an_upward_import():
    graph = {"kimi_quant.quant.base": {"kimi_quant.plan"}, "kimi_quant.plan": {"kimi_quant.quant.base"}}
    assert _upward_imports(graph, [{"quant"}, {"plan"}]) == ["kimi_quant.quant.base -> kimi_quant.plan"]
    assert _upward_imports({"kimi_quant.new.x": set(), "kimi_quant.plan": {"kimi_quant.new.x"}}, [{"plan"}]) \
        == ["new: in no layer (add it to LAYERS)"]


def test_every_import_of_the_package_names_a_module_of_it():
    """A module moved or renamed: every import of kimi_quant.* (lazy ones too) still finds its module."""
    mods = _modules()
    missing = [f"{m}: {target}" for m, target, names in _import_statements(mods)
               if target.split(".")[0] == "kimi_quant" and target not in mods
               and not (names and all(f"{target}.{n}" in mods for n in names))]
    assert missing == []
