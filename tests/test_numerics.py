"""sympow.numerics: the compute dtype rule, the division that defines empty rows as 0, the
rounding XLA keeps, zeros XLA writes per call, and the sum that keeps its rounding errors."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sympow.numerics import (
    compensated_sum,
    compute_dtype,
    round_to,
    safe_divide,
    safe_reciprocal,
    zeros_of_call,
)


def test_compute_dtype_is_float32_or_wider(x64):
    assert compute_dtype(jnp.zeros(2, jnp.bfloat16)) == jnp.float32
    assert compute_dtype(jnp.bfloat16, None, jnp.float16) == jnp.float32
    assert compute_dtype(jnp.zeros(2, jnp.float32), jnp.zeros(2, jnp.float64)) == jnp.float64


def test_safe_divide_rows_and_zero_rows():
    num = jnp.asarray([[2.0, 4.0], [3.0, 6.0], [1.0, 1.0]])
    den = jnp.asarray([2.0, 3.0, 0.0])
    np.testing.assert_array_equal(safe_divide(num, den), [[1.0, 2.0], [1.0, 2.0], [0.0, 0.0]])


def test_safe_divide_and_reciprocal_give_nan_for_a_nan_den_and_zero_where_no_weight():
    """0 where den <= 0 (no weight; a rounding below 0 too), NaN where den is NaN: a NaN
    input must not come out as the zeros of an empty row."""
    den = jnp.asarray([2.0, 0.0, -1e-30, jnp.nan])
    got = safe_divide(jnp.ones((4, 2)), den)
    np.testing.assert_array_equal(got[:3], [[0.5, 0.5], [0.0, 0.0], [0.0, 0.0]])
    assert np.isnan(np.asarray(got[3])).all()
    np.testing.assert_array_equal(safe_reciprocal(den)[:3], [0.5, 0.0, 0.0])
    assert np.isnan(float(safe_reciprocal(den)[3]))


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


# 2^27 + 8 + 7 - 2^27: float32's spacing at 2^27 is 16, so a plain sum in any order that
# does not cancel the large terms first loses the small ones (8 and 7 - 2^27 both round).
CANCELLING = [2.0 ** 27, 8.0, 7.0, -(2.0 ** 27)]


@pytest.mark.parametrize("order", [(0, 1, 2, 3), (3, 2, 1, 0), (0, 2, 1, 3), (1, 0, 3, 2)])
def test_compensated_sum_is_exact_where_a_float32_sum_loses_the_small_terms(order):
    x = jnp.asarray([CANCELLING[i] for i in order], jnp.float32)
    assert float(jnp.sum(x)) != 15.0  # the plain sum loses them (the test's premise)
    assert float(compensated_sum(x, 0)) == 15.0
    assert float(jax.jit(compensated_sum, static_argnums=1)(x, 0)) == 15.0


def test_compensated_sum_over_any_axis_is_the_float64_sum_rounded(rng):
    """Terms over nine decades with both signs: the result within an ulp or so of the
    float64 sum, per output, on the axis asked (negative axes too), in x's dtype."""
    x = (rng.standard_normal((3, 2000, 5)) * 10.0 ** rng.uniform(-3, 6, (3, 2000, 5)))
    x = x.astype(np.float32)
    for axis in (1, -2, 0, 2):
        got = compensated_sum(jnp.asarray(x), axis)
        want = x.astype(np.float64).sum(axis=axis)
        assert got.dtype == jnp.float32 and got.shape == want.shape
        ulp = np.spacing(np.abs(want).astype(np.float32)).astype(np.float64)
        assert np.all(np.abs(np.asarray(got, np.float64) - want) <= 2 * ulp)


def test_compensated_sum_keeps_infinities_and_nans_as_a_plain_sum_does():
    for terms in ([np.inf, 1.0], [-np.inf, 2.0, 3.0], [np.inf, -np.inf], [np.nan, 1.0]):
        x = jnp.asarray(terms, jnp.float32)
        np.testing.assert_array_equal(compensated_sum(x, 0), jnp.sum(x))


def test_compensated_sum_differentiates_as_the_sum():
    x = jnp.asarray([[1.0, -2.0, 3.0], [0.5, 0.25, 4.0]], jnp.float32)
    grad = jax.grad(lambda x: compensated_sum(x * x, 1) @ jnp.asarray([1.0, 10.0]))(x)
    np.testing.assert_array_equal(grad, 2 * x * jnp.asarray([[1.0], [10.0]]))


@pytest.mark.parametrize(("shape", "axis", "dtype", "message"), [
    ((2, 3), 2, jnp.float32, r"axis=2 is not an axis of x \(2, 3\)"),
    ((2, 3), -3, jnp.float32, r"axis=-3 is not an axis of x \(2, 3\)"),
    ((), 0, jnp.float32, r"axis=0 is not an axis of x \(\)"),
    ((4,), 0, jnp.bfloat16, "x must be float32 or float64 .* got bfloat16"),
])
def test_compensated_sum_names_a_bad_axis_or_dtype(shape, axis, dtype, message):
    with pytest.raises(ValueError, match=message):
        compensated_sum(jnp.ones(shape, dtype), axis)
