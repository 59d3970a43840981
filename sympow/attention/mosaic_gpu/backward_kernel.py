"""The attention backward on Hopper in one pass: dQ, dK, dV and the gate pieces from one
kernel that walks the query blocks of each key block (FlashAttention's one-pass backward).

Per tile pair the kernel issues five products: the scores s = K Q^T and dw = V dO^T
(keys as the tile's rows), dV += w dO, dK += ds Q, and dQ's partial ds^T K. The two-kernel
backward it replaces (a query-major dQ kernel beside this key-major one, until 2026-11-26)
recomputed s and dw in each, seven products a pair. ds^T is read from shared memory
transposed (a register operand cannot be transposed), and the partial [64 queries, d]
float32 is added into a float32 dQ in GMEM by a TMA reduction (`copy_smem_to_gmem(...,
reduction_op="add")`): every key block adds into every later query block (in chunk layout
into its own diagonal block too).

The gate cotangent's pieces (`chunked.block_gate_cotangent`) come without a sum across the
tile's rows per query (they span warps):
- dhead_i (dl summed over the keys of earlier blocks) = q_i . dQ_off_i / p, since
  dl_ij = ds_ij s_ij / p and s_ij = q_i . k_j, with dQ_off the off-diagonal partials. In
  chunk layout each off-diagonal step forms q_i . (ds^T K)_i from the query tile it
  holds and reduces it into a float32 [B, Hq, N, C] beside dQ, and every partial, the
  diagonal blocks' too (each query block's diagonal is one warpgroup's step), is reduced
  into one float32 dQ; in token layout the diagonal blocks' partials are stored apart
  and XLA forms dhead from dQ_off (`assemble`). (Until 2026-11-27 both layouts stored
  them apart: a second float32 array of q's size, 128 MiB at the chunked call's peak at
  T = 65,536, H = 8; q . dQ less the diagonal's share instead left rounding noise where
  dhead is exactly 0, under full decay.) dhead carries ds's bf16 rounding, as dq does;
- dtail_j (dl summed over the queries of later blocks): the row sums, in registers;
- the block-pair totals: each step's row sums pass through shared memory into the columns'
  layout (which every warp holds whole) behind the barrier the dQ partial's stage takes
  anyway, are summed within each warp, and leave ROWS pairs at a time;
- the diagonal's straddle sums: `straddle_sums` (XLA, one product) of the
  diagonal blocks' dl, which the kernel stores in bf16 (in the kernel, three products on
  them as the dQ kernel took them made ptxas serialize every wgmma of this one, 15.2
  against 13.5 ms at T = 16k, H = 12, H200; one product with both operands in shared
  memory still did, 14.8 against 13.1).

The wide arrays (q, k, v, dO and dq, dk, dv) come in chunk layout [B, H, N, C, W] or, for
the attention form, in the callers' token layout [B, T, H, W] (`blocks.rows_at`: a TMA box
of strided rows), which spares XLA the transposes to and from chunk layout.

Shared memory: dk and dv leave through the ring's q and dO slots once both compute
warpgroups are past their walks, which keeps d = e = 128 within the 227 KB.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from sympow.attention.mosaic_gpu.blocks import (
    COL_VECTOR,
    COMPUTE_REGISTERS,
    COMPUTE_WGS,
    LOG2E,
    MEMORY_REGISTERS,
    ROW_VECTOR,
    ROWS,
    TILE_ROWS,
    VECTOR,
    WGMMA,
    Ring,
    block_totals,
    by_cols,
    by_rows,
    decay_product,
    heads_of,
    in_tokens,
    indices,
    launch,
    load,
    load_own,
    own_scratch,
    program_position,
    row_vector,
    rows_at,
    scores,
    store_own,
    tile,
    write_mask,
    zeros,
)
from sympow.attention.mosaic_gpu.weights import capped_exp2, power_terms
from sympow.numerics import zeros_of_call

F32, BF16 = jnp.float32, jnp.bfloat16


def _backward_kernel(q_ref, k_ref, v_ref, a_ref, hd_ref, tl_ref, tot_ref, m_ref, c_ref,
                     do_ref, dden_ref, dq_ref, *refs, p, groups, tiles, diagonal_apart):
    # diagonal_apart: the diagonal blocks' partials stored to an output of their own (dhead
    # then q . dQ_off outside); else q . dQ_off reduced here, into an input after dQ
    if diagonal_apart:
        q_dq_ref, (dk_ref, dv_ref, dtail_ref, dq_diag_ref, diag_ref, pairs_ref) = None, refs[:6]
    else:
        dq_diag_ref, (q_dq_ref, dk_ref, dv_ref, dtail_ref, diag_ref, pairs_ref) = None, refs[:6]
    own, own_bars, ring_arrays, ring_loaded, ring_freed, walk_done, out = refs[6:]
    b, hk, n, tile_, wg = program_position(heads_of(k_ref))
    chunk = tiles * TILE_ROWS
    blocks = tiles * COMPUTE_WGS
    start = COMPUTE_WGS * tile_  # the first query block of the walk
    block = start + wg  # J: this warpgroup's key block
    steps = (blocks - start) * groups  # (query block start + step // R, head step % R)
    first = wg * groups  # this warpgroup's first diagonal step
    ring = Ring.of(ring_arrays, ring_loaded, ring_freed)

    @pl.when(wg < COMPUTE_WGS)
    def _compute():
        plgpu.set_max_registers(COMPUTE_REGISTERS, action="increase")
        k_smem, v_smem, a_smem, tl_smem, ones_smem = own
        dtail_smem = out[0]  # [COMPUTE_WGS, ROWS], for `store_own`
        ds_smem, stage_smem, rows_smem, pair_smem, *q_dq_smem = (x.at[wg] for x in out[1:])
        rows_of = pl.ds(block * ROWS, ROWS)
        mine = (b, hk, n, rows_of)
        load_own([(rows_at(k_ref, *mine, chunk), k_smem), (rows_at(v_ref, *mine, chunk), v_smem),
                  (a_ref.at[mine], a_smem), (tl_ref.at[mine], tl_smem)], wg, own_bars)
        write_mask(ones_smem.at[wg], lambda k, i: k <= i)
        # [j, i] = sum_{j < k <= i} a_k: the diagonal's decays with keys as rows
        diagonal = decay_product(a_smem.at[wg], lambda j, k: k > j, ones_smem.at[wg]) * LOG2E
        tail = load(tl_smem.at[wg], ROW_VECTOR) * LOG2E
        tail_factor = by_rows(jnp.exp2(tail))  # the keys' decay factors, <= 1
        rows, cols = indices()
        d = k_ref.shape[-1]
        k_own = k_smem.at[wg]

        @pl.loop(0, first)
        def _skip(step):
            ring.skip(step)

        column_blocks = [k_own if d == ROWS else k_own.at[:, pl.ds(c0, ROWS)]
                         for c0 in range(0, d, ROWS)]

        def products(dv, dk, w, ds, q_smem, do_smem):
            """(dv + w dO, dk + ds Q, [ds^T K by column blocks of ROWS]), the step's products
            issued together and waited for once (ds also in ds_smem, visible to the tensor
            cores): their register operands stay live until the wait."""
            def issue(refs):
                dv_ref, dk_ref, *dq_refs = refs
                plgpu.wgmma(dv_ref, w, do_smem)
                plgpu.wgmma(dk_ref, ds, q_smem)
                for dq_ref, columns in zip(dq_refs, column_blocks, strict=True):
                    plgpu.wgmma(dq_ref, ds_smem.transpose((1, 0)), columns)
                plgpu.wgmma_wait(0)

            inits = [dv, dk] + [zeros((ROWS, ROWS))] * len(column_blocks)
            dv, dk, *parts = pl.run_state(issue)([plgpu.ACC.init(x) for x in inits])
            return dv, dk, parts

        def store_partials(parts, dst_of, reduction):
            """The dQ partials through the stage into dst_of(columns) of GMEM (reduction
            'add' or a plain store). The stage's previous store was waited for (read) before
            ds was committed, one column block ago at d = 128."""
            for index, part in enumerate(parts):
                if index:
                    plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                stage_smem[...] = part
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(stage_smem, dst_of(pl.ds(index * ROWS, ROWS)),
                                        reduction_op=reduction)

        def visit(step, carry, on_diagonal: bool):
            dk, dv, dtail, mid = carry
            slot = ring.slot(step)
            query_block = start + lax.div(step, groups)
            hq = hk * groups + lax.rem(step, groups)
            queries = (b, hq, n, pl.ds(query_block * ROWS, ROWS))
            (q_smem,) = ring.wait(slot, 0)
            s = scores(k_own, q_smem)  # [keys j, queries i]
            (head_smem,) = ring.wait(slot, 4)  # waited on every step: the barrier phases
            m2 = load(ring.wait(slot, 2)[0], COL_VECTOR) * LOG2E
            c = load(ring.wait(slot, 5)[0], COL_VECTOR)
            shift = m2 + p * c
            if on_diagonal:
                exponent = jnp.where(cols >= rows, diagonal - by_cols(shift), -jnp.inf)
                factors = (capped_exp2(exponent),)
            else:  # D_ji - shift_i = tail_j + (head_i + mid - shift_i): a factor of each
                head = load(head_smem, COL_VECTOR)
                factors = (tail_factor, by_cols(capped_exp2((head + mid) * LOG2E - shift)))
            scale = jnp.exp2(c)
            w, dsdw = power_terms(s, factors, by_cols(scale), by_cols(p * scale), p)
            (do_smem,) = ring.wait(slot, 1)
            dden = load(ring.wait(slot, 3)[0], COL_VECTOR)
            dw = scores(v_smem.at[wg], do_smem) + by_cols(dden)
            dl = w * dw
            ds = (dsdw * dw).astype(BF16)
            ds_smem[...] = ds  # the last step's products (which read it) were waited for
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the stage's last store
            plgpu.commit_smem()
            dv, dk, parts = products(dv, dk, w.astype(BF16), ds, q_smem, do_smem)
            if not (on_diagonal or diagonal_apart):  # q_i . (ds^T K)_i from q's tile: this
                # pair's share of dhead
                q_dq = sum(jnp.sum(load(
                    q_smem if d == ROWS else q_smem.at[:, pl.ds(index * ROWS, ROWS)],
                    WGMMA).astype(F32) * part, axis=1) for index, part in enumerate(parts))
            ring.release(slot)

            def reduce_partials():  # into dQ (in chunk layout the diagonal's too)
                store_partials(parts, lambda cols_: rows_at(dq_ref, *queries, chunk, cols_),
                               "add")

            if on_diagonal:  # this block's own queries (one visit each)
                if diagonal_apart:
                    store_partials(parts, lambda cols_: rows_at(dq_diag_ref, *queries, chunk,
                                                                cols_), None)
                else:
                    reduce_partials()
                # its dl [keys, queries] in bf16 for the straddle sums (`straddle_sums`, by
                # XLA: one more product here, even with both operands in shared memory, made
                # ptxas serialize every wgmma of the kernel and spill; 14.84 against 13.1 ms
                # at T = 16k, H = 12, H200). ds_smem's last reader, the dQ product, was
                # waited for; the store is waited for (read) before the next step writes ds.
                ds_smem[...] = dl.astype(BF16)
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(ds_smem, diag_ref.at[b, hq, n, rows_of])
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                return dk, dv, dtail, mid
            row_sums = dl.sum(axis=1)  # [keys]: this pair's share of dtail and its total
            rows_smem[...] = row_sums  # visible after the stage's barrier
            if not diagonal_apart:
                q_dq_smem[0][...] = q_dq  # read by the copy below, after the stage's barrier
            reduce_partials()
            if not diagonal_apart:
                plgpu.copy_smem_to_gmem(q_dq_smem[0], q_dq_ref.at[queries], reduction_op="add")
            column = start * groups + step  # the pair's column: query block * R + head
            slot_of_pair = lax.rem(column, ROWS)
            # the pair's total, a sum across the warpgroup's four warps: the row sums in
            # the columns' layout, which every warp holds whole, summed within each warp.
            # (Mosaic GPU's own reduction across warps uses one scratch region for both
            # compute warpgroups, which raced: wrong totals now and then, H200; the row
            # sums of ROWS steps summed at once in the columns' layout took 1.1 ms of
            # 13.7 at T = 16k, a barrier of their own a step 1.3 ms.) The next step
            # writes rows_smem after its first barrier, when every warp has read it.
            pair_smem[slot_of_pair] = load(rows_smem, COL_VECTOR).sum()

            @pl.when(jnp.logical_or(slot_of_pair == ROWS - 1, step == steps - 1))
            def _flush():  # the slots not written since the last flush: pairs J >= I
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(pair_smem, pairs_ref.at[
                    b, hk, n, block, pl.ds(column - slot_of_pair, ROWS)])
                plgpu.wait_smem_to_gmem(0)

            last_head = lax.rem(step, groups) == groups - 1
            return (dk, dv, dtail + row_sums,
                    mid + jnp.where(last_head, tot_ref[b, hk, n, query_block], 0.0))

        e = v_ref.shape[-1]
        carry = (zeros((ROWS, d)), zeros((ROWS, e)), row_vector(0.0), jnp.zeros((), F32))
        carry = lax.fori_loop(first, first + groups,
                              lambda s, c: visit(s, c, on_diagonal=True), carry)
        carry = (*carry[:3], jnp.zeros((), F32))
        dk, dv, dtail, _ = lax.fori_loop(first + groups, steps,
                                         lambda s, c: visit(s, c, on_diagonal=False), carry)
        walked = walk_done.at[0]  # both warpgroups past their last step: the ring is free
        plgpu.barrier_arrive(walked)
        plgpu.barrier_wait(walked)
        dk_smem, dv_smem = ring.arrays[0], ring.arrays[1]  # [stages = COMPUTE_WGS, ...]
        store_own([(dk.astype(dk_ref.dtype), dk_smem, rows_at(dk_ref, *mine, chunk)),
                   (dv.astype(dv_ref.dtype), dv_smem, rows_at(dv_ref, *mine, chunk)),
                   (dtail, dtail_smem, dtail_ref.at[mine])], wg)

    @pl.when(wg == COMPUTE_WGS)
    def _memory():
        plgpu.set_max_registers(MEMORY_REGISTERS, action="decrease")

        def sources(step):
            rows_of = pl.ds((start + lax.div(step, groups)) * ROWS, ROWS)
            query = (b, hk * groups + lax.rem(step, groups), n, rows_of)
            return (rows_at(q_ref, *query, chunk), rows_at(do_ref, *query, chunk),
                    m_ref.at[query], dden_ref.at[query],
                    hd_ref.at[b, hk, n, rows_of], c_ref.at[query])

        ring.fill(steps, sources)


def attention_bwd(q, k, v, a, head, tail, m, scales, do, dden, *, p: int, stages: int = 2):
    """The Hopper backward in one kernel: (dq, dhead, ddiag, pairs) and (dk, dv, dtail).

    Inputs as `attention_kernels.attention_fwd`'s, with its m and c (`scales`) and the
    cotangents do [B,Hq,N,C,E] (bfloat16) and dden [B,Hq,N,C]. dq, dk, dv in the inputs'
    dtype; dhead [B,Hq,N,C] (per query, dl summed over the keys of earlier blocks of ROWS)
    and dtail [B,Hk,N,C] (per key, over the queries of later blocks) float32; ddiag
    [B,Hq,N,C] float32, per k the sum of dl_ij over i >= k > j within k's diagonal block
    (`straddle_sums` of the blocks' dl, which the kernel stores in bf16); pairs
    [B,Hq,N,C/ROWS,C/ROWS] float32: [I, J] the total of dl over the block pair for J < I,
    unwritten for J >= I (the caller masks them). The wide arrays (q, k, v, do and dq, dk,
    dv) may all come in token layout [B, T, H, W] instead (`blocks.in_tokens`).

    dhead: in chunk layout (the chunked algorithm) the kernel reduces q_i . dQ_off_i per
    query as it goes and every dQ partial into one float32 dQ; in token layout (the
    attention form) it stores the diagonal blocks' partials apart and dhead is q . dQ_off
    by XLA: the per-step products cost the form's backward 6 % at T = 4k, H = 12 (5.72
    against 6.06 ms, H200), and there the second float32 array is not at the peak."""
    b, hk, n, c = a.shape
    hq, d, e = heads_of(q), q.shape[-1], v.shape[-1]
    groups, tiles, blocks = hq // hk, c // TILE_ROWS, c // ROWS
    columns = -(-blocks * groups // ROWS) * ROWS  # the pairs [.., J, I * R + head], padded
    if stages != COMPUTE_WGS:
        raise ValueError(f"stages must be {COMPUTE_WGS} (dk and dv leave through the ring's "
                         f"slots, one per compute warpgroup); got {stages}")
    bars = tuple(plgpu.Barrier(num_barriers=COMPUTE_WGS) for _ in range(4))
    # the TMA reductions' target: zeros of this call (not a copy of a shared constant), made
    # from do: zeros of q were ready in the forward, where XLA filled them, and the 128 MiB
    # (T = 65,536, H = 8) lived through the whole state backward (peak 1.41 -> 1.31 GiB)
    dq = jax.new_ref(zeros_of_call(q.shape, F32, like=do))
    apart = in_tokens(q)
    # token layout: the diagonal blocks' partials (an output); chunk layout: q . dQ_off per
    # query (reduced into zeros, as dQ)
    partial = (jax.ShapeDtypeStruct(q.shape, F32) if apart
               else jax.new_ref(zeros_of_call((b, hq, n, c), F32, like=do)))
    dk, dv, dtail, *apart_out, diagonal, pairs = launch(
        lambda *refs: _backward_kernel(*refs, p=p, groups=groups, tiles=tiles,
                                       diagonal_apart=apart),
        name="sympow_attention_bwd",
        out_type=[jax.ShapeDtypeStruct(k.shape, k.dtype),
                  jax.ShapeDtypeStruct(v.shape, v.dtype),
                  jax.ShapeDtypeStruct((b, hk, n, c), F32),
                  *([partial] if apart else []),
                  jax.ShapeDtypeStruct((b, hq, n, c, ROWS), BF16),
                  jax.ShapeDtypeStruct((b, hk, n, blocks, columns), F32)],
        scratch=(own_scratch(tile(d), tile(e), VECTOR, VECTOR, tile(ROWS)), bars,
                 *Ring.scratch([tile(d), tile(e), VECTOR, VECTOR, VECTOR, VECTOR], stages),
                 plgpu.Barrier(num_arrivals=COMPUTE_WGS, num_barriers=COMPUTE_WGS),
                 # dtail, ds (bf16; on the diagonal then dl), the stage of the dQ partials,
                 # a step's row sums, the pair totals of up to ROWS steps, a step's q . dQ
                 # partial (dk and dv leave through the ring's q and dO slots)
                 own_scratch(VECTOR, tile(ROWS), tile(ROWS, F32), VECTOR, VECTOR,
                             *([] if apart else [VECTOR]))),
        grid=(n, b * hk, tiles), grid_names=("chunk", "bh", "tile"),
        args=(q, k, v, a, head, tail, block_totals(a), m, scales, do, dden, dq,
              *([] if apart else [partial])))
    partial = apart_out[0] if apart else partial[...]
    return assemble(q, dq[...], partial, diagonal, pairs, p=p), (dk, dv, dtail)


def straddle_sums(diagonal):
    """The diagonal blocks' straddle sums [B,Hq,N,C] (per k, sum_{j < k <= i} dl_ji within
    k's block) from their dl tiles `diagonal` [B,Hq,N,C,ROWS] bfloat16 (keys j as rows,
    queries i as columns): each tile flattened to its ROWS^2 entries (j, i) times one 0/1
    matrix [(j, i), k] = [j < k <= i], float32 accumulation: one product whose output is
    the sums themselves. (As a product [k, i] = sum_{j < k} dl_ji and row sums over i >= k,
    XLA wrote and read a float32 array of the tiles' size: 2.3 ms of GPT-2's step at 65,536
    tokens on an H100; as cumulative sums, 185-254 us at T = 4k, H = 12.) dl carries bf16
    rounding here, as ds does in dq."""
    b, hq, n, c, _ = diagonal.shape
    tiles = diagonal.reshape(b, hq, n, c // ROWS, ROWS * ROWS)  # [.., (j, i)]
    return jnp.einsum("...f,fk->...k", tiles, straddle_matrix().astype(diagonal.dtype),
                      preferred_element_type=F32).reshape(b, hq, n, c)


@functools.lru_cache(maxsize=1)
def straddle_matrix() -> np.ndarray:
    """[(j, i), k] = 1 where j < k <= i: which pairs of a ROWS x ROWS tile each k's
    straddle sum takes (float32 0/1, [ROWS^2, ROWS])."""
    k = np.arange(ROWS)
    j, i, kk = k[:, None, None], k[None, :, None], k[None, None, :]
    return ((j < kk) & (kk <= i)).reshape(ROWS * ROWS, ROWS).astype(np.float32)


def assemble(q, dq, partial, diagonal, pairs, *, p: int):
    """(dq, dhead, ddiag, pairs) as `attention_bwd` returns them, from the kernel's outputs:
    dq float32 of q's shape; partial float32, in chunk layout q_i . dQ_off_i [B,Hq,N,C]
    (the partials of the earlier key blocks; dq then the partials of every key block up to
    the diagonal one), in token layout [B,T,Hq,D] the diagonal blocks' partials (dq then
    the others'); dhead_i = q_i . dQ_off_i / p, since dl_ij = ds_ij s_ij / p with s_ij =
    q_i . k_j. diagonal [B,Hq,N,C,ROWS] bfloat16 (`straddle_sums`), pairs
    [B,Hk,N,C/ROWS,P] float32 ([J, I * R + head] the total of dl over a block pair, R query
    heads a kv head, P >= R C/ROWS). dq comes in q's layout and dtype, the rest in chunk
    layout."""
    ddiag = straddle_sums(diagonal)
    b, hq, n, c = ddiag.shape
    hk, blocks = pairs.shape[1], c // ROWS
    groups = hq // hk
    if in_tokens(q):  # q . dQ_off [B, T, Hq] -> [B, Hq, N, C]
        dhead = jnp.einsum("...d,...d->...", q.astype(F32), dq) / p
        dq, dhead = (dq + partial).astype(q.dtype), jnp.moveaxis(
            dhead.reshape(b, n, c, hq), 3, 1)
    else:
        dq, dhead = dq.astype(q.dtype), partial / p
    # [b, hk, n, J, I * R + head] -> [b, hk * R + head, n, I, J]
    pairs = pairs[..., :blocks * groups].reshape(b, hk, n, blocks, blocks, groups)
    pairs = jnp.transpose(pairs, (0, 1, 5, 2, 4, 3)).reshape(b, hq, n, blocks, blocks)
    return dq, dhead, ddiag, pairs
