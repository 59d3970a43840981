"""Training: one step per variant, learning, exact resume after SIGKILL, data parallelism.

Tiny models (1-2 layers, d_model 32-64, contexts 32-128) on the embedded Austen store keep the
suite to about two minutes on a 2-core CPU; most of that is XLA compiling the steps.

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
from pathlib import Path

import numpy as np
import pytest

from sympow.train import config as configlib
from sympow.train import data as datalib
from sympow.train.metrics import final_loss, read_metrics
from sympow.train.trainer import StopRequest, stop_after, train

ROOT = Path(__file__).resolve().parents[1]
TRAIN_PY = ROOT / "experiments" / "train.py"
QUICKSTART = str(ROOT / "configs" / "quickstart.py")

# A tiny fp32 softmax run: the reference for resume and data parallelism (fp32 compute keeps
# the 1- vs 4-device comparison at float32 reassociation error).
REF_SPEC = f"{QUICKSTART}:softmax,runlocal"
REF_OVERRIDES = ["model.n_layer=1", "model.d_model=32", "model.dtype=float32",
                 "data.context_size=32", "data.docs_per_batch=4", "num_train_steps=12",
                 "log_every=1", "checkpoint_every=3", "optim.warmup_steps=0"]


def tiny_config(spec: str = REF_SPEC, overrides=(), base=REF_OVERRIDES):
    return configlib.load_config(spec, [*base, *overrides])


def losses(workdir) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_metrics(workdir)}


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


@pytest.mark.parametrize("variant", ["softmax", "sympow", "gating", "conformal"])
def test_one_step_each_variant(variant, tmp_path):
    config = tiny_config(f"{QUICKSTART}:{variant},runlocal",
                         ["num_train_steps=1", "model.dtype=bfloat16"])
    summary = train(config, tmp_path, progress=False)
    assert summary["steps"] == 1 and summary["interrupted"] is None
    (record,) = read_metrics(tmp_path)
    assert record["step"] == 1
    assert 10.0 < record["loss"] < 11.5  # ~ln(50304) = 10.83 at init
    assert np.isfinite(record["grad_norm"]) and record["grad_norm"] > 0
    saved = configlib.load_workdir_config(tmp_path)
    assert saved.variant == variant and saved.model.attention == config.model.attention
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


def test_train_batches_wrap_and_resume_positions():
    ds = datalib.open_loader(tiny_config().data, "train", 4, 16384)  # 2 blocks x 4 windows
    assert len(ds) == 8
    steps = [k for k, _, _ in datalib.train_batches(ds, 6, 19)]
    assert steps == list(range(6, 19))
    (_, x, y), = [b for b in datalib.train_batches(ds, 13, 14)]
    np.testing.assert_array_equal(x, ds[13 % 8][0])
    np.testing.assert_array_equal(y, ds[13 % 8][1])


def test_divisibility_and_data_errors():
    mesh = datalib.make_mesh()
    datalib.check_divisible(4, mesh, 2)
    with pytest.raises(ValueError, match="docs_per_batch"):
        datalib.check_divisible(3, mesh, 2)
    config = configlib.load_config(f"{ROOT / 'configs' / 'sweep_p2.py'}:softmax")
    with pytest.raises(ValueError, match="runlocal"):  # 512 docs > the 11 of Austen
        datalib.open_loader(config.data, "train", 512, 1024)


def test_config_args_and_overrides():
    config = configlib.load_config(f"{QUICKSTART}:gating,p=4,context=128",
                                   ["optim.learning_rate=1e-3", "num_train_steps=7",
                                    "data.path=/somewhere/else"])
    assert (config.variant, config.model.p, config.model.gating, config.model.rotary) == (
        "gating", 4, True, "fixed")
    assert config.data.context_size == 128 and config.num_train_steps == 7
    assert config.optim.learning_rate == 1e-3 and config.data.path == "/somewhere/else"
    with pytest.raises(ValueError, match="unknown word"):
        configlib.load_config(f"{QUICKSTART}:nonsense")
    with pytest.raises(ValueError, match="p must be a positive even int"):
        configlib.load_config(f"{QUICKSTART}:p=3")
    with pytest.raises(ValueError, match="no field"):
        configlib.apply_override(config, "optim.nope=1")


def test_every_config_loads():
    for path in sorted((ROOT / "configs").glob("*.py")):
        module = configlib.load_module(path)
        if not hasattr(module, "get_config"):
            continue
        assert "python experiments/" in module.__doc__, f"{path.name}: no launch command"
        assert "Expected result" in module.__doc__, f"{path.name}: no expected result"
        for arg in (None, "runlocal"):
            config = module.get_config(arg)
            assert config.num_train_steps > 0 and config.data.docs_per_batch > 0
            assert config.data.path == str(datalib.AUSTEN_PATH)
        if hasattr(module, "get_sweep"):
            runs = module.get_sweep("runlocal")
            assert {c.variant for c in runs} == {"softmax", "sympow", "gating", "conformal"}
    paper = configlib.load_config(f"{ROOT / 'configs' / 'sweep_p4.py'}:sympow,context=65536")
    assert paper.data.docs_per_batch * paper.data.context_size == 524288
    assert paper.optim.learning_rate == 6e-4 and paper.optim.schedule == "constant"
    assert (paper.model.n_layer, paper.model.d_model, paper.model.p) == (12, 768, 4)


def test_final_loss_weights_records_by_steps():
    records = [{"step": 10, "loss": 5.0}, {"step": 20, "loss": 3.0}, {"step": 25, "loss": 1.0}]
    assert final_loss(records, 5) == 1.0
    assert final_loss(records, 10) == pytest.approx((5 * 3.0 + 5 * 1.0) / 10)
    assert final_loss(records, 100) == pytest.approx((10 * 5 + 10 * 3 + 5 * 1) / 25)
