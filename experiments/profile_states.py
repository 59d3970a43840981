"""Times each Hopper state kernel at the breakdown's size, alone or under a profiler.

  PYTHONPATH=. python3 experiments/profile_states.py               # kernel medians
  PYTHONPATH=. python3 experiments/profile_states.py --primitives  # with the XLA glue

Each kernel's time is its duration in a jax.profiler trace (the GPU's own), beside the
median wall time of a call, which also holds the host's dispatch and wait (0.2-0.35 ms a
call on an H200 on 2026-11-27: a wall time alone understates the kernels' rate by a third).
With --peak (the default) the same process then times XLA's bf16 matmul
(`timing.matmul_rate`) and gives each kernel's useful rate, over the symmetric state's
d (d + 1) / 2 distinct features, as a share of the matmul's kernel-time rate: issue 13's
measure of a state kernel (>= 45 %).
Under ncu (docs/kernels.md, Next steps) the first two kernels profiled on 2026-11-27 and
row_gradients did not (ncu stopped at it).

One launch of each of rows_to_state, state_to_rows and row_gradients (the transposed
product as the backward runs it), and of the last two with the normalizer's quadratic form
(`_z`, as the tier runs them), per repetition (bf16, col in the tier's
`states.COLUMNS_DTYPE`, T = --t, H = --heads, chunk --chunk, d = e = 64), with median timings;
with --primitives, the tier's update_state and query_state, forward and backward, as
jitted programs (their XLA glue included), for a per-kernel summary of each.

Variants: --options=stages=2,stages=4,chunks_per_program=2 times each kernel at its
defaults and under each entry whose keywords it takes (`stages`: its ring's depth;
`chunks_per_program`: the chunks a program takes in turn; with the normalizer,
state_to_rows and row_gradients refuse more than one, named; `upper=1`: state_to_rows over
the upper blocks of the symmetric state, `upper=1;packed=1` with its short blocks packed;
`pipelined=1` / `pipelined=0`: a step's products in two halves or whole),
all in turns in one process
(`timed_interleaved`: their ratios free of the machine's drift), to tell whether a kernel
waits on its copies or on its fixed cost a program. Each variant's output is compared with
the default's on the same inputs (the same sums: 0 expected; `upper` sums the other half
of the symmetric states and columns drawn here: a rounding's difference); one that does not
run (a ring deeper than shared memory holds) is named with its error and left out:

  PYTHONPATH=. python3 experiments/profile_states.py --reps=30 \
      --options="chunks_per_program=1,chunks_per_program=2,chunks_per_program=4"

--lower only lowers each variant for CUDA and names it (no GPU needed: what a CPU test
runs before a GPU call is spent on it).
"""

import functools
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from absl import app, flags  # noqa: E402
from timing import (  # noqa: E402  (experiments/timing.py, beside this script)
    kernel_times_interleaved,
    matmul_rate,
    timed,
    timed_interleaved,
)

_T = flags.DEFINE_integer("t", 65536, "tokens")
_HEADS = flags.DEFINE_integer("heads", 8, "heads")
_CHUNK = flags.DEFINE_integer("chunk", 512, "chunk")
_REPS = flags.DEFINE_integer("reps", 5, "timed launches of each kernel")
_PRIMITIVES = flags.DEFINE_bool("primitives", False, "run the tier's state primitives, "
                                "forward and backward, instead of the bare kernels")
_OPTIONS = flags.DEFINE_list(
    "options", [""], "kernel keyword overrides, each 'name=N;...' (e.g. stages=4, "
    "chunks_per_program=2); each kernel runs its default and every entry it takes")
_LOWER = flags.DEFINE_bool("lower", False, "only lower each kernel variant for CUDA")
_PEAK = flags.DEFINE_bool("peak", True, "also time XLA's bf16 matmul (timing.matmul_rate) "
                          "and give each kernel's useful rate as a share of it")


