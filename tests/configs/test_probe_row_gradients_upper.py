"""experiments/probe_row_gradients_upper.py on the CPU: its Mosaic GPU kernel (the row
gradients from the stored rows of the upper layout, under each of its schedules of the
CUDA-core work against the products) lowers for CUDA here, one kernel that
takes the upper layout's four arrays and writes g in float32; it names what it does not
take (its refusal off a Hopper GPU: test_probes.py). Each check runs in its own process:
the script's absl flags must not join this process's."""

from __future__ import annotations

import json

from tests.configs.test_probes import lowering_script, run

LOWER = lowering_script("probe_row_gradients_upper", """
import functools
from sympow.attention.mosaic_gpu.state_walks import upper_shapes
b, h, n, c = 1, 2, 2, 256
f32 = jnp.float32
def args(c, d=64):
    return ([jax.ShapeDtypeStruct((b, h, n, c, 64), jnp.bfloat16),
             jax.ShapeDtypeStruct((b, h, n, c, d), jnp.bfloat16),
             jax.ShapeDtypeStruct((b, h, n, c), f32),
             jax.ShapeDtypeStruct((b, h, n, d, c), jnp.bfloat16)]
            + [jax.ShapeDtypeStruct(s, jnp.bfloat16) for s in upper_shapes((b, h, n), d, 64)])
fn = lambda *x, schedule="serial": probe.row_gradients_upper(*x[:4], x[4:], schedule=schedule)
texts = [jax.jit(functools.partial(fn, schedule=schedule)).trace(*args(c)).lower(
    lowering_platforms=("cuda",)).as_text() for schedule in probe.SCHEDULES]
print(json.dumps({
    "kernels": [text.count("stablehlo.custom_call @mosaic_gpu") for text in texts],
    "output": all(f"tensor<{b}x{h}x{n}x{c}x64xf32>" in text for text in texts),
    "short_chunk": outcome(lambda: jax.eval_shape(fn, *args(64))),
    "schedule": outcome(lambda: jax.eval_shape(functools.partial(fn, schedule="ping"),
                                               *args(c))),
}))
""")


def test_the_kernel_lowers_for_cuda_and_names_what_it_does_not_take():
    done = run("-c", LOWER)
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got["kernels"] == [1, 1, 1] and got["output"] is True, got  # each schedule
    assert "schedule must be one of ('serial', 'in_step', 'lagged'); got 'ping'" in got[
        "schedule"], got
    assert "C a multiple of 128; got d=64, e=64, C=64" in got["short_chunk"], got
