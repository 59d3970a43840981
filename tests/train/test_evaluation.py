"""sympow.train.evaluation: the jitted per-position loss against an unjitted computation,
windows longer than the training context (and of lengths that are not powers of two), the
workdir evaluation with its CSV / JSON / PNG outputs, the command line with an overlay, and
bad arguments (each a ValueError naming it, raised before anything is read)."""

from __future__ import annotations

import csv
import json
import subprocess
import sys

import jax
import numpy as np
import pytest

from sympow.data import LongCrawl64
from sympow.train import data as datalib
from sympow.train import evaluation
from sympow.train.model import init_model_state, model_def
from sympow.train.trainer import train
from tests.train.helpers import QUICKSTART, ROOT, tiny_config

# The tiny run of tests.train.helpers, checkpointed every step, evaluated on 3 windows of 96.
EVAL = ["checkpoint_every=1", "eval.length=96", "eval.num_windows=3"]


def per_position_loss_unjitted(model, inputs, labels) -> np.ndarray:
    """Mean over rows of -log softmax(logits)[label] at each position, op by op in numpy."""
    with jax.disable_jit():
        logits = np.asarray(model(inputs), np.float64)  # [B, T, V]
    b, t, _ = logits.shape
    out = np.zeros(t)
    for i in range(t):
        for r in range(b):
            row = logits[r, i]
            log_z = row.max() + np.log(np.exp(row - row.max()).sum())
            out[i] += log_z - row[labels[r, i]]
    return out / b


@pytest.mark.parametrize("variant", ["softmax", "conformal"])
def test_contextwise_matches_unjitted(variant):
    config = tiny_config(f"{QUICKSTART}:{variant},runlocal", EVAL)
    mdef = model_def(config.model)
    params, rest = init_model_state(mdef, seed=3)
    mesh = datalib.make_mesh()
    length = 48  # longer than the training context 32, not a power of two (crop of 64)
    source = evaluation.WindowSource(config.data, length, num_windows=2, batch_size=1,
                                     mesh=mesh)
    assert (source.loader_length, source.num_windows) == (64, 2)
    got, count = evaluation.contextwise_loss(evaluation.jit_contextwise(mdef, mesh), params,
                                             rest, source)
    assert got.shape == (length,) and count == 2

    heldout = LongCrawl64(config.data.path, "heldout", 1, 64, prefetch=0)
    model = mdef.merge(params, rest)
    want = np.mean([per_position_loss_unjitted(model, heldout[k][0][:, :length],
                                               heldout[k][1][:, :length]) for k in range(2)],
                   axis=0)
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)
    assert np.ptp(got) > 1e-3  # genuinely per position, not one number broadcast


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("run")
    config = tiny_config(overrides=[*EVAL, "num_train_steps=2"])
    train(config, workdir, progress=False)
    return workdir


def test_evaluate_workdir_writes_outputs(trained, tmp_path):
    curves = evaluation.evaluate_workdir(trained, "all")
    assert [c.step for c in curves] == [1, 2]
    for c in curves:
        assert c.losses.shape == (96,) and c.num_windows == 3 and c.train_context == 32
        assert np.all(np.isfinite(c.losses)) and 9.0 < c.mean < 11.5
    assert np.abs(curves[1].losses - curves[0].losses).max() > 1e-4  # different checkpoints
    paths = evaluation.write_outputs(tmp_path, curves)
    with paths["csv"].open() as f:
        rows = list(csv.reader(f))
    assert rows[0] == ["position", curves[0].label, curves[1].label]
    assert len(rows) == 97 and rows[1][0] == "1" and rows[-1][0] == "96"
    back = evaluation.read_csv(paths["csv"])
    np.testing.assert_allclose(back[1].losses, curves[1].losses, atol=1e-6)
    meta = json.loads(paths["json"].read_text())
    assert meta[0]["train_context"] == 32 and meta[1]["step"] == 2
    assert paths["png"].stat().st_size > 10_000
    with pytest.raises(ValueError, match="not among the checkpoints"):
        evaluation.evaluate_workdir(trained, "7")


