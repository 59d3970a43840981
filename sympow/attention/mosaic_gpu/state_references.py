"""The Hopper state kernels (`state_kernels`) in plain JAX: float32, exact products.

The specification `experiments/gpu_check.py` compares the kernels with on a GPU, and what
the CPU tests put in the kernels' place to check the custom_vjps and the chunked algorithm
around them (`tests/attention/mosaic_gpu/test_states.py`). Same arguments and outputs as
the kernels (shapes in their docstrings), but every output float32 where the kernel's is
float32 or rounded as the kernel rounds it (S and dx to bf16); col stored, or
`column_forms.Columns` formed as the kernels form it (`stored_columns`).
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from sympow.attention.mosaic_gpu.column_forms import stored_columns
from sympow.attention.mosaic_gpu.state_kernels import (
    BF16,
    DIM,
    F32,
    Normalizer,
    check_slots,
)
from sympow.attention.mosaic_gpu.state_walks import BLOCK


def rows_to_state_reference(xt, col, a, *, kv_heads: int, slots: int | None = None,
                            slot_offset: int = 0, pipelined: bool = True, upper: bool = False,
                            square_products: bool = False):
    """The slots no chunk maps to hold NaN: what reads them shows. pipelined and
    square_products (the order and the shapes of the kernel's products): taken and unused.
    upper: the state in the upper layout (`upper_arrays`)."""
    del pipelined, square_products
    col = stored_columns(col)
    b, hx, n, d, c = xt.shape
    slots = n if slots is None else slots
    check_slots(slots, n, slot_offset)
    grouped = lambda x: x.reshape(b, kv_heads, hx // kv_heads, *x.shape[2:])  # noqa: E731
    s = jnp.einsum("bhgnir,bhgnjr,bhgnre->bhnije", grouped(col.astype(F32)),
                   grouped(xt.astype(F32)),
                   grouped(a.astype(F32)), precision=lax.Precision.HIGHEST)
    s = s.reshape(b, kv_heads, n, d * d, a.shape[-1]).astype(BF16)
    unwritten = jnp.full((b, kv_heads, slots, d * d, a.shape[-1]), jnp.nan, BF16)
    s = unwritten.at[:, :, slot_offset:slot_offset + n].set(s)
    return upper_arrays(s) if upper else s


def row_gradients_reference(a, x, col, s, *, normalizer: Normalizer | None = None,
                            slot_offset: int = 0, pipelined: bool = False):
    del pipelined  # the order the kernel issues its products in
    g = state_to_rows_reference(a, col, s, transposed=True, slot_offset=slot_offset)
    if normalizer is not None:
        g = g + normalizer.weights[..., None] * quadratic_product_reference(x, normalizer)
    dx = 2.0 * g
    return dx.astype(BF16), jnp.sum(dx * x.astype(F32), axis=-1)


def state_to_rows_reference(rows, col, s, *, transposed: bool,
                            normalizer: Normalizer | None = None, slot_offset: int = 0,
                            upper: bool = False, packed: bool = False, pipelined: bool = False,
                            out_dtype=F32):
    """packed and pipelined change the kernel's ring walk and the order it issues its
    products in, not its sum: taken and unused here. s: square, or a tuple in the upper
    layout (`upper_arrays`). out (not den) in out_dtype, rounded from float32."""
    del packed, pipelined
    col = stored_columns(col)
    s = square_of_upper(s) if isinstance(s, (tuple, list)) else s
    b, hx, n, c, _ = rows.shape
    d, hk = col.shape[-2], s.shape[1]
    check_slots(s.shape[2], n, slot_offset)
    s = s[:, :, slot_offset:slot_offset + n]
    s = s * upper_weights(s.dtype)[:, None] if upper else s
    blocks = jnp.repeat(s.astype(F32).reshape(b, hk, n, d, d, -1), hx // hk, axis=1)
    spec = "bhnrw,bhnir,bhnijw->bhnrj" if transposed else "bhnrw,bhnir,bhniwe->bhnre"
    out = jnp.einsum(spec, rows.astype(F32), col.astype(F32), blocks,
                     precision=lax.Precision.HIGHEST).astype(out_dtype)
    if normalizer is None:
        return out
    xz = quadratic_product_reference(rows, normalizer)
    return out, normalizer.weights * jnp.sum(xz * rows.astype(F32), axis=-1)


def upper_weights(dtype=F32):
    """[D^2]: the weight of feature (i, j) in `state_to_rows(upper=True)`'s sum, 1 in the
    diagonal blocks (i // BLOCK == j // BLOCK), 2 right of them, 0 left of them. For the
    tier's states and columns (S symmetric, col = x^T e^(2 ls), so col_ir x_rj is too)
    the weighted sum is the square one."""
    block = jnp.arange(DIM) // BLOCK
    weights = jnp.where(block[:, None] == block[None, :], 1.0,
                        jnp.where(block[:, None] < block[None, :], 2.0, 0.0))
    return weights.reshape(-1).astype(dtype)


def quadratic_product_reference(x, normalizer: Normalizer):
    """x Z [B, Hx, N, C, D] float32 for rows x [B, Hx, N, C, D] and Z the sum of the parts."""
    parts = normalizer.parts[:, :, :x.shape[2]].astype(F32)  # by chunk (more slots: unread)
    b, hk, n, three_d, d = parts.shape
    z = parts.reshape(b, hk, n, 3, d, d).sum(axis=3)
    z = jnp.repeat(z, x.shape[1] // hk, axis=1)
    return jnp.einsum("bhnci,bhnij->bhncj", x.astype(F32), z, precision=lax.Precision.HIGHEST)


def upper_arrays(s) -> tuple:
    """A state [..., D^2, E] in the upper layout (`state_walks.upper_shapes`): per 16-row
    group b of i, [..., BLOCK, D - 16 b, E] with S[(i, j)], j >= 16 b."""
    square = s.reshape(*s.shape[:-2], DIM, DIM, s.shape[-1])
    return tuple(square[..., lo:lo + BLOCK, lo:, :] for lo in range(0, DIM, BLOCK))


def square_of_upper(arrays) -> jnp.ndarray:
    """The square state [..., D^2, E] of one in the upper layout: S[(i, j)] from the group
    of i where j >= 16 (i // 16), else its mirror S[(j, i)] from the group of j."""
    lead, e = arrays[0].shape[:-3], arrays[0].shape[-1]
    placed = jnp.zeros((*lead, DIM, DIM, e), arrays[0].dtype)  # the held entries
    for lo, array in zip(range(0, DIM, BLOCK), arrays, strict=True):
        placed = placed.at[..., lo:lo + BLOCK, lo:, :].set(array)
    i, j = jnp.arange(DIM)[:, None], jnp.arange(DIM)[None, :]
    held = (j >= BLOCK * (i // BLOCK))[..., None]  # [D, D, 1]
    square = jnp.where(held, placed, jnp.swapaxes(placed, -2, -3))
    return square.reshape(*lead, DIM * DIM, e)
