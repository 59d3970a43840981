"""experiments/probe_symmetric_blocks.py on the CPU: its Mosaic GPU kernels lower for CUDA
here (the Pallas lowering and Mosaic GPU's layout inference run without a GPU); a K-sliced
product with the 128-byte swizzle the state kernels use fails to lower, which is why the
probe's blocks run with 32-byte tiles; and its FLOP count is the blocks' 62.5 % of the
square layout's (its refusal off a Hopper GPU: test_probes.py). Each check runs in its own
process: the script's absl flags must not join this process's (other scripts define the
same names)."""

from __future__ import annotations

import json

from tests.configs.test_probes import lowering_script, run

LOWER = lowering_script("probe_symmetric_blocks", """square, vector = (64, 64), (64,)
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
""", "--programs=2", "--steps=1")


def test_kernels_lower_for_cuda_and_k_slices_need_the_narrow_swizzle():
    done = run("-c", LOWER)
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    for name in ("packed_48", "packed_32", "sliced_16", "sliced_32", "sliced_48",
                 "rate_square_128", "rate_square_32", "rate_blocks_32"):
        assert got[name] is True, (name, got[name])
    assert "K must be a multiple of 64" in got["sliced_16_swizzle_128"], got
    assert got["flop_ratio"] == 2560 / 4096
