"""sympow.train.reports and experiments/report.py: runs read back as the trainer wrote them,
the relative-loss table, the figures, the command line; several seeds on hand-made runs."""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys

import numpy as np
import pytest

from sympow.train import reports, sweep, tables
from sympow.train.evaluation import JSON_FILE, Curve, write_json
from sympow.train.metrics import METRICS_FILE
from sympow.train.trainer import SUMMARY_FILE, train
from tests.train.helpers import QUICKSTART, ROOT, losses, tiny_config

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
OUTPUTS = (reports.CURVES_PNG, reports.TABLE_CSV, reports.TABLE_MD, reports.CONTEXT_PNG)


@pytest.fixture(scope="module")
def tiny_runs(tmp_path_factory):
    """A folder of four real 5-step runs: softmax and conformal at contexts 32 and 64."""
    root = tmp_path_factory.mktemp("runs")
    for variant in ("softmax", "conformal"):
        for context in (32, 64):
            config = tiny_config(f"{QUICKSTART}:{variant},runlocal", [
                f"data.context_size={context}", "num_train_steps=5", "checkpoint_every=5",
                "final_loss_steps=2"])
            train(config, root / sweep.run_name(config), progress=False)
    return root


def summary_loss(run_dir) -> float:
    return json.loads((run_dir / SUMMARY_FILE).read_text())["final_loss"]


def is_png(path) -> bool:
    return path.is_file() and path.stat().st_size > 0 and path.read_bytes()[:8] == PNG_SIGNATURE


def test_load_run_reads_what_the_trainer_wrote(tiny_runs):
    dirs = reports.find_runs([tiny_runs])
    assert [d.name for d in dirs] == ["conformal_p2_ctx32", "conformal_p2_ctx64",
                                      "softmax_ctx32", "softmax_ctx64"]
    for d in dirs:
        run = reports.load_run(d)
        config = json.loads((d / "config.json").read_text())
        assert (run.variant, run.context, run.seed) == (
            config["variant"], config["data"]["context_size"], config["seed"])
        assert run.p == (None if run.variant == "softmax" else 2)
        assert run.steps.tolist() == [1, 2, 3, 4, 5]
        assert np.all(np.isfinite(run.loss))
        assert run.loss.tolist() == [losses(d)[s] for s in run.steps.tolist()]
        assert run.tokens.tolist() == [s * 4 * run.context for s in range(1, 6)]
        assert run.final_loss == summary_loss(d) == pytest.approx(run.loss[-2:].mean())
        assert math.isnan(run.heldout_loss)  # never evaluated
    assert reports.find_runs([dirs[0], tiny_runs]) == dirs  # a run named twice counts once


def test_relative_loss_table_divides_the_summaries(tiny_runs, tmp_path):
    rows = reports.relative_loss_table(reports.load_runs([tiny_runs]))
    assert [(r["variant"], r["p"], r["context"], r["seeds"]) for r in rows] == [
        ("conformal", 2, 32, 1), ("conformal", 2, 64, 1)]
    for r in rows:
        expected = (summary_loss(tiny_runs / f"conformal_p2_ctx{r['context']}")
                    / summary_loss(tiny_runs / f"softmax_ctx{r['context']}"))
        assert r["ratio"] == pytest.approx(expected, rel=1e-12)
        assert r["ratio_min"] == r["ratio_max"] == r["ratio"] and r["ratio_std"] is None
    header, body = tables.read_csv(reports.write_table_csv(tmp_path / "t.csv", rows))
    column = {name: i for i, name in enumerate(reports.TABLE_FIELDS)}
    assert header == list(reports.TABLE_FIELDS) and len(body) == 2
    assert body[0][column["ratio_std"]] == "" and body[0][column["form"]] == ""
    assert float(body[1][column["ratio"]]) == pytest.approx(rows[1]["ratio"], abs=1e-6)
    table = reports.markdown_table(rows)
    assert f"| conformal | 2 | 64 | 1 | {rows[1]['loss']:.4f} |" in table


def test_figures_are_pngs(tiny_runs, tmp_path):
    runs = reports.load_runs([tiny_runs])
    assert is_png(reports.plot_curves(runs, tmp_path / "a.png"))
    assert is_png(reports.plot_curves(runs, tmp_path / "b.png", x="step", smooth=2))
    assert is_png(reports.plot_final_vs_context(runs, tmp_path / "c.png"))
    with pytest.raises(ValueError, match="x: need 'tokens' or 'step'"):
        reports.plot_curves(runs, tmp_path / "d.png", x="time")
    with pytest.raises(ValueError, match="no run has a finite heldout_loss"):
        reports.plot_final_vs_context(runs, tmp_path / "e.png", metric="heldout_loss")


