"""sympow.train.sweep: every (variant, context) of a sweep file trained, evaluated, tabled and
plotted; run folder names."""

from __future__ import annotations

import csv

import pytest

from sympow.train.sweep import CSV_FILE, PNG_FILE, load_sweep, read_csv, run_name, run_sweep
from tests.train.helpers import CONFIGS


def test_sweep_files_list_the_papers_runs():
    p4 = load_sweep(str(CONFIGS / "sweep_p4.py"))
    p2 = load_sweep(str(CONFIGS / "sweep_p2.py"))
    assert sorted({c.data.context_size for c in p4}) == [1024, 2048, 4096, 8192, 16384, 32768,
                                                         65536]
    assert sorted({c.data.context_size for c in p2}) == [256, 512, 1024, 2048, 4096, 8192]
    assert {c.model.p for c in p4 if c.model.attention == "sympow"} == {4}
    assert {c.model.p for c in p2 if c.model.attention == "sympow"} == {2}
    assert len({run_name(c) for c in p4}) == len(p4) == 4 * 7


def test_tiny_sweep_writes_table_and_figure(tmp_path):
    spec = f"{CONFIGS / 'sweep_p2.py'}:runlocal,variants=softmax+conformal,contexts=64+128,steps=3"
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
    typed = read_csv(tmp_path / CSV_FILE)
    assert [(r["variant"], r["p"], r["context"], r["steps"]) for r in typed] == [
        (r["variant"], r["p"], r["context"], 3) for r in rows]
    for got, row in zip(typed, rows, strict=True):
        assert got["final_loss"] == pytest.approx(row["final_loss"], abs=5e-7)
        assert got["workdir"] == row["workdir"]


def test_run_names_are_preset_names():
    """Run folders are ``<preset>_p<p>_ctx<T>`` (softmax: no p); the arg word 'gating' names
    the preset 'sympow_gating', so its runs live in sympow_gating_p<p>_ctx<T>."""
    runs = load_sweep(f"{CONFIGS / 'sweep_p2.py'}:variants=softmax+gating+conformal,"
                      "contexts=1024")
    assert [run_name(c) for c in runs] == ["softmax_ctx1024", "sympow_gating_p2_ctx1024",
                                           "conformal_p2_ctx1024"]


@pytest.mark.parametrize("override, match", [
    ("variant=flash", r"variant: 'flash' not in \['conformal', "),
    ("optim.learning_rate=0", r"optim.learning_rate: need a finite number > 0, got 0.0"),
])
def test_invalid_overrides_stop_the_sweep_before_any_run(tmp_path, override, match):
    spec = f"{CONFIGS / 'sweep_p2.py'}:runlocal,variants=softmax+conformal,contexts=64,steps=1"
    with pytest.raises(ValueError, match=match):
        run_sweep(spec, tmp_path, overrides=[override], progress=False)
    assert list(tmp_path.iterdir()) == []  # no run folder, nothing trained


def test_sweep_split_over_invocations_accumulates_its_table(tmp_path):
    """A part run as subsets in one workdir (one per device call) keeps every subset's rows;
    a subset run again replaces its own rows instead of duplicating them."""
    base = f"{CONFIGS / 'sweep_p2.py'}:runlocal,variants=softmax,steps=2"
    run_sweep(f"{base},contexts=64", tmp_path, eval_windows=1, progress=False)
    second = run_sweep(f"{base},contexts=128", tmp_path, eval_windows=1, progress=False)
    assert [r["context"] for r in second] == [128]
    table = read_csv(tmp_path / CSV_FILE)
    assert sorted(r["context"] for r in table) == [64, 128]
    run_sweep(f"{base},contexts=128", tmp_path, eval_windows=1, progress=False)
    assert sorted(r["context"] for r in read_csv(tmp_path / CSV_FILE)) == [64, 128]
