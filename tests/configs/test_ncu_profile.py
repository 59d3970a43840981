"""experiments/ncu_profile.py on the CPU: its summary of an Nsight Compute raw CSV report
(units converted, stall reasons found by pattern and kept largest first,
message lines skipped, a report without launches refused), and a case run end to end (the
xla backend; on the GPU machine ncu wraps the same call). Each run is its own process: the
script's absl flags must not join this process's (other scripts define the same names)."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.train.helpers import CONFIGS

ROOT = CONFIGS.parent

HEADER = ['ID', 'Process ID', 'Process Name', 'Host Name', 'Kernel Name', 'Context', 'Stream',
          'Block Size', 'Grid Size', 'Device', 'CC', 'gpu__time_duration.sum',
          'sm__throughput.avg.pct_of_peak_sustained_elapsed',
          'sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_active',
          'smsp__average_warps_issue_stalled_barrier_per_issue_active.ratio',
          'smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio',
          'smsp__average_warps_issue_stalled_wait_per_issue_active.ratio',
          'launch__registers_per_thread']
UNITS = ['', '', '', '', '', '', '', '', '', '', '', 'ms', '%', '%', 'inst', 'inst', 'inst',
         'register/thread']
ROWS = [
    ['0', '11', 'python3', 'h', 'sympow_attention_fwd', '1', '7', '(384, 1, 1)', '(64, 1, 48)',
     '0', '9.0', '1.25', '45.5', '33.1', '2.5', '0.25', '0.75', '168'],
    ['1', '11', 'python3', 'h', 'cudnn_generated_fort_native_sdpa', '1', '7', '(128, 1, 1)',
     '(1,024, 1, 1)', '0', '9.0', '0.5', '80', '61.5', '0.1', '1,234.5', 'n/a', '255'],
]


def report(rows) -> str:
    quote = lambda row: ",".join(f'"{cell}"' for cell in row)  # noqa: E731  ncu quotes all
    return "\n".join(["==PROF== Connected to process 11", quote(HEADER), quote(UNITS),
                      *map(quote, rows), "==PROF== Disconnected from process 11"]) + "\n"


def run(*args):
    return subprocess.run([sys.executable, "experiments/ncu_profile.py", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=600,
                          env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})


def test_summary_converts_units_and_orders_stalls(tmp_path):
    (tmp_path / "r.csv").write_text(report(ROWS))
    done = run(f"--summarize={tmp_path / 'r.csv'}", f"--out={tmp_path}", "--stalls=2")
    assert done.returncode == 0, done.stderr[-3000:]
    fwd, cudnn = json.loads((tmp_path / "ncu_profile.json").read_text())["kernels"]
    assert fwd["name"] == "sympow_attention_fwd" and fwd["grid"] == "(64, 1, 48)"
    assert fwd["duration_us"] == 1250.0  # ms -> us
    assert fwd["sm_pct"] == 45.5 and fwd["registers"] == 168.0
    assert fwd["tensor_pct"] == 33.1
    assert list(fwd["stalls"].items()) == [("barrier", 2.5), ("wait", 0.75)]  # 2 kept
    assert "memory_pct" not in fwd  # not in the report: left out, not zero
    # thousands separators read as numbers; a text cell ('n/a') is no stall value
    assert list(cudnn["stalls"].items()) == [("long_scoreboard", 1234.5), ("barrier", 0.1)]
    assert "sympow_attention_fwd" in done.stdout


def test_a_report_without_launches_is_refused(tmp_path):
    (tmp_path / "r.csv").write_text(report([]))
    done = run(f"--summarize={tmp_path / 'r.csv'}")
    assert done.returncode != 0
    assert "no kernel rows" in done.stderr


def test_a_case_runs_its_forward_and_backward_once():
    done = run("--cases=xla:chunked:4096:1")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "ran xla:chunked:4096:1" in done.stdout
