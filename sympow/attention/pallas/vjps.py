"""The four primitives of the portable tier, each a `jax.custom_vjp` with named residuals.

Each forward and backward runs Pallas kernels, so the op's public custom_vjp (which
differentiates the composed chunked forward with jax.vjp) runs kernels only. Inputs are
already in the kernels' shapes (padded by `primitives.py`) and described by a `Plan`.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from sympow.attention.pallas import attention_kernels, prefix_kernels, state_kernels
from sympow.attention.pallas.plan import Plan, PrefixPlan
from sympow.numerics import safe_divide, safe_reciprocal


class UpdateResiduals(NamedTuple):
    k: jax.Array
    v: jax.Array
    tail: jax.Array


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def update_state(plan: Plan, k, v, tail):
    """Per-chunk states with each key decayed by exp(tail) (tail <= 0, [B, Hk, N, C])."""
    return _update_fwd(plan, k, v, tail)[0]


def _update_fwd(plan, k, v, tail):
    s, z = state_kernels.rows_to_state(k, tail / plan.p, v, None, plan,
                                      name="sympow_update_state")
    return (s, z), UpdateResiduals(k, v, tail)


def _update_bwd(plan, res: UpdateResiduals, cts):
    ds, dz = cts
    ls = res.tail / plan.p  # phi(K e^ls) = e^tail phi(K): the kernels scale rows by e^ls
    dk, dls = state_kernels.rows_grad(res.k, ls, ds, dz, res.v, None, plan,
                                     name="sympow_update_state_dk")
    dv = state_kernels.rows_product(res.k, ls, ds, plan, name="sympow_update_state_dv")
    return dk, dv, dls / plan.p


update_state.defvjp(_update_fwd, _update_bwd)


class PrefixResiduals(NamedTuple):
    s_in: jax.Array
    z_in: jax.Array
    decay: jax.Array
    weights: jax.Array | None


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def prefix_sum(plan: PrefixPlan, s, z, g_last, weights=None):
    """(s_in, z_in, s_final, z_final) of the gated prefix sum (`prefix_kernels.prefix_fwd`;
    s and z may be tuples of groups, one launch over them all). weights [F] (or None; with
    groups a tuple of each group's [F_g]): the features' weights in g_last's cotangent
    (`prefix_kernels.prefix_bwd`); constants, no cotangent of their own."""
    return _prefix_fwd(plan, s, z, g_last, weights)[0]


def _prefix_fwd(plan, s, z, g_last, weights):
    decay = jnp.exp(g_last)
    out = prefix_kernels.prefix_fwd(s, z, decay, plan)
    return out, PrefixResiduals(out[0], out[1], decay, weights)


def _prefix_bwd(plan, res: PrefixResiduals, cts):
    ds, dz, ddecay = prefix_kernels.prefix_bwd(res.s_in, res.z_in, res.decay, *cts, plan,
                                               weights=res.weights)
    return ds, dz, ddecay * res.decay, None


prefix_sum.defvjp(_prefix_fwd, _prefix_bwd)


class AttentionResiduals(NamedTuple):
    q: jax.Array
    k: jax.Array
    v: jax.Array
    a: jax.Array
    m: jax.Array


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def attention(plan: Plan, q, k, v, a):
    """Intra-chunk attention (o, den, m) for log gates a [B, Hk, N, C] (attention_kernels)."""
    return _attention_fwd(plan, q, k, v, a)[0]


def _attention_fwd(plan, q, k, v, a):
    head, tail = attention_kernels.block_gate_sums(a, plan)
    o, den, m = attention_kernels.attention_fwd(q, k, v, a, head, tail, plan)
    return (o, den, m), AttentionResiduals(q, k, v, a, m)


def _attention_bwd(plan, res: AttentionResiduals, cts):
    do, dden, _ = cts  # m is a stop_gradient'ed row max, as in the oracle: no cotangent
    head, tail = attention_kernels.block_gate_sums(res.a, plan)
    return attention_kernels.attention_bwd(res.q, res.k, res.v, res.a, head, tail, res.m, do,
                                           dden, plan)


attention.defvjp(_attention_fwd, _attention_bwd)


def normalizer_cotangent(plan: Plan, do, y, dden):
    """The cotangent of den for y = o / den, -(do . y) [B, H, N, C], from the kernels'
    arithmetic (`attention_kernels.row_dots`) where `plan.dden_in_kernel_order` (float32
    products); else `dden`, the same quantity as XLA formed it (bf16 kernels round do and v
    to bf16: a dot of rounded y would move dden by y's rounding)."""
    if not plan.dden_in_kernel_order:
        return dden
    return -attention_kernels.row_dots(do, y, plan)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def normalized(plan: Plan, o, den):
    """y = o / den [B, H, N, C, E] for o [B, H, N, C, E] and den [B, H, N, C] (0 where
    den = 0, as `numerics.safe_divide`), its cotangent of den `normalizer_cotangent`'s: the
    attention form's output from the attention kernels' (o, den)."""
    return safe_divide(o, den)


def _normalized_fwd(plan, o, den):
    y = safe_divide(o, den)
    return y, (den, y)


def _normalized_bwd(plan, res, dy):
    den, y = res  # dy / dden of o / den: -(dy . o) / den^2 = -(do . y)
    do = dy * safe_reciprocal(den)[..., None]
    return do, normalizer_cotangent(plan, do, y, -jnp.sum(do * y, axis=-1))


normalized.defvjp(_normalized_fwd, _normalized_bwd)


class QueryResiduals(NamedTuple):
    q: jax.Array
    s_in: jax.Array
    z_in: jax.Array
    g: jax.Array
    o: jax.Array
    den: jax.Array
    y: jax.Array
    c_intra: jax.Array  # w_intra / total per row: y = o c_intra + inter_o c_inter
    c_inter: jax.Array


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def query_state(plan: Plan, q, s_in, z_in, g, o, den, m):
    return _query_fwd(plan, q, s_in, z_in, g, o, den, m)[0]


def _query_fwd(plan, q, s_in, z_in, g, o, den, m):
    y, ci, ce = state_kernels.query_rows(q, g / plan.p, s_in, z_in, o, den, m, plan)
    return y, QueryResiduals(q, s_in, z_in, g, o, den, y, ci, ce)


def _query_bwd(plan, res: QueryResiduals, dy):
    b, hq, n, c, _ = res.q.shape
    hk = res.g.shape[1]
    ci, ce = res.c_intra[..., None], res.c_inter[..., None]
    delta = jnp.sum(dy * res.y, axis=-1, keepdims=True)  # y = num / total: d total = -delta
    do = dy * ci
    dden = normalizer_cotangent(plan, do, res.y, (-delta * ci)[..., 0])
    dm = (ci * (jnp.sum(dy * res.o, axis=-1, keepdims=True) - delta * res.den[..., None]))[..., 0]
    d_inter_o, d_inter_den = dy * ce, (-delta * ce)[..., 0]
    ls = res.g / plan.p
    dq, dls = state_kernels.rows_grad(res.q, ls, res.s_in, res.z_in, d_inter_o, d_inter_den,
                                     plan, name="sympow_query_state_dq")
    ds_in, dz_in = state_kernels.rows_to_state(res.q, ls, d_inter_o, d_inter_den, plan,
                                              name="sympow_query_state_ds")
    dg = dls.reshape(b, hk, hq // hk, n, c).sum(axis=2) / plan.p
    return dq, ds_in, dz_in, dg, do, dden, dm


query_state.defvjp(_query_fwd, _query_bwd)
