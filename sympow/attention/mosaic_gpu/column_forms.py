"""col = x^T e^(2 ls), the state kernels' scaling of their operands, as a kernel takes it:
stored ([B, Hx, N, D, C], bf16 or float32, written by XLA: `states.columns`) or formed by
the kernel where it loads it from x^T and e^(2 ls) (`Columns`; `states.FORMED_COLUMNS`).
"""

from __future__ import annotations

from typing import NamedTuple

import jax.numpy as jnp
from jaxtyping import Array

F32, BF16 = jnp.float32, jnp.bfloat16


class Columns(NamedTuple):
    """col = x^T e^(2 ls) formed by the kernel where it loads it, from

    xt [B, Hx, N, D, C] bf16: the rows x transposed (which rows_to_state reads anyway);
    w [B, Hx, N, C] float32: e^(2 ls) per row,

    each entry xt_ir w_r rounded to bf16 in the kernel: the numbers `states.columns`
    stores (the same float32 product, rounded once), without the [D, C] array XLA would
    write and keep for the backward (at T = 65,536, H = 8: 64 MiB and ~40 us a pass on an
    H200). The kernels read xt where they read col, the same bytes, and w beside it."""

    xt: Array
    w: Array


def column_parts(col) -> tuple[Array, Array | None]:
    """(source, w): the [B, Hx, N, D, C] array a kernel copies its col blocks from and the
    weights it scales them by: (col, None) for a stored col, a `Columns`' (xt, w)."""
    return (col.xt, col.w) if isinstance(col, Columns) else (col, None)


def formed_column(x, w):
    """A col vector as the tensor cores take it, bf16: a stored col's x, or (w given) x the
    rows' xt entries times their weights w, in float32, rounded once (`Columns`)."""
    return x.astype(BF16) if w is None else (x.astype(F32) * w).astype(BF16)


def stored_columns(col) -> Array:
    """col as an array [B, Hx, N, D, C]: itself, or a `Columns`' entries formed as the
    kernels form them (bf16)."""
    if not isinstance(col, Columns):
        return col
    return formed_column(col.xt, col.w[..., None, :])
