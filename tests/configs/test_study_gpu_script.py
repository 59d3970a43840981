"""experiments/study_gpu.sh on the CPU: a part and the contextwise evaluation run, and only the
small files of each run come back (no checkpoints)."""

from __future__ import annotations

import os
import subprocess
import sys
import tarfile
from pathlib import Path

from sympow.data import AUSTEN_PATH
from tests.train.helpers import CONFIGS

ROOT = CONFIGS.parent
SCRIPT = ROOT / "experiments" / "study_gpu.sh"


def run_script(out, runs, *parts, **env):
    env = {**os.environ, "PYTHON": sys.executable, "DATA": str(AUSTEN_PATH), "RUNS": str(runs),
           "SWEEP_EXTRA": ",runlocal,steps=2", **env}
    return subprocess.run(["bash", str(SCRIPT), str(out), *parts], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)


def test_a_part_and_its_contextwise_loss(tmp_path):
    out, runs = tmp_path / "out", tmp_path / "runs"
    done = run_script(out, runs, "p4", "contextwise", CONTEXTWISE_FROM="p4",
                      CONTEXTWISE_CONTEXT="64", CONTEXTWISE_LENGTH="128",
                      CONTEXTWISE_WINDOWS="2")
    assert done.returncode == 0, done.stderr[-3000:]
    names = {"sympow_p4_ctx64", "sympow_gating_p4_ctx64", "conformal_p4_ctx64"}
    assert {p.name for p in (out / "p4").iterdir() if p.is_dir()} == names
    for name in names:
        got = {p.name for p in (out / "p4" / name).iterdir()}
        assert {"config.json", "metrics.jsonl", "summary.json"} <= got, got
        assert (runs / "p4" / name / "checkpoints").is_dir()
    assert not list(out.rglob("checkpoints"))
    assert (out / "p4" / "sweep.csv").is_file() and (out / "contextwise").is_dir()
    assert list((out / "contextwise").glob("*.csv")), list((out / "contextwise").iterdir())
    assert "study part contextwise:" in done.stdout


def test_bad_calls_fail_with_a_reason(tmp_path):
    no_part = run_script(tmp_path / "out", tmp_path / "runs")
    assert no_part.returncode == 2 and "name at least one part" in no_part.stderr
    no_data = run_script(tmp_path / "out", tmp_path / "runs", "clip", DATA=str(tmp_path))
    assert no_data.returncode == 2 and "holds no train.zarr" in no_data.stderr


def test_packed_files_come_back_when_a_later_part_fails(tmp_path):
    """PACK=1: one tarball of the run files; a part that fails (here contextwise with no
    conformal run at the context) still returns what the parts before it wrote."""
    out, runs = tmp_path / "out", tmp_path / "runs"
    done = run_script(out, runs, "clip", "contextwise", PACK="1", CONTEXTWISE_FROM="clip",
                      CONTEXTWISE_CONTEXT="32")
    assert done.returncode == 2 and "no conformal run at context 32" in done.stderr
    assert [p.name for p in out.iterdir()] == ["study_files.tar.gz"]
    with tarfile.open(out / "study_files.tar.gz") as tar:
        names = {Path(n).name for n in tar.getnames()}
        assert not [n for n in tar.getnames() if "checkpoints" in n]
    assert {"config.json", "metrics.jsonl", "summary.json", "sweep.csv"} <= names, names