def test_evaluate_cli_overlay(trained, tmp_path):
    out = tmp_path / "out"
    cmd = [sys.executable, str(ROOT / "experiments" / "evaluate.py"), f"--workdir={trained}",
           "--steps=1", f"--compare={trained}", "--length=40", "--num_windows=2",
           f"--out={out}"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    curves = evaluation.read_csv(out / evaluation.CSV_FILE)
    assert [c.label.split()[-1] for c in curves] == ["1", "2"]  # step 1, then the overlay
    assert all(len(c.losses) == 40 for c in curves)
    assert (out / evaluation.PNG_FILE).is_file()
    assert "mean loss over 1..40" in proc.stdout




@pytest.mark.parametrize("steps, want", [
    (None, "latest"), ("latest", "latest"), ("all", "all"), ("1000, 2000", [1000, 2000]),
    ([3], [3]),
])
def test_parse_steps(steps, want):
    assert evaluation.parse_steps(steps) == want


@pytest.mark.parametrize("kwargs, match", [
    (dict(batch_size=-1), "batch_size: need a positive int, got -1"),
    (dict(batch_size=0), "batch_size: need a positive int, got 0"),
    (dict(length=0), "length: need a positive int, got 0"),
    (dict(num_windows=2.5), "num_windows: need a positive int, got 2.5"),
    (dict(steps=""), r"steps: '' is not 'latest', 'all' or comma-separated step numbers"),
    (dict(steps="1,,2"), r"steps: '1,,2' is not"),
    (dict(steps="last"), r"steps: 'last' is not"),
    (dict(steps=[]), r"steps: need 'latest', 'all' or step numbers >= 0, got \[\]"),
    (dict(steps=[-1]), r"steps: need .* got \[-1\]"),
])
def test_bad_arguments_raise_before_anything_is_read(tmp_path, kwargs, match):
    with pytest.raises(ValueError, match=match):
        evaluation.evaluate_workdir(tmp_path / "not_a_run", **kwargs)


@pytest.mark.parametrize("flag, match", [
    ("--steps=", "ValueError: steps: '' is not 'latest', 'all'"),  # was an IndexError
    ("--batch_size=-1", "flag --batch_size=-1: -1 is not a positive integer"),  # was accepted
])
def test_evaluate_cli_rejects_bad_flags(tmp_path, flag, match):
    cmd = [sys.executable, str(ROOT / "experiments" / "evaluate.py"), f"--workdir={tmp_path}",
           flag]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1 and match in proc.stderr, proc.stderr
    assert "IndexError" not in proc.stderr


def test_log_binned():
    losses = np.arange(1, 1001, dtype=float)
    x, y = evaluation.log_binned(losses, bins=10)
    assert np.all(np.diff(x) > 0) and x[0] == 1 and y[0] == 1.0
    assert np.isclose(y.max(), losses[-len(losses) // 5:].mean(), rtol=0.2)


def test_csv_round_trip_of_curves_of_different_lengths(tmp_path):
    curves = [evaluation.Curve("a", np.array([1.0, 2.5, 3.25]), 1),
              evaluation.Curve("b", np.array([0.1234567]), 1)]
    path = evaluation.write_csv(tmp_path / "c.csv", curves)
    assert path.read_text().splitlines() == [
        "position,a,b", "1,1.000000,0.123457", "2,2.500000,", "3,3.250000,"]
    back = evaluation.read_csv(path)
    assert [c.label for c in back] == ["a", "b"]
    np.testing.assert_array_equal(back[0].losses, [1.0, 2.5, 3.25])
    np.testing.assert_array_equal(back[1].losses, [0.123457])


def test_curve_bands_and_context_use():
    losses = np.concatenate([[8.0, 6.0], np.full(61, 5.0), np.full(193, 4.0), np.full(256, 3.0)])
    curve = evaluation.Curve("c", losses, num_windows=1, train_context=256)
    assert curve.band(1, 2) == 7.0 and curve.band(64, 256) == 4.0
    assert curve.uses_context() == 3.0
    assert curve.band(257, 10_000) == 3.0  # clipped to the curve
    with pytest.raises(ValueError, match=r"band: need 1 <= first <= last, got 3..2"):
        curve.band(3, 2)
    with pytest.raises(ValueError, match=r"band: positions 600..700 are past the curve's 512"):
        curve.band(600, 700)
