"""experiments/benchmark.py on the CPU: a sweep case end to end (the xla backend; its table
and JSON, with the paired column empty), and --paired refused off a GPU (it times each case
against cuDNN in turns). Each run is its own process: the script's absl flags must not join
this process's (other scripts define the same names)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from tests.train.helpers import CONFIGS

ROOT = CONFIGS.parent
CASE = ["--impls=xla:attention", "--ts=256", "--heads=2", "--tokens=512", "--reps=2"]


def _run(*flags: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, str(ROOT / "experiments" / "benchmark.py"), *flags],
                          capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)


def test_a_sweep_case_runs_and_reports(tmp_path):
    proc = _run(*CASE, f"--out={tmp_path}")
    assert proc.returncode == 0, proc.stderr[-2000:]
    (row,) = json.loads((tmp_path / "benchmark.json").read_text())
    assert row["impl"] == "xla:attention" and row["t"] == 256 and row["h"] == 2
    assert row["fwd_ms"] > 0 and row["fwd_bwd_ms"] > 0 and "paired_ms" not in row
    assert row["fwd_bwd_pipelined_ms"] > 0
    header, line = proc.stdout.strip().splitlines()[-2:]
    assert header.split()[-1] == "paired" and line.split()[-1] == "-"


def test_paired_needs_a_gpu():
    proc = _run(*CASE, "--paired")
    assert proc.returncode != 0
    assert "--paired times each case against cuDNN, which needs a GPU" in proc.stderr


def test_a_setting_is_read_as_its_type():
    """--impls=impl@NAME=value settings: 'False' must not set a truthy string, '3' an int
    (benchmark.setting_value, imported in a process of its own: the script defines flags)."""
    script = """
import sys; sys.path.insert(0, "experiments")
import json
from benchmark import setting_value
def outcome(*args):
    try:
        return setting_value(*args)
    except ValueError as error:
        return str(error)
print(json.dumps([outcome("UPPER_BLOCKS", "False", True), outcome("UPPER_BLOCKS", "true", False),
                  outcome("PREFIX_STAGES", "3", 2), outcome("COLUMNS_DTYPE", "float32", "bf16"),
                  outcome("UPPER_BLOCKS", "0", True), outcome("PREFIX_STAGES", "x", 2)]))
"""
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=300, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == [
        False, True, 3, "float32", "--impls: UPPER_BLOCKS is true or false; got '0'",
        "--impls: PREFIX_STAGES is an integer; got 'x'"]
