"""Intra-chunk attention of the chunked algorithm: Pallas forward and backward kernels.

Per chunk, on the causal C x C block (chunk layout, see sympow.attention.chunked):
  l_ij = p log|Q_i . K_j| + g_i - g_j for j <= i and Q_i . K_j != 0 (else -inf),
  m_i = max_j l_ij (0 where no j counts), w_ij = exp(l_ij - m_i),
  o_i = sum_j w_ij V_j, den_i = sum_j w_ij,
exactly as `sympow.attention.xla.attention`, computed flash-style: a query block walks the
key blocks up to the diagonal with an online row max, so no C x C matrix is stored.

Backward (m is a constant, as the stop_gradient in the oracle makes it): with
dw_ij = dO_i . V_j + dden_i and dl_ij = w_ij dw_ij,
  dV_j = sum_i w_ij dO_i,  dQ_i = sum_j ds_ij K_j,  dK_j = sum_i ds_ij Q_i,
  ds_ij = p dl_ij / (Q_i . K_j)   (d l_ij / d s_ij = p / s_ij),
  dg_i += sum_j dl_ij,  dg_j -= sum_i dl_ij.
Two kernels recompute w from the saved m: one per query block (dQ, dg_i) and one per key
block looping over the R query heads of its kv head (dK, dV, dg_j); no atomics.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from sympow.attention.pallas.launch import dot, idiv, irem, launch, split_heads
from sympow.attention.pallas.plan import Plan


def _scores(q, k, g_q, g_k, rows, cols, plan: Plan, *, causal: bool):
    """Scores s [bq, bk], validity mask and logits l (-inf where not valid).

    causal=False for blocks wholly below the diagonal: no causal compare and no select, as
    log|0| = -inf already gives a zero score no weight (the mask is still returned, for the
    backward's division by s)."""
    s = dot(q, k, plan, trans_b=True)  # [bq, bk]
    if not causal:
        return s, s != 0, plan.p * jnp.log(jnp.abs(s)) + g_q[:, None] - g_k[None, :]
    valid = (s != 0) & (rows[:, None] >= cols[None, :])
    log_power = plan.p * jnp.log(jnp.abs(jnp.where(valid, s, 1.0)))
    return s, valid, jnp.where(valid, log_power + g_q[:, None] - g_k[None, :], -jnp.inf)


def _below_then_on_diagonal(split, stop, body, init):
    """body(j, carry, causal) over the key blocks [0, split) unmasked, then [split, stop)."""
    carry = jax.lax.fori_loop(0, split, lambda j, c: body(j, c, causal=False), init)
    return jax.lax.fori_loop(split, stop, lambda j, c: body(j, c, causal=True), carry)


def _grad_terms(s, valid, logit, m, do, v, dden, plan: Plan):
    """w [bq, bk] from the saved row max, dl = w dw and ds = p dl / s."""
    w = jnp.exp(logit - m[:, None])  # logit <= m: no overflow; -inf -> 0
    dw = dot(do, v, plan, trans_b=True) + dden[:, None]  # [bq, bk]
    dl = w * dw
    ds = jnp.where(valid, plan.p * dl / jnp.where(valid, s, 1.0), 0.0)
    return w, dl, ds


def _key_blocks(i, plan: Plan):
    """(first key block touching the diagonal of query block i, key blocks up to it): the
    key blocks before the first lie wholly below the diagonal and need no causal mask."""
    bq, bk = plan.attn_bq, plan.attn_bk
    return idiv(i * bq, bk), idiv((i + 1) * bq + bk - 1, bk)


def _fwd_kernel(q_ref, k_ref, v_ref, g_ref, o_ref, den_ref, m_ref, *, plan: Plan):
    bq, bk = plan.attn_bq, plan.attn_bk
    i = pl.program_id(0)
    q = q_ref[...]  # [bq, D]
    rows = i * bq + jnp.arange(bq, dtype=jnp.int32)
    g_q = g_ref[pl.ds(pl.multiple_of(i * bq, bq), bq)]

    def body(j, carry, causal):
        acc, den, m = carry
        keys = pl.ds(pl.multiple_of(j * bk, bk), bk)
        cols = j * bk + jnp.arange(bk, dtype=jnp.int32)
        _, _, logit = _scores(q, k_ref[keys, :], g_q, g_ref[keys], rows, cols, plan,
                              causal=causal)
        m_new = jnp.maximum(m, jnp.max(logit, axis=1))
        shift = jnp.where(m_new == -jnp.inf, 0.0, m_new)  # finite: no inf - inf
        alpha = jnp.exp(m - shift)
        w = jnp.exp(logit - shift[:, None])  # [bq, bk]
        acc = acc * alpha[:, None] + dot(w, v_ref[keys, :], plan)
        return acc, den * alpha + jnp.sum(w, axis=1), m_new

    init = (jnp.zeros((bq, plan.e), jnp.float32), jnp.zeros((bq,), jnp.float32),
            jnp.full((bq,), -jnp.inf, jnp.float32))
    acc, den, m = _below_then_on_diagonal(*_key_blocks(i, plan), body, init)
    o_ref[...] = acc
    den_ref[...] = den
    m_ref[...] = jnp.where(m == -jnp.inf, 0.0, m)


def _dq_kernel(q_ref, k_ref, v_ref, g_ref, m_ref, do_ref, dden_ref, dq_ref, dg_ref, *,
               plan: Plan):
    bq, bk = plan.attn_bq, plan.attn_bk
    i = pl.program_id(0)
    q, m, do, dden = q_ref[...], m_ref[...], do_ref[...], dden_ref[...]
    rows = i * bq + jnp.arange(bq, dtype=jnp.int32)
    g_q = g_ref[pl.ds(pl.multiple_of(i * bq, bq), bq)]

    def body(j, carry, causal):
        dq, dg = carry
        keys = pl.ds(pl.multiple_of(j * bk, bk), bk)
        cols = j * bk + jnp.arange(bk, dtype=jnp.int32)
        k = k_ref[keys, :]
        s, valid, logit = _scores(q, k, g_q, g_ref[keys], rows, cols, plan, causal=causal)
        _, dl, ds = _grad_terms(s, valid, logit, m, do, v_ref[keys, :], dden, plan)
        return dq + dot(ds, k, plan), dg + jnp.sum(dl, axis=1)

    init = (jnp.zeros((bq, plan.d), jnp.float32), jnp.zeros((bq,), jnp.float32))
    dq, dg = _below_then_on_diagonal(*_key_blocks(i, plan), body, init)
    dq_ref[...] = dq.astype(dq_ref.dtype)
    dg_ref[...] = dg


def _dkv_kernel(q_ref, k_ref, v_ref, g_ref, m_ref, do_ref, dden_ref, dk_ref, dv_ref, dg_ref,
                *, plan: Plan, groups: int):
    bq, bk = plan.attn_bq, plan.attn_bk
    j = pl.program_id(0)
    k, v = k_ref[...], v_ref[...]
    cols = j * bk + jnp.arange(bk, dtype=jnp.int32)
    g_k = g_ref[pl.ds(pl.multiple_of(j * bk, bk), bk)]
    # Query blocks from the diagonal's (masked) to the first wholly below it, then the rest.
    first, split = idiv(j * bk, bq), idiv((j + 1) * bk + bq - 1, bq)
    blocks = {False: (split, plan.c // bq - split), True: (first, split - first)}

    def body(it, carry, causal):  # it runs over (query head r of the group, query block)
        dk, dv, dg = carry
        start, count = blocks[causal]
        r, i = idiv(it, count), start + irem(it, count)
        qs = pl.ds(pl.multiple_of(i * bq, bq), bq)
        rows = i * bq + jnp.arange(bq, dtype=jnp.int32)
        q, do = q_ref[r, qs, :], do_ref[r, qs, :]
        s, valid, logit = _scores(q, k, g_ref[qs], g_k, rows, cols, plan, causal=causal)
        w, dl, ds = _grad_terms(s, valid, logit, m_ref[r, qs], do, v, dden_ref[r, qs], plan)
        return (dk + dot(ds, q, plan, trans_a=True), dv + dot(w, do, plan, trans_a=True),
                dg - jnp.sum(dl, axis=0))

    init = (jnp.zeros((bk, plan.d), jnp.float32), jnp.zeros((bk, plan.e), jnp.float32),
            jnp.zeros((bk,), jnp.float32))
    fori = jax.lax.fori_loop
    carry = fori(0, groups * blocks[True][1], lambda it, c: body(it, c, causal=True), init)
    dk, dv, dg = fori(0, groups * blocks[False][1], lambda it, c: body(it, c, causal=False),
                      carry)
    dk_ref[...] = dk.astype(dk_ref.dtype)
    dv_ref[...] = dv.astype(dv_ref.dtype)
    dg_ref[...] = dg


def _specs(plan: Plan, hq: int, groups: int):
    """BlockSpec makers for grid (row block, chunk, batch * heads)."""
    def per_query(block, width=None):  # [B, Hq, N, C(, W)] at query block x, query head
        shape = (None, None, None, block) + (() if width is None else (width,))
        return pl.BlockSpec(shape, lambda x, n, bh: (*split_heads(bh, hq), n, x)
                            + (() if width is None else (0,)))

    def per_kv_chunk(width=None):  # whole chunk of the kv head of query head bh % hq
        shape = (None, None, None, plan.c) + (() if width is None else (width,))
        return pl.BlockSpec(shape, lambda x, n, bh: (idiv(bh, hq), idiv(irem(bh, hq), groups), n, 0)
                            + (() if width is None else (0,)))
    return per_query, per_kv_chunk


def attention_fwd(q, k, v, g, plan: Plan):
    """(o [B,Hq,N,C,E], den, m [B,Hq,N,C]) in float32; see the module docstring."""
    b, hq, n, c, d = q.shape
    groups = hq // k.shape[1]
    per_query, per_kv = _specs(plan, hq, groups)
    f32 = jnp.float32
    return launch(
        lambda *refs: _fwd_kernel(*refs, plan=plan), plan=plan, name="sympow_attention_fwd",
        grid=(c // plan.attn_bq, n, b * hq),
        in_specs=[per_query(plan.attn_bq, d), per_kv(d), per_kv(plan.e), per_kv()],
        out_specs=[per_query(plan.attn_bq, plan.e), per_query(plan.attn_bq),
                   per_query(plan.attn_bq)],
        out_shape=[jax.ShapeDtypeStruct((b, hq, n, c, plan.e), f32),
                   jax.ShapeDtypeStruct((b, hq, n, c), f32),
                   jax.ShapeDtypeStruct((b, hq, n, c), f32)],
        warps=plan.warps_attn, stages=plan.attn_stages)(q, k, v, g)


def attention_bwd(q, k, v, g, m, do, dden, plan: Plan):
    """(dq, dk, dv, dg) of `attention_fwd` for cotangents (do, dden); m carries none."""
    b, hq, n, c, d = q.shape
    hk = k.shape[1]
    groups = hq // hk
    e = plan.e
    per_query, per_kv = _specs(plan, hq, groups)
    do = do.astype(plan.mm_dtype)
    dq, dg_q = launch(
        lambda *refs: _dq_kernel(*refs, plan=plan), plan=plan, name="sympow_attention_dq",
        grid=(c // plan.attn_bq, n, b * hq),
        in_specs=[per_query(plan.attn_bq, d), per_kv(d), per_kv(e), per_kv(),
                  per_query(plan.attn_bq), per_query(plan.attn_bq, e), per_query(plan.attn_bq)],
        out_specs=[per_query(plan.attn_bq, d), per_query(plan.attn_bq)],
        out_shape=[jax.ShapeDtypeStruct(q.shape, q.dtype),
                   jax.ShapeDtypeStruct((b, hq, n, c), jnp.float32)],
        warps=plan.warps_attn, stages=plan.attn_stages)(q, k, v, g, m, do, dden)

    def per_key(width=None):  # [B, Hk, N, C(, W)] at key block x
        shape = (None, None, None, plan.attn_bk) + (() if width is None else (width,))
        return pl.BlockSpec(shape, lambda x, n_, bh: (*split_heads(bh, hk), n_, x)
                            + (() if width is None else (0,)))

    def per_group(width=None):  # the R query heads of kv head bh % hk, whole chunk
        shape = (None, groups, None, c) + (() if width is None else (width,))
        return pl.BlockSpec(shape, lambda x, n_, bh: (*split_heads(bh, hk), n_, 0)
                            + (() if width is None else (0,)))

    whole_chunk = pl.BlockSpec((None, None, None, c),
                               lambda x, n_, bh: (*split_heads(bh, hk), n_, 0))
    dk, dv, dg_k = launch(
        lambda *refs: _dkv_kernel(*refs, plan=plan, groups=groups), plan=plan,
        name="sympow_attention_dkv", grid=(c // plan.attn_bk, n, b * hk),
        in_specs=[per_group(d), per_key(d), per_key(e), whole_chunk, per_group(),
                  per_group(e), per_group()],
        out_specs=[per_key(d), per_key(e), per_key()],
        out_shape=[jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype),
                   jax.ShapeDtypeStruct((b, hk, n, c), jnp.float32)],
        warps=plan.warps_attn, stages=plan.attn_stages)(q, k, v, g, m, do, dden)
    dg = dg_k + dg_q.reshape(b, hk, groups, n, c).sum(axis=2)
    return dq, dk, dv, dg
