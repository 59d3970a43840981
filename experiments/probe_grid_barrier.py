"""What a persistent decoding kernel would rest on (docs/kernels.md, "L2 warmed ahead of the
one-row products, tried", Next steps), measured before it is built:

1. a grid-wide barrier from Mosaic GPU's global semaphores, every program resident (one a
   SM): its time from kernels of 1 and --barriers barriers (the slope);
2. weights streamed behind barriers: --layers layers, each program asking for its slice of
   a layer's weights (TMA into one of two shared-memory slots) before the layer's barrier
   and waiting for it after, GPT-2 small's 14 MB a layer; against the same loads with no
   barrier, and the barriers alone. If a layer's time is near its bytes' time, a decoding
   step that computes its products between such barriers has ~9 us a layer of memory
   under it (weights and state) instead of today's ~31 us of kernels;
3. the product such a kernel would compute between its barriers, one row on the CUDA cores
   in Mosaic GPU (`one_row_product`), against the fused step's Triton kernel and jnp.

Two barriers (--styles), their signals releases and their waits acquires at GPU scope:
- `release_each`: every program signals an arrival semaphore; program 0 waits for all of
  them (taking them away again) and signals each program's own release semaphore, on which
  each program waits (taking it away). H100, 2026-11-28: ~49 us a barrier at 132 programs,
  program 0's 132 release signals one after another (each a fence) and its
  compare-and-swap wait against 132 arrivals;
- `counter`: every program adds one to an arrival counter and waits (plain loads, no
  compare-and-swap) until it reaches programs x (barriers so far): one release a program,
  none serialized. After its last barrier each program signals a leaving semaphore;
  program 0 waits for all of them and takes the counter back to zero (nobody reads it
  after leaving), ready for the next call. H100, 2026-11-28: 0.92 us a barrier at 132
  programs, 0.8 at 66 (docs/benchmarks.md).

  PYTHONPATH=. python3 experiments/probe_grid_barrier.py --out=$OUT

Prints one JSON row per measurement and writes probe_grid_barrier.json under --out. Needs a
Hopper GPU; refuses more programs than the GPU has SMs (they would not all be resident and
the first barrier would never open).
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from absl import app, flags  # noqa: E402
from probes import against, attempt, hopper_main  # noqa: E402  (beside this script)
from timing import gpu_us  # noqa: E402  (experiments/timing.py, beside this script)

_OUT = flags.DEFINE_string("out", None, "directory for probe_grid_barrier.json")
_PROGRAMS = flags.DEFINE_integer("programs", 0, "programs (0: one per SM of the GPU)")
_BARRIERS = flags.DEFINE_integer("barriers", 64, "barriers of the long barrier-only kernel")
_LAYERS = flags.DEFINE_integer("layers", 12, "layers of the streaming kernels")
_ROWS = flags.DEFINE_integer("rows", 208, "rows of 256 bf16 a program loads a layer "
                             "(208 x 512 B x 132 programs = 14.1 MB)")
_REPS = flags.DEFINE_integer("reps", 10, "traced calls per measurement")
_STYLES = flags.DEFINE_list("styles", ["counter", "release_each"], "barriers to time")

STYLES = ("counter", "release_each")

WIDTH = 256  # a TMA box's widest dimension


def probe_kernel(programs: int, layers: int, rows: int, *, barrier: bool, stream: bool,
                 style: str = "counter"):
    """fn(weights [layers, programs, rows, WIDTH] bf16) -> an int32 token (never written):
    `layers` rounds of (ask for this program's slice of the layer, barrier, wait for the
    slice), with the barrier or the loads left out as asked; `style` one of STYLES."""
    if style not in STYLES:
        raise ValueError(f"style must be one of {STYLES}; got {style!r}")
    import jax
    import jax.numpy as jnp
    from jax import lax
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu

    def counter_barrier(arrive, index):
        plgpu.semaphore_signal(arrive, 1, memory_scope="gpu")
        plgpu.semaphore_wait(arrive, programs * (index + 1), decrement=False,
                             memory_scope="gpu")

    def counter_reset(program, arrive, leave):
        plgpu.semaphore_signal(leave, 1, memory_scope="gpu")

        @pl.when(program == 0)
        def _reset():
            plgpu.semaphore_wait(leave, programs, decrement=True, memory_scope="gpu")
            # every program has passed its last wait: the counter goes back to zero
            plgpu.semaphore_signal(arrive, -programs * layers, memory_scope="gpu")

    def release_each_barrier(program, arrive, release):
        plgpu.semaphore_signal(arrive, 1, memory_scope="gpu")

        @pl.when(program == 0)
        def _open():
            plgpu.semaphore_wait(arrive, programs, decrement=True, memory_scope="gpu")

            @pl.loop(0, programs)
            def _(other):
                plgpu.semaphore_signal(release.at[other], 1, memory_scope="gpu")

        plgpu.semaphore_wait(release.at[program], 1, decrement=True, memory_scope="gpu")

    def body(weights_ref, token_ref, slots, loaded):
        del token_ref  # the output only keeps the kernel (returned from the jit)
        program = lax.axis_index("program")
        arrive = pl.get_global(plgpu.SemaphoreType.REGULAR(()))
        release = pl.get_global(plgpu.SemaphoreType.REGULAR((programs,)))
        leave = pl.get_global(plgpu.SemaphoreType.REGULAR(()))
        for layer in range(layers):
            slot = layer % 2
            if stream:
                plgpu.copy_gmem_to_smem(weights_ref.at[layer, program], slots.at[slot],
                                        loaded.at[slot])
            if barrier and style == "counter":
                counter_barrier(arrive, layer)
            elif barrier:
                release_each_barrier(program, arrive, release)
            if stream:
                plgpu.barrier_wait(loaded.at[slot])
        if barrier and style == "counter":
            counter_reset(program, arrive, leave)

    kernel = plgpu.kernel(
        body, out_type=jax.ShapeDtypeStruct((programs, 128), jnp.int32),
        scratch_types=[plgpu.SMEM((2, rows, WIDTH), jnp.bfloat16),
                       plgpu.Barrier(num_barriers=2)],
        grid=(programs,), grid_names=("program",))
    return jax.jit(kernel)


def one_row_product(k: int, n: int):
    """fn(x [1, K] float32, wt [N, K] bf16) -> x @ wt^T, float32 [N]: a Mosaic GPU kernel of
    N / 64 programs, each streaming its 64 rows of wt (one TMA copy a [64, 64] block, all
    issued first) and summing them against x on the CUDA cores (wgmma-layout tiles times x
    broadcast along the rows, a row sum at the end): the product a persistent kernel would
    compute between its barriers. K a multiple of 64 whose [64, K] block fits shared
    memory (K <= 1536); N a multiple of 64."""
    import jax
    import jax.numpy as jnp
    from jax import lax
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu

    from sympow.attention.mosaic_gpu.blocks import (
        COL_VECTOR,
        ROWS,
        by_cols,
        load,
        swizzled,
        zeros,
    )

    if k % ROWS or n % ROWS or k > 1536:
        raise ValueError(f"K and N must be multiples of {ROWS}, K <= 1536; got K = {k}, "
                         f"N = {n}")
    blocks = k // ROWS

    def body(x_ref, wt_ref, out_ref, w_smem, x_smem, y_smem, loaded):
        program = lax.axis_index("program")
        rows = pl.ds(program * ROWS, ROWS)
        for c in range(blocks):
            plgpu.copy_gmem_to_smem(wt_ref.at[rows, pl.ds(c * ROWS, ROWS)], w_smem.at[c],
                                    loaded.at[c])
        plgpu.copy_gmem_to_smem(x_ref, x_smem, loaded.at[blocks])
        plgpu.barrier_wait(loaded.at[blocks])
        acc = zeros((ROWS, ROWS))
        for c in range(blocks):
            plgpu.barrier_wait(loaded.at[c])
            x = load(x_smem.at[c], COL_VECTOR)
            acc = acc + w_smem.at[c][...].astype(jnp.float32) * by_cols(x)
        y_smem[...] = acc.sum(axis=1)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(y_smem, out_ref.at[rows])
        plgpu.wait_smem_to_gmem(0)

    kernel = plgpu.kernel(
        body, out_type=jax.ShapeDtypeStruct((n,), jnp.float32),
        scratch_types=[swizzled((blocks, ROWS, ROWS), jnp.bfloat16),
                       plgpu.SMEM((blocks, ROWS), jnp.float32),
                       plgpu.SMEM((ROWS,), jnp.float32),
                       plgpu.Barrier(num_barriers=blocks + 1)],
        grid=(n // ROWS,), grid_names=("program",),
        compiler_params=plgpu.CompilerParams(
            lowering_semantics=plgpu.LoweringSemantics.Warpgroup))
    # x as [K / 64, 64]: a TMA box is at most 256 elements a dimension
    return jax.jit(lambda x, wt: kernel(x.reshape(blocks, ROWS), wt))


def resident_programs() -> int:
    """--programs, or the GPU's SM count; refuses more programs than SMs."""
    import jax

    sms = getattr(jax.devices()[0], "core_count", None)
    programs = _PROGRAMS.value or sms
    if not programs or (sms and programs > sms):
        raise SystemExit(f"--programs={_PROGRAMS.value}: need 1..{sms} (one program a SM, all "
                         f"resident, or the first barrier never opens)")
    return programs


