"""sympow.train.trainer: one step per variant, learning, exact resume after SIGKILL, data
parallelism, graceful stops.

Kill-and-resume uses a real crash: ``experiments/train.py`` runs in a subprocess and gets
SIGKILL as soon as its first periodic checkpoint is on disk, so nothing but what the checkpoint
holds (params, optimizer state, step, RNG; the data position is the step) survives; the resumed
run must then reproduce the uninterrupted run's losses bit for bit. The graceful path
(SIGTERM / Ctrl-C / ``stop_fn``: save at the current step and return) is tested in-process with
``stop_fn``, which goes through the same code after the signal handler sets its flag.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from sympow.train import config as configlib
from sympow.train.metrics import read_metrics
from sympow.train.trainer import StopRequest, stop_after, summary_line, train
from tests.train.helpers import (
    QUICKSTART,
    REF_OVERRIDES,
    REF_SPEC,
    ROOT,
    losses,
    tiny_config,
)

TRAIN_PY = ROOT / "experiments" / "train.py"


def cli(config_spec: str, overrides, workdir, **popen):
    cmd = [sys.executable, str(TRAIN_PY), f"--config={config_spec}", f"--workdir={workdir}",
           "--noprogress", *[f"--config.{o}" for o in overrides]]
    return subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, **popen)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted 12-step run on 1 device."""
    workdir = tmp_path_factory.mktemp("reference")
    summary = train(tiny_config(), workdir, progress=False)
    assert summary["steps"] == 12 and summary["devices"] == 1
    return workdir


# The config arg's words and the preset names the config stores (docs/experiments.md).
@pytest.mark.parametrize("variant, preset", [("softmax", "softmax"), ("sympow", "sympow"),
                                             ("gating", "sympow_gating"),
                                             ("conformal", "conformal")])
def test_one_step_each_variant(variant, preset, tmp_path):
    config = tiny_config(f"{QUICKSTART}:{variant},runlocal",
                         ["num_train_steps=1", "model.dtype=bfloat16"])
    summary = train(config, tmp_path, progress=False)
    assert summary["steps"] == 1 and summary["interrupted"] is None
    (record,) = read_metrics(tmp_path)
    assert record["step"] == 1
    assert 10.0 < record["loss"] < 11.5  # ~ln(50304) = 10.83 at init
    assert np.isfinite(record["grad_norm"]) and record["grad_norm"] > 0
    saved = configlib.load_workdir_config(tmp_path)
    assert saved.variant == preset and saved.model.attention == config.model.attention
    assert (tmp_path / "checkpoints" / "1").is_dir()  # saved at exit
    assert list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))


def test_quickstart_loss_decreases(tmp_path):
    config = configlib.load_config(f"{QUICKSTART}:runlocal", [
        "num_train_steps=40", "log_every=1", "model.n_layer=1", "data.context_size=64",
        "final_loss_steps=4"])
    assert config.variant == "conformal" and config.model.rotary == "learned"
    summary = train(config, tmp_path, progress=False)
    curve = losses(tmp_path)
    first = np.mean([curve[s] for s in range(1, 6)])
    last = np.mean([curve[s] for s in range(36, 41)])
    assert first > 10.5
    assert last < first - 2.0, (first, last)
    assert summary["final_loss"] == pytest.approx(np.mean([curve[s] for s in range(37, 41)]))


def test_kill_and_resume_is_exact(reference, tmp_path):
    proc = cli(REF_SPEC, [*REF_OVERRIDES, "num_train_steps=100000"], tmp_path)
    first_checkpoint = tmp_path / "checkpoints" / "3"
    deadline = time.monotonic() + 240
    try:
        while not first_checkpoint.is_dir():
            assert proc.poll() is None, proc.stdout.read()
            assert time.monotonic() < deadline, "no checkpoint within 240 s"
            time.sleep(0.02)
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.wait()
    assert proc.returncode == -signal.SIGKILL
    killed = sorted(losses(tmp_path))
    resumed_from = max(int(p.name) for p in (tmp_path / "checkpoints").iterdir()
                       if p.name.isdigit())
    assert resumed_from < 12 and resumed_from % 3 == 0

    # Resume in-process; stop gracefully mid-way (saves at a non-checkpoint step), resume again.
    stop_at = resumed_from + 2
    summary = train(tiny_config(), tmp_path, stop_fn=stop_after(stop_at), progress=False)
    assert summary["interrupted"] == "stop_fn" and summary["steps"] == stop_at
    assert (tmp_path / "checkpoints" / str(stop_at)).is_dir()
    summary = train(tiny_config(), tmp_path, progress=False)
    assert summary["steps"] == 12 and summary["interrupted"] is None

    ref, got = losses(reference), losses(tmp_path)
    assert sorted(got) == list(range(1, 13)), "metrics.jsonl must hold each step once"
    assert killed[-1] >= resumed_from  # the killed run got at least to its checkpoint
    np.testing.assert_array_equal([got[s] for s in range(1, 13)], [ref[s] for s in range(1, 13)])
    records = read_metrics(tmp_path)
    assert [r["step"] for r in records] == list(range(1, 13))


def test_data_parallel_4_devices_matches_1(reference, tmp_path):
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=4",
           "JAX_PLATFORMS": "cpu"}
    proc = cli(REF_SPEC, [*REF_OVERRIDES, "num_train_steps=6"], tmp_path, env=env)
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, out
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["devices"] == 4
    ref, got = losses(reference), losses(tmp_path)
    np.testing.assert_allclose([got[s] for s in range(1, 7)], [ref[s] for s in range(1, 7)],
                               rtol=2e-6)
    assert "summary: softmax steps 6/6" in out


def test_stop_request_catches_sigterm():
    with StopRequest() as stop:
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.01)
        assert stop.signal_name == "SIGTERM"
    assert signal.getsignal(signal.SIGTERM) is not stop._handle



def test_invalid_config_raises_before_training(tmp_path):
    for override, match in (("num_train_steps=-1", "num_train_steps: need >= 0"),
                            ("log_every=0", "log_every: need a positive int"),
                            ("checkpoint_every=0", "checkpoint_every: need a positive int")):
        with pytest.raises(ValueError, match=match):
            train(tiny_config(overrides=[override]), tmp_path, progress=False)
    assert not (tmp_path / "config.json").exists()  # nothing written


def test_stop_after_and_summary_line():
    stop = stop_after(3)
    assert [stop(s) for s in (1, 2, 3, 4)] == [False, False, True, True]
    summary = {"variant": "softmax", "steps": 5, "num_train_steps": 10, "final_loss": 6.5,
               "final_loss_steps": 2, "tokens": 5120, "wall_s": 1.34, "tokens_per_sec": 4096.0,
               "num_params": 1_500_000, "devices": 1, "workdir": "/w", "interrupted": "SIGTERM"}
    assert summary_line(summary) == (
        "summary: softmax steps 5/10 final_loss 6.5000 (mean of last 2 steps) tokens 5,120 "
        "wall 1.3s 4,096 tok/s params 1.50M devices 1 workdir /w INTERRUPTED (SIGTERM)")
