"""The Hopper tier's attention primitive: Mosaic GPU forward and backward kernels.

`attention(plan, q, k, v, a)` computes what `sympow.attention.pallas.vjps.attention` does,
with the same residuals: where `unsupported` finds nothing against it, under its own
custom_vjp whose forward and backward run `attention_kernels` and `backward_kernel`
(wgmma, TMA, warp specialization); otherwise the portable tier's primitive, with the reason
logged once.

`normalized_in_tokens` is the attention form's call: the wide arrays in token layout and the
output y = o / den from the forward kernel, under a custom_vjp of its own.

The backward's gate cotangent comes from local sums as in the portable tier
(`chunked.block_gate_cotangent`): dhead, dtail, the block-pair totals and the diagonal
blocks' straddle sums from the one-pass backward kernel and its epilogue
(`backward_kernel.assemble`).
"""

from __future__ import annotations

import functools
import logging
from typing import NamedTuple

import jax
import jax.numpy as jnp

from sympow import numerics
from sympow.attention import chunked
from sympow.attention.mosaic_gpu import attention_kernels, backward_kernel, blocks
from sympow.attention.pallas import attention_kernels as portable_kernels
from sympow.attention.pallas import vjps as portable
from sympow.attention.pallas.plan import Plan

logger = logging.getLogger(__name__)
F32 = jnp.float32
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


def attention(plan: Plan, q, k, v, a, *, o_dtype: str = "float32"):
    """Intra-chunk attention (o, den, m) for log gates a [B, Hk, N, C], as the portable tier's
    `vjps.attention`; o in o_dtype (float32, or q's dtype: the kernel's float32 sums rounded
    where it stores them) from the Mosaic GPU kernels, float32 from the portable ones."""
    reason = unsupported(plan)
    if reason is not None:
        log_fallback("attention", reason)
        return portable.attention(plan, q, k, v, a)
    return _hopper_attention(plan, o_dtype, q, k, v, a)


def normalized_in_tokens(plan: Plan, q, k, v, a):
    """The attention form's output y = o / den [B, T, Hq, E] in q's dtype (0 where den = 0,
    as `numerics.safe_divide`) for q [B, T, Hq, D], k [B, T, Hk, D], v [B, T, Hk, E] in
    token layout and a [B, Hk, 1, T] (one chunk: T = C); for plans that `unsupported`
    passes (the portable kernels take chunk layout only): ValueError else. The forward
    kernel divides (`attention_fwd(normalized=True)`), so no float32 o is stored; the
    backward forms o's and den's cotangents from dy and y."""
    reason = unsupported(plan)
    if reason is not None:
        raise ValueError(f"the token layout needs the Mosaic GPU kernels, which cannot run "
                         f"{reason}")
    return _hopper_normalized(plan, q, k, v, a)


class Residuals(NamedTuple):
    q: jax.Array
    k: jax.Array
    v: jax.Array
    a: jax.Array
    m: jax.Array
    c: jax.Array  # the rows' scale exponents (`attention_kernels.attention_fwd`)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _hopper_attention(plan: Plan, o_dtype: str, q, k, v, a):
    return _attention_fwd(plan, o_dtype, q, k, v, a)[0]


def _attention_fwd(plan, o_dtype, q, k, v, a):
    head, tail = portable_kernels.block_gate_sums(a, plan)
    o, den, m, c = attention_kernels.attention_fwd(q, k, v, a, head, tail, p=plan.p,
                                                   o_dtype=o_dtype)
    return (o, den, m), Residuals(q, k, v, a, m, c)


def _attention_bwd(plan, _o_dtype, res: Residuals, cts):
    do, dden, _ = cts  # m is a stop_gradient'ed row max, as in the oracle: no cotangent
    return _backward(plan, res, do, dden)


_hopper_attention.defvjp(_attention_fwd, _attention_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _hopper_normalized(plan: Plan, q, k, v, a):
    return _normalized_fwd(plan, q, k, v, a)[0]


def _normalized_fwd(plan, q, k, v, a):
    head, tail = portable_kernels.block_gate_sums(a, plan)
    y, den, m, c = attention_kernels.attention_fwd(q, k, v, a, head, tail, p=plan.p,
                                                   normalized=True)
    return y, (Residuals(q, k, v, a, m, c), y, den)


def _normalized_bwd(plan, res, dy):
    """y = o / den: do = dy / den and dden = -(dy . o) / den^2 = -(do . y); both 0 where
    den = 0 (y is 0 there whatever o is).

    dden is formed from do as the kernel takes it (rounded to q's dtype by
    `numerics.round_to`, which XLA keeps on GPU where it drops an astype round trip): the
    kernel's dw_ij = v_j . do_i + dden_i then equals (v_j - y_i) . do_i for that one do,
    which is small where a row's weight sits on few keys (v_j ~ y_i). With dden from the
    unrounded do, v_j times do's rounding stayed uncancelled: bf16 dq and dk 3-4x the bf16
    reference's error on half the seeds of gpu_check's b2_t1024_h8x8_d64_e64_p2_c256_gated
    (docs/kernels.md)."""
    res, y, den = res
    b, t, hq, _ = y.shape
    by_token = jnp.moveaxis(den.reshape(b, hq, t), 1, 2)  # [B, Hq, 1, T] -> [B, T, Hq]
    positive = by_token > 0
    inverse = jnp.where(positive, 1.0 / jnp.where(positive, by_token, 1.0), 0.0)
    do = numerics.round_to(dy.astype(F32) * inverse[..., None], res.q.dtype)  # the kernel's
    dden = -jnp.einsum("bthe,bthe->bth", do, y.astype(F32))
    return _backward(plan, res, do.astype(res.q.dtype),
                     jnp.moveaxis(dden, 2, 1).reshape(den.shape))


_hopper_normalized.defvjp(_normalized_fwd, _normalized_bwd)


def _backward(plan, res: Residuals, do, dden):
    """(dq, dk, dv, da) from the cotangents of o and den."""
    q, k, v, a, m, scales = res
    b, hk, n, c = a.shape
    hq, rows = blocks.heads_of(q), blocks.ROWS
    nb = c // rows
    head, tail = portable_kernels.block_gate_sums(a, plan)
    do = do.astype(q.dtype)
    (dq, dhead, ddiag, pairs), (dk, dv, dtail) = backward_kernel.attention_bwd(
        q, k, v, a, head, tail, m, scales, do, dden, p=plan.p)
    below = jnp.arange(nb)[:, None] > jnp.arange(nb)[None, :]  # [I, J]: the pairs written
    pairs = jnp.where(below, pairs, 0.0)
    per_kv_head = lambda x: x.reshape(b, hk, hq // hk, *x.shape[2:]).sum(axis=2)  # noqa: E731
    in_blocks = lambda x: x.reshape(b, hk, n, nb, rows)  # noqa: E731
    da = chunked.block_gate_cotangent(
        in_blocks(per_kv_head(dhead)), in_blocks(dtail), in_blocks(per_kv_head(ddiag)),
        per_kv_head(pairs))
    return dq, dk, dv, da.reshape(a.shape)
