"""What a p = 2 state in symmetric 16 x 16 blocks would rest on (docs/kernels.md, "Next
steps", 2026-11-27), measured before it is built:

1. a packed rows_to_state tile: the A operand x^T [64 j, 64 r] scaled by one row of col in
   its first `split` rows and by another in the rest (two feature rows i of the triangle
   in one M = 64 tile: 48 + 16 or 32 + 32 rows of j), as a select on the row index in the
   wgmma register layout, against jnp;
2. a K-sliced state_to_rows product: (x[:, k0:] scaled by col per row) @ S_i[k0:] with
   K = 64 - k0 in {48, 32, 16}, against jnp. Mosaic GPU takes K in multiples of the
   shared-memory swizzle's width (64 columns at 128 bytes, 32 at 64, 16 at 32: lowered on
   a CPU, 2026-11-27), so these run with 32-byte swizzled tiles;
3. the rate of state_to_rows-like products over all 64 feature rows i of a state: the
   square layout (K = 64 for every i) with 128- and 32-byte swizzles, and the blocks
   (K = 64, 48, 32, 16 for 16 i's each: 62.5 % of the work) with 32-byte swizzles. The
   blocks pay if their time is near 62.5 % of the square layout's at 128 bytes.

  PYTHONPATH=. python3 experiments/probe_symmetric_blocks.py --out=$OUT

Prints one JSON row per check or measurement and writes probe_symmetric_blocks.json under
--out. Needs a Hopper GPU (Mosaic GPU kernels); on anything else it exits with the reason.
"""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from absl import app, flags  # noqa: E402
from probes import against, attempt, hopper_main  # noqa: E402  (beside this script)
from timing import timed_interleaved  # noqa: E402  (experiments/timing.py, beside this script)

_OUT = flags.DEFINE_string("out", None, "directory for probe_symmetric_blocks.json")
_PROGRAMS = flags.DEFINE_integer("programs", 264, "programs of the rate kernel (2 per SM)")
_STEPS = flags.DEFINE_integer("steps", 256, "passes over the 64 feature rows per program")
_REPS = flags.DEFINE_integer("reps", 10, "timed calls per measurement (median)")

ROWS = 64  # rows of a block, the wgmma's M, and d
BLOCK = 16  # the symmetric layout's block of i and of j
LAYOUTS = {"square": (0, 0, 0, 0), "blocks": (0, 16, 32, 48)}  # K's start for i // 16


def _one_program(body, scratch, out_width: int = ROWS):
    """A one-warpgroup kernel: fn(*args) -> float32 [64, out_width] through `body`."""
    import jax
    import jax.numpy as jnp
    from jax.experimental.pallas import mosaic_gpu as plgpu

    return jax.jit(plgpu.kernel(
        body, out_type=jax.ShapeDtypeStruct((ROWS, out_width), jnp.float32),
        scratch_types=scratch,
        compiler_params=plgpu.CompilerParams(
            lowering_semantics=plgpu.LoweringSemantics.Warpgroup)))


