"""The chunked algorithm's normalizer products on the tensor cores, at float32 precision.

For p = 2 the normalizer state of a chunk and a row's normalizer against an entering state
are

    z = sum_r w_r x_r x_r^T  [d, d]          (`normalizer_state`, update_state's Z)
    den_r = w_r x_r^T Z x_r                   (`normalizer_rows`, query_state's denominator)

with x the bf16 rows (keys or queries), w_r = e^(2 ls_r) and Z float32. Written as float32
einsums at HIGHEST precision they run as SIMT GEMMs: on an H200 their forward and backward
took 0.87 ms of the 8.3 ms chunked call at T = 65,536 (docs/kernels.md). Here each product
is one bf16 GEMM with float32 accumulation (the tensor cores): its float32 operand split
into three bf16 parts (`split`: 3 x 8 significand bits hold float32's 24) side by side on a
free axis of the product, its bf16 operand as it is. A product of two bf16 values is exact
in float32, so each result is a sum of exact products in float32, as the float32 GEMM's is.

Both are `jax.custom_vjp`s whose backward passes are the same two products (autodiff of the
split would round the cotangents to bf16).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

F32, BF16 = jnp.float32, jnp.bfloat16
PARTS = 3  # bf16 parts of a float32 operand


def split(x: Float[Array, "... n"]) -> Float[Array, "... 3n"]:
    """bf16 [..., PARTS n]: x = hi + mid + lo to float32 precision, the parts side by side
    on the last axis (each remainder is exact in float32; the last part rounds at 2^-27 of
    x, below float32's own rounding)."""
    parts, rest = [], x.astype(F32)
    for _ in range(PARTS):
        part = rest.astype(BF16)
        parts.append(part)
        rest = rest - part.astype(F32)
    return jnp.concatenate(parts, axis=-1)


def rows_times(x: Float[Array, "... C d"], m: Float[Array, "... d k"]) -> Float[Array, "... C k"]:
    """x @ m in float32 for bf16 rows x and a float32 matrix m: one tensor-core GEMM."""
    y = jnp.einsum("...cd,...dk->...ck", x.astype(BF16), split(m),
                   preferred_element_type=F32)  # [..., C, PARTS k]
    return jnp.sum(y.reshape(*y.shape[:-1], PARTS, -1), axis=-2)


def rows_gram(a: Float[Array, "... C d"], x: Float[Array, "... C k"]) -> Float[Array, "... d k"]:
    """a^T x in float32 for float32 rows a and bf16 rows x: one tensor-core GEMM."""
    y = jnp.einsum("...ci,...cj->...ij", split(a), x.astype(BF16),
                   preferred_element_type=F32)  # [..., PARTS d, k]
    return jnp.sum(y.reshape(*y.shape[:-2], PARTS, -1, y.shape[-1]), axis=-3)


def _weights(ls: Float[Array, "... C"]) -> Float[Array, "... C"]:
    return jnp.exp(2.0 * ls)


@jax.custom_vjp
def normalizer_state(x: Float[Array, "... C d"], ls: Float[Array, "... C"]
                     ) -> Float[Array, "... d d"]:
    """z [..., d, d] float32 = sum_r e^(2 ls_r) x_r x_r^T, for bf16 rows x [..., C, d] and
    float32 ls [..., C] (phi(x_r e^ls_r) summed, in the square layout)."""
    return rows_gram(x.astype(F32) * _weights(ls)[..., None], x)


def _state_fwd(x, ls):
    return normalizer_state(x, ls), (x, ls)


def _state_bwd(res, dz):
    x, ls = res
    w = _weights(ls)
    m = rows_times(x, dz + jnp.swapaxes(dz, -1, -2))  # [..., C, d]: (dz + dz^T) x_r
    return (m * w[..., None]).astype(x.dtype), w * jnp.sum(m * x.astype(F32), axis=-1)


normalizer_state.defvjp(_state_fwd, _state_bwd)


@jax.custom_vjp
def normalizer_rows(x: Float[Array, "... C d"], ls: Float[Array, "... C"],
                    z: Float[Array, "... d d"]) -> Float[Array, "... C"]:
    """den [..., C] float32 = e^(2 ls_r) x_r^T Z x_r, for bf16 rows x [..., C, d], float32
    ls [..., C] and a float32 normalizer state Z [..., d, d]."""
    return _rows_fwd(x, ls, z)[0]


def _rows_fwd(x, ls, z):
    den = _weights(ls) * jnp.sum(rows_times(x, z) * x.astype(F32), axis=-1)
    return den, (x, ls, z, den)


def _rows_bwd(res, dden):
    x, ls, z, den = res
    c = dden * _weights(ls)  # [..., C]
    dz = rows_gram(x.astype(F32) * c[..., None], x)
    dx = rows_times(x, z + jnp.swapaxes(z, -1, -2)) * c[..., None]
    return dx.astype(x.dtype), 2.0 * dden * den, dz


normalizer_rows.defvjp(_rows_fwd, _rows_bwd)
