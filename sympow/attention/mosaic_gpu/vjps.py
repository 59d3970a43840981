"""The Hopper tier's attention primitive: the Mosaic GPU forward, the portable backward.

`attention(plan, q, k, v, a)` computes what `sympow.attention.pallas.vjps.attention` does,
with the same residuals, so that one backward serves both: the forward runs
`attention_kernels.attention_fwd` (wgmma, TMA, warp specialization) where `unsupported`
finds nothing against it, and the portable tier's forward kernel otherwise, with the reason
logged once. The backward kernels are the portable tier's until the Hopper tier has its own.
"""

from __future__ import annotations

import functools
import logging

import jax

from sympow.attention.mosaic_gpu import attention_kernels
from sympow.attention.pallas import attention_kernels as portable_kernels
from sympow.attention.pallas import vjps as portable
from sympow.attention.pallas.plan import Plan

logger = logging.getLogger(__name__)
HOPPER = "9.0"  # the compute capability of the H100 and H200: wgmma and TMA need it


@functools.lru_cache(maxsize=8)
def _compute_capability() -> str | None:
    try:
        return getattr(jax.local_devices(backend="gpu")[0], "compute_capability", None)
    except RuntimeError:  # no GPU backend in this process
        return None


def unsupported(plan: Plan) -> str | None:
    """Why the Mosaic GPU forward cannot run `plan`'s problem, or None."""
    if plan.interpret:
        return "the interpreter (the Mosaic GPU kernels run on a Hopper GPU only)"
    if plan.dtype != "bfloat16" or plan.mm != "bfloat16":
        return f"dtype {plan.dtype} with matmul dtype {plan.mm} (supported: bfloat16)"
    if plan.d not in attention_kernels.WIDTHS or plan.e not in attention_kernels.WIDTHS:
        return f"d={plan.d}, e={plan.e} (supported: {attention_kernels.WIDTHS})"
    if plan.c % attention_kernels.TILE_ROWS or plan.attn_bq != attention_kernels.ROWS:
        return (f"chunk {plan.c} with blocks of {plan.attn_bq} (supported: multiples of "
                f"{attention_kernels.TILE_ROWS} rows in blocks of {attention_kernels.ROWS})")
    capability = _compute_capability()
    if capability != HOPPER:
        return f"GPU compute capability {capability} (supported: {HOPPER})"
    return None


@functools.lru_cache(maxsize=64)
def _log_fallback(reason: str) -> None:
    logger.warning("sympow impl='mosaic_gpu': the attention forward runs the portable tier's "
                   "kernel for %s", reason)


def attention(plan: Plan, q, k, v, a):
    """Intra-chunk attention (o, den, m) for log gates a [B, Hk, N, C], as the portable tier's
    `vjps.attention` (whose backward it shares)."""
    reason = unsupported(plan)
    if reason is not None:
        _log_fallback(reason)
        return portable.attention(plan, q, k, v, a)
    return _hopper_attention(plan, q, k, v, a)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _hopper_attention(plan: Plan, q, k, v, a):
    return _attention_fwd(plan, q, k, v, a)[0]


def _attention_fwd(plan, q, k, v, a):
    head, tail = portable_kernels.block_gate_sums(a, plan)
    o, den, m = attention_kernels.attention_fwd(q, k, v, a, head, tail, p=plan.p)
    return (o, den, m), portable.AttentionResiduals(q, k, v, a, m)


_hopper_attention.defvjp(_attention_fwd, portable.attention_backward)