def _copy_in(pairs, bars) -> None:
    """Each (GMEM ref, SMEM ref) pair copied in, one barrier each, all waited for."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    for t, (src, dst) in enumerate(pairs):
        plgpu.copy_gmem_to_smem(src, dst, bars.at[t])
    for t in range(len(pairs)):
        plgpu.barrier_wait(bars.at[t])


def _product_to(out_ref, out_smem, operand, b_smem) -> None:
    """out_ref = operand @ b_smem in float32, through shared memory."""
    import jax.numpy as jnp
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu

    def product(acc_ref):
        plgpu.wgmma(acc_ref, operand, b_smem)
        plgpu.wgmma_wait(0)
        return acc_ref[...]

    out_smem[...] = pl.run_scoped(product, plgpu.ACC((ROWS, ROWS), jnp.float32))
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(out_smem, out_ref)
    plgpu.wait_smem_to_gmem(0)


def packed_product(split: int):
    """fn(xt [64, 64], col [2, 64], a [64, 64]) -> float32 (xt * scale) @ a, scale[m, r] =
    col[0, r] for rows m < split, col[1, r] below; bf16 operands, the scaled one rounded
    to bf16 as the wgmma takes it."""
    import jax.numpy as jnp
    from jax.experimental.pallas import mosaic_gpu as plgpu

    from sympow.attention.mosaic_gpu.blocks import (
        COL_VECTOR,
        WGMMA,
        by_cols,
        indices,
        load,
        swizzled,
    )

    bf16 = jnp.bfloat16

    def body(xt_ref, col_ref, a_ref, out_ref, xt_smem, col_smem, a_smem, out_smem, bars):
        _copy_in(((xt_ref, xt_smem), (col_ref, col_smem), (a_ref, a_smem)), bars)
        xt = load(xt_smem, WGMMA)
        first, rest = (load(col_smem.at[t], COL_VECTOR).astype(bf16)
                       for t in range(2))
        rows, _ = indices()
        operand = xt * jnp.where(rows < split, by_cols(first), by_cols(rest))
        _product_to(out_ref, out_smem, operand, a_smem)

    return _one_program(body, [swizzled((ROWS, ROWS), bf16), plgpu.SMEM((2, ROWS), bf16),
                               swizzled((ROWS, ROWS), bf16),
                               swizzled((ROWS, ROWS), jnp.float32),
                               plgpu.Barrier(num_barriers=3)])


def sliced_product(start: int, swizzle: int = 32):
    """fn(x [64, 64], col [64], s [64, 64]) -> float32 (x[:, start:] * col[:, None]) @
    s[start:], the K range sliced in registers (x) and in shared memory (s)."""
    import jax.numpy as jnp
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu

    from sympow.attention.mosaic_gpu.blocks import ROW_VECTOR, WGMMA, by_rows, load, swizzled

    bf16, k = jnp.bfloat16, ROWS - start

    def body(x_ref, col_ref, s_ref, out_ref, x_smem, col_smem, s_smem, out_smem, bars):
        _copy_in(((x_ref, x_smem), (col_ref, col_smem), (s_ref, s_smem)), bars)
        col = load(col_smem, ROW_VECTOR).astype(bf16)
        x = load(x_smem, WGMMA)[:, start:]
        _product_to(out_ref, out_smem, x * by_rows(col, (ROWS, k)),
                    s_smem.at[pl.ds(start, k)])

    tile = swizzled((ROWS, ROWS), bf16, swizzle)
    return _one_program(body, [tile, plgpu.SMEM((ROWS,), bf16), tile,
                               swizzled((ROWS, ROWS), jnp.float32),
                               plgpu.Barrier(num_barriers=3)])


def rate_kernel(layout: str, swizzle: int):
    """fn(x [64, 64], col [64, 64], s [64, 64]) -> float32 [programs * 64, 64]: each program
    runs `steps` passes of acc += (x[:, k0:] * col_i per row) @ s[k0:] over the 64 feature
    rows i, k0 = LAYOUTS[layout][i // 16] (one s tile stands in for every S_i: the rate of
    the products and their operands, not of streaming the state), two products in flight
    a wait as the state kernels issue them."""
    import jax
    import jax.numpy as jnp
    from jax import lax
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu

    from sympow.attention.mosaic_gpu.blocks import ROW_VECTOR, WGMMA, by_rows, load, swizzled

    bf16, starts = jnp.bfloat16, LAYOUTS[layout]
    tile = swizzled((ROWS, ROWS), bf16, swizzle)

    def body(x_ref, col_ref, s_ref, out_ref, x_smem, col_smem, s_smem, out_smem, bars):
        _copy_in(((x_ref, x_smem), (col_ref, col_smem), (s_ref, s_smem)), bars)
        x = load(x_smem, WGMMA)

        def passes(acc_ref):
            @pl.loop(0, _STEPS.value)
            def _pass(step):
                del step
                for group, start in enumerate(starts):
                    @pl.loop(0, BLOCK // 2)
                    def _pair(pair, group=group, start=start):
                        i = group * BLOCK + 2 * pair
                        operands = [x[:, start:] * by_rows(load(
                            col_smem.at[i + t], ROW_VECTOR).astype(bf16),
                            (ROWS, ROWS - start)) for t in range(2)]
                        for operand in operands:
                            plgpu.wgmma(acc_ref, operand, s_smem.at[pl.ds(start,
                                                                          ROWS - start)])
                        plgpu.wgmma_wait(0)

            return acc_ref[...]

        out_smem[...] = pl.run_scoped(passes, plgpu.ACC((ROWS, ROWS), jnp.float32))
        plgpu.commit_smem()
        program = lax.axis_index("program")
        plgpu.copy_smem_to_gmem(out_smem, out_ref.at[pl.ds(program * ROWS, ROWS)])
        plgpu.wait_smem_to_gmem(0)

    return jax.jit(plgpu.kernel(
        body, out_type=jax.ShapeDtypeStruct((_PROGRAMS.value * ROWS, ROWS), jnp.float32),
        scratch_types=[tile, plgpu.SMEM((ROWS, ROWS), bf16), tile,
                       swizzled((ROWS, ROWS), jnp.float32), plgpu.Barrier(num_barriers=3)],
        grid=(_PROGRAMS.value,), grid_names=("program",),
        compiler_params=plgpu.CompilerParams(
            lowering_semantics=plgpu.LoweringSemantics.Warpgroup)))


def executed_flop(layout: str) -> float:
    """FLOP of one rate_kernel call: 2 M N K a product, summed over the feature rows."""
    k_total = sum(BLOCK * (ROWS - start) for start in LAYOUTS[layout])
    return 2.0 * ROWS * ROWS * k_total * _STEPS.value * _PROGRAMS.value


def _inputs(*shapes):
    import jax
    import jax.numpy as jnp

    keys = jax.random.split(jax.random.key(0), len(shapes))
    return [jax.random.normal(key, shape, jnp.bfloat16)
            for key, shape in zip(keys, shapes, strict=True)]


def probe_products() -> list[dict]:
    """Rows of the packed and sliced products against jnp."""
    import jax.numpy as jnp

    f32, bf16 = jnp.float32, jnp.bfloat16
    rows = []
    for split in (48, 32):
        row = dict(probe="packed_tile", split=split)
        xt, col, a = _inputs((ROWS, ROWS), (2, ROWS), (ROWS, ROWS))
        scale = jnp.where(jnp.arange(ROWS)[:, None] < split, col[0], col[1])
        want = jnp.dot((xt * scale).astype(bf16).astype(f32), a.astype(f32))
        rows.append(attempt(row, lambda xt=xt, col=col, a=a, split=split, want=want:
                            against(packed_product(split)(xt, col, a), want)))
    for start in (16, 32, 48):
        row = dict(probe="sliced_k", start=start, k=ROWS - start, swizzle=32)
        x, col, s = _inputs((ROWS, ROWS), (ROWS,), (ROWS, ROWS))
        operand = (x[:, start:] * col[:, None]).astype(bf16).astype(f32)
        want = jnp.dot(operand, s[start:].astype(f32))
        rows.append(attempt(row, lambda x=x, col=col, s=s, start=start, want=want:
                            against(sliced_product(start)(x, col, s), want)))
    return rows


def probe_rates() -> list[dict]:
    """Rows of rate_kernel's time and executed TFLOP/s per (layout, swizzle), the kernels
    that compile timed in turns (the same clocks for all)."""
    import jax

    args = _inputs((ROWS, ROWS), (ROWS, ROWS), (ROWS, ROWS))
    rows, calls = [], []
    for layout, swizzle in (("square", 128), ("square", 32), ("blocks", 32)):
        row = dict(probe="rate", layout=layout, swizzle=swizzle, programs=_PROGRAMS.value,
                   steps=_STEPS.value)
        try:
            fn = rate_kernel(layout, swizzle)
            jax.block_until_ready(fn(*args))  # compiles, or says why not
            calls.append((row, fn))
        except Exception as error:  # noqa: BLE001  (record what failed, go on)
            row.update(error=f"{type(error).__name__}: {str(error)[:300]}")
        rows.append(row)
    times = timed_interleaved([(fn, args) for _, fn in calls], reps=_REPS.value)
    for (row, _), ms in zip(calls, times, strict=True):
        row.update(ms=ms, tflop_per_s=executed_flop(row["layout"]) / (ms * 1e-3) / 1e12)
    square = next((row["ms"] for row in rows
                   if (row["layout"], row["swizzle"]) == ("square", 128) and "ms" in row), None)
    for row in rows:
        if square and "ms" in row:
            row["time_vs_square_128"] = row["ms"] / square
        print(json.dumps(row), flush=True)
    return rows


def main(argv):
    del argv
    hopper_main("probe_symmetric_blocks", _OUT.value, probe_products, probe_rates)


if __name__ == "__main__":
    app.run(main)
