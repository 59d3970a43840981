"""The pieces of `nnx.Linear` that the layers split apart: its product without the bias, and
the MLP's bias + GELU recomputed in the backward.

A layer that adds a Linear's bias somewhere else than right after the product (inside a
kernel, or inside the GELU's fusion) takes the product from `product` and the bias from the
module; the numbers are those of `linear(x)`. Also the shape checks of the layers' inputs
(`check_input`, `check_valid`), kept here to keep the layers' module short.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Float

__all__ = ["bias_gelu", "check_input", "check_valid", "product", "products_side_by_side",
           "shape_of"]


def shape_of(x) -> str:
    """x's shape and dtype for an error message, or its type where it has none (a list,
    None)."""
    if getattr(x, "shape", None) is None:
        return f"of type {type(x).__name__}"
    return f"shape {tuple(x.shape)} and dtype {getattr(x, 'dtype', None)}"


def check_input(x, d_model: int, *, one_token: bool = False) -> None:
    """ValueError unless x is [B, T, C] with C = d_model and T >= 1 (one_token: T = 1, a
    decoding step's). Shapes only: x may be traced."""
    shape = getattr(x, "shape", ())
    if len(shape) != 3 or shape[2] != d_model or shape[1] < 1 or (one_token and shape[1] != 1):
        want = "[B, 1, C] with C = d_model = {} (one token)" if one_token else (
            "[B, T, C] with C = d_model = {} and T >= 1")
        raise ValueError(f"x must be {want.format(d_model)}, got {shape_of(x)}")


def check_valid(valid, x) -> None:
    """ValueError unless a prefill's valid mask is None or bool [B, T] like x [B, T, C] (its
    values, each row's valid tokens at its end, may be traced: the caller's to get right)."""
    if valid is None:
        return
    b, t = x.shape[:2]
    if getattr(valid, "shape", None) != (b, t) or valid.dtype != jnp.bool_:
        raise ValueError(f"valid must be bool [B, T] with T = {t} and B = {b} (the prompt), "
                         f"got {shape_of(valid)}")


def product(linear: nnx.Linear, x: Float[Array, "... C"],
            kernel: Float[Array, "C N"] | None = None) -> Float[Array, "... N"]:
    """`linear(x)` without its bias: the same promotion and product as `nnx.Linear`; kernel:
    another [C, N] kernel multiplied as linear multiplies its own (None: its own)."""
    kernel = linear.kernel[...] if kernel is None else kernel
    x, kernel = linear.promote_dtype((x, kernel), dtype=linear.dtype)
    return linear.dot_general(x, kernel, (((x.ndim - 1,), (0,)), ((), ())),
                              precision=linear.precision)


def products_side_by_side(linears: Sequence[nnx.Linear], x: Float[Array, "... C"]
                          ) -> list[Float[Array, "... N_i"]]:
    """`[linear(x) for linear in linears]` from one product of x with their kernels side by
    side ([C, sum N_i]), each output then sliced out and given its bias.

    The backward then makes x's cotangent from these linears with one product, not one per
    linear plus a pass that sums them. The linears must compute alike (dtype, precision and
    dot_general; ValueError otherwise), so that x is promoted once.
    """
    first = linears[0]
    for linear in linears[1:]:
        if (linear.dtype, linear.precision, linear.dot_general) != (
                first.dtype, first.precision, first.dot_general):
            raise ValueError("products_side_by_side needs linears of one dtype, precision "
                             f"and dot_general, got {[(m.dtype, m.precision) for m in linears]}")
    if len(linears) == 1:
        return [first(x)]
    kernel = jnp.concatenate([linear.kernel[...] for linear in linears], axis=1)  # [C, sum N]
    y = product(first, x, kernel)  # [..., sum N]
    outputs, start = [], 0
    for linear in linears:
        width = linear.out_features
        out = y[..., start:start + width]
        if linear.bias is not None:
            out = out + linear.bias[...].astype(out.dtype)
        outputs.append(out)
        start += width
    return outputs


@jax.checkpoint
def bias_gelu(h: Float[Array, "... N"], bias: Float[Array, " N"]) -> Float[Array, "... N"]:
    """GPT-2's tanh-approximate GELU of h + bias (bias cast to h's dtype, as `nnx.Linear`
    adds it), recomputed in the backward from h and the bias.

    Without the recompute XLA's forward fusion writes a second [..., N] array beside the
    output for the backward to read (the MLP's hidden width: 4 C a token); with it the
    forward writes the output alone and the backward reads h, which stays alive anyway as
    the product's output (docs/kernels.md, "The MLP's GELU recomputed").
    """
    return jax.nn.gelu(h + bias.astype(h.dtype))
