"""Launch shapes of the residual add + LayerNorm kernels against XLA's passes, on one GPU.

  PYTHONPATH=. python3 experiments/norm_sweep.py --out=$OUT

`norm_kernel.add_layer_norm` on GPT-2 small's rows (--tokens x 768, bf16) for each launch
shape of --tiles (rows:chunks:warps), forward alone and forward + backward (all cotangents),
timed in turns with impl='xla' (the specification as XLA compiles it: its own passes), the
median of --reps rounds; with the GB/s of the kernels' reads and writes (forward: x, delta
in, s, y out; backward: s, dy, ds in, dx out). Writes norm_sweep.json under --out.
"""

import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from absl import app, flags  # noqa: E402
from timing import timed_interleaved  # noqa: E402

_TOKENS = flags.DEFINE_integer("tokens", 65536, "rows")
_WIDTH = flags.DEFINE_integer("width", 768, "C")
_TILES = flags.DEFINE_list("tiles", ["16:1:8", "16:1:4", "8:1:4", "32:1:8", "16:8:8", "4:1:4"],
                           "launch shapes rows:chunks:warps")
_REPS = flags.DEFINE_integer("reps", 30, "timed rounds")
_OUT = flags.DEFINE_string("out", None, "output folder")


def main(argv):
    del argv
    import functools

    import jax
    import jax.numpy as jnp

    from sympow.layers import norm_kernel

    n, c = _TOKENS.value, _WIDTH.value
    keys = jax.random.split(jax.random.key(0), 7)
    x, delta, ds, dy = (jax.random.normal(k, (n, c)).astype(jnp.bfloat16) for k in keys[:4])
    vectors = [jax.random.normal(k, (c,)) for k in keys[4:]]
    args = (x, delta, *vectors)

    def forward(impl, tiles, *a):
        return norm_kernel.add_layer_norm(*a, eps=1e-5, impl=impl, tiles=tiles)

    def both(impl, tiles, *a):
        outs, vjp = jax.vjp(functools.partial(forward, impl, tiles), *a)
        return outs, vjp((ds, dy))

    shapes = [("xla", norm_kernel.TILES)] + [
        ("pallas", norm_kernel.Tiles(*map(int, t.split(":")))) for t in _TILES.value]
    results = []
    for name, fn, moved in (("forward", forward, 4), ("forward+backward", both, 8)):
        calls = [(jax.jit(functools.partial(fn, impl, tiles)), args) for impl, tiles in shapes]
        times = timed_interleaved(calls, reps=_REPS.value)
        for (impl, tiles), ms in zip(shapes, times, strict=True):
            row = {"pass": name, "impl": impl, "tiles": list(tiles) if impl == "pallas" else None,
                   "ms": round(ms, 4), "GB/s": round(moved * n * c * 2 / ms / 1e6, 1)}
            print(json.dumps(row), flush=True)
            results.append(row)
    record = {"device": jax.devices()[0].device_kind, "jax": jax.__version__,
              "date": time.strftime("%Y-%m-%d"), "command": " ".join(sys.argv),
              "results": results}
    if _OUT.value:
        Path(_OUT.value).mkdir(parents=True, exist_ok=True)
        Path(_OUT.value, "norm_sweep.json").write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    app.run(main)