def styles() -> list[str]:
    """--styles, each checked against STYLES."""
    unknown = sorted(set(_STYLES.value) - set(STYLES))
    if unknown:
        raise SystemExit(f"--styles: unknown {unknown}; choose from {STYLES}")
    return list(_STYLES.value)


def probe_barriers() -> list[dict]:
    import jax.numpy as jnp

    programs, rows = resident_programs(), []
    none = jnp.zeros((1, programs, 1, WIDTH), jnp.bfloat16)  # not read: no loads
    for style in styles():
        times = {}
        for count in (1, _BARRIERS.value):
            row = dict(probe="barriers", style=style, programs=programs, barriers=count)

            def measure(count=count, style=style, times=times):
                us = gpu_us(probe_kernel(programs, count, 1, barrier=True, stream=False,
                                         style=style), none, reps=_REPS.value)
                times[count] = us
                return dict(kernel_us=us)

            rows.append(attempt(row, measure))
        if len(times) == 2:
            rows.append(attempt(
                dict(probe="barrier_slope", style=style, programs=programs),
                lambda times=times: dict(us_per_barrier=(times[_BARRIERS.value] - times[1])
                                         / (_BARRIERS.value - 1))))
    return rows


def probe_streaming() -> list[dict]:
    import jax
    import jax.numpy as jnp

    programs, layers, width_rows = resident_programs(), _LAYERS.value, _ROWS.value
    weights = jax.random.normal(jax.random.key(0), (layers, programs, width_rows, WIDTH),
                                jnp.bfloat16)
    layer_mb = programs * width_rows * WIDTH * 2 / 1e6
    cases = [(True, True, style) for style in styles()]
    cases += [(False, True, None)] + [(True, False, style) for style in styles()]
    rows = []
    for barrier, stream, style in cases:
        row = dict(probe="streaming", programs=programs, layers=layers, layer_mb=layer_mb,
                   barrier=barrier, stream=stream, style=style)

        def measure(barrier=barrier, stream=stream, style=style):
            us = gpu_us(probe_kernel(programs, layers, width_rows, barrier=barrier,
                                     stream=stream, style=style or "counter"), weights,
                        reps=_REPS.value)
            return dict(kernel_us=us, us_per_layer=us / layers,
                        tb_per_s=layer_mb * layers / us if stream else None)  # MB/us

        rows.append(attempt(row, measure))
    return rows


