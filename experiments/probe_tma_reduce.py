"""What a one-pass attention backward on Hopper would rest on (docs/kernels.md, "Products
kept in flight ...", 2026-11-25), measured before it is built:

1. the rate of TMA reductions into GMEM (`plgpu.copy_smem_to_gmem(..., reduction_op="add")`)
   of float32 [64, 64] tiles issued from every SM, against plain TMA stores of the same
   tiles: the dQ partials' traffic, at several target sizes (L2-resident to HBM);
2. wgmma with the A operand read transposed from shared memory (ds^T stored, ds read),
   each against jnp, with B 64 or 16 columns wide: the N = 16 product (against a ones
   operand it would sum rows) is the narrowest the 32-byte swizzle takes, and Mosaic GPU's
   layout inference rejects it (recorded as the row's error; measured 2026-11-25).

  PYTHONPATH=. python3 experiments/probe_tma_reduce.py --out=$OUT

Prints one JSON row per measurement and writes probe_tma_reduce.json under --out. Needs a
Hopper GPU (Mosaic GPU kernels); on anything else it exits with the reason.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from absl import app, flags  # noqa: E402
from probes import against, attempt, hopper_main  # noqa: E402  (beside this script)
from timing import timed  # noqa: E402  (experiments/timing.py, beside this script)

_OUT = flags.DEFINE_string("out", None, "directory for probe_tma_reduce.json")
_PROGRAMS = flags.DEFINE_integer("programs", 264, "programs of the traffic kernel (2 per SM)")
_STEPS = flags.DEFINE_integer("steps", 1024, "tiles each program writes")
_IN_FLIGHT = flags.DEFINE_integer("in_flight", 4, "TMA writes a program keeps in flight")
_TARGETS = flags.DEFINE_list("targets", ["64", "1024", "16384"],
                             "target sizes in [64, 64] float32 tiles (16 KiB each)")
_REPS = flags.DEFINE_integer("reps", 10, "timed calls per measurement (median)")

ROWS = 64


def traffic_kernel(targets: int, reduction: str | None):
    """fn() -> float32 [targets * 64, 64]: every program writes its tile of ones into
    target tiles (program * 7 + step) % targets, `reduction` ('add') or plain stores. The
    output is not initialized (the rate does not depend on the values)."""
    import jax
    import jax.numpy as jnp
    from jax import lax
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu

    steps, in_flight = _STEPS.value, _IN_FLIGHT.value

    def body(out_ref, tile):
        tile[...] = plgpu.layout_cast(jnp.full((ROWS, ROWS), 1.0, jnp.float32),
                                      plgpu.Layout.WGMMA)
        plgpu.commit_smem()
        program = lax.axis_index("program")

        @pl.loop(0, steps)
        def _write(step):
            target = lax.rem(program * 7 + step, targets)
            plgpu.copy_smem_to_gmem(tile, out_ref.at[pl.ds(target * ROWS, ROWS)],
                                    reduction_op=reduction)
            plgpu.wait_smem_to_gmem(in_flight, wait_read_only=True)

        plgpu.wait_smem_to_gmem(0)

    kernel = plgpu.kernel(
        body, out_type=jax.ShapeDtypeStruct((targets * ROWS, ROWS), jnp.float32),
        scratch_types=[plgpu.SMEM((ROWS, ROWS), jnp.float32)], grid=(_PROGRAMS.value,),
        grid_names=("program",),
        compiler_params=plgpu.CompilerParams(
            lowering_semantics=plgpu.LoweringSemantics.Warpgroup))
    return jax.jit(kernel)


def transposed_product(width: int):
    """fn(a [64, 64], b [64, width]) -> a^T @ b (float32), A read transposed from shared
    memory, bf16 operands."""
    import jax
    import jax.numpy as jnp
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu

    from sympow.attention.mosaic_gpu.blocks import swizzled

    def body(a_ref, b_ref, out_ref, a_smem, b_smem, out_smem, bars):
        plgpu.copy_gmem_to_smem(a_ref, a_smem, bars.at[0])
        plgpu.copy_gmem_to_smem(b_ref, b_smem, bars.at[1])
        plgpu.barrier_wait(bars.at[0])
        plgpu.barrier_wait(bars.at[1])

        def product(acc_ref):
            plgpu.wgmma(acc_ref, a_smem.transpose((1, 0)), b_smem)
            return acc_ref[...]

        out_smem[...] = pl.run_scoped(product, plgpu.ACC((ROWS, width), jnp.float32))
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(out_smem, out_ref)
        plgpu.wait_smem_to_gmem(0)

    kernel = plgpu.kernel(
        body, out_type=jax.ShapeDtypeStruct((ROWS, width), jnp.float32),
        scratch_types=[swizzled((ROWS, ROWS), jnp.bfloat16),
                       swizzled((ROWS, width), jnp.bfloat16),
                       swizzled((ROWS, width), jnp.float32),
                       plgpu.Barrier(num_barriers=2)],
        compiler_params=plgpu.CompilerParams(
            lowering_semantics=plgpu.LoweringSemantics.Warpgroup))
    return jax.jit(kernel)


def probe_traffic() -> list[dict]:
    rows = []
    for targets in map(int, _TARGETS.value):
        for reduction in ("add", None):
            row = dict(probe="traffic", targets=targets, target_mib=targets * 16 / 1024,
                       reduction=reduction or "store", programs=_PROGRAMS.value,
                       steps=_STEPS.value, in_flight=_IN_FLIGHT.value)

            def measure(targets=targets, reduction=reduction):
                ms = timed(traffic_kernel(targets, reduction), reps=_REPS.value)
                gib = _PROGRAMS.value * _STEPS.value * ROWS * ROWS * 4 / 2**30
                return dict(ms=ms, written_gib=gib, gb_per_s=gib * 2**30 / (ms * 1e-3) / 1e9)

            rows.append(attempt(row, measure))
    return rows


def probe_transposed() -> list[dict]:
    import jax
    import jax.numpy as jnp

    rows = []
    keys = jax.random.split(jax.random.key(0), 2)
    for width in (ROWS, 16):
        a = jax.random.normal(keys[0], (ROWS, ROWS), jnp.bfloat16)
        b = jax.random.normal(keys[1], (ROWS, width), jnp.bfloat16)
        want = jnp.dot(a.T.astype(jnp.float32), b.astype(jnp.float32))
        rows.append(attempt(dict(probe="transposed_a", width=width),
                            lambda a=a, b=b, width=width, want=want: against(
                                transposed_product(width)(a, b), want)))
    return rows


def main(argv):
    del argv
    hopper_main("probe_tma_reduce", _OUT.value, probe_transposed, probe_traffic)


if __name__ == "__main__":
    app.run(main)
