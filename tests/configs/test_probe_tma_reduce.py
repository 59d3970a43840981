"""experiments/probe_tma_reduce.py on the CPU: it refuses to run without a Hopper GPU, naming
why, and its Mosaic GPU kernels lower for CUDA here (the Pallas lowering and Mosaic GPU's
layout inference run without a GPU); the product narrower than 64 columns that the probe
records as failing on the H100 fails here too. Each check runs in its own process: the
script's absl flags must not join this process's (other scripts define the same names)."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.train.helpers import CONFIGS

ROOT = CONFIGS.parent

LOWER = """
import json, sys
sys.path.insert(0, "experiments")
from absl import flags
flags.FLAGS(["probe_tma_reduce"])
import jax, jax.numpy as jnp
import probe_tma_reduce as probe

def lowered(fn, *shapes):
    args = [jax.ShapeDtypeStruct(shape, jnp.bfloat16) for shape in shapes]
    return "mosaic_gpu" in jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()

def outcome(thunk):
    try:
        return thunk()
    except ValueError as error:
        return str(error)[:200]

print(json.dumps({
    "traffic_add": outcome(lambda: lowered(probe.traffic_kernel(64, "add"))),
    "traffic_store": outcome(lambda: lowered(probe.traffic_kernel(64, None))),
    "transposed_64": outcome(lambda: lowered(probe.transposed_product(64), (64, 64), (64, 64))),
    "transposed_16": outcome(lambda: lowered(probe.transposed_product(16), (64, 64), (64, 16))),
}))
"""


def run(*args):
    return subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=300, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})


def test_refuses_without_a_hopper_gpu():
    done = run("experiments/probe_tma_reduce.py")
    assert done.returncode != 0
    assert "needs a Hopper GPU" in done.stderr, done.stderr[-2000:]


def test_kernels_lower_for_cuda_and_a_narrow_product_fails_layout_inference():
    done = run("-c", LOWER)
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got["traffic_add"] is True and got["traffic_store"] is True, got
    assert got["transposed_64"] is True, got
    assert "Failed to infer a possible set of layouts" in got["transposed_16"], got
