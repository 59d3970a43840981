"""Draw and check the import graph of the `sympow` package (docs/design.md §8).

  python scripts/import_graph.py           # a Mermaid drawing of the graph
  python scripts/import_graph.py --update  # redraw it in docs/design.md §8
  python scripts/import_graph.py --check   # exit 1 on an import loop or an upward import

Every `import` of a sympow module counts, also one inside a function. Two rules:
- no loop: the graph of modules is acyclic;
- no upward import: a module imports only modules of its own layer or lower ones (`LAYERS`,
  lowest first), and never a package that contains it (its parents' `__init__`, which
  would import it back).
"""

from __future__ import annotations

import argparse
import ast
import sys
from collections.abc import Mapping
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# Lowest first; a module's layer is the longest entry that is it or a package holding it.
LAYERS = (
    "sympow.numerics", "sympow.embedding", "sympow.rotary",
    # The attention op, in the order of its file roles.
    "sympow.attention.config", "sympow.attention.reference", "sympow.attention.chunked",
    "sympow.attention.xla", "sympow.attention.blocked", "sympow.attention.streaming",
    "sympow.attention.pallas.plan", "sympow.attention.pallas.launch",
    "sympow.attention.pallas.phi", "sympow.attention.pallas.attention_kernels",
    "sympow.attention.pallas.state_kernels", "sympow.attention.pallas.prefix_kernels",
    "sympow.attention.pallas.vjps", "sympow.attention.pallas.primitives",
    "sympow.attention.pallas.attention_form",
    "sympow.attention.pallas",
    # The Hopper tier builds on the portable one (its backward, plans and wrappers).
    "sympow.attention.mosaic_gpu.blocks", "sympow.attention.mosaic_gpu.weights",
    "sympow.attention.mosaic_gpu.attention_kernels",
    "sympow.attention.mosaic_gpu.gram",
    "sympow.attention.mosaic_gpu.backward_kernel",
    "sympow.attention.mosaic_gpu.vjps", "sympow.attention.mosaic_gpu.state_walks",
    "sympow.attention.mosaic_gpu.column_forms",
    "sympow.attention.mosaic_gpu.state_kernels", "sympow.attention.mosaic_gpu.state_sums",
    "sympow.attention.mosaic_gpu.state_references",
    "sympow.attention.mosaic_gpu.states",
    "sympow.attention.mosaic_gpu.primitives", "sympow.attention.mosaic_gpu",
    "sympow.attention.implementations", "sympow.attention.api",
    "sympow.attention.testing", "sympow.attention",
    "sympow",  # the top-level public face: only the package's own __init__ is this layer
    "sympow.layers", "sympow.data", "sympow.train",
)


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def module_imports(root: Path = ROOT, package: str = "sympow") -> dict[str, set[str]]:
    """module -> the modules of `package` it imports (`from a import b` is a.b when that is
    a module, else a)."""
    files = {module_name(p, root): p for p in sorted((root / package).rglob("*.py"))}
    graph: dict[str, set[str]] = {}
    for name, path in files.items():
        targets = set()
        is_package = path.name == "__init__.py"
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: resolve against this module's package
                    anchor = name.split(".")[: len(name.split(".")) - node.level + is_package]
                    base = ".".join(anchor + ([base] if base else []))
                for alias in node.names:
                    sub = f"{base}.{alias.name}"
                    targets.add(sub if sub in files else base)
        graph[name] = {t for t in targets if t in files and t != name}
    return graph


def layer(module: str, layers=LAYERS) -> int:
    matches = [i for i, entry in enumerate(layers) if module == entry
               or (module.startswith(entry + ".") and entry != "sympow")]
    if not matches:
        raise ValueError(f"module {module} is in no layer of LAYERS; add it there")
    return max(matches, key=lambda i: len(layers[i]))


def find_cycle(graph: Mapping[str, set[str]]) -> list[str] | None:
    """One import loop as [a, b, ..., a], or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def upward_imports(graph: Mapping[str, set[str]], layers=LAYERS) -> list[str]:
    """Every import of a higher layer or of a package holding the importer, as text."""
    found = []
    for module, targets in sorted(graph.items()):
        for target in sorted(targets):
            if module.startswith(target + "."):
                found.append(f"{module} imports its own package {target}")
            elif layer(target, layers) > layer(module, layers):
                found.append(f"{module} imports {target}, a higher layer")
    return found


def problems(graph: Mapping[str, set[str]], layers=LAYERS) -> list[str]:
    cycle = find_cycle(graph)
    return ([f"import loop: {' -> '.join(cycle)}"] if cycle else []) + upward_imports(
        graph, layers)


def mermaid(graph: Mapping[str, set[str]]) -> str:
    """A Mermaid flowchart, importer above imported; `sympow.` dropped from the names."""
    short = lambda m: m.removeprefix("sympow.") or "sympow"  # noqa: E731
    ident = lambda m: short(m).replace(".", "_")  # noqa: E731
    lines = ["flowchart TD"]
    lines += [f"  {ident(m)}[{short(m)}]" for m in sorted(graph)]
    lines += [f"  {ident(m)} --> {ident(t)}" for m in sorted(graph) for t in sorted(graph[m])]
    return "\n".join(lines)


DESIGN_DOC = ROOT / "docs" / "design.md"
FENCE, END = "```mermaid\n", "\n```"


def drawing_in(text: str) -> str:
    """The Mermaid block of a Markdown text."""
    return text.split(FENCE, 1)[1].split(END, 1)[0]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 on a loop or upward import")
    parser.add_argument("--update", action="store_true", help="redraw docs/design.md's graph")
    args = parser.parse_args(argv)
    graph = module_imports()
    if args.update:
        text = DESIGN_DOC.read_text()
        DESIGN_DOC.write_text(text.replace(FENCE + drawing_in(text) + END,
                                           FENCE + mermaid(graph) + END, 1))
        return 0
    if args.check:
        found = problems(graph)
        print("\n".join(found) or f"{len(graph)} modules: no import loop, no upward import")
        return 1 if found else 0
    print(mermaid(graph))
    return 0


if __name__ == "__main__":
    sys.exit(main())
