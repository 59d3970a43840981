"""scripts/import_graph.py: the package has no import loop and no upward import, and the
checker finds both kinds when they are there."""

from __future__ import annotations

import pytest

from scripts import import_graph


def test_sympow_has_no_loop_and_no_upward_import():
    graph = import_graph.module_imports()
    assert "sympow.attention.pallas.primitives" in graph  # the walk saw the subpackages
    assert "sympow.attention.xla" in graph["sympow.attention.pallas.primitives"]
    assert import_graph.problems(graph) == []


def test_every_module_has_a_layer():
    for module in import_graph.module_imports():
        import_graph.layer(module)


def test_checker_reports_loops_and_upward_imports():
    layers = ("pkg.low", "pkg.high", "pkg")
    graph = {"pkg.low.a": {"pkg.high.b"}, "pkg.high.b": {"pkg.low.a"},
             "pkg.high.c": {"pkg.high"}, "pkg.high": set(), "pkg": set()}
    found = import_graph.problems(graph, layers)
    assert found[0] in ("import loop: pkg.high.b -> pkg.low.a -> pkg.high.b",
                        "import loop: pkg.low.a -> pkg.high.b -> pkg.low.a")
    assert "pkg.high.c imports its own package pkg.high" in found
    assert "pkg.low.a imports pkg.high.b, a higher layer" in found


def test_unknown_module_needs_a_layer():
    with pytest.raises(ValueError, match="module other.x is in no layer"):
        import_graph.layer("other.x")


def test_mermaid_draws_every_edge():
    drawing = import_graph.mermaid({"sympow.a": {"sympow.b"}, "sympow.b": set()})
    assert drawing.splitlines() == ["flowchart TD", "  a[a]", "  b[b]", "  a --> b"]


def test_the_drawing_in_the_design_doc_is_current():
    drawing = import_graph.drawing_in(import_graph.DESIGN_DOC.read_text())
    assert drawing == import_graph.mermaid(import_graph.module_imports()), (
        "docs/design.md §8 is stale: run `python scripts/import_graph.py --update`")
