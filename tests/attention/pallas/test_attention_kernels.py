"""Intra-chunk attention kernels (attention_kernels.py) through their custom_vjp, against
the pure-JAX primitive: forward (o, den, m) and vjp."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sympow.attention import testing, xla
from sympow.attention.pallas import attention_kernels, vjps
from sympow.attention.pallas import plan as pallas_plan
from sympow.numerics import safe_divide
from tests.attention.pallas.helpers import chunk_inputs, primitives, vjp_close


@pytest.mark.parametrize("p", [2, 4])
def test_attention_primitive(x64, rng, p):
    q, k, v, g = chunk_inputs(rng)
    prims = primitives(p)
    # (o, den, m); m is a stop_gradient'ed row max in both, so its cotangent is ignored.
    vjp_close(lambda *a: prims.attention(*a, p=p), lambda *a: xla.attention(*a, p=p),
              (q, k, v, g), rng)


def _float32_plan(c=128, e=32):
    return pallas_plan.make_plan(2, 16, e, c, "float32", True)


def test_row_dots_are_each_rows_dot_product(rng):
    """row_dots(x, y)[.., r] = x_r . y_r (the diagonal of each block's x y^T), several
    blocks a chunk, against float64 sums."""
    plan = _float32_plan()
    assert plan.c // plan.attn_bq >= 2, "the case should span several row blocks"
    x, y = (rng.normal(size=(2, 3, 2, plan.c, plan.e)) for _ in range(2))
    got = attention_kernels.row_dots(jnp.asarray(x, jnp.float32), jnp.asarray(y, jnp.float32),
                                     plan)
    assert got.shape == (2, 3, 2, plan.c) and got.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(got), np.einsum("bhnce,bhnce->bhnc", x, y),
                               rtol=1e-5, atol=1e-5)


def test_row_dots_refuse_other_shapes():
    plan = _float32_plan()
    x = jnp.zeros((1, 1, 1, plan.c, plan.e))
    with pytest.raises(ValueError, match=r"row_dots needs x and y of one shape"):
        attention_kernels.row_dots(x, jnp.zeros((1, 1, 1, plan.c, plan.e + 1)), plan)
    with pytest.raises(ValueError, match=r"\[B, H, N, 128, 32\]"):
        attention_kernels.row_dots(x[..., :16], x[..., :16], plan)
    with pytest.raises(ValueError, match=r"got x \(128, 32\)"):
        attention_kernels.row_dots(x[0, 0, 0], x[0, 0, 0], plan)


@pytest.mark.parametrize("algorithm", ["chunked", "attention"])
def test_full_decay_gradients_of_the_keys_and_queries_are_exactly_zero(rng, algorithm):
    """Under full decay (every log gate -1e4) each row attends to itself only: y = v, and
    dq = dk = 0 exactly. The kernels' dw_ii = do_i . v_i + dden_i must cancel exactly, with
    dden = -(do . y) formed in the kernels' arithmetic (`row_dots`): from XLA's sum it left
    float32 noise that p / s amplified (max |dk| 7e-3 in the interpreter at seed 12). T = 300 is
    no multiple of the chunk (128)."""
    case = testing.Case(t=300, d=64, e=64, hq=4, hk=2, chunk=128)
    q, k, v, log_g, dy = testing.inputs(case, rng, kind="full_decay")
    out = testing.run(case, (q, k, v, log_g, dy), ("pallas", algorithm))
    np.testing.assert_array_equal(np.asarray(out["y"]), np.repeat(np.asarray(v), 2, axis=2))
    for name in ("dq", "dk"):
        assert np.all(np.asarray(out[name]) == 0.0), (
            f"{name}: max |{name}| {np.abs(np.asarray(out[name])).max():.2e}")


def test_normalized_matches_the_safe_division_and_its_gradients(rng):
    """vjps.normalized(plan, o, den) = safe_divide(o, den), its vjp that of the division
    (float32 plan: dden from row_dots), rows with den = 0 giving 0 and zero cotangents."""
    plan = _float32_plan()
    o = jnp.asarray(rng.normal(size=(2, 2, 1, plan.c, plan.e)), jnp.float32)
    den = jnp.asarray(rng.uniform(0.5, 2.0, size=(2, 2, 1, plan.c)), jnp.float32)
    den = den.at[..., ::7].set(0.0)
    dy = jnp.asarray(rng.normal(size=o.shape), jnp.float32)
    got, got_vjp = jax.vjp(lambda o, den: vjps.normalized(plan, o, den), o, den)
    want, want_vjp = jax.vjp(safe_divide, o, den)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    for g, w in zip(got_vjp(dy), want_vjp(dy), strict=True):
        assert np.all(np.isfinite(np.asarray(g)))
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-5)
    assert np.all(np.asarray(got_vjp(dy)[1])[..., ::7] == 0.0)


def test_dden_in_kernel_order_for_float32_products_only():
    """row_dots' dden and w dden kept out of the product go together, for float32 products."""
    assert _float32_plan().dden_in_kernel_order
    assert not pallas_plan.make_plan(2, 16, 32, 128, "bfloat16", True).dden_in_kernel_order
