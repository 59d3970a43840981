"""experiments/probe_dq_traffic.py on the CPU: the backward kernel lowers for CUDA with its
dQ reductions kept, made plain stores or left out (the Pallas lowering and Mosaic GPU's
layout inference run without a GPU), and the patched `plgpu` changes only the 'add'
copies (its refusal off a Hopper GPU: test_probes.py). Each check runs in its own
process: the script's absl flags must not join this process's."""

from __future__ import annotations

import json

from tests.configs.test_probes import lowering_script, run

LOWER = lowering_script("probe_dq_traffic", """
from jax import ShapeDtypeStruct as S
b, t, h, d = 1, 256, 2, 64
tokens, rows = S((b, t, h, d), jnp.bfloat16), S((b, h, 1, t), jnp.float32)
args = (tokens, tokens, tokens, rows, rows, rows, rows, rows, tokens, rows)
print(json.dumps({variant: "mosaic_gpu" in probe.lowered_backward(
    variant, args, lowering_platforms=("cuda",)).as_text() for variant in probe.VARIANTS}))
""")

COPIES = lowering_script("probe_dq_traffic", """
class Recorder:
    def __init__(self):
        self.calls = []

    def copy_smem_to_gmem(self, src, dst, reduction_op=None):
        self.calls.append([src, dst, reduction_op])

    barrier_wait = "the real module's"

got = {}
for variant in probe.VARIANTS:
    real = Recorder()
    patched = probe._DqCopies(real, variant)
    patched.copy_smem_to_gmem("s", "d", reduction_op="add")
    patched.copy_smem_to_gmem("s", "d")
    got[variant] = [real.calls, patched.barrier_wait]
print(json.dumps(got))
""")


def test_each_variant_lowers_for_cuda():
    done = run("-c", LOWER)
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got == {"reduce": True, "store": True, "none": True}, got


def test_only_the_reductions_change():
    done = run("-c", COPIES)
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    passed = "the real module's"  # everything else passes through
    assert got == {"reduce": [[["s", "d", "add"], ["s", "d", None]], passed],
                   "store": [[["s", "d", None], ["s", "d", None]], passed],
                   "none": [[["s", "d", None]], passed]}, got
