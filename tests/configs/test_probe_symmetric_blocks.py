"""experiments/probe_symmetric_blocks.py on the CPU: it refuses to run without a Hopper GPU,
naming why; its Mosaic GPU kernels lower for CUDA here (the Pallas lowering and Mosaic GPU's
layout inference run without a GPU); a K-sliced product with the 128-byte swizzle the state
kernels use fails to lower, which is why the probe's blocks run with 32-byte tiles; and its
FLOP count is the blocks' 62.5 % of the square layout's. Each check runs in its own process:
the script's absl flags must not join this process's (other scripts define the same names)."""

from __future__ import annotations

import json

from tests.configs.test_probe_tma_reduce import run

LOWER = """
import json, sys
sys.path.insert(0, "experiments")
from absl import flags
import jax, jax.numpy as jnp
import probe_symmetric_blocks as probe
flags.FLAGS(["probe_symmetric_blocks", "--programs=2", "--steps=1"])

def lowered(fn, *shapes):
    args = [jax.ShapeDtypeStruct(shape, jnp.bfloat16) for shape in shapes]
    return "mosaic_gpu" in jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()

def outcome(thunk):
    try:
        return thunk()
    except ValueError as error:
        return str(error)[:200]

square, vector = (64, 64), (64,)
print(json.dumps({
    **{f"packed_{split}": outcome(lambda split=split: lowered(
        probe.packed_product(split), square, (2, 64), square)) for split in (48, 32)},
    **{f"sliced_{start}": outcome(lambda start=start: lowered(
        probe.sliced_product(start), square, vector, square)) for start in (16, 32, 48)},
    "sliced_16_swizzle_128": outcome(lambda: lowered(
        probe.sliced_product(16, swizzle=128), square, vector, square)),
    **{f"rate_{layout}_{swizzle}": outcome(lambda layout=layout, swizzle=swizzle: lowered(
        probe.rate_kernel(layout, swizzle), square, square, square))
       for layout, swizzle in (("square", 128), ("square", 32), ("blocks", 32))},
    "flop_ratio": probe.executed_flop("blocks") / probe.executed_flop("square"),
}))
"""


def test_refuses_without_a_hopper_gpu():
    done = run("experiments/probe_symmetric_blocks.py")
    assert done.returncode != 0
    assert "needs a Hopper GPU" in done.stderr, done.stderr[-2000:]


def test_kernels_lower_for_cuda_and_k_slices_need_the_narrow_swizzle():
    done = run("-c", LOWER)
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    for name in ("packed_48", "packed_32", "sliced_16", "sliced_32", "sliced_48",
                 "rate_square_128", "rate_square_32", "rate_blocks_32"):
        assert got[name] is True, (name, got[name])
    assert "K must be a multiple of 64" in got["sliced_16_swizzle_128"], got
    assert got["flop_ratio"] == 2560 / 4096
