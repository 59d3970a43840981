"""The Hopper tier's attention primitive: Mosaic GPU forward and backward kernels.

`attention(plan, q, k, v, a)` computes what `sympow.attention.pallas.vjps.attention` does,
with the same residuals: where `unsupported` finds nothing against it, under its own
custom_vjp whose forward and backward run `attention_kernels` (wgmma, TMA, warp
specialization); otherwise the portable tier's primitive, with the reason logged once.

The backward's gate cotangent comes from local sums as in the portable tier
(`chunked.block_gate_cotangent`): dhead and the block-pair totals from the dQ kernel, dtail
from the dK, dV kernel, and the diagonal blocks' straddle sums here, in float32 XLA over
the recomputed diagonal blocks only (T x 64 scores per head: a diagonal block's sums run
down its rows, which a wgmma result spreads over warps).
"""

from __future__ import annotations

import functools
import logging
from typing import NamedTuple

import jax
import jax.numpy as jnp

from sympow.attention import chunked
from sympow.attention.mosaic_gpu import attention_kernels, blocks
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
    """Why the Mosaic GPU kernels cannot run `plan`'s problem, or None."""
    if plan.interpret:
        return "the interpreter (the Mosaic GPU kernels run on a Hopper GPU only)"
    if plan.dtype != "bfloat16" or plan.mm != "bfloat16":
        return f"dtype {plan.dtype} with matmul dtype {plan.mm} (supported: bfloat16)"
    if plan.d not in blocks.WIDTHS or plan.e not in blocks.WIDTHS:
        return f"d={plan.d}, e={plan.e} (supported: {blocks.WIDTHS})"
    if plan.c % blocks.TILE_ROWS or plan.attn_bq != blocks.ROWS:
        return (f"chunk {plan.c} with blocks of {plan.attn_bq} (supported: multiples of "
                f"{blocks.TILE_ROWS} rows in blocks of {blocks.ROWS})")
    return not_hopper()


def not_hopper() -> str | None:
    """Why this process's GPU cannot run the tier's kernels, or None on a Hopper GPU."""
    capability = _compute_capability()
    if capability != HOPPER:
        return f"GPU compute capability {capability} (supported: {HOPPER})"
    return None


@functools.lru_cache(maxsize=64)
def log_fallback(kernels: str, reason: str) -> None:
    """Logs once per (kernels, reason) that the portable tier's `kernels` kernels run."""
    logger.warning("sympow impl='mosaic_gpu': the %s kernels of the portable tier run for %s",
                   kernels, reason)


def attention(plan: Plan, q, k, v, a):
    """Intra-chunk attention (o, den, m) for log gates a [B, Hk, N, C], as the portable tier's
    `vjps.attention`."""
    reason = unsupported(plan)
    if reason is not None:
        log_fallback("attention", reason)
        return portable.attention(plan, q, k, v, a)
    return _hopper_attention(plan, q, k, v, a)


class Residuals(NamedTuple):
    q: jax.Array
    k: jax.Array
    v: jax.Array
    a: jax.Array
    m: jax.Array
    c: jax.Array  # the rows' scale exponents (`attention_kernels.attention_fwd`)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _hopper_attention(plan: Plan, q, k, v, a):
    return _attention_fwd(plan, q, k, v, a)[0]


def _attention_fwd(plan, q, k, v, a):
    head, tail = portable_kernels.block_gate_sums(a, plan)
    o, den, m, c = attention_kernels.attention_fwd(q, k, v, a, head, tail, p=plan.p)
    return (o, den, m), Residuals(q, k, v, a, m, c)


def diagonal_straddle(q, k, v, a, m, do, dden, p: int):
    """sum_{i >= k > j} dl_ij within each diagonal block of ROWS (float32 [B, Hq, N, C]):
    the blocks' scores, weights and dl recomputed in float32 from the saved row max m, with
    the in-block decays as exact sums (the portable kernels' diagonal). The scores and
    do . v are GEMMs of the bf16 rows with float32 accumulation: a product of two bf16
    values is exact in float32, so they equal float32 products of the same values."""
    b, hq, n, c, d = q.shape
    hk, rows = k.shape[1], blocks.ROWS
    groups, nb = hq // hk, c // rows
    f32 = jnp.float32
    in_blocks = lambda x, h: x.reshape(b, h, n, nb, rows, *x.shape[4:])  # noqa: E731
    by_group = lambda x: x.reshape(b, hk, groups, *x.shape[2:])  # noqa: E731
    qb, dob = (by_group(in_blocks(x, hq)) for x in (q, do))  # [b,hk,r,n,x,i,.]
    kb, vb = (in_blocks(x, hk) for x in (k, v))  # [b,hk,n,x,j,.]
    mb, ddb = (by_group(in_blocks(x, hq)) for x in (m, dden))  # [b,hk,r,n,x,i]
    s = jnp.einsum("bhrnxid,bhnxjd->bhrnxij", qb, kb, preferred_element_type=f32)
    index = jnp.arange(rows)
    ab = in_blocks(a, hk)[:, :, None]  # [b,hk,1,n,x,k]
    terms = jnp.where(index[:, None] > index[None, :], ab[..., :, None], 0.0)  # [k, j]
    decay = jnp.cumsum(terms, axis=-2)  # [i, j] = sum_{j < k <= i} a_k
    valid = (s != 0) & (index[:, None] >= index[None, :])
    logit = jnp.where(valid, p * jnp.log(jnp.abs(jnp.where(valid, s, 1.0))) + decay, -jnp.inf)
    w = jnp.exp(logit - mb[..., None])
    dw = jnp.einsum("bhrnxie,bhnxje->bhrnxij", dob, vb, preferred_element_type=f32)
    dw = dw + ddb[..., None]
    return chunked.diagonal_straddle(w * dw).reshape(b, hq, n, c)


def _attention_bwd(plan, res: Residuals, cts):
    do, dden, _ = cts  # m is a stop_gradient'ed row max, as in the oracle: no cotangent
    q, k, v, a, m, scales = res
    b, hq, n, c, _ = q.shape
    hk, rows = k.shape[1], blocks.ROWS
    nb = c // rows
    head, tail = portable_kernels.block_gate_sums(a, plan)
    do = do.astype(q.dtype)
    (dq, dhead, pairs), (dk, dv, dtail) = attention_kernels.attention_bwd(
        q, k, v, a, head, tail, m, scales, do, dden, p=plan.p)
    ddiag = diagonal_straddle(q, k, v, a, m, do, dden, plan.p)
    below = jnp.arange(nb)[:, None] > jnp.arange(nb)[None, :]  # [I, J]: the pairs written
    pairs = jnp.where(below, pairs[..., :nb], 0.0)
    per_kv_head = lambda x: x.reshape(b, hk, hq // hk, *x.shape[2:]).sum(axis=2)  # noqa: E731
    in_blocks = lambda x: x.reshape(b, hk, n, nb, rows)  # noqa: E731
    da = chunked.block_gate_cotangent(
        in_blocks(per_kv_head(dhead)), in_blocks(dtail), in_blocks(per_kv_head(ddiag)),
        per_kv_head(pairs))
    return dq, dk, dv, da.reshape(a.shape)


_hopper_attention.defvjp(_attention_fwd, _attention_bwd)