def primitives(reps: int) -> None:
    """update_state and query_state of the Hopper tier, forward + backward, `reps` times."""
    import jax
    import jax.numpy as jnp

    from sympow.attention.mosaic_gpu import states

    d = e = 64
    n, c, h = _T.value // _CHUNK.value, _CHUNK.value, _HEADS.value
    keys = jax.random.split(jax.random.PRNGKey(0), 4)
    k = jax.random.normal(keys[0], (1, h, n, c, d), jnp.bfloat16) / 8
    v = jax.random.normal(keys[1], (1, h, n, c, e), jnp.bfloat16)
    a = jax.nn.log_sigmoid(3.0 + jax.random.normal(keys[2], (1, h, n, c)))
    g = jnp.cumsum(a, axis=-1)
    s, z = jax.jit(states.update_state)(k, v, g - g[..., -1:])
    o = jax.random.normal(keys[3], (1, h, n, c, e), jnp.float32)
    den, m = jnp.ones((1, h, n, c)), jnp.zeros((1, h, n, c))

    def both(fn, *args):
        out, vjp = jax.vjp(fn, *args)
        return out, vjp(jax.tree.map(jnp.ones_like, out))

    runs = {"update_state": (jax.jit(lambda *x: both(states.update_state, *x)),
                             (k, v, g - g[..., -1:])),
            "query_state": (jax.jit(lambda *x: both(states.query_state, *x)),
                            (k, s, z, g, o, den, m))}
    for name, (fn, args) in runs.items():
        ms = timed(fn, *args, reps=reps, warmup=1)
        print(f"{name:16s} fwd+bwd {ms:7.3f} ms (median of {reps})", flush=True)


def parse_options(options: list[str]) -> list[dict[str, int]]:
    """--options entries as keyword dicts: 'stages=4;chunks_per_program=2' -> {'stages': 4,
    'chunks_per_program': 2}, '' -> {} (the defaults); values positive integers."""
    parsed = []
    for entry in options:
        pairs = [item.split("=") for item in entry.split(";") if item]
        if any(len(pair) != 2 or not pair[0].isidentifier() or not pair[1].isdigit()
               or int(pair[1]) < 1 for pair in pairs):
            raise ValueError(f"--options: entries are 'name=N;...' with N a positive integer, "
                             f"or ''; got {entry!r}")
        parsed.append({name: int(value) for name, value in pairs})
    return parsed


