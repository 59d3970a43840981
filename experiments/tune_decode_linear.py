"""GPU time of the fused decoding step's products under several launch shapes, against XLA.

  PYTHONPATH=. python3 experiments/tune_decode_linear.py --out=$OUT
  ncu --clock-control none -k regex:sympow_decode_linear --section SpeedOfLight -f -o /tmp/lin \
      python3 experiments/tune_decode_linear.py --ncu --tiles=4:2:3:1024:1:1

GPT-2 small's four products of a block (`sympow.layers.fused_decode`): in (LayerNorm, 768
-> 2336), out (768 -> 768, residual), fc (LayerNorm, 768 -> 3072, GELU), proj (3072 -> 768,
residual), or those of --products (also in_plain and fc_plain: in and fc without their
LayerNorm and GELU), bf16, at --rows rows, for each `LinearTiles` of --tiles
(block_n:warps:stages:max_block_k:unroll[:fma]) and for XLA's jnp.dot of the same shapes.
Times are the kernels' own GPU times from jax.profiler's trace (mean over --reps calls),
with the weight bytes over that time. Writes tune_decode_linear.json under --out.
"""

import functools
import itertools
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from absl import app, flags  # noqa: E402
from timing import gpu_us  # noqa: E402

_ROWS = flags.DEFINE_integer("rows", 1, "rows of x (sequences decoded together)")
_REPS = flags.DEFINE_integer("reps", 20, "traced calls per shape")
_TILES = flags.DEFINE_list(
    "tiles", [f"{n}:{w}:{s}:{k}:{u}" for n, w, s, k, u in itertools.product(
        (16, 32), (2, 4, 8), (3,), (256, 512), (0, 1))],
    "launch shapes block_n:warps:stages:max_block_k:unroll[:fma] (unroll, fma 0 or 1; fma: "
    "one row on the CUDA cores, `LinearTiles.fma`)")
_PRODUCTS = flags.DEFINE_list("products", ["in", "out", "fc", "proj"],
                              "products to time (PRODUCTS: in, out, fc, proj, in_plain, "
                              "fc_plain)")
_NCU = flags.DEFINE_bool("ncu", False, "run each product once per launch shape, untimed, "
                         "for Nsight Compute (the jax profiler's trace and ncu both take "
                         "CUPTI); writes nothing")
_OUT = flags.DEFINE_string("out", None, "directory for tune_decode_linear.json")

# name: (K, N, LayerNorm, GELU, residual); the *_plain ones are in and fc without their
# LayerNorm and GELU, to tell the normalization's cost from the shape's
PRODUCTS = {"in": (768, 2336, True, False, False), "out": (768, 768, False, False, True),
            "fc": (768, 3072, True, True, False), "proj": (3072, 768, False, False, True),
            "in_plain": (768, 2336, False, False, False),
            "fc_plain": (768, 3072, False, False, False)}


def parse_tiles(spec: str):
    """A `LinearTiles` from block_n:warps:stages:max_block_k:unroll[:fma]."""
    from sympow.layers.decode_linear import LinearTiles

    block_n, warps, stages, max_k, unroll, *fma = map(int, spec.split(":"))
    return LinearTiles(block_n, warps, stages, max_k, bool(unroll), bool(fma and fma[0]))


def main(argv):
    del argv
    import jax
    import jax.numpy as jnp

    from sympow.layers.decode_linear import LayerNormWeights, linear

    rows, reps = _ROWS.value, _REPS.value
    results = []
    unknown = set(_PRODUCTS.value) - set(PRODUCTS)
    if unknown:
        raise ValueError(f"--products: unknown {sorted(unknown)}; known: {list(PRODUCTS)}")
    for name in _PRODUCTS.value:
        k, n, norm, gelu, residual = PRODUCTS[name]
        keys = jax.random.split(jax.random.key(0), 3)
        x = jax.random.normal(keys[0], (rows, k), jnp.bfloat16)
        wt = (jax.random.normal(keys[1], (n, k)) * k ** -0.5).astype(jnp.bfloat16)
        res = jax.random.normal(keys[2], (rows, n), jnp.bfloat16) if residual else None
        ln = LayerNormWeights(jnp.ones(k), jnp.zeros(k), 1e-5) if norm else None
        b = jnp.zeros(n)
        weight_bytes = n * k * 2
        if _NCU.value:
            for spec in _TILES.value:
                jax.block_until_ready(jax.jit(functools.partial(
                    linear, b=b, norm=ln, gelu=gelu, residual=res,
                    tiles=parse_tiles(spec)))(x, wt))
            continue
        xla = gpu_us(jax.jit(lambda x, wt: jnp.dot(x, wt.T, preferred_element_type=jnp.float32)),
                     x, wt, reps=reps)
        row = {"product": name, "k": k, "n": n, "rows": rows, "xla_dot_us": round(xla, 2),
               "tiles": []}
        for spec in _TILES.value:
            fn = jax.jit(functools.partial(linear, b=b, norm=ln, gelu=gelu, residual=res,
                                           tiles=parse_tiles(spec)))
            try:
                us = gpu_us(fn, x, wt, reps=reps)
            except Exception as error:  # noqa: BLE001  (a shape that does not compile)
                row["tiles"].append({"tiles": spec, "error": str(error)[:200]})
                continue
            row["tiles"].append({"tiles": spec, "us": round(us, 2),
                                 "gb_per_s": round(weight_bytes / us / 1e3, 1)})
        row["tiles"].sort(key=lambda t: t.get("us", float("inf")))
        best = row["tiles"][0]
        print(f"{name:5s} K={k:5d} N={n:5d}: XLA dot {xla:6.2f} us; best {best}", flush=True)
        for t in row["tiles"][:5]:
            print(f"        {t}")
        results.append(row)
    if _OUT.value:
        out = Path(_OUT.value)
        out.mkdir(parents=True, exist_ok=True)
        (out / "tune_decode_linear.json").write_text(json.dumps(
            {"device": jax.devices()[0].device_kind, "jax": jax.__version__,
             "date": time.strftime("%Y-%m-%d"), "command": " ".join(sys.argv),
             "results": results}, indent=1))


if __name__ == "__main__":
    app.run(main)
