"""sympow.layers.linear: the product without the bias, products side by side, the
recomputed bias + GELU; each against the nnx.Linear / jax.nn expression it replaces."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.ad_checkpoint import print_saved_residuals

from sympow.layers.linear import bias_gelu, product, products_side_by_side


def _linear(n_in, n_out, *, seed, dtype=jnp.float32, use_bias=True):
    linear = nnx.Linear(n_in, n_out, use_bias=use_bias, dtype=dtype, rngs=nnx.Rngs(seed))
    if use_bias:  # nonzero biases, so that a missing or doubled one shows
        linear.bias[...] = jax.random.normal(jax.random.key(seed + 100), (n_out,))
    return linear


def _x(shape, dtype, seed=0):
    return jax.random.normal(jax.random.key(seed), shape, jnp.float32).astype(dtype)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_product_is_the_linear_without_its_bias(dtype):
    linear = _linear(16, 8, seed=1, dtype=dtype)
    x = _x((2, 5, 16), dtype)
    y = product(linear, x)
    assert y.dtype == jnp.dtype(dtype)
    np.testing.assert_array_equal(y + linear.bias[...].astype(dtype), linear(x))


def test_products_side_by_side_match_each_linear_values_and_gradients():
    # the gate's (bias) and the rotary's (no bias) maps of an attention layer: float32
    # linears of a bf16 input
    linears = [_linear(16, 3, seed=2), _linear(16, 5, seed=3, use_bias=False),
               _linear(16, 4, seed=4)]
    x = _x((2, 7, 16), jnp.bfloat16, seed=5)
    ct = [_x((2, 7, n), jnp.float32, seed=6 + i) for i, n in enumerate((3, 5, 4))]
    graphdef, params = nnx.split(nnx.List(linears))

    def loss(x, params, merged):
        models = nnx.merge(graphdef, params)
        outs = (products_side_by_side(list(models), x) if merged
                else [linear(x) for linear in models])
        return sum(jnp.sum(o * c) for o, c in zip(outs, ct, strict=True)), outs

    (_, merged), grads = jax.value_and_grad(loss, (0, 1), has_aux=True)(x, params, True)
    (_, apart), grads_apart = jax.value_and_grad(loss, (0, 1), has_aux=True)(
        x, params, False)
    for a, b in zip(merged, apart, strict=True):
        assert a.shape == b.shape and a.dtype == b.dtype == jnp.float32
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)
    for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(grads_apart), strict=True):
        assert a.dtype == b.dtype
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32),
                                   rtol=1e-2 if a.dtype == jnp.bfloat16 else 1e-5,
                                   atol=1e-2 if a.dtype == jnp.bfloat16 else 1e-5)


def test_products_side_by_side_of_one_linear_is_the_linear():
    linear = _linear(16, 3, seed=7)
    x = _x((3, 16), jnp.float32)
    np.testing.assert_array_equal(products_side_by_side([linear], x)[0], linear(x))


def test_products_side_by_side_refuse_linears_that_compute_differently():
    linears = [_linear(16, 3, seed=8), _linear(16, 3, seed=9, dtype=jnp.bfloat16)]
    with pytest.raises(ValueError, match="one dtype, precision"):
        products_side_by_side(linears, _x((3, 16), jnp.float32))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_bias_gelu_is_gelu_of_the_sum_values_and_gradients(dtype):
    h = _x((4, 24), dtype, seed=10)
    bias = jax.random.normal(jax.random.key(11), (24,))
    ct = _x((4, 24), dtype, seed=12)

    def direct(h, bias):
        return jax.nn.gelu(h + bias.astype(h.dtype))

    y, vjp = jax.vjp(bias_gelu, h, bias)
    y_ref, vjp_ref = jax.vjp(direct, h, bias)
    assert y.dtype == jnp.dtype(dtype)
    np.testing.assert_array_equal(y, y_ref)
    for a, b in zip(vjp(ct), vjp_ref(ct), strict=True):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(a, b)


def test_bias_gelu_saves_only_its_inputs_for_the_backward(capsys):
    h, bias = _x((4, 24), jnp.bfloat16), jnp.ones(24)
    print_saved_residuals(lambda h, b: bias_gelu(h, b).sum(), h, bias)
    saved = [line for line in capsys.readouterr().out.splitlines() if line.strip()]
    assert len(saved) == 2 and all("from the argument" in line for line in saved), saved
    # the expression it replaces saves the GELU's intermediates (what XLA wrote out)
    print_saved_residuals(
        lambda h, b: jax.nn.gelu(h + b.astype(h.dtype)).sum(), h, bias)
    assert sum("output of" in line for line in capsys.readouterr().out.splitlines()) >= 2