def test_command_line_writes_the_four_files(tiny_runs, tmp_path):
    out = tmp_path / "report"
    done = subprocess.run([sys.executable, str(ROOT / "experiments" / "report.py"), "--runs",
                           str(tiny_runs), "--out", str(out), "--smooth", "2"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "| conformal | 2 | 32 | 1 |" in done.stdout
    assert all((out / name).stat().st_size > 0 for name in OUTPUTS)
    assert is_png(out / reports.CURVES_PNG) and is_png(out / reports.CONTEXT_PNG)
    assert (out / reports.TABLE_MD).read_text() in done.stdout


def test_a_directory_without_metrics_is_named(tmp_path):
    run_dir = tmp_path / "not_a_run"
    run_dir.mkdir()
    (run_dir / "config.json").write_text("{}")
    with pytest.raises(ValueError, match=re.escape(f"{run_dir}: no {METRICS_FILE}")):
        reports.load_run(run_dir)
    (run_dir / METRICS_FILE).write_text("")
    with pytest.raises(ValueError, match=re.escape(f"{run_dir}: no records in {METRICS_FILE}")):
        reports.load_run(run_dir)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match=re.escape(f"{empty}: neither a run")):
        reports.find_runs([empty])


def fake_run(path, variant, context, seed, loss, *, p=2, summary=True, gate_bias=None,
             grad_clip=None, devices=None):
    """A run directory as the trainer leaves it: 4 logged steps, the last loss ``loss``;
    gate_bias / grad_clip written to its config when given (else the fields are absent)."""
    path.mkdir(parents=True)
    attention = "softmax" if variant == "softmax" else "sympow"
    model = {"attention": attention, "p": p, "gating": variant in ("sympow_gating", "conformal")}
    if gate_bias is not None:
        model["gate_bias"] = None if gate_bias == "none" else gate_bias
    optim = {} if grad_clip is None else {"grad_clip": grad_clip}
    (path / "config.json").write_text(json.dumps({
        "variant": variant, "seed": seed, "num_train_steps": 4, "final_loss_steps": 2,
        "model": model, "optim": optim, "data": {"context_size": context, "docs_per_batch": 2}}))
    records = [{"step": s, "loss": value} for s, value in enumerate([5.0, 4.0, 3.0, loss], 1)]
    (path / METRICS_FILE).write_text("".join(json.dumps(r) + "\n" for r in records))
    if summary:
        extra = {} if devices is None else {"devices": devices}
        (path / SUMMARY_FILE).write_text(json.dumps({"final_loss": loss, "steps": 4, **extra}))
    return path


def test_runs_on_different_device_counts_are_told_apart(tmp_path):
    """The data-parallel comparison: the same run on 1 and 2 devices gets its device count in
    its label and its own line style; runs that share one count are labelled as before."""
    fake_run(tmp_path / "one" / "conformal_p2_ctx64", "conformal", 64, 0, 1.8, devices=1)
    fake_run(tmp_path / "two" / "conformal_p2_ctx64", "conformal", 64, 0, 1.7, devices=2)
    runs = reports.load_runs([tmp_path / "one", tmp_path / "two"])
    assert [r.label for r in runs] == ["conformal p=2 ctx=64 seed=0 devices=1",
                                       "conformal p=2 ctx=64 seed=0 devices=2"]
    assert [r.devices for r in runs] == [1, 2]
    assert is_png(reports.plot_curves(runs, tmp_path / "curves.png"))
    alone = reports.load_runs([tmp_path / "two"])
    assert [r.label for r in alone] == ["conformal p=2 ctx=64 seed=0"]


def test_several_seeds_give_mean_and_spread(tmp_path):
    for seed, (soft, conf) in enumerate([(2.0, 1.8), (2.5, 2.0)]):  # ratios 0.9 and 0.8
        fake_run(tmp_path / f"s{seed}" / "softmax_ctx64", "softmax", 64, seed, soft)
        fake_run(tmp_path / f"s{seed}" / "conformal_p2_ctx64", "conformal", 64, seed, conf)
    # seed 2 has no softmax run: compared with the mean softmax loss at 64, (2.0 + 2.5) / 2
    fake_run(tmp_path / "s2" / "sympow_p4_ctx64", "sympow", 64, 2, 2.7, p=4)
    fake_run(tmp_path / "s2" / "conformal_p2_ctx128", "conformal", 128, 2, 1.0)  # no softmax
    # no summary yet: the final loss is the mean of the last final_loss_steps records
    fake_run(tmp_path / "s3" / "softmax_ctx128", "softmax", 128, 3, 1.5, summary=False)
    runs = reports.load_runs([tmp_path / f"s{i}" for i in range(4)])
    assert [r.final_loss for r in runs if r.seed == 3] == [(3.0 + 1.5) / 2]
    rows = reports.relative_loss_table(runs)
    assert [(r["variant"], r["p"], r["context"], r["seeds"]) for r in rows] == [
        ("conformal", 2, 64, 2), ("conformal", 2, 128, 1), ("sympow", 4, 64, 1)]
    conf, conf128, p4 = rows
    assert conf["ratio"] == pytest.approx(0.85)
    assert conf["ratio_std"] == pytest.approx(math.sqrt(2 * 0.05 ** 2 / 1))  # ddof 1
    assert (conf["ratio_min"], conf["ratio_max"]) == (pytest.approx(0.8), pytest.approx(0.9))
    assert (conf["loss"], conf["softmax_loss"]) == (pytest.approx(1.9), pytest.approx(2.25))
    assert conf128["ratio"] == pytest.approx(1.0 / 2.25)  # seed 3's softmax, the only one
    assert p4["ratio"] == pytest.approx(2.7 / 2.25) and p4["ratio_std"] is None
    assert "| conformal | 2 | 64 | 2 | 1.9000 | 2.2500 | 0.8500 ± 0.0707 [0.8000, 0.9000] |" \
        in reports.markdown_table(rows)
    assert is_png(reports.plot_final_vs_context(runs, tmp_path / "ctx.png"))
    assert is_png(reports.plot_curves(runs, tmp_path / "curves.png"))
    assert reports.moving_mean(np.asarray([1.0, 2.0, 3.0, 4.0]), 2).tolist() == [
        1.0, 1.5, 2.5, 3.5]


def test_deviations_from_the_papers_form_are_kept_apart(tmp_path):
    papers = {"gate_bias": "none", "grad_clip": 0.0}
    fake_run(tmp_path / "a" / "softmax_ctx64", "softmax", 64, 0, 2.0, **papers)
    fake_run(tmp_path / "a" / "conformal_p2_ctx64", "conformal", 64, 0, 1.8, **papers)
    fake_run(tmp_path / "bias" / "conformal_p2_ctx64", "conformal", 64, 0, 1.6, gate_bias=5.0,
             grad_clip=0.0)
    fake_run(tmp_path / "clip" / "conformal_p2_ctx64", "conformal", 64, 0, 1.5,
             gate_bias="none", grad_clip=1.0)  # no softmax run with clipping: not in the table
    fake_run(tmp_path / "old" / "sympow_p2_ctx64", "sympow", 64, 0, 1.9)  # fields absent
    runs = reports.load_runs([tmp_path / d for d in ("a", "bias", "clip", "old")])
    assert sorted(r.label for r in runs) == [
        "conformal p=2 (clip 1) ctx=64 seed=0", "conformal p=2 (gate bias +5) ctx=64 seed=0",
        "conformal p=2 ctx=64 seed=0", "softmax ctx=64 seed=0",
        "sympow p=2 (clip 1) ctx=64 seed=0"]  # an ungated model has no gate bias
    rows = reports.relative_loss_table(runs)
    assert [(r["variant"], r["form"], r["seeds"]) for r in rows] == [
        ("conformal", "", 1), ("conformal", "gate bias +5", 1)]  # not pooled as seeds
    assert [r["ratio"] for r in rows] == [pytest.approx(0.9), pytest.approx(0.8)]
    assert "| conformal (gate bias +5) | 2 | 64 | 1 | 1.6000 | 2.0000 | 0.8000 |" in (
        reports.markdown_table(rows))
    assert is_png(reports.plot_final_vs_context(runs, tmp_path / "ctx.png"))
    # one form for every run tells nothing apart: it is left out of the labels
    same = reports.load_runs([tmp_path / "clip"])
    assert [(r.form, r.label) for r in same] == [("", "conformal p=2 ctx=64 seed=0")]
    assert reports.load_run(tmp_path / "clip" / "conformal_p2_ctx64").form == "clip 1"


def test_heldout_loss_from_a_sweep_table_or_an_evaluation(tmp_path):
    swept = fake_run(tmp_path / "sweep" / "softmax_ctx64", "softmax", 64, 0, 2.0)
    sweep.write_csv(tmp_path / "sweep" / sweep.CSV_FILE, [{
        "variant": "softmax", "p": 2, "context": 64, "final_loss": 2.0, "heldout_loss": 2.25,
        "steps": 4, "tokens_per_sec": 1.0, "workdir": "elsewhere/sweep/softmax_ctx64"}])
    assert reports.load_run(swept).heldout_loss == pytest.approx(2.25)
    evaluated = fake_run(tmp_path / "runs" / "conformal", "conformal", 64, 0, 2.0)
    curves = [Curve("a", np.full(128, value), 1, train_context=64, step=step,
                    workdir=str(evaluated))
              for value, step in [(2.5, 4), (3.0, 2)]]  # the latest step counts
    curves.append(Curve("short", np.full(32, 1.0), 1, 64, 9, str(evaluated)))  # not at T
    curves.append(Curve("other", np.full(128, 1.0), 1, 64, 9, str(tmp_path / "x")))
    write_json(tmp_path / "runs" / JSON_FILE, curves)  # evaluate.py --out runs
    assert reports.load_run(evaluated).heldout_loss == pytest.approx(2.5)
