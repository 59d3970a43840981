"""Runs each Hopper state kernel a few times at the breakdown's size, for a profiler.

  PYTHONPATH=. ncu --kernel-name regex:sympow_states --launch-skip 3 --launch-count 3 \\
      --section SpeedOfLight --section WarpStateStats python3 experiments/profile_states.py

One launch of each of rows_to_state, state_to_rows and state_to_rows transposed per
repetition (bf16, T = --t, H = --heads, chunk --chunk, d = e = 64), with timings printed.
"""

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from absl import app, flags  # noqa: E402

_T = flags.DEFINE_integer("t", 65536, "tokens")
_HEADS = flags.DEFINE_integer("heads", 8, "heads")
_CHUNK = flags.DEFINE_integer("chunk", 512, "chunk")
_REPS = flags.DEFINE_integer("reps", 3, "launches of each kernel")


def main(argv):
    del argv
    import jax
    import jax.numpy as jnp

    from sympow.attention.mosaic_gpu import state_kernels as sk

    d = e = sk.DIM
    n, c, h = _T.value // _CHUNK.value, _CHUNK.value, _HEADS.value
    keys = jax.random.split(jax.random.PRNGKey(0), 3)
    x = jax.random.normal(keys[0], (1, h, n, c, d), jnp.bfloat16) / 8
    a = jax.random.normal(keys[1], (1, h, n, c, e), jnp.bfloat16)
    s = jax.random.normal(keys[2], (1, h, n, d * d, e), jnp.bfloat16)
    col, xt = jnp.swapaxes(x.astype(jnp.float32), -1, -2), jnp.swapaxes(x, -1, -2)
    kernels = {
        "rows_to_state": (jax.jit(lambda *z: sk.rows_to_state(*z, kv_heads=h)), (xt, col, a)),
        "state_to_rows": (jax.jit(lambda *z: sk.state_to_rows(*z, transposed=False)),
                          (x, col, s)),
        "state_to_rows_t": (jax.jit(lambda *z: sk.state_to_rows(*z, transposed=True)),
                            (a, col, s)),
    }
    flop = 2 * h * _T.value * d * d * e
    for name, (fn, args) in kernels.items():
        jax.block_until_ready(fn(*args))  # compile
        for _ in range(_REPS.value):
            start = time.perf_counter()
            jax.block_until_ready(fn(*args))
            ms = (time.perf_counter() - start) * 1e3
        print(f"{name:16s} {ms:7.3f} ms  {flop / ms / 1e9:6.1f} TFLOP/s", flush=True)


if __name__ == "__main__":
    app.run(main)
