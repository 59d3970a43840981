"""experiments/probes.py, the Hopper probes' shared entry and rows, on the CPU: each probe
script refuses to run without a Hopper GPU, naming itself and why; a row records a failing
measurement instead of ending the run; `against` compares to the largest entry."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import numpy as np
import pytest

from tests.train.helpers import CONFIGS

ROOT = CONFIGS.parent
SPEC = importlib.util.spec_from_file_location("sympow_probes", ROOT / "experiments" / "probes.py")
probes = importlib.util.module_from_spec(SPEC)
SPEC.loader.exec_module(probes)


def lowering_script(script: str, body: str, *flags: str) -> str:
    """Python source that imports experiments/<script>.py as `probe` (its absl flags parsed
    from `flags`), defines lowered(fn, *shapes) (True when fn lowers for CUDA to a Mosaic GPU
    kernel, with bf16 arguments of those shapes) and outcome(thunk) (thunk(), or the
    ValueError's message), then runs `body`."""
    return f"""
import json, sys
sys.path.insert(0, "experiments")
from absl import flags
import jax, jax.numpy as jnp
import {script} as probe
flags.FLAGS({[script, *flags]!r})

def lowered(fn, *shapes):
    args = [jax.ShapeDtypeStruct(shape, jnp.bfloat16) for shape in shapes]
    return "mosaic_gpu" in jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()

def outcome(thunk):
    try:
        return thunk()
    except ValueError as error:
        return str(error)[:200]

{body}"""


def run(*args):
    """A Python process in the repository root (PYTHONPATH the root) with these arguments."""
    return subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=300, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})


@pytest.mark.parametrize("script", ["probe_tma_reduce", "probe_symmetric_blocks",
                                    "probe_grid_barrier", "probe_row_gradients_upper",
                                    "probe_dq_traffic"])
def test_a_probe_refuses_without_a_hopper_gpu(script):
    done = run(f"experiments/{script}.py")
    assert done.returncode != 0
    assert f"{script}.py needs a Hopper GPU" in done.stderr, done.stderr[-2000:]


def test_a_failing_measurement_is_a_row_not_the_end(capsys):
    def fails():
        raise ValueError("K must be a multiple of 64")

    row = probes.attempt({"probe": "x"}, fails)
    assert row["ok"] is False and row["error"].startswith("ValueError: K must be")
    assert probes.attempt({"probe": "y"}, lambda: {"ms": 1.5}) == {"probe": "y", "ms": 1.5}
    assert capsys.readouterr().out.count("\n") == 2  # each row printed as it is made


def test_against_is_the_error_per_the_largest_entry():
    want = np.array([[100.0, -1.0], [0.5, 2.0]])
    got = want + np.array([[0.0, 1e-4], [0.0, 0.0]])
    row = probes.against(got, want)
    assert row["max_rel_err"] == pytest.approx(1e-6) and row["ok"] is True
    assert probes.against(got, want, tol=1e-7)["ok"] is False
