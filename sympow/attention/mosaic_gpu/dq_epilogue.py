"""The Hopper backward's dQ epilogue: dq and dhead from the kernel's two float32 dQ partials
in one streaming pass (a Pallas Triton kernel; the interpreter elsewhere).

The one-pass backward kernel leaves dQ in two float32 partials of q's shape: the
off-diagonal one (ds^T K reduced over the key blocks below each query block) and the
diagonal blocks'. What the gate cotangent needs of them, per query row i:

    dq_i    = (dQ_off_i + dQ_diag_i) in q's dtype,
    dhead_i = q_i . dQ_off_i / p     (dl summed over the keys of earlier blocks).

In the chunked algorithm's chunk layout XLA formed them in two fusions and laid dQ_off out
transposed to [.., D, C] for dhead's product (the layout of the q^T the state kernels
read): a float32 copy of q's size alive at the call's peak (docs/kernels.md). A kernel
takes its operands row-major, so here both come from one read of each partial in the
layout the backward kernel wrote: on an H100 at T = 65,536, H = 8, 0.15 ms (~2.6 TB/s;
with a 0.07 ms cast XLA keeps after it, 0.22) against XLA's 0.34, and the call's peak
1.66 -> 1.43 GiB.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jaxtyping import Array, Float

from sympow.attention.pallas.launch import launch

F32 = jnp.float32
ELEMENTS = 1 << 14  # of each operand a program holds: 256 rows of 64, 128 of 128
WARPS = 4


class RowPlan(NamedTuple):
    """What `launch` reads of a plan: the interpreter or Triton, and its pipelining depth."""

    interpret: bool
    stages: int = 1


def _epilogue_kernel(q_ref, off_ref, diag_ref, dq_ref, dhead_ref, *, p: int):
    off = off_ref[...]  # [R, D] float32
    dq_ref[...] = (off + diag_ref[...]).astype(dq_ref.dtype)
    dhead_ref[...] = jnp.sum(q_ref[...].astype(F32) * off, axis=1) / p


def rows_per_program(rows: int, width: int) -> int:
    """Rows of one program: the largest power of two that divides `rows` and keeps a
    program's block of each operand within ELEMENTS."""
    block = max(1, ELEMENTS // width)
    while rows % block:
        block //= 2
    return block


def dq_and_dhead(
    q: Float[Array, "... D"],
    dq_off: Float[Array, "... D"],
    dq_diag: Float[Array, "... D"],
    *,
    p: int,
    interpret: bool = False,
) -> tuple[Float[Array, "..."], Float[Array, "..."]]:
    """(dq [..., D] in q's dtype, dhead [...] float32) from the float32 partials dq_off and
    dq_diag, all three of q's shape in either layout ([B, Hq, N, C, D] or [B, T, Hq, D]):
    dq = dq_off + dq_diag, dhead = q . dq_off / p per row (see the module docstring)."""
    if dq_off.shape != q.shape or dq_diag.shape != q.shape:
        raise ValueError(f"dq_off and dq_diag must have q's shape {q.shape}; got "
                         f"{dq_off.shape} and {dq_diag.shape}")
    if dq_off.dtype != F32 or dq_diag.dtype != F32:
        raise ValueError(f"dq_off and dq_diag must be float32; got {dq_off.dtype} and "
                         f"{dq_diag.dtype}")
    *lead, width = q.shape
    rows = q.size // width
    block = rows_per_program(rows, width)
    flat = lambda x: x.reshape(rows, width)  # noqa: E731
    wide = pl.BlockSpec((block, width), lambda i: (i, 0))
    dq, dhead = launch(
        lambda *refs: _epilogue_kernel(*refs, p=p), plan=RowPlan(interpret),
        name="sympow_dq_epilogue", grid=(rows // block,),
        in_specs=[wide, wide, wide],
        out_specs=[wide, pl.BlockSpec((block,), lambda i: (i,))],
        out_shape=[jax.ShapeDtypeStruct((rows, width), q.dtype),
                   jax.ShapeDtypeStruct((rows,), F32)],
        warps=WARPS)(flat(q), flat(dq_off), flat(dq_diag))
    return dq.reshape(q.shape), dhead.reshape(lead)
