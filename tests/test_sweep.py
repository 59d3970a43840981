"""One-command context sweeps: every (variant, context) trained, evaluated and plotted."""

from __future__ import annotations

import csv

from sympow.train.sweep import CSV_FILE, PNG_FILE, load_sweep, run_name, run_sweep


def test_sweep_files_list_the_papers_runs():
    p4 = load_sweep("configs/sweep_p4.py")
    p2 = load_sweep("configs/sweep_p2.py")
    assert sorted({c.data.context_size for c in p4}) == [1024, 2048, 4096, 8192, 16384, 32768,
                                                         65536]
    assert sorted({c.data.context_size for c in p2}) == [256, 512, 1024, 2048, 4096, 8192]
    assert {c.model.p for c in p4 if c.model.attention == "sympow"} == {4}
    assert {c.model.p for c in p2 if c.model.attention == "sympow"} == {2}
    assert len({run_name(c) for c in p4}) == len(p4) == 4 * 7


def test_tiny_sweep_writes_table_and_figure(tmp_path):
    spec = "configs/sweep_p2.py:runlocal,variants=softmax+conformal,contexts=64+128,steps=3"
    rows = run_sweep(spec, tmp_path, eval_windows=1, progress=False)
    assert sorted((r["variant"], r["context"]) for r in rows) == [
        ("conformal", 64), ("conformal", 128), ("softmax", 64), ("softmax", 128)]
    with open(tmp_path / CSV_FILE) as f:
        table = list(csv.DictReader(f))
    assert len(table) == 4
    for row in table:
        assert 0 < float(row["final_loss"]) < 20 and 0 < float(row["heldout_loss"]) < 20
        assert int(row["steps"]) == 3
    assert (tmp_path / PNG_FILE).stat().st_size > 1000
    # A rerun finds every run finished and only rebuilds the table.
    again = run_sweep(spec, tmp_path, eval_windows=1, progress=False)
    assert [r["final_loss"] for r in again] == [r["final_loss"] for r in rows]
