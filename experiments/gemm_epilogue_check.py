"""Which shapes of a layer's products let XLA fold the sums around them into cuBLAS's GEMMs.

  PYTHONPATH=. python3 experiments/gemm_epilogue_check.py --out=$OUT

XLA's GPU GEMM rewriter turns `dot + c` into one cuBLAS call (c read by the GEMM's epilogue,
beta = 1) and `dot + broadcast(bias)` into a bias epilogue, but only where the sum meets the
dot's own output; a dot of [B, T, C] activations is rewritten as a [B * T, C] GEMM followed by
a reshape, which sits between the two. Each case runs forward + backward (grads of the inputs
and weights, bf16 compute, float32 parameters, GPT-2 small's width, 65,536 tokens) with the
activations [1, T, C] ('3d', as the model's layers ran them) and [T, C] ('2d'), and reports
the median time of the two timed in turns, the kernels in the compiled program and its
GEMMs' epilogues (`beta` and `epilogue` of their backend configs). Cases: 'projections' (the
five products of an attention layer's input: q, k, v in bf16, the gate's and the rotary's
in float32; their input cotangents are summed), 'residual' (x + out_proj(h)),
'residual_first' (the same sum as out_proj's product + (x + its bias)), 'mlp'
(x + proj(gelu(fc(x)))). Writes gemm_epilogue_check.json under --out. Finding (H100, jax
0.11.2, docs/benchmarks.md): by default nothing is folded in either layout; with
XLA_FLAGS=--xla_gpu_enable_triton_gemm=false biases and sums are, and every case is slower.
"""

import json
import re
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from absl import app, flags  # noqa: E402
from timing import timed_interleaved  # noqa: E402

_TOKENS = flags.DEFINE_integer("tokens", 65536, "B x T")
_WIDTH = flags.DEFINE_integer("width", 768, "d_model C")
_REPS = flags.DEFINE_integer("reps", 20, "timed rounds")
_OUT = flags.DEFINE_string("out", None, "output folder")


def _cases(t: int, c: int):
    import jax
    import jax.numpy as jnp

    bf16, f32 = jnp.bfloat16, jnp.float32

    def linear(x, w, b=None, dtype=bf16):
        y = x.astype(dtype) @ w.astype(dtype)
        return y if b is None else y + b.astype(dtype)

    def projections(x, ws):
        wq, wk, wv, bq, bk, bv, wg, bg, wb = ws
        return (linear(x, wq, bq), linear(x, wk, bk), linear(x, wv, bv),
                linear(x, wg, bg, f32), linear(x, wb, None, f32))

    def residual(x, ws):
        h, wo, bo = ws
        return x + linear(h.reshape(x.shape), wo, bo)

    def residual_first(x, ws):  # the residual and the bias summed first: dot + (x + b)
        h, wo, bo = ws
        return linear(h.reshape(x.shape), wo) + (x + bo.astype(bf16))

    def mlp(x, ws):
        w1, b1, w2, b2 = ws
        return x + linear(jax.nn.gelu(linear(x, w1, b1)), w2, b2)

    keys = iter(jax.random.split(jax.random.key(0), 32))

    def normal(shape, dtype=f32, scale=0.02):
        return (scale * jax.random.normal(next(keys), shape, f32)).astype(dtype)

    x = normal((t, c), bf16, 1.0)
    weights = {
        "projections": (normal((c, c)), normal((c, c)), normal((c, c)), normal((c,)),
                        normal((c,)), normal((c,)), normal((c, 12)), normal((12,)),
                        normal((c, 12))),
        "residual": (normal((t, c), bf16, 1.0), normal((c, c)), normal((c,))),
        "mlp": (normal((c, 4 * c)), normal((4 * c,)), normal((4 * c, c)), normal((c,))),
    }
    forwards = {"projections": projections, "residual": residual,
                "residual_first": residual_first, "mlp": mlp}
    for name, forward in forwards.items():
        ws = weights[name.split("_")[0]]
        for layout in ("3d", "2d"):
            shape = (1, t, c) if layout == "3d" else (t, c)

            def loss(x, ws, forward=forward, shape=shape):
                outs = forward(x.reshape(shape), ws)
                outs = outs if isinstance(outs, tuple) else (outs,)
                return sum(jnp.sum(o.astype(f32) * jnp.cos(o.astype(f32))) for o in outs)

            yield name, layout, jax.jit(jax.grad(loss, argnums=(0, 1))), (x, ws)


def _gemms(hlo: str) -> dict:
    """Kernels of the entry computation and the GEMMs' epilogues in an optimized HLO."""
    entry = hlo[hlo.index("ENTRY"):]
    kernels = re.findall(r"%?([a-z_.]+?)(?:[._]\d+)* = [^=]*? (?:fusion|custom-call)\(", entry)
    calls = re.findall(r'custom_call_target="(__cublas[^"]*)".*?backend_config=(\{.*)', entry)
    epilogues = []
    for target, config in calls:
        beta = re.search(r'"beta":([-0-9.e]+)', config)
        epilogue = re.search(r'"epilogue":"([A-Z_]+)"', config)
        epilogues.append(f"{target} beta={beta.group(1) if beta else '?'} "
                         f"epilogue={epilogue.group(1) if epilogue else '-'}")
    kinds = {name: kernels.count(name) for name in sorted(set(kernels))}
    return {"kernels": len(kernels), "kinds": kinds, "gemms": epilogues}


def main(argv):
    del argv
    import jax

    results = []
    cases = list(_cases(_TOKENS.value, _WIDTH.value))
    for i in range(0, len(cases), 2):
        pair = cases[i:i + 2]
        times = timed_interleaved([(fn, args) for _, _, fn, args in pair], reps=_REPS.value)
        for (name, layout, fn, args), ms in zip(pair, times, strict=True):
            row = {"case": name, "layout": layout, "ms": round(ms, 4),
                   **_gemms(fn.lower(*args).compile().as_text())}
            print(json.dumps(row), flush=True)
            results.append(row)
    record = {"device": jax.devices()[0].device_kind, "jax": jax.__version__,
              "date": time.strftime("%Y-%m-%d"), "command": " ".join(sys.argv),
              "results": results}
    if _OUT.value:
        Path(_OUT.value).mkdir(parents=True, exist_ok=True)
        Path(_OUT.value, "gemm_epilogue_check.json").write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    app.run(main)
