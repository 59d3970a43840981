"""Shared by the tests of sympow.train: the repo's config paths, a tiny fp32 run config, and
faults (a full disk, truncated checkpoint files, another process holding a workdir's lock).

Tiny models (1-2 layers, d_model 32-64, contexts 32-128) on the embedded Austen store keep
the suite to a few minutes on a 2-core CPU; most of that is XLA compiling the steps.
"""

from __future__ import annotations

import contextlib
import resource
import signal
import subprocess
import sys
from pathlib import Path

from sympow.train import config as configlib
from sympow.train.metrics import read_metrics

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = ROOT / "configs"
QUICKSTART = str(CONFIGS / "quickstart.py")

# A tiny fp32 softmax run: the reference for resume and data parallelism (fp32 compute keeps
# the 1- vs 4-device comparison at float32 reassociation error).
REF_SPEC = f"{QUICKSTART}:softmax,runlocal"
REF_OVERRIDES = ["model.n_layer=1", "model.d_model=32", "model.dtype=float32",
                 "data.context_size=32", "data.docs_per_batch=4", "num_train_steps=12",
                 "log_every=1", "checkpoint_every=3", "optim.warmup_steps=0"]

# ``config.model`` of a one-layer fp32 softmax GPT over 64 tokens, for step and model tests.
MODEL = {"vocab_size": 64, "n_layer": 1, "n_head": 2, "n_kv_head": 2, "d_model": 16,
         "attention": "softmax", "rotary": "fixed", "dtype": "float32",
         "param_dtype": "float32"}


def tiny_config(spec: str = REF_SPEC, overrides=(), base=REF_OVERRIDES):
    """``load_config(spec)`` with the tiny-run overrides, then ``overrides`` (which win)."""
    return configlib.load_config(spec, [*base, *overrides])


def losses(workdir) -> dict[int, float]:
    """step -> logged training loss of a run's metrics.jsonl."""
    return {r["step"]: r["loss"] for r in read_metrics(workdir)}


# A process that takes the lock of the workdir argv[1], says 'locked', and waits to be killed.
HOLD_LOCK = ("import sys, time; from sympow.train.workdir import WorkdirLock; "
             "WorkdirLock(sys.argv[1]).acquire(); print('locked', flush=True); time.sleep(300)")


@contextlib.contextmanager
def lock_holder(workdir):
    """A child process holding the workdir's lock for the block (killed at its end)."""
    child = subprocess.Popen([sys.executable, "-c", HOLD_LOCK, str(workdir)], cwd=ROOT,
                             stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "locked"
        yield child
    finally:
        child.kill()
        child.wait()


def truncate_data_files(step_dir) -> None:
    """Halves every array data file of a saved step (a save cut short by a crash or a full
    disk, outside orbax's atomic rename)."""
    files = list(step_dir.glob("*/d/*"))
    assert files, f"no data files under {step_dir}"
    for path in files:
        with open(path, "r+b") as f:
            f.truncate(path.stat().st_size // 2)


@contextlib.contextmanager
def file_size_limit(limit: int):
    """Writes past ``limit`` bytes fail with EFBIG (a disk that fills up, without root)."""
    previous_handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # else the kernel kills us
    previous = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, previous[1]))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, previous)
        signal.signal(signal.SIGXFSZ, previous_handler)