def kernel_variants(options: list[str]):
    """[(kernel, name, jitted fn, argument (shape, dtype)s, tie)]: each bare kernel once
    per --options entry whose keywords it takes (name: kernel@name=N;...), its default
    first; tie: the indices of its rows and its col among the arguments (`arguments`)."""
    import inspect

    import jax
    import jax.numpy as jnp

    from sympow.attention.mosaic_gpu import state_kernels as sk
    from sympow.attention.mosaic_gpu import state_sums as ss
    from sympow.attention.mosaic_gpu import states

    d = e = sk.DIM
    n, c, h = _T.value // _CHUNK.value, _CHUNK.value, _HEADS.value
    bf16, col = jnp.bfloat16, jnp.dtype(states.COLUMNS_DTYPE)
    x, a, xt = ((1, h, n, c, d), bf16), ((1, h, n, c, e), bf16), ((1, h, n, d, c), bf16)
    s, cols = ((1, h, n, d * d, e), bf16), ((1, h, n, d, c), col)
    parts, weights = ((1, h, n, 3 * d, d), bf16), ((1, h, n, c), jnp.float32)
    kernels = {  # name: (kernel, fn(*args, **options), argument specs, (rows, col) indices)
        "rows_to_state": (ss.rows_to_state, lambda *z, **kw: ss.rows_to_state(
            *z, kv_heads=h, **kw), (xt, cols, a), (0, 1)),
        "state_to_rows": (sk.state_to_rows, lambda *z, **kw: sk.state_to_rows(
            *z, transposed=False, **kw), (x, cols, s), (0, 1)),
        "row_gradients": (sk.row_gradients, sk.row_gradients, (a, x, cols, s), (1, 2)),
        # with the normalizer's quadratic form, as the tier runs them
        "state_to_rows_z": (sk.state_to_rows, lambda *z, **kw: sk.state_to_rows(
            *z[:3], transposed=False, normalizer=sk.Normalizer(*z[3:]), **kw),
            (x, cols, s, parts, weights), (0, 1)),
        "row_gradients_z": (sk.row_gradients, lambda *z, **kw: sk.row_gradients(
            *z[:4], normalizer=sk.Normalizer(*z[4:]), **kw), (a, x, cols, s, parts, weights),
            (1, 2)),
    }
    parsed = parse_options(options)
    bound = {"kv_heads", "transposed", "normalizer"}  # set by the calls above

    def takes(kernel) -> set[str]:
        return {name for name, parameter in inspect.signature(kernel).parameters.items()
                if parameter.kind == inspect.Parameter.KEYWORD_ONLY} - bound

    unused = [kw for kw in parsed if kw and not any(set(kw) <= takes(k) for k, *_ in
                                                    kernels.values())]
    if unused:
        raise ValueError(f"--options: no kernel takes {unused} (keywords of rows_to_state, "
                         f"state_to_rows or row_gradients other than {sorted(bound)})")
    variants = []
    for name, (kernel, fn, shapes, tie) in kernels.items():
        for kw in [{}] + [kw for kw in parsed if kw and set(kw) <= takes(kernel)]:
            suffix = ";".join(f"{key}={value}" for key, value in kw.items())
            variants.append((name, f"{name}@{suffix}" if kw else name,
                             jax.jit(functools.partial(fn, **kw)), shapes, tie))
    return variants


def arguments(shapes, key, tie):
    """Random arrays of (shape, dtype) pairs: standard normals / 8 (the tier's keys' scale)
    in each dtype, but with the tier's symmetries, which state_to_rows' `upper` rests on: a
    state [..., D^2, E] symmetric in its (i, j), and col the rows x^T (at ls = 0) for tie =
    (index of x or x^T, index of col)."""
    import jax
    import jax.numpy as jnp

    from sympow.attention.mosaic_gpu.state_kernels import DIM

    def draw(k, shape, dtype):
        x = jax.random.normal(k, shape, jnp.float32) / 8
        if len(shape) > 1 and shape[-2] == DIM ** 2:
            square = x.reshape(*shape[:-2], DIM, DIM, shape[-1])
            x = (0.5 * (square + jnp.swapaxes(square, -2, -3))).reshape(shape)
        return x.astype(dtype)

    keys = jax.random.split(key, len(shapes))
    args = [draw(k, shape, dtype) for k, (shape, dtype) in zip(keys, shapes, strict=True)]
    rows, col = tie
    columns = args[rows] if args[rows].shape == args[col].shape else jnp.swapaxes(args[rows],
                                                                                  -1, -2)
    args[col] = columns.astype(args[col].dtype)
    return tuple(args)


def stored_like(out, default):
    """The default's state as `out` stores it: the upper layout's arrays
    (`state_references.upper_arrays`) where a variant stores S upper (rows_to_state's
    `upper`: a tuple of four arrays) and the default square; else the default itself."""
    from sympow.attention.mosaic_gpu.state_references import upper_arrays

    return upper_arrays(default) if isinstance(out, tuple) and not isinstance(
        default, tuple) else default


def relative_difference(got, want) -> float:
    """max |got - want| / max |want| over the leaves of two outputs."""
    import jax

    from sympow.attention.testing import max_err

    return max(max_err(g, w) / max(max_err(w, 0.0), 1e-30)
               for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True))


