"""experiments/probe_tma_reduce.py on the CPU: it refuses to run without a Hopper GPU, naming
why, and its Mosaic GPU kernels lower for CUDA here (the Pallas lowering and Mosaic GPU's
layout inference run without a GPU); the products narrower than 64 columns that the probe
records as failing on the H100 fail here too."""

from __future__ import annotations

import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest
from absl import flags

from tests.train.helpers import CONFIGS

ROOT = CONFIGS.parent
sys.path.insert(0, str(ROOT / "experiments"))
import probe_tma_reduce  # noqa: E402


def lowered(fn, *shapes):
    args = [jax.ShapeDtypeStruct(shape, jnp.bfloat16) for shape in shapes]
    return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


@pytest.fixture(autouse=True)
def parsed_flags():
    if not flags.FLAGS.is_parsed():
        flags.FLAGS(["probe_tma_reduce"])


def test_refuses_without_a_hopper_gpu():
    done = subprocess.run([sys.executable, "experiments/probe_tma_reduce.py"], cwd=ROOT,
                          capture_output=True, text=True, timeout=300,
                          env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert done.returncode != 0
    assert "needs a Hopper GPU" in done.stderr, done.stderr[-2000:]


@pytest.mark.parametrize("reduction", ["add", None])
def test_traffic_kernel_lowers_for_cuda(reduction):
    text = lowered(probe_tma_reduce.traffic_kernel(64, reduction))
    assert "mosaic_gpu" in text


def test_transposed_product_lowers_at_64_columns_and_fails_narrower():
    assert "mosaic_gpu" in lowered(probe_tma_reduce.transposed_product(64), (64, 64), (64, 64))
    with pytest.raises(ValueError, match="Failed to infer a possible set of layouts"):
        lowered(probe_tma_reduce.transposed_product(16), (64, 64), (64, 16))
