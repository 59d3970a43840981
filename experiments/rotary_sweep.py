"""Time the learned-rotary kernels (sympow.layers.rotary_kernel) per block size and warp
count against XLA's rotation (`rotate_reference`), forward and forward + backward, on
GPT-2 small's queries at 65,536 tokens (bf16, B = 1, H = 12, D = 64). Wall time per call of
a jitted function, 20 calls after a compiling one: the sweep that chose BLOCK_ROWS and
WARPS (docs/kernels.md); kernel_profile.py measures them inside the training step.

  PYTHONPATH=. python3 experiments/rotary_sweep.py --out=$OUT/rotary_sweep.json
"""

import datetime
import functools
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from absl import app, flags  # noqa: E402

_OUT = flags.DEFINE_string("out", None, "write the timings here as JSON")
_BLOCKS = flags.DEFINE_list("blocks", ["16", "32", "64", "128", "256"], "block_rows to try")
_WARPS = flags.DEFINE_list("warps", ["2", "4", "8"], "warp counts to try")
_REPS = flags.DEFINE_integer("reps", 20, "timed calls per case")


def main(argv):
    del argv
    import jax
    import jax.numpy as jnp
    import numpy as np

    from sympow.layers import rotary_kernel

    b, t, h, d = 1, 65536, 12, 64
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((b, t, h, d)), jnp.bfloat16)
    mu = jnp.asarray(np.cumsum(rng.uniform(0, 2, (b, t, h)), axis=1), jnp.float32)
    dy = jnp.asarray(rng.standard_normal((b, t, h, d)), jnp.bfloat16)

    def ms_per_call(f, *args):
        jax.block_until_ready(f(*args))
        start = time.perf_counter()
        for _ in range(_REPS.value):
            out = f(*args)
        jax.block_until_ready(out)
        return (time.perf_counter() - start) / _REPS.value * 1e3

    def timings(rotate):
        forward = jax.jit(rotate)
        both = jax.jit(lambda x, mu, dy: jax.vjp(rotate, x, mu)[1](dy))
        return dict(forward_ms=ms_per_call(forward, x, mu), fwd_bwd_ms=ms_per_call(both, x, mu, dy))

    rows = [dict(impl="xla", **timings(functools.partial(rotary_kernel.rotate_reference,
                                                         base=65536.0)))]
    print(rows[-1], flush=True)
    for block in map(int, _BLOCKS.value):
        for warps in map(int, _WARPS.value):
            rotary_kernel.WARPS = warps  # read when the kernel is traced
            rotate = functools.partial(rotary_kernel.rotate, base=65536.0, block_rows=block,
                                       interpret=False)
            try:
                rows.append(dict(impl="pallas", block_rows=block, warps=warps, **timings(rotate)))
            except Exception as error:  # noqa: BLE001  (a configuration that does not fit)
                rows.append(dict(impl="pallas", block_rows=block, warps=warps,
                                 error=str(error)[:200]))
            print(rows[-1], flush=True)
    if _OUT.value:
        Path(_OUT.value).write_text(json.dumps(dict(
            device=jax.devices()[0].device_kind, jax=jax.__version__,
            date=datetime.date.today().isoformat(), command=" ".join(sys.argv),
            shape=dict(b=b, t=t, h=h, d=d, dtype="bfloat16"), results=rows), indent=1))


if __name__ == "__main__":
    app.run(main)
