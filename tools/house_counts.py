"""The house's structure in numbers (issue 26's counts), read with `ast`, nothing imported:

    python tools/house_counts.py

- public methods and properties of HybridStrategy;
- library modules over 450 lines;
- import circles among owt_tf modules (imports inside functions included);
- comparisons of a scheme with a string literal ('owt-b', "data", ...).
"""
from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "owt_tf"
SCHEME_NAMES = {"single", "data", "owt-a", "owt-b", "owt-c"}
sys.path.insert(0, str(ROOT / "tests"))


def modules() -> dict:
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = path
    return found


def imports_of(path: Path, names) -> set:
    from test_structure import imported_modules  # the suite's own import reader

    out = set()
    for _, module in imported_modules(path):
        while module and module not in names:
            module = module.rpartition(".")[0]
        if module and module != "owt_tf":
            out.add(module)
    return out


def import_circles(graph: dict) -> list:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, comps, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
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
                comps.append(sorted(comp))

    sys.setrecursionlimit(10000)
    for v in graph:
        if v not in index:
            visit(v)
    return comps


def hybrid_public(path: Path) -> list:
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and node.name == "HybridStrategy":
            return [f.name for f in node.body if isinstance(f, (ast.FunctionDef,))
                    and not f.name.startswith("_")]
    return []


def literal_scheme_comparisons(path: Path) -> int:
    count = 0
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Compare):
            for side in [node.left] + node.comparators:
                values = side.elts if isinstance(side, (ast.Tuple, ast.List, ast.Set)) else [side]
                if any(isinstance(v, ast.Constant) and v.value in SCHEME_NAMES for v in values):
                    count += 1
                    break
    return count


def main() -> None:
    mods = modules()
    graph = {name: imports_of(path, mods) - {name} for name, path in mods.items()}
    strategy = next((p for n, p in mods.items() if n.endswith("parallel.strategy")), None)
    public = hybrid_public(strategy) if strategy else []
    print(f"HybridStrategy public methods and properties: {len(public)}")
    big = [(len(p.read_text().splitlines()), n) for n, p in mods.items()]
    big = sorted(((lines, n) for lines, n in big if lines > 450), reverse=True)
    print(f"modules over 450 lines: {len(big)}" + "".join(f"\n  {n} {lines}" for lines, n in big))
    circles = import_circles(graph)
    print(f"import circles: {len(circles)}" + "".join(f"\n  {' <-> '.join(c)}" for c in circles))
    per_file = {n: literal_scheme_comparisons(p) for n, p in mods.items()}
    per_file = {n: c for n, c in per_file.items() if c}
    print(f"comparisons of a scheme with a literal: {sum(per_file.values())} in {len(per_file)} files"
          + "".join(f"\n  {n} {c}" for n, c in sorted(per_file.items(), key=lambda t: -t[1])))


if __name__ == "__main__":
    main()
