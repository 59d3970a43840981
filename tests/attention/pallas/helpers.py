"""Helpers of the Pallas tier tests: chunk-layout inputs, the tier's primitives in the
interpreter, and the gold/ref/test comparison of a primitive and its vjp with the oracle."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from sympow.attention import testing
from sympow.attention.config import AttentionConfig
from sympow.attention.pallas import plan as pallas_plan
from sympow.attention.pallas import primitives as pallas_primitives
from sympow.attention.pallas.phi import to_symmetric_layout

# float32 products only: the normalizer's cotangent in the attention kernels' arithmetic
ROW_DOTS = {"sympow_row_dots"}


def chunk_inputs(rng, *, b=2, hq=4, hk=2, n=3, c=16, d=16, e=16, dtype=jnp.float32):
    unit = lambda x: x / np.linalg.norm(x, axis=-1, keepdims=True)  # noqa: E731
    q = unit(rng.normal(size=(b, hq, n, c, d)))
    k = rng.normal(size=(b, hk, n, c, d))
    k = k / np.linalg.norm(k, axis=-1).max()
    v = rng.normal(size=(b, hk, n, c, e))
    g = np.cumsum(np.log(rng.uniform(0.7, 1.0, size=(b, hk, n, c))), axis=-1)
    cast = lambda x, t=dtype: jnp.asarray(x, t)  # noqa: E731
    return cast(q), cast(k), cast(v), cast(g, jnp.float32)


def primitives(p, c=16):
    return pallas_primitives.primitives(AttentionConfig(
        p=p, algorithm="chunked", backend="pallas", chunk_size=c, interpret=True))


def compiled(f):
    """jax.jit at the interpreter-friendly optimization level of the shared cases."""
    return jax.jit(f, compiler_options=testing.CPU_OPTIONS)


def out_and_vjp(f, args, ct):
    """f(*args) and its vjp at cotangent ct, as one compiled program."""
    def both(args, ct):
        out, vjp = jax.vjp(f, *args)
        return out, vjp(ct)
    return compiled(both)(args, ct)


def vjp_close(f_test, f_ref, args, rng, k=3.0, atol=1e-6):
    """Outputs and vjp (random cotangent) of f_test agree with the oracle f_ref.

    gold/ref/test in float32 (run under the x64 fixture): gold = f_ref on float64 inputs,
    ref = f_ref on float32, test = f_test on float32; ||gold - test|| <= k ||gold - ref||
    + atol ||gold|| per output (the p log|s| gradients are ill-conditioned where |Q.K| is
    small, so a fixed float32 tolerance would be either loose or flaky).
    """
    f64 = lambda t: jax.tree.map(lambda x: x.astype(jnp.float64), t)  # noqa: E731
    ct = jax.tree.map(lambda y: jnp.asarray(rng.normal(size=y.shape), y.dtype),
                      jax.eval_shape(f_ref, *args))
    test, ref, gold = (out_and_vjp(f_test, args, ct), out_and_vjp(f_ref, args, ct),
                       out_and_vjp(f_ref, f64(args), f64(ct)))
    for x, y, z in zip(*map(jax.tree.leaves, (test, ref, gold)), strict=True):
        assert x.dtype == jnp.float32
        x, y, z = (np.asarray(a, np.float64) for a in (x, y, z))
        bound = k * np.linalg.norm(z - y) + atol * np.linalg.norm(z)
        assert np.linalg.norm(z - x) <= bound, (np.linalg.norm(z - x), bound)


def tiled(d, p):
    """Feature map tiled -> tile=1: x[..., index, :] * scale[:, None]."""
    return to_symmetric_layout(d, p, pallas_plan.tile_width(d, p))
