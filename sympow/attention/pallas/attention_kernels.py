"""Intra-chunk attention of the chunked algorithm: Pallas forward and backward kernels.

Per chunk, on the causal C x C block (chunk layout, see sympow.attention.chunked), with a the
log gates and D_ij = sum_{j<k<=i} a_k the decay from key j to query i:
  l_ij = p log|Q_i . K_j| + D_ij for j <= i and Q_i . K_j != 0 (else -inf),
  m_i = max_j l_ij (0 where no j counts), w_ij = exp(l_ij - m_i),
  o_i = sum_j w_ij V_j, den_i = sum_j w_ij,
exactly as `sympow.attention.xla.attention`, computed flash-style: a query block walks the
key blocks from the diagonal back to the first with an online row max, so no C x C matrix
is stored.

Decays from local sums (docs/design.md §4). Blocks are K = attn_bq = attn_bk rows. For i in
query block I and j in an earlier key block J,
  D_ij = head_i + mid_IJ + tail_j,
with head_i the gate sum from the start of block I to i, tail_j the sum after j to the end
of block J (both from `block_gate_sums`) and mid_IJ the totals of the blocks strictly
between, accumulated as the loop walks away from the diagonal. On the diagonal block D is an
in-kernel cumulative sum down the rows of the [K, K] tile a_k [k > j]. Every D is a sum of
terms <= 0, never a difference of two large cumulative sums, so a strong gate early in the
sequence costs later tokens no precision. Blocks wholly below the diagonal need no causal
mask and no zero-score select (log|0| = -inf already gives no weight).

Backward (m is a constant, as the stop_gradient in the oracle makes it): with
dw_ij = dO_i . V_j + dden_i and dl_ij = w_ij dw_ij,
  dV_j = sum_i w_ij dO_i,  dQ_i = sum_j ds_ij K_j,  dK_j = sum_i ds_ij Q_i,
  ds_ij = p dl_ij / (Q_i . K_j)   (d l_ij / d s_ij = p / s_ij),
and the log gates' cotangent da_k = sum_{i >= k > j} dl_ij through the local sums the decays
were built from (`chunked.block_gate_cotangent`): per query the sum over earlier key blocks
(dhead), per key the sum over later query blocks (dtail), per diagonal block the in-block
sums, per block pair its total (for the blocks between). Each pair enters once, so nothing
relies on two kernels rounding a pair alike. Two kernels recompute w from the saved m: one
per query block (dQ, dhead, the diagonal and the pair totals) and one per key block looping
over the R query heads of its kv head (dK, dV, dtail); no atomics.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from sympow.attention import chunked
from sympow.attention.pallas.launch import dot, idiv, irem, launch, split_heads
from sympow.attention.pallas.plan import Plan


def block_gate_sums(a, plan: Plan):
    """(head, tail) [B, Hk, N, C] of log gates a: `chunked.block_gate_sums` within each
    block of attn_bq rows."""
    blocks = a.reshape(*a.shape[:-1], -1, plan.attn_bq)
    return tuple(x.reshape(a.shape) for x in chunked.block_gate_sums(blocks))


def _diagonal_decay(a, plan: Plan):
    """D [K, K] of a diagonal block from its log gates a [K]: [i, j] = sum_{j<k<=i} a_k
    (for j <= i; the caller masks j > i)."""
    rows = jnp.arange(plan.attn_bq, dtype=jnp.int32)
    terms = jnp.where(rows[:, None] > rows[None, :], a[:, None], 0.0)  # [k, j]: a_k, k > j
    return jnp.cumsum(terms, axis=0)


def _scores(q, k, decay, plan: Plan, *, diagonal: bool):
    """Scores s [K, K], validity mask and logits l (-inf where not valid) of one block pair
    with decays `decay` [K, K]; off the diagonal without the causal mask or select."""
    s = dot(q, k, plan, trans_b=True)  # [K, K]
    if not diagonal:
        return s, s != 0, plan.p * jnp.log(jnp.abs(s)) + decay
    rows = jnp.arange(plan.attn_bq, dtype=jnp.int32)
    valid = (s != 0) & (rows[:, None] >= rows[None, :])
    log_power = plan.p * jnp.log(jnp.abs(jnp.where(valid, s, 1.0)))
    return s, valid, jnp.where(valid, log_power + decay, -jnp.inf)


def _grad_terms(s, valid, logit, m, do, v, dden, plan: Plan):
    """w [bq, bk] from the saved row max, dl = w dw and ds = p dl / s.

    With `plan.dden_in_kernel_order` dl = w (do . v) + w dden: the product is not added to
    dden, which Triton folds into the product's accumulator (dden + do_0 v_0 + ...), where
    `row_dots`' -dden no longer cancels it exactly (dq under full decay on an H100: up to
    1.4e-3 of the scale). bf16 plans take no dden from row_dots and keep the fold (one
    multiply a pair fewer: the portable attention form's fwd + bwd 4 % faster, H100)."""
    w = jnp.exp(logit - m[:, None])  # logit <= m: no overflow; -inf -> 0
    products = dot(do, v, plan, trans_b=True)  # [bq, bk]
    if plan.dden_in_kernel_order:
        dl = w * products + w * dden[:, None]
    else:
        dl = w * (products + dden[:, None])
    ds = jnp.where(valid, plan.p * dl / jnp.where(valid, s, 1.0), 0.0)
    return w, dl, ds


def _block(index, plan: Plan):
    return pl.ds(pl.multiple_of(index * plan.attn_bq, plan.attn_bq), plan.attn_bq)


def _pair_slots(plan: Plan) -> int:
    """Length of a query block's row of pair totals: C / K blocks, rounded up to a power of
    two (Triton's vectors)."""
    return 1 << (plan.c // plan.attn_bq - 1).bit_length()


def _walk_back(i, a_ref, head, tl_ref, visit, carry, plan: Plan):
    """visit(carry, key block j, decay [K, K], diagonal) for the diagonal block j = i, then
    for j = i - 1, ..., 0 with decay head_i + mid + tail_j (mid grows by each block passed)."""
    carry = visit(carry, i, _diagonal_decay(a_ref[_block(i, plan)], plan), True)

    def body(step, state):
        carry, mid = state
        j = i - 1 - step
        keys = _block(j, plan)
        carry = visit(carry, j, head[:, None] + (mid + tl_ref[keys][None, :]), False)
        return carry, mid + jnp.sum(a_ref[keys])

    return jax.lax.fori_loop(0, i, body, (carry, jnp.zeros((), jnp.float32)))[0]


def _fwd_kernel(q_ref, k_ref, v_ref, a_ref, hd_ref, tl_ref, o_ref, den_ref, m_ref, *,
                plan: Plan):
    i = pl.program_id(0)
    q = q_ref[...]  # [K, D]

    def visit(carry, j, decay, diagonal):
        acc, den, m = carry
        keys = _block(j, plan)
        _, _, logit = _scores(q, k_ref[keys, :], decay, plan, diagonal=diagonal)
        m_new = jnp.maximum(m, jnp.max(logit, axis=1))
        shift = jnp.where(m_new == -jnp.inf, 0.0, m_new)  # finite: no inf - inf
        alpha = jnp.exp(m - shift)
        w = jnp.exp(logit - shift[:, None])  # [K, K]
        acc = acc * alpha[:, None] + dot(w, v_ref[keys, :], plan)
        return acc, den * alpha + jnp.sum(w, axis=1), m_new

    kk = plan.attn_bq
    init = (jnp.zeros((kk, plan.e), jnp.float32), jnp.zeros((kk,), jnp.float32),
            jnp.full((kk,), -jnp.inf, jnp.float32))
    acc, den, m = _walk_back(i, a_ref, hd_ref[_block(i, plan)], tl_ref, visit, init, plan)
    o_ref[...] = acc
    den_ref[...] = den
    m_ref[...] = jnp.where(m == -jnp.inf, 0.0, m)


def _dq_kernel(q_ref, k_ref, v_ref, a_ref, hd_ref, tl_ref, m_ref, do_ref, dden_ref, dq_ref,
               dhead_ref, ddiag_ref, pairs_ref, *, plan: Plan):
    i = pl.program_id(0)
    q, m, do, dden = q_ref[...], m_ref[...], do_ref[...], dden_ref[...]
    # The pair totals are stored one element per key block as the walk passes it, not carried
    # as a [slots] vector through the loop: the carried row faulted on an H100
    # (CUDA_ERROR_MISALIGNED_ADDRESS, jax 0.11.2) for chunks of 15 blocks.
    pairs_ref[...] = jnp.zeros(pairs_ref.shape, jnp.float32)

    def visit(carry, j, decay, diagonal):
        dq, dhead, ddiag = carry
        keys = _block(j, plan)
        k = k_ref[keys, :]
        s, valid, logit = _scores(q, k, decay, plan, diagonal=diagonal)
        _, dl, ds = _grad_terms(s, valid, logit, m, do, v_ref[keys, :], dden, plan)
        dq = dq + dot(ds, k, plan)
        if diagonal:
            return dq, dhead, chunked.diagonal_straddle(dl)
        rows = jnp.sum(dl, axis=1)
        pairs_ref[pl.ds(j, 1)] = jnp.sum(rows, keepdims=True)
        return dq, dhead + rows, ddiag

    kk = plan.attn_bq
    zeros = jnp.zeros((kk,), jnp.float32)
    init = (jnp.zeros((kk, plan.d), jnp.float32), zeros, zeros)
    dq, dhead, ddiag = _walk_back(i, a_ref, hd_ref[_block(i, plan)], tl_ref, visit, init, plan)
    dq_ref[...] = dq.astype(dq_ref.dtype)
    dhead_ref[...] = dhead
    ddiag_ref[...] = ddiag


def _dkv_kernel(q_ref, k_ref, v_ref, a_ref, hd_ref, tl_ref, m_ref, do_ref, dden_ref, dk_ref,
                dv_ref, dtail_ref, *, plan: Plan, groups: int):
    j = pl.program_id(0)
    k, v = k_ref[...], v_ref[...]
    own = _block(j, plan)
    tail = tl_ref[own]

    def visit(carry, queries, decay, diagonal):  # every query head r of the group
        def one_head(r, carry):
            dk, dv, dtail = carry
            q, do = q_ref[r, queries, :], do_ref[r, queries, :]
            s, valid, logit = _scores(q, k, decay, plan, diagonal=diagonal)
            w, dl, ds = _grad_terms(s, valid, logit, m_ref[r, queries], do, v,
                                    dden_ref[r, queries], plan)
            if not diagonal:  # the diagonal block's pairs are the dq kernel's
                dtail = dtail + jnp.sum(dl, axis=0)
            return (dk + dot(ds, q, plan, trans_a=True), dv + dot(w, do, plan, trans_a=True),
                    dtail)
        return jax.lax.fori_loop(0, groups, one_head, carry)

    kk = plan.attn_bq
    init = (jnp.zeros((kk, plan.d), jnp.float32), jnp.zeros((kk, plan.e), jnp.float32),
            jnp.zeros((kk,), jnp.float32))
    carry = visit(init, own, _diagonal_decay(a_ref[own], plan), True)

    def body(step, state):  # query block i = j + 1 + step, walking away from the diagonal
        carry, mid = state
        queries = _block(j + 1 + step, plan)
        carry = visit(carry, queries, hd_ref[queries][:, None] + (mid + tail[None, :]), False)
        return carry, mid + jnp.sum(a_ref[queries])

    steps = plan.c // kk - 1 - j
    dk, dv, dtail = jax.lax.fori_loop(0, steps, body, (carry, jnp.zeros((), jnp.float32)))[0]
    dk_ref[...] = dk.astype(dk_ref.dtype)
    dv_ref[...] = dv.astype(dv_ref.dtype)
    dtail_ref[...] = dtail


def _row_dots_kernel(x_ref, y_ref, out_ref, *, plan: Plan):
    """x_i . y_i of a block of rows as the diagonal of the block product x y^T [K, K]: the
    arithmetic (same dot, same shapes, same warps) of `_grad_terms`' do_i . v_j, so where
    y_i = v_j the two round alike and dw_ij = do_i . v_j - do_i . y_i is exactly 0."""
    prod = dot(x_ref[...], y_ref[...], plan, trans_b=True)  # [K, K]
    rows = jnp.arange(plan.attn_bq, dtype=jnp.int32)
    out_ref[...] = jnp.sum(jnp.where(rows[:, None] == rows[None, :], prod, 0.0), axis=1)


def row_dots(x, y, plan: Plan):
    """[B, H, N, C] float32: x_r . y_r for x, y [B, H, N, C, E] (E = plan.e), computed as the
    backward kernels compute do . v (`_row_dots_kernel`). The normalizer's cotangent
    dden = -(do . y) formed so cancels exactly against the kernels' do . v where a row's
    output is one value row (y_i = v_j: under full decay every row's own): formed by XLA
    (another summation order) it left float32 noise of up to ~1e-3 of the problem's scale
    in dq and dk, which are exactly 0 there (docs/kernels.md)."""
    if x.ndim != 5 or y.shape != x.shape or x.shape[3:] != (plan.c, plan.e):
        raise ValueError(f"row_dots needs x and y of one shape [B, H, N, {plan.c}, {plan.e}], "
                         f"got x {x.shape}, y {y.shape}")
    b, h, n, c, e = x.shape
    per_query, _ = _specs(plan, h, 1)
    rows = plan.attn_bq
    return launch(
        lambda *refs: _row_dots_kernel(*refs, plan=plan), plan=plan, name="sympow_row_dots",
        grid=(c // rows, n, b * h), in_specs=[per_query(rows, e), per_query(rows, e)],
        out_specs=per_query(rows),
        out_shape=jax.ShapeDtypeStruct((b, h, n, c), jnp.float32),
        warps=plan.warps_attn, stages=plan.attn_stages)(x.astype(plan.mm_dtype),
                                                       y.astype(plan.mm_dtype))


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


def _check_square_blocks(plan: Plan) -> None:
    if plan.attn_bq != plan.attn_bk:  # the diagonal block's decays assume one block size
        raise ValueError(f"attention kernels need attn_bq == attn_bk, got {plan.attn_bq} x "
                         f"{plan.attn_bk}")


def attention_fwd(q, k, v, a, head, tail, plan: Plan):
    """(o [B,Hq,N,C,E], den, m [B,Hq,N,C]) in float32 for log gates a and their
    `block_gate_sums` (head, tail), each [B,Hk,N,C]; see the module docstring."""
    _check_square_blocks(plan)
    b, hq, n, c, d = q.shape
    groups = hq // k.shape[1]
    per_query, per_kv = _specs(plan, hq, groups)
    f32 = jnp.float32
    rows = plan.attn_bq
    return launch(
        lambda *refs: _fwd_kernel(*refs, plan=plan), plan=plan, name="sympow_attention_fwd",
        grid=(c // rows, n, b * hq),
        in_specs=[per_query(rows, d), per_kv(d), per_kv(plan.e), per_kv(), per_kv(), per_kv()],
        out_specs=[per_query(rows, plan.e), per_query(rows), per_query(rows)],
        out_shape=[jax.ShapeDtypeStruct((b, hq, n, c, plan.e), f32),
                   jax.ShapeDtypeStruct((b, hq, n, c), f32),
                   jax.ShapeDtypeStruct((b, hq, n, c), f32)],
        warps=plan.warps_attn, stages=plan.attn_stages)(q, k, v, a, head, tail)


def attention_bwd(q, k, v, a, head, tail, m, do, dden, plan: Plan):
    """(dq, dk, dv, da) of `attention_fwd` for cotangents (do, dden); m carries none. da
    [B,Hk,N,C] is the cotangent of the log gates a (head and tail, being sums of a, pass
    theirs on to it)."""
    _check_square_blocks(plan)
    b, hq, n, c, d = q.shape
    hk = k.shape[1]
    groups = hq // hk
    e, rows = plan.e, plan.attn_bq
    per_query, per_kv = _specs(plan, hq, groups)
    do = do.astype(plan.mm_dtype)
    blocks, slots = c // rows, _pair_slots(plan)
    pair_row = pl.BlockSpec((None, None, None, None, slots),  # [B, Hq, N, C/K, slots]
                            lambda x, n_, bh: (*split_heads(bh, hq), n_, x, 0))
    f32 = jnp.float32
    dq, dhead, ddiag, pairs = launch(
        lambda *refs: _dq_kernel(*refs, plan=plan), plan=plan, name="sympow_attention_dq",
        grid=(blocks, n, b * hq),
        in_specs=[per_query(rows, d), per_kv(d), per_kv(e), per_kv(), per_kv(), per_kv(),
                  per_query(rows), per_query(rows, e), per_query(rows)],
        out_specs=[per_query(rows, d), per_query(rows), per_query(rows), pair_row],
        out_shape=[jax.ShapeDtypeStruct(q.shape, q.dtype),
                   jax.ShapeDtypeStruct((b, hq, n, c), f32),
                   jax.ShapeDtypeStruct((b, hq, n, c), f32),
                   jax.ShapeDtypeStruct((b, hq, n, blocks, slots), f32)],
        warps=plan.warps_attn, stages=plan.attn_stages)(q, k, v, a, head, tail, m, do, dden)

    def per_key(width=None):  # [B, Hk, N, C(, W)] at key block x
        shape = (None, None, None, rows) + (() if width is None else (width,))
        return pl.BlockSpec(shape, lambda x, n_, bh: (*split_heads(bh, hk), n_, x)
                            + (() if width is None else (0,)))

    def per_group(width=None):  # the R query heads of kv head bh % hk, whole chunk
        shape = (None, groups, None, c) + (() if width is None else (width,))
        return pl.BlockSpec(shape, lambda x, n_, bh: (*split_heads(bh, hk), n_, 0)
                            + (() if width is None else (0,)))

    whole_chunk = pl.BlockSpec((None, None, None, c),
                               lambda x, n_, bh: (*split_heads(bh, hk), n_, 0))
    dk, dv, dtail = launch(
        lambda *refs: _dkv_kernel(*refs, plan=plan, groups=groups), plan=plan,
        name="sympow_attention_dkv", grid=(c // rows, n, b * hk),
        in_specs=[per_group(d), per_key(d), per_key(e), whole_chunk, whole_chunk, whole_chunk,
                  per_group(), per_group(e), per_group()],
        out_specs=[per_key(d), per_key(e), per_key()],
        out_shape=[jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype),
                   jax.ShapeDtypeStruct((b, hk, n, c), jnp.float32)],
        warps=plan.warps_attn, stages=plan.attn_stages)(q, k, v, a, head, tail, m, do, dden)
    per_kv_head = lambda x: x.reshape(b, hk, groups, *x.shape[2:]).sum(axis=2)  # noqa: E731
    in_blocks = lambda x: x.reshape(b, hk, n, blocks, rows)  # noqa: E731
    da = chunked.block_gate_cotangent(
        in_blocks(per_kv_head(dhead)), in_blocks(dtail), in_blocks(per_kv_head(ddiag)),
        per_kv_head(pairs)[..., :blocks])
    return dq, dk, dv, da.reshape(a.shape)
