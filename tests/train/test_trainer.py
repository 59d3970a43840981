"""sympow.train.trainer: one step per variant, learning, exact resume after SIGKILL, data
parallelism, graceful stops; bad input and faults.

Kill-and-resume uses a real crash: ``experiments/train.py`` runs in a subprocess and gets
SIGKILL as soon as its first periodic checkpoint is on disk, or while a later checkpoint is
being written, so nothing but what the last complete checkpoint holds (params, optimizer
state, step, RNG; the data position is the step) survives; the resumed run must then
reproduce the uninterrupted run's losses bit for bit. The graceful path (SIGTERM / Ctrl-C /
``stop_fn``: save at the current step and return) is tested in-process with ``stop_fn``,
which goes through the same code after the signal handler sets its flag.

Bad input (an invalid resolved config, ids past the vocabulary, an unwritable or locked
workdir, a diverging loss) must raise a ValueError naming it before anything is trained on or
written; faults (a disk that fills during a save, an unreadable newest checkpoint) must fail
naming the folder, or resume from the previous checkpoint with a warning, and resume exactly.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from sympow.train import config as configlib
from sympow.train.checkpoint import CheckpointWriteError, checkpoint_dir
from sympow.train.metrics import read_metrics
from sympow.train.trainer import (
    DivergenceError,
    StopRequest,
    check_loss,
    stop_after,
    summary_line,
    train,
)
from tests.data.helpers import COLS, pattern, write_store
from tests.train.helpers import (
    QUICKSTART,
    REF_OVERRIDES,
    REF_SPEC,
    ROOT,
    file_size_limit,
    lock_holder,
    losses,
    tiny_config,
    truncate_data_files,
)

TRAIN_PY = ROOT / "experiments" / "train.py"


def cli(config_spec: str, overrides, workdir, *, flags=(), **popen):
    """experiments/train.py in a subprocess (stdout and stderr together, text)."""
    cmd = [sys.executable, str(TRAIN_PY), f"--config={config_spec}", f"--workdir={workdir}",
           "--noprogress", *flags, *[f"--config.{o}" for o in overrides]]
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


def complete_steps(workdir) -> list[int]:
    folder = workdir / "checkpoints"
    return sorted(int(p.name) for p in folder.iterdir() if p.name.isdigit()) if (
        folder.is_dir()) else []


def partial_saves(workdir) -> list[str]:
    """Step folders orbax is still writing (renamed to ``<step>`` once complete)."""
    folder = workdir / "checkpoints"
    return [p.name for p in folder.iterdir() if "tmp" in p.name] if folder.is_dir() else []


def kill_when(proc, condition, what: str) -> None:
    """SIGKILLs ``proc`` as soon as ``condition()`` holds (polled every millisecond)."""
    deadline = time.monotonic() + 240
    try:
        while not condition():
            assert proc.poll() is None, proc.stdout.read()
            assert time.monotonic() < deadline, f"no {what} within 240 s"
            time.sleep(0.001)
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.wait()
    assert proc.returncode == -signal.SIGKILL


@pytest.mark.parametrize("kill", ["after_a_save", "during_a_save"])
def test_kill_and_resume_is_exact(reference, tmp_path, kill):
    def long_run():
        return cli(REF_SPEC, [*REF_OVERRIDES, "num_train_steps=100000"], tmp_path)

    if kill == "after_a_save":
        proc = long_run()

        def first_checkpoint_then_a_second_run():
            if 3 not in complete_steps(tmp_path):
                return False
            # Two training processes in one workdir: the second refuses, naming the first.
            with pytest.raises(ValueError, match=rf"workdir: .* is in use by another training "
                                                 rf"process \(pid {proc.pid} "):
                train(tiny_config(), tmp_path, progress=False)
            return True

        kill_when(proc, first_checkpoint_then_a_second_run, "checkpoint")
    else:
        for _ in range(3):  # a kill can land just after the save it saw has finished: retry
            kill_when(long_run(), lambda: complete_steps(tmp_path) and partial_saves(tmp_path),
                      "save in progress after a complete checkpoint")
            if partial_saves(tmp_path):
                break
        else:
            pytest.fail("three SIGKILLs all landed after their save had finished")
    killed = sorted(losses(tmp_path))
    resumed_from = max(complete_steps(tmp_path))
    assert resumed_from < 12 and resumed_from % 3 == 0

    # Resume in-process; stop gracefully mid-way (saves at a non-checkpoint step), resume again.
    stop_at = resumed_from + 2
    summary = train(tiny_config(), tmp_path, stop_fn=stop_after(stop_at), progress=False)
    assert summary["interrupted"] == "stop_fn" and summary["steps"] == stop_at
    assert (tmp_path / "checkpoints" / str(stop_at)).is_dir()
    assert partial_saves(tmp_path) == []  # what the kill cut short was removed
    summary = train(tiny_config(), tmp_path, progress=False)
    assert summary["steps"] == 12 and summary["interrupted"] is None

    ref, got = losses(reference), losses(tmp_path)
    assert sorted(got) == list(range(1, 13)), "metrics.jsonl must hold each step once"
    assert killed[-1] >= resumed_from  # the killed run got at least to its checkpoint
    np.testing.assert_array_equal([got[s] for s in range(1, 13)], [ref[s] for s in range(1, 13)])
    records = read_metrics(tmp_path)
    assert [r["step"] for r in records] == list(range(1, 13))


# orbax's background writer reports the failure again as it is torn down
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_a_full_disk_during_a_save_fails_naming_the_folder_and_resumes_exactly(reference,
                                                                               tmp_path):
    full, seen = contextlib.ExitStack(), []

    def fill_the_disk_after_step_4(step):
        seen.append(step)
        if step == 4:  # once checkpoint 3 is complete, no file may exceed 1 MB
            deadline = time.monotonic() + 60
            while complete_steps(tmp_path) != [3]:  # it is written in the background
                assert time.monotonic() < deadline, "checkpoint 3 not complete within 60 s"
                time.sleep(0.01)
            full.enter_context(file_size_limit(1_000_000))
        if step >= 6:
            time.sleep(2.0)  # ample time for the save of step 6 to fail (0.5 s was not, under load)
        return False

    with full, pytest.raises(CheckpointWriteError, match=rf"checkpoint: saving step 6 to "
                             rf"{checkpoint_dir(tmp_path)} failed \(.*File too large.*\); the "
                             r"checkpoints on disk are intact: steps \[3\]"):
        train(tiny_config(), tmp_path, stop_fn=fill_the_disk_after_step_4, progress=False)
    assert max(seen) < 8  # reported within a step of failing, not by the next save (step 9)
    assert complete_steps(tmp_path) == [3]
    summary = train(tiny_config(), tmp_path, progress=False)
    assert summary["steps"] == 12
    ref, got = losses(reference), losses(tmp_path)
    np.testing.assert_array_equal([got[s] for s in range(1, 13)], [ref[s] for s in range(1, 13)])


def test_an_unreadable_newest_checkpoint_resumes_from_the_one_before(reference, tmp_path,
                                                                     train_log):
    run = tmp_path / "run"
    shutil.copytree(reference, run)
    assert complete_steps(run) == [6, 9, 12]
    truncate_data_files(run / "checkpoints" / "12")
    summary = train(tiny_config(), run, progress=False)
    assert summary["steps"] == 12 and summary["interrupted"] is None
    warnings = [r.getMessage() for r in train_log.records if r.levelname == "WARNING"]
    assert any(f"{run.resolve() / 'checkpoints' / '12'} cannot be restored" in w
               for w in warnings), warnings
    assert any("resuming from step 9" in w for w in warnings), warnings
    assert (run / "checkpoints_unreadable" / "12").is_dir()
    assert complete_steps(run) == [6, 9, 12]  # 12 recomputed and saved again
    ref, got = losses(reference), losses(run)
    np.testing.assert_array_equal([got[s] for s in range(1, 13)], [ref[s] for s in range(1, 13)])


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
    for override, match in (("num_train_steps=-1", "num_train_steps: need an int >= 0"),
                            ("log_every=0", "log_every: need a positive int"),
                            ("checkpoint_every=0", "checkpoint_every: need a positive int"),
                            ("variant=flash", r"variant: 'flash' not in \['conformal', ")):
        config = tiny_config()
        configlib.apply_override(config, override)  # as absl's --config.a.b=value: unchecked
        with pytest.raises(ValueError, match=match):
            train(config, tmp_path, progress=False)
    assert not list(tmp_path.iterdir())  # nothing written


def test_an_unknown_variant_override_stops_train_py(tmp_path):
    proc = cli(REF_SPEC, [*REF_OVERRIDES, "variant=flash"], tmp_path / "run")
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 1, out
    assert "ValueError: variant: 'flash' not in ['conformal', 'softmax', 'sympow', " in out
    assert not (tmp_path / "run").exists()


def test_ids_beyond_the_vocabulary_stop_training(tmp_path):
    tokens = pattern(range(4), range(COLS))
    tokens[2, 17] = 60000  # in the first batch: documents 0-3, columns 0-31
    write_store(tmp_path / "store" / "train.zarr", 4, tokens=tokens)
    config = tiny_config(overrides=[f"data.path={tmp_path / 'store'}"])
    with pytest.raises(ValueError, match=r"token id 60000 at document 2, column 17 of "
                                         r".*store/train.zarr is >= vocab_size 50304"):
        train(config, tmp_path / "run", progress=False)
    assert not read_metrics(tmp_path / "run")  # not one step trained


def test_check_loss():
    check_loss(107.9, 5, (1, 10.8), 10.0, 1e-3)
    check_loss(1e9, 5, (1, 10.8), 0.0, 1e-3)  # 0: the ratio check is off
    with pytest.raises(DivergenceError, match=r"loss is nan at step 5: training diverged; try "
                                              r"a lower optim.learning_rate \(now 0.001\)"):
        check_loss(float("nan"), 5, (1, 10.8), 0.0, 1e-3)
    with pytest.raises(ValueError, match=r"loss 108.1 at step 5 is more than max_loss_ratio=10 "
                                         r"times the first logged loss 10.8 \(step 1\)"):
        check_loss(108.1, 5, (1, 10.8), 10.0, 1e-3)


def test_a_diverging_loss_stops_the_run(tmp_path):
    config = tiny_config(overrides=["optim.learning_rate=1000.0"])
    with pytest.raises(ValueError, match=r"loss .* at step 2 is more than max_loss_ratio=10 times "
                       r"the first logged loss 10.8 \(step 1\): training diverged; try a lower "
                       r"optim.learning_rate \(now 1000\), or set --config.max_loss_ratio=0 "
                       "to turn this check off") as raised:
        train(config, tmp_path / "on", progress=False)
    assert isinstance(raised.value, FloatingPointError)  # like a NaN loss
    assert not (tmp_path / "on" / "summary.json").exists() and not complete_steps(tmp_path / "on")
    # What the check stops: with it off, the same run "succeeds" at an absurd loss.
    config = tiny_config(overrides=["optim.learning_rate=1000.0", "max_loss_ratio=0",
                                    "num_train_steps=3"])
    summary = train(config, tmp_path / "off", progress=False)
    assert summary["steps"] == 3 and summary["final_loss"] > 1e4


def test_an_unwritable_workdir_fails_before_training(tmp_path, make_read_only):
    """A read-only checkpoints folder made orbax fail in a background thread and train.py
    hang at exit; now it is a ValueError before anything else is written."""
    with pytest.raises(ValueError, match=r"workdir: cannot write to .*ro \("):
        train(tiny_config(), make_read_only(tmp_path / "ro"), progress=False)
    make_read_only(tmp_path / "run" / "checkpoints")
    with pytest.raises(ValueError, match=r"workdir: cannot write to .*run/checkpoints \("):
        train(tiny_config(), tmp_path / "run", progress=False)
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == [".lock", "checkpoints"]
    proc = cli(REF_SPEC, REF_OVERRIDES, tmp_path / "run")
    out, _ = proc.communicate(timeout=120)  # it used to hang here until killed
    assert proc.returncode == 1 and "ValueError: workdir: cannot write to" in out, out


def test_a_locked_workdir_is_refused_until_its_holder_dies(tmp_path):
    with lock_holder(tmp_path) as child:
        with pytest.raises(ValueError, match=rf"workdir: {tmp_path} is in use by another "
                                             rf"training process \(pid {child.pid} "):
            train(tiny_config(), tmp_path, progress=False)
        assert sorted(p.name for p in tmp_path.iterdir()) == [".lock"]  # nothing written
    summary = train(tiny_config(overrides=["num_train_steps=1"]), tmp_path, progress=False)
    assert summary["steps"] == 1


def test_stop_after_and_summary_line():
    stop = stop_after(3)
    assert [stop(s) for s in (1, 2, 3, 4)] == [False, False, True, True]
    summary = {"variant": "softmax", "steps": 5, "num_train_steps": 10, "final_loss": 6.5,
               "final_loss_steps": 2, "tokens": 5120, "wall_s": 1.34, "tokens_per_sec": 4096.0,
               "num_params": 1_500_000, "devices": 1, "workdir": "/w", "interrupted": "SIGTERM"}
    assert summary_line(summary) == (
        "summary: softmax steps 5/10 final_loss 6.5000 (mean of last 2 steps) tokens 5,120 "
        "wall 1.3s 4,096 tok/s params 1.50M devices 1 workdir /w INTERRUPTED (SIGTERM)")
