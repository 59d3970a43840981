"""Heuristics of the Pallas tier (plan.py): support, reasons, layouts and default chunks."""

from __future__ import annotations

from sympow.attention.pallas import plan as pallas
from sympow.embedding import expanded_dim


def test_make_plan_reasons():
    assert isinstance(pallas.make_plan(2, 64, 64, 256, "bfloat16", False), pallas.Plan)
    assert "p=6" in pallas.make_plan(6, 64, 64, 256, "bfloat16", False)
    assert "d=64 with p=4" in pallas.make_plan(4, 64, 64, 256, "float32", False)
    assert "dtype float16" in pallas.make_plan(2, 64, 64, 256, "float16", False)
    assert "chunk_size=2048" in pallas.make_plan(2, 64, 64, 2048, "float32", False)


def test_tiled_feature_counts_are_unambiguous():
    """prefix_sum tells the kernel layout from F alone: no tile=1 F of any d, and no other
    supported d, has the same F."""
    for p, ds in pallas.SUPPORTED_D.items():
        tiled_fs = [expanded_dim(d, p, pallas.tile_width(d, p)) for d in ds]
        assert len(set(tiled_fs)) == len(ds)
        symmetric = {expanded_dim(d, p) for d in range(1, 1024)}
        assert not symmetric & set(tiled_fs), p
        assert [pallas.tiled_layout(f, p) for f in tiled_fs] == [
            (d, pallas.tile_width(d, p)) for d in ds]


def test_default_chunk_and_padded_widths():
    assert [pallas.default_chunk_size(t) for t in (1, 17, 100, 5000)] == [16, 32, 128, 512]
    assert [pallas.padded_width(e) for e in (1, 16, 17, 48, 64, 100)] == [16, 16, 32, 64, 64, 128]