def probe_products() -> list[dict]:
    """The one-row product in Mosaic GPU against the fused step's Triton kernel
    (`decode_linear.linear`, its launch shape for one row) at GPT-2 small's 768 -> 768 and
    768 -> 3072, both with their weights in L2 (the same weights each call), and its values
    against jnp's product in float32 (x rounded to bf16 as the Triton kernel does)."""
    import jax
    import jax.numpy as jnp

    from sympow.layers.decode_linear import linear

    rows = []
    for k, n in ((768, 768), (768, 3072)):
        keys = jax.random.split(jax.random.key(k + n), 2)
        x = jax.random.normal(keys[0], (1, k)).astype(jnp.bfloat16)
        wt = (jax.random.normal(keys[1], (n, k)) * k ** -0.5).astype(jnp.bfloat16)
        want = jnp.dot(x.astype(jnp.float32), wt.astype(jnp.float32).T,
                       precision=jax.lax.Precision.HIGHEST)[0]

        def measure(k=k, n=n, x=x, wt=wt, want=want):
            mosaic = one_row_product(k, n)
            triton = jax.jit(lambda x, wt: linear(x, wt, out_dtype=jnp.float32))
            row = against(mosaic(x.astype(jnp.float32), wt), want)
            row.update(mosaic_us=gpu_us(mosaic, x.astype(jnp.float32), wt, reps=_REPS.value),
                       triton_us=gpu_us(triton, x, wt, reps=_REPS.value),
                       weight_mb=n * k * 2 / 1e6)
            return row

        rows.append(attempt(dict(probe="one_row_product", k=k, n=n), measure))
    return rows


def main(argv):
    del argv
    hopper_main("probe_grid_barrier", _OUT.value, probe_products, probe_barriers,
                probe_streaming)


if __name__ == "__main__":
    app.run(main)
