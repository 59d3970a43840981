"""sympow.numerics: the compute dtype rule, the division that defines empty rows as 0, the
rounding XLA keeps and zeros XLA writes per call."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from sympow.numerics import compute_dtype, round_to, safe_divide, zeros_of_call


def test_compute_dtype_is_float32_or_wider(x64):
    assert compute_dtype(jnp.zeros(2, jnp.bfloat16)) == jnp.float32
    assert compute_dtype(jnp.bfloat16, None, jnp.float16) == jnp.float32
    assert compute_dtype(jnp.zeros(2, jnp.float32), jnp.zeros(2, jnp.float64)) == jnp.float64


def test_safe_divide_rows_and_zero_rows():
    num = jnp.asarray([[2.0, 4.0], [3.0, 6.0], [1.0, 1.0]])
    den = jnp.asarray([2.0, 3.0, 0.0])
    np.testing.assert_array_equal(safe_divide(num, den), [[1.0, 2.0], [1.0, 2.0], [0.0, 0.0]])


def test_safe_divide_has_finite_gradients_at_zero_rows():
    """The masked branch must not leak a 0/0 into the gradient (jnp.where's classic trap)."""
    def f(num, den):
        return jnp.sum(safe_divide(num, den))

    dnum, dden = jax.grad(f, argnums=(0, 1))(jnp.ones((2, 3)), jnp.asarray([2.0, 0.0]))
    np.testing.assert_allclose(dnum, [[0.5] * 3, [0.0] * 3])
    np.testing.assert_allclose(dden, [-3 / 4, 0.0])


def test_round_to_rounds_to_the_narrower_dtype_and_keeps_the_dtype():
    x = jnp.asarray(np.random.default_rng(0).normal(size=(64,)) * 1e3, jnp.float32)
    rounded = round_to(x, jnp.bfloat16)
    assert rounded.dtype == jnp.float32
    np.testing.assert_array_equal(rounded, x.astype(jnp.bfloat16).astype(jnp.float32))
    assert np.any(rounded != x)  # bf16 keeps 8 of float32's 24 significant bits
    assert round_to(x, jnp.float32) is x


def test_round_to_is_an_op_xla_keeps():
    """An astype round trip is two converts, which XLA's GPU compiler removes as a pair;
    round_to must be one reduce_precision instead."""
    jaxpr = str(jax.make_jaxpr(lambda x: round_to(x, jnp.bfloat16))(jnp.ones(4)))
    assert "reduce_precision" in jaxpr and "convert_element_type" not in jaxpr


def test_zeros_of_call_are_zeros_whatever_the_first_element():
    for first in (1.5, -3.0, 0.0, np.inf, -np.inf, np.nan):
        like = jnp.asarray([first, 2.0], jnp.bfloat16)
        zeros = zeros_of_call((3, 4), jnp.float32, like)
        assert zeros.shape == (3, 4) and zeros.dtype == jnp.float32
        np.testing.assert_array_equal(zeros, np.zeros((3, 4)))


def test_zeros_of_call_are_written_per_call_not_copied_from_one_constant():
    """Two jnp.zeros of one shape compile (XLA CPU, as on GPU) to one broadcast and a copy
    of it; zeros_of_call of two calls' arrays to two fills."""
    def roots(fn):
        text = jax.jit(fn).lower(jnp.ones(3), jnp.ones(3)).compile().as_text()
        return next(line for line in text.splitlines() if "ROOT" in line and "tuple(" in line)

    shared = roots(lambda a, b: (jnp.zeros((64, 8)), jnp.zeros((64, 8))))
    assert "copy" in shared
    own = roots(lambda a, b: (zeros_of_call((64, 8), jnp.float32, a),
                              zeros_of_call((64, 8), jnp.float32, b)))
    assert "copy" not in own and own.count("fusion") == 2
