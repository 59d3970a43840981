"""experiments/probe_grid_barrier.py on the CPU: its three kernels (barriers alone, weights
streamed behind barriers, the same loads with none) lower for CUDA to Mosaic GPU kernels
here, the streamed one longer than the same loads without barriers (its refusal off a
Hopper GPU: test_probes.py). In its own process: the script's absl flags must not join
this process's."""

from __future__ import annotations

import json

from tests.configs.test_probes import lowering_script, run

LOWER = lowering_script("probe_grid_barrier", """
def text(barrier, stream, layers, rows):
    fn = probe.probe_kernel(8, layers, rows, barrier=barrier, stream=stream)
    arg = jax.ShapeDtypeStruct((layers, 8, rows, probe.WIDTH), jnp.bfloat16)
    return fn.trace(arg).lower(lowering_platforms=("cuda",)).as_text()

kernels = {"barriers": (True, False, 4, 1), "streamed": (True, True, 3, 16),
           "loads_only": (False, True, 3, 16)}
print(json.dumps({name: {"mosaic": "mosaic_gpu" in t, "chars": len(t)}
                  for name, t in ((name, text(*case)) for name, case in kernels.items())}))
""")


def test_the_three_kernels_lower_for_cuda():
    done = run("-c", LOWER)
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert all(kernel["mosaic"] for kernel in got.values()), got
    # the barriers add code: the streamed kernel's module is longer than the loads alone
    assert got["streamed"]["chars"] > got["loads_only"]["chars"], got
