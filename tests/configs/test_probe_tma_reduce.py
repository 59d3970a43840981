"""experiments/probe_tma_reduce.py on the CPU: its Mosaic GPU kernels lower for CUDA here
(the Pallas lowering and Mosaic GPU's layout inference run without a GPU); the product
narrower than 64 columns that the probe records as failing on the H100 fails here too (its
refusal off a Hopper GPU: test_probes.py). Each check runs in its own process: the script's
absl flags must not join this process's (other scripts define the same names)."""

from __future__ import annotations

import json

from tests.configs.test_probes import lowering_script, run

LOWER = lowering_script("probe_tma_reduce", """print(json.dumps({
    "traffic_add": outcome(lambda: lowered(probe.traffic_kernel(64, "add"))),
    "traffic_store": outcome(lambda: lowered(probe.traffic_kernel(64, None))),
    "transposed_64": outcome(lambda: lowered(probe.transposed_product(64), (64, 64), (64, 64))),
    "transposed_16": outcome(lambda: lowered(probe.transposed_product(16), (64, 64), (64, 16))),
}))
""")


def test_kernels_lower_for_cuda_and_a_narrow_product_fails_layout_inference():
    done = run("-c", LOWER)
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got["traffic_add"] is True and got["traffic_store"] is True, got
    assert got["transposed_64"] is True, got
    assert "Failed to infer a possible set of layouts" in got["transposed_16"], got
