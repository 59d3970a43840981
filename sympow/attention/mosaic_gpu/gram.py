"""The square layout's normalizer sums: weighted gram matrices per chunk, float32-accurate, in
one streaming pass over the bf16 rows (a Pallas Triton kernel; the interpreter elsewhere).

For p = 2 the normalizer state z of a chunk is the symmetric d x d matrix

    G = sum over the rows r of the chunk and the heads of a kv group of w_r x_r x_r^T,

with x the bf16 rows (keys, or queries in the backward) and w a float32 weight per row
(e^(2 ls), or dden e^(2 ls) for the query side's z cotangent). The normalizer is divided
by, so G must be float32-accurate, not a bf16 product. XLA ran it as one einsum with the
`BF16_BF16_F32_X6` algorithm, and for that wrote the float32 product w x of the rows' size
first (128 MiB at T = 65,536, H = 8): alive at the chunked call's peak (docs/kernels.md).

Here a program owns one (chunk, kv head), walks its rows ROWS_PER_STEP at a time, forms w x
in float32 registers, splits it in three bf16 parts (`blocks.bf16_parts`: their sum is w x
to float32 accuracy) and sums part^T x on the tensor cores for each: x is bf16, so every
product is exact in float32 and only the sums round. The tensor cores' float32 accumulator
does not round to nearest (on an H100 a kernel that accumulated all of a chunk's products
in it erred 1.5e-6 of an entry's scale, against 2.4e-7 for XLA's einsum), so each step's
three products start from zero and the step's sum joins the running one in an ordinary
float32 add. Nothing but G is written.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jaxtyping import Array, Float

from sympow.attention.mosaic_gpu.blocks import bf16_parts
from sympow.attention.pallas.launch import LaunchPlan, idiv, irem, launch, split_heads

F32, BF16 = jnp.float32, jnp.bfloat16
ROWS_PER_STEP = 64  # rows of one step's products: a multiple of every supported chunk
WARPS = 4
STAGES = 3  # Triton's pipelining of the steps' loads


def _gram_kernel(x_ref, w_ref, g_ref, *, groups: int, steps: int):
    d = x_ref.shape[-1]

    def step(i, acc):
        head = idiv(i, steps)
        rows = pl.ds(pl.multiple_of(irem(i, steps) * ROWS_PER_STEP, ROWS_PER_STEP),
                     ROWS_PER_STEP)
        x = x_ref[head, rows, :]  # [ROWS, D] bf16
        xw = x.astype(F32) * w_ref[head, rows][:, None]  # [ROWS, D] float32
        step_sum = None  # this step's products, from zero: see the module docstring
        for part in bf16_parts(xw):  # smallest first: small parts round least
            product = jax.lax.dot_general(part, x, (((0,), (0,)), ((), ())),
                                          preferred_element_type=F32)
            step_sum = product if step_sum is None else step_sum + product
        return acc + step_sum

    g_ref[...] = jax.lax.fori_loop(0, groups * steps, step, jnp.zeros((d, d), F32))


def weighted_gram(
    x: Float[Array, "B Hx N C D"],
    weights: Float[Array, "B Hx N C"],
    *,
    kv_heads: int,
    interpret: bool = False,
) -> Float[Array, "B Hk N D D"]:
    """G [B, Hk, N, D, D] float32: for chunk n and kv head h, the sum over the chunk's rows
    r and the query heads of group h (heads h R .. h R + R - 1, R = Hx / Hk) of
    weights_r x_r x_r^T, float32-accurate (see the module docstring).

    x [B, Hx, N, C, D] bf16 (C a multiple of ROWS_PER_STEP); weights [B, Hx, N, C]
    float32."""
    b, hx, n, c, d = x.shape
    if x.dtype != BF16:
        raise ValueError(f"x must be bfloat16 (its products are exact only so); got {x.dtype}")
    if weights.shape != x.shape[:-1]:
        raise ValueError(f"weights must have shape {x.shape[:-1]} (x's without D); got "
                         f"{weights.shape}")
    if hx % kv_heads:
        raise ValueError(f"kv_heads={kv_heads} must divide x's {hx} heads (shape {x.shape})")
    if c % ROWS_PER_STEP:
        raise ValueError(f"x's chunk of {c} rows (shape {x.shape}) must be a multiple of "
                         f"{ROWS_PER_STEP}")
    groups = hx // kv_heads
    at = lambda *blk: lambda n_, bh: (*split_heads(bh, kv_heads), n_) + blk  # noqa: E731
    return launch(
        lambda *refs: _gram_kernel(*refs, groups=groups, steps=c // ROWS_PER_STEP),
        plan=LaunchPlan(interpret, STAGES), name="sympow_weighted_gram",
        grid=(n, b * kv_heads),
        in_specs=[pl.BlockSpec((None, groups, None, c, d), at(0, 0)),
                  pl.BlockSpec((None, groups, None, c), at(0))],
        out_specs=pl.BlockSpec((None, None, None, d, d), at(0, 0)),
        out_shape=jax.ShapeDtypeStruct((b, kv_heads, n, d, d), F32),
        warps=WARPS)(x, weights.astype(F32))
