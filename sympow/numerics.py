"""Numerics shared by the specification, the kernels' wrappers, rotary and the layers.

One home for the conventions every part of the library follows (docs/design.md §4):
products at full float32 precision, computation in float32 or wider, a division that
gives 0 (not NaN) where the normalizer is 0, and a sum that keeps its rounding errors where
its terms cancel.
"""

from __future__ import annotations

import functools
import math
import numbers

import jax
import jax.numpy as jnp
from jaxtyping import Array

# Matmul precision of the pure-JAX forms: true float32 products (the default may be tf32 or
# bf16 passes on GPU), so the specification is exact to float32 rounding.
HIGHEST = jax.lax.Precision.HIGHEST


def compute_dtype(*xs) -> jnp.dtype:
    """float32, or wider when an input (array or dtype) is float64 (x64 exactness checks)."""
    return jnp.result_type(jnp.float32, *(x for x in xs if x is not None))


def round_to(x: Array, dtype) -> Array:
    """x rounded to `dtype`'s precision and range, kept in x's dtype (x unchanged where dtype is
    as wide as x's).

    Where a value must be used both as the bf16 operand a kernel takes and in float32
    arithmetic beside it, an `x.astype(bf16).astype(f32)` round trip is not enough on GPU: XLA
    removes convert pairs there (its default `xla_allow_excess_precision`), so the float32
    side would see the unrounded x. `lax.reduce_precision` is kept.
    """
    info = jnp.finfo(dtype)
    if info.bits >= jnp.finfo(x.dtype).bits:
        return x
    return jax.lax.reduce_precision(x, exponent_bits=info.nexp, mantissa_bits=info.nmant)


def zeros_of_call(shape, dtype, like: Array) -> Array:
    """Zeros of `shape` and `dtype` that XLA writes once per call site: exactly 0 (+-0),
    computed from the first element of `like` (any array of the call).

    A kernel that accumulates into a zero-filled buffer it takes as its output (input-output
    aliased) changes that buffer in place. XLA merges equal `jnp.zeros` of the same shape
    into one constant, so with several such calls (GPT-2's twelve layers) it keeps one zero
    array and copies it before each call: a read and a write of the whole buffer where a
    fill writes it only. A value that depends on the call's data cannot be merged."""
    first = like.reshape(-1)[0].astype(dtype)
    zero = jnp.where(jnp.isfinite(first), first * 0, 0)  # 0 for any value of `first`
    return jnp.broadcast_to(zero, shape)


def is_int(value) -> bool:
    """Whether `value` is a Python or numpy integer; a bool is a flag, not a count."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def is_finite_number(value) -> bool:
    """Whether `value` is a finite Python or numpy real (not a bool): NaN and inf would pass
    a comparison check silently (NaN as False everywhere, inf as larger than all)."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)


def has_weight(den: Array) -> Array:
    """Where a row's weight sum den counts: den > 0, and NaN too, so that a NaN input gives
    NaN rows, never the zeros of a row without weight (NaN > 0 is False)."""
    return ~(den <= 0)


def safe_divide(num: Array, den: Array) -> Array:
    """num / den broadcast over the last axis of num, and 0 where den <= 0 (no NaN grads).

    num [..., E], den [...]: rows with nothing to average (den == 0) give 0, the output the
    library defines for a row whose attention weights are all zero; a NaN den gives NaN.
    """
    empty = den <= 0  # NaN <= 0 is False: a NaN den is carried (`has_weight`)
    return jnp.where(empty[..., None], 0.0, num / jnp.where(empty, 1.0, den)[..., None])


def safe_reciprocal(den: Array) -> Array:
    """1 / den, and 0 where den <= 0 (`safe_divide`'s factor; NaN for a NaN den). Plain
    comparisons and selects, so the Hopper kernels call it too."""
    empty = den <= 0
    return jnp.where(empty, 0.0, 1.0 / jnp.where(empty, 1.0, den))


@functools.partial(jax.custom_jvp, nondiff_argnums=(1,))
def compensated_sum(x: Array, axis: int) -> Array:
    """x [..., n, ...] float32 or float64 summed over `axis` (the n), with every addition's
    rounding error kept and added back: x's shape without that axis, in x's dtype, the
    exact sum rounded about once.

    A float32 sum of many terms that cancel errs by ~eps times its partial sums, not its
    result, and how much depends on the order XLA's reduction takes on each backend (the
    decoding readout's sum of its tiles' shares: docs/kernels.md). Here each addition
    s = a + b also yields its error exactly (Knuth's TwoSum, for finite a, b), the errors
    are summed beside, and s + errors is returned: one XLA reduction of (sum, error) pairs,
    within ~eps |sum| + n eps^2 sum |x| of the exact sum in any order (two orders may
    still differ by about an ulp). Where the sum is infinite or NaN it is returned as the
    plain sum has it (TwoSum's error of an infinity is NaN). Only float32 and float64:
    TwoSum needs every operation rounded to x's dtype, which XLA need not do for narrower
    types on a GPU (`round_to`). Its derivative is the plain sum's.
    """
    if x.ndim == 0 or not -x.ndim <= axis < x.ndim:
        raise ValueError(f"axis={axis} is not an axis of x {tuple(x.shape)}")
    if x.dtype not in (jnp.float32, jnp.float64):
        raise ValueError(f"x must be float32 or float64 (TwoSum needs each operation rounded "
                         f"to it); got {x.dtype}")

    def add(left, right):
        (a, a_err), (b, b_err) = left, right
        s = a + b
        b_seen = s - a  # the part of b that s holds
        err = (a - (s - b_seen)) + (b - b_seen)  # a + b - s, exactly
        return s, a_err + b_err + err

    zero = jnp.zeros((), x.dtype)
    total, errors = jax.lax.reduce((x, jnp.zeros_like(x)), (zero, zero), add, (axis % x.ndim,))
    return jnp.where(jnp.isfinite(total), total + errors, total)


@compensated_sum.defjvp
def _compensated_sum_jvp(axis, primals, tangents):
    (x,), (dx,) = primals, tangents
    return compensated_sum(x, axis), jnp.sum(dx, axis=axis)
