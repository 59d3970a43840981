"""Time the learned-rotary kernels (sympow.layers.rotary_kernel) as GPT-2 small's layer runs
them: q and k [B, T, 12, 64] bf16 with their biases, one mu [B, T, 12]; XLA's rotation
(`rotate_reference`), the two arrays rotated one call each (`rotate` at 64 rows and 8
warps), and both in one call (`rotate_together`) per kv heads a program, block rows and
warp count; each layout. GPU microseconds of all the kernels of a call (jax's profiler,
`timing.gpu_us`: the bias cotangents' reductions included), forward and the vjp call
(`jax.vjp(...)[1]` jitted): the sweep that chose KV_HEADS, BLOCK_ROWS and
WARPS (docs/kernels.md); kernel_profile.py measures them inside the training step.

  PYTHONPATH=. python3 experiments/rotary_sweep.py --out=$OUT/rotary_sweep.json
"""

import datetime
import functools
import itertools
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from absl import app, flags  # noqa: E402

_OUT = flags.DEFINE_string("out", None, "write the timings here as JSON")
_SHAPE = flags.DEFINE_list("shape", ["16", "4096"], "B, T (GPT-2 small at 4k: 16 x 4096)")
_KV_HEADS = flags.DEFINE_list("kv_heads", ["1", "2", "3", "4", "6", "12"],
                              "kv heads a program to try (rotate_together)")
_BLOCKS = flags.DEFINE_list("blocks", ["32", "64"], "block_rows to try")
_WARPS = flags.DEFINE_list("warps", ["4", "8"], "warp counts to try")
_LAYOUTS = flags.DEFINE_list("layouts", ["tokens", "heads"], "layouts to try")
_REPS = flags.DEFINE_integer("reps", 10, "profiled calls per case")


def main(argv):
    del argv
    import jax
    import jax.numpy as jnp
    import numpy as np
    from timing import gpu_us

    from sympow.layers import rotary_kernel

    b, t = map(int, _SHAPE.value)
    h, d, base = 12, 64, 65536.0
    rng = np.random.default_rng(0)
    q, k, dq, dk = (jnp.asarray(rng.standard_normal((b, t, h, d)), jnp.bfloat16)
                    for _ in range(4))
    biases = tuple(jnp.asarray(0.1 * rng.standard_normal((h, d)), jnp.float32) for _ in "qk")
    mu = jnp.asarray(np.cumsum(rng.uniform(0, 2, (b, t, h)), axis=1), jnp.float32)

    def timings(rotate_both):
        """rotate_both(q, k, mu, biases) -> (q', k')."""
        forward = jax.jit(rotate_both)
        both = jax.jit(lambda q, k, mu, biases, dq, dk: jax.vjp(
            rotate_both, q, k, mu, biases)[1]((dq, dk)))
        return dict(forward_us=gpu_us(forward, q, k, mu, biases, reps=_REPS.value),
                    fwd_bwd_us=gpu_us(both, q, k, mu, biases, dq, dk, reps=_REPS.value))

    def reference(q, k, mu, biases):
        return tuple(rotary_kernel.rotate_reference(x, mu, base=base, bias=bias)
                     for x, bias in zip((q, k), biases, strict=True))

    def separately(q, k, mu, biases, layout):
        return tuple(rotary_kernel.rotate(x, mu, base=base, bias=bias, layout=layout,
                                          block_rows=64, kv_heads=1, interpret=False)
                     for x, bias in zip((q, k), biases, strict=True))

    def together(q, k, mu, biases, layout, kv_heads, block):
        return rotary_kernel.rotate_together((q, k), mu, base=base, biases=biases,
                                             layout=layout, kv_heads=kv_heads,
                                             block_rows=block, interpret=False)

    rows = [dict(impl="xla", **timings(reference))]
    print(rows[-1], flush=True)
    for layout in _LAYOUTS.value:
        rotary_kernel.WARPS = 8  # read when the kernel is traced
        rows.append(dict(impl="separately", layout=layout, kv_heads=1, block_rows=64, warps=8,
                         **timings(functools.partial(separately, layout=layout))))
        print(rows[-1], flush=True)
        for kv_heads, block, warps in itertools.product(
                map(int, _KV_HEADS.value), map(int, _BLOCKS.value), map(int, _WARPS.value)):
            rotary_kernel.WARPS = warps  # read when the kernel is traced
            case = dict(impl="together", layout=layout, kv_heads=kv_heads,
                        block_rows=block, warps=warps)
            try:
                case.update(timings(functools.partial(
                    together, layout=layout, kv_heads=kv_heads, block=block)))
            except Exception as error:  # noqa: BLE001  (a configuration that fails)
                case["error"] = str(error)[:300]
            rows.append(case)
            print(rows[-1], flush=True)
    if _OUT.value:
        Path(_OUT.value).write_text(json.dumps(dict(
            device=jax.devices()[0].device_kind, jax=jax.__version__,
            date=datetime.date.today().isoformat(), command=" ".join(sys.argv),
            shape=dict(b=b, t=t, h=h, d=d, dtype="bfloat16", biases=True), results=rows),
            indent=1))


if __name__ == "__main__":
    app.run(main)