def main(argv):
    del argv
    if _PRIMITIVES.value:
        primitives(_REPS.value)
        return
    import jax

    from sympow.attention.mosaic_gpu.state_kernels import DIM

    variants = kernel_variants(_OPTIONS.value)
    if _LOWER.value:
        for _, name, fn, shapes, _ in variants:
            specs = [jax.ShapeDtypeStruct(shape, dtype) for shape, dtype in shapes]
            try:
                text = fn.trace(*specs).lower(lowering_platforms=("cuda",)).as_text()
            except Exception as error:  # noqa: BLE001  (report it, lower the others)
                print(f"{name:40s} does not lower: {type(error).__name__}: {str(error)[:160]}")
                continue
            print(f"{name:40s} lowers to {text.count('@mosaic_gpu')} Mosaic GPU kernel(s)")
        return
    key = jax.random.PRNGKey(0)
    kernels = list(dict.fromkeys(kernel for kernel, *_ in variants))
    runnable, defaults = [], {}
    for kernel, name, fn, shapes, tie in variants:
        args = arguments(shapes, jax.random.fold_in(key, kernels.index(kernel)), tie)
        try:  # a ring too deep for shared memory fails here, not the whole run
            out = jax.block_until_ready(fn(*args))
        except Exception as error:  # noqa: BLE001  (report it, time the others)
            print(f"{name:40s} does not run: {type(error).__name__}: {str(error)[:160]}")
            continue
        if name == kernel:
            defaults[kernel] = out
        elif kernel in defaults:  # the same inputs: a variant must give the default's sums
            difference = relative_difference(out, stored_like(out, defaults[kernel]))
            print(f"{name:40s} against the default: {difference:.2e} of its largest entry")
        else:
            print(f"{name:40s} not compared: the default did not run")
        runnable.append((name, fn, args))
    flop = 2 * _HEADS.value * _T.value * DIM ** 3  # the square layout's, d = e = DIM
    if not runnable:  # off a Hopper GPU no kernel runs
        print("no kernel ran: nothing to time")
        return
    calls = [(fn, args) for _, fn, args in runnable]
    walls = timed_interleaved(calls, reps=_REPS.value)
    # The kernels' own durations: a call's wall time also holds the host's dispatch and wait
    # (0.2-0.35 ms a call on an H200 on 2026-11-27, against ncu's and the trace's).
    kernel_us = kernel_times_interleaved(calls, reps=_REPS.value, prefix="sympow_states",
                                         warmup=0)  # warmed by the wall times' rounds
    peak = matmul_rate(reps=_REPS.value) if _PEAK.value else None
    if peak:
        print(f"matmul peak (XLA, bf16 [{peak['matmul_n']}]^3, float32 sums): "
              f"{peak['matmul_kernel_tflops']:.1f} TFLOP/s by kernel time, "
              f"{peak['matmul_tflops']:.1f} by wall time", flush=True)
    for (name, _, _), ms, us in zip(runnable, walls, kernel_us, strict=True):
        print(f"{name:40s} kernel {us:7.1f} us  {flop / us / 1e6:6.1f} TFLOP/s  wall {ms:7.3f} "
              f"ms (medians of {_REPS.value}, in turns)"
              f"{useful_rate(us, peak, heads=_HEADS.value, t=_T.value)}", flush=True)


def useful_rate(kernel_us: float, peak: dict | None, *, heads: int, t: int) -> str:
    """A state kernel's rate over the symmetric state's distinct features (d (d + 1) / 2 of
    the square layout's d^2, whatever the layout a variant computes), and as a share of the
    matmul peak's kernel-time rate: the issue's measure of a state kernel."""
    from sympow.attention.mosaic_gpu.state_kernels import DIM

    useful = 2 * heads * t * DIM * (DIM + 1) // 2 * DIM
    tflops = useful / kernel_us / 1e6
    share = f" = {100 * tflops / peak['matmul_kernel_tflops']:.1f} % of the peak" if peak else ""
    return f"  useful {tflops:6.1f} TFLOP/s{share}"


if __name__ == "__main__":
    app.run(main)
