"""Times each Hopper state kernel at the breakdown's size, alone or under a profiler.

  PYTHONPATH=. python3 experiments/profile_states.py               # kernel medians
  PYTHONPATH=. python3 experiments/profile_states.py --primitives  # with the XLA glue
  PYTHONPATH=. nsys profile --stats=true -o $OUT/states python3 experiments/profile_states.py

(On 2026-11-24 neither profiler ran on the H100 machine: ncu crashed, nsys is absent;
experiments/kernel_profile.py reads jax's own profiler instead.)

One launch of each of rows_to_state, state_to_rows and row_gradients (the transposed
product as the backward runs it), and of the last two with the normalizer's quadratic form
(`_z`, as the tier runs them), per repetition (bf16, col in the tier's
`states.COLUMNS_DTYPE`, T = --t, H = --heads, chunk --chunk, d = e = 64), with median timings;
with --primitives, the tier's update_state and query_state, forward and backward, as
jitted programs (their XLA glue included), for a per-kernel summary of each.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from absl import app, flags  # noqa: E402
from timing import timed  # noqa: E402  (experiments/timing.py, beside this script)

_T = flags.DEFINE_integer("t", 65536, "tokens")
_HEADS = flags.DEFINE_integer("heads", 8, "heads")
_CHUNK = flags.DEFINE_integer("chunk", 512, "chunk")
_REPS = flags.DEFINE_integer("reps", 5, "timed launches of each kernel")
_PRIMITIVES = flags.DEFINE_bool("primitives", False, "run the tier's state primitives, "
                                "forward and backward, instead of the bare kernels")


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


def main(argv):
    del argv
    if _PRIMITIVES.value:
        primitives(_REPS.value)
        return
    import jax
    import jax.numpy as jnp

    from sympow.attention.mosaic_gpu import state_kernels as sk
    from sympow.attention.mosaic_gpu import states

    d = e = sk.DIM
    n, c, h = _T.value // _CHUNK.value, _CHUNK.value, _HEADS.value
    keys = jax.random.split(jax.random.PRNGKey(0), 3)
    x = jax.random.normal(keys[0], (1, h, n, c, d), jnp.bfloat16) / 8
    a = jax.random.normal(keys[1], (1, h, n, c, e), jnp.bfloat16)
    s = jax.random.normal(keys[2], (1, h, n, d * d, e), jnp.bfloat16)
    xt = jnp.swapaxes(x, -1, -2)
    col = xt.astype(states.COLUMNS_DTYPE)  # ls = 0
    normalizer = sk.Normalizer(states.z_parts(jnp.ones((1, h, n, d * d), jnp.float32)),
                               jnp.ones((1, h, n, c), jnp.float32))
    kernels = {
        "rows_to_state": (jax.jit(lambda *z: sk.rows_to_state(*z, kv_heads=h)), (xt, col, a)),
        "state_to_rows": (jax.jit(lambda *z: sk.state_to_rows(*z, transposed=False)),
                          (x, col, s)),
        "row_gradients": (jax.jit(sk.row_gradients), (a, x, col, s)),
        # with the normalizer's quadratic form, as the tier runs them
        "state_to_rows_z": (jax.jit(lambda *z: sk.state_to_rows(
            *z[:3], transposed=False, normalizer=z[3])), (x, col, s, normalizer)),
        "row_gradients_z": (jax.jit(lambda *z: sk.row_gradients(*z[:4], normalizer=z[4])),
                            (a, x, col, s, normalizer)),
    }
    flop = 2 * h * _T.value * d * d * e
    for name, (fn, args) in kernels.items():
        ms = timed(fn, *args, reps=_REPS.value, warmup=1)
        print(f"{name:16s} {ms:7.3f} ms  {flop / ms / 1e9:6.1f} TFLOP/s (median of "
              f"{_REPS.value})", flush=True)


if __name__ == "__main__":
    app.run(main)
