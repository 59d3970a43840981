"""The attention kernels' forward on Hopper: Mosaic GPU, wgmma, TMA, warp specialization.

The same function as `sympow.attention.pallas.attention_kernels.attention_fwd` (whose module
docstring states it: l_ij = p log|Q_i . K_j| + D_ij, the online row max m, o = sum_j w_ij
V_j and den = sum_j w_ij with w_ij = exp(l_ij - m_i)), with the same outputs and
conventions, so the portable tier's backward kernels take its residuals unchanged.

One program per 128 query rows of a chunk and query head: three warpgroups. Two compute
warpgroups own 64 rows each (one wgmma M, one block I of the local gate sums); the third
only issues TMA copies of the key blocks, walking from the last compute warpgroup's diagonal
block back to the first block, `stages` blocks ahead, each slot released by both compute
warpgroups (no shared-memory copy of k or v is read while it is being refilled). Per key
block J a compute warpgroup runs S = Q K^T (wgmma, bf16 operands, float32 accumulator), the
logits in base 2, the online max, W = exp2(l - m) and acc += W V (wgmma, W from registers).

Decays from local sums, as the portable kernels take them: off the diagonal
D_ij = head_i + mid_IJ + tail_j, with mid the carried sum of the block totals passed (each
step adds one total: sums of terms <= 0, never a difference of long sums). On the diagonal
D_ij = sum_{j<k<=i} a_k is a product: A @ N with A_ik = a_k [k <= i] (registers) and the 0/1
matrix N_kj = [k > j] (shared memory); A is split into three bf16 parts whose products with
N are exact, so D carries float32 accuracy relative to itself. (D as a difference of
in-block prefix sums would lose a strong gate's size, e.g. 1e4, in every later decay of the
block.) One such product per warpgroup and program.

The logits are kept in base 2 (l2 = p log2|s| + D log2(e)): one lg2 and one ex2 per score;
m is stored in natural units (m2 ln 2) as the backward expects.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

ROWS = 64  # rows of a compute warpgroup's query block and of a key block (one wgmma M)
COMPUTE_WGS = 2
TILE_ROWS = ROWS * COMPUTE_WGS  # query rows of one program
WIDTHS = (64, 128)  # d and e the kernel takes (bf16 rows of 128 or 256 bytes)
LOG2E = math.log2(math.e)
LN2 = math.log(2.0)
COMPUTE_REGISTERS, MEMORY_REGISTERS = 232, 40  # per thread, after setmaxnreg


def _swizzled(shape, dtype) -> plgpu.SMEM:
    """Shared memory for a TMA / wgmma tile: 128-byte swizzle with the tiling it implies."""
    itemsize = jnp.dtype(dtype).itemsize
    swizzle = min(128, shape[-1] * itemsize)
    return plgpu.SMEM(shape, dtype, transforms=(
        plgpu.TilingTransform((8, swizzle // itemsize)), plgpu.SwizzleTransform(swizzle)))


def _rows_vector(x):
    """A [ROWS] vector in the layout of a wgmma result's rows (one value per query)."""
    return plgpu.layout_cast(x, plgpu.Layout.WGMMA.reduce(1))


def _by_rows(x, shape):
    return lax.broadcast_in_dim(x, shape, [0])


def _by_cols(x, shape):
    return lax.broadcast_in_dim(x, shape, [1])


def _diagonal_decay(a_smem, below_smem):
    """D [ROWS, ROWS] (float32, wgmma layout) of a diagonal block from its log gates a
    [ROWS] in shared memory: [i, j] = sum_{j<k<=i} a_k for j <= i (module docstring)."""
    shape = (ROWS, ROWS)
    rows = plgpu.broadcasted_iota(jnp.int32, shape, 0, layout=plgpu.Layout.WGMMA)
    cols = plgpu.broadcasted_iota(jnp.int32, shape, 1, layout=plgpu.Layout.WGMMA)
    a = plgpu.load(a_smem, (), layout=plgpu.Layout.WGMMA.reduce(0))
    gates = jnp.where(cols <= rows, _by_cols(a, shape), 0.0)  # [i, k]: a_k, k <= i
    high = gates.astype(jnp.bfloat16)
    rest = gates - high.astype(jnp.float32)  # exact in float32
    middle = rest.astype(jnp.bfloat16)
    low = (rest - middle.astype(jnp.float32)).astype(jnp.bfloat16)

    def product(acc_ref):
        for part in (low, middle, high):  # small parts first: they round least
            plgpu.wgmma(acc_ref, part, below_smem)
        return acc_ref[...]

    return pl.run_scoped(product, plgpu.ACC(shape, jnp.float32))


def _below_diagonal(below_smem) -> None:
    """Writes N [ROWS, ROWS] bf16, N_kj = [k > j], for the diagonal product."""
    shape = (ROWS, ROWS)
    rows = plgpu.broadcasted_iota(jnp.int32, shape, 0, layout=plgpu.Layout.WGMMA)
    cols = plgpu.broadcasted_iota(jnp.int32, shape, 1, layout=plgpu.Layout.WGMMA)
    below_smem[...] = jnp.where(rows > cols, 1.0, 0.0).astype(jnp.bfloat16)
    plgpu.commit_smem()  # the tensor cores read it next


def _fwd_kernel(q_ref, k_ref, v_ref, a_ref, hd_ref, tl_ref, tot_ref, o_ref, den_ref, m_ref,
                smem, loaded, freed, *, p: int, groups: int, stages: int, tiles: int):
    q_smem, k_smem, v_smem, tl_smem, a_smem, hd_smem, below_smem, o_smem, den_smem, m_smem = smem
    q_bar, a_bar, hd_bar, k_bar, tl_bar, v_bar = loaded
    k_free, v_free = freed
    heads = q_ref.shape[1]
    tile = tiles - 1 - lax.axis_index("tile")  # the longest walks start first
    n, bh, wg = lax.axis_index("chunk"), lax.axis_index("bh"), lax.axis_index("wg")
    b, hq = lax.div(bh, heads), lax.rem(bh, heads)
    hk = lax.div(hq, groups)
    top = COMPUTE_WGS * tile + COMPUTE_WGS - 1  # the last compute warpgroup's diagonal block
    steps = top + 1  # key blocks top, top - 1, ..., 0

    def key_rows(step):
        return pl.ds((top - step) * ROWS, ROWS)

    @pl.when(wg < COMPUTE_WGS)
    def _compute():
        plgpu.set_max_registers(COMPUTE_REGISTERS, action="increase")
        block = COMPUTE_WGS * tile + wg  # I: this warpgroup's query block
        own = pl.ds(block * ROWS, ROWS)
        plgpu.copy_gmem_to_smem(q_ref.at[b, hq, n, own], q_smem.at[wg], q_bar.at[wg])
        plgpu.copy_gmem_to_smem(a_ref.at[b, hk, n, own], a_smem.at[wg], a_bar.at[wg])
        plgpu.copy_gmem_to_smem(hd_ref.at[b, hk, n, own], hd_smem.at[wg], hd_bar.at[wg])
        _below_diagonal(below_smem.at[wg])
        for bar in (q_bar, a_bar, hd_bar):
            plgpu.barrier_wait(bar.at[wg])
        shape = (ROWS, ROWS)
        diag_decay = _diagonal_decay(a_smem.at[wg], below_smem.at[wg]) * LOG2E
        head = plgpu.load(hd_smem.at[wg], (), layout=plgpu.Layout.WGMMA.reduce(1)) * LOG2E
        rows = plgpu.broadcasted_iota(jnp.int32, shape, 0, layout=plgpu.Layout.WGMMA)
        cols = plgpu.broadcasted_iota(jnp.int32, shape, 1, layout=plgpu.Layout.WGMMA)
        causal = cols <= rows

        def release(slot):
            plgpu.barrier_arrive(k_free.at[slot])
            plgpu.barrier_arrive(v_free.at[slot])

        @pl.when(block < top)  # the key block above this warpgroup's diagonal: not needed,
        def _skip():  # but waited for, so that every barrier's phase stays in step
            for bar in (k_bar, tl_bar, v_bar):
                plgpu.barrier_wait(bar.at[0])
            release(0)

        def visit(step, carry, diagonal: bool):
            acc, m2, den, mid = carry
            slot = lax.rem(step, stages)
            plgpu.barrier_wait(k_bar.at[slot])
            plgpu.barrier_wait(tl_bar.at[slot])

            def scores(acc_ref):
                plgpu.wgmma(acc_ref, q_smem.at[wg], k_smem.at[slot].transpose((1, 0)))
                return acc_ref[...]

            s = pl.run_scoped(scores, plgpu.ACC(shape, jnp.float32))  # [ROWS, ROWS]
            if diagonal:
                decay = diag_decay
            else:
                tail = plgpu.load(tl_smem.at[slot], (), layout=plgpu.Layout.WGMMA.reduce(0))
                decay = _by_rows(head, shape) + _by_cols((tail + mid) * LOG2E, shape)
            plgpu.barrier_arrive(k_free.at[slot])  # k and the tail are read
            logit = p * jnp.log2(jnp.abs(s)) + decay  # log2|0| = -inf: no weight
            if diagonal:
                logit = jnp.where(causal, logit, -jnp.inf)
            m_new = jnp.maximum(m2, logit.max(axis=1))
            shift = jnp.where(m_new == -jnp.inf, 0.0, m_new)  # finite: no inf - inf
            alpha = jnp.exp2(m2 - shift)
            w = jnp.exp2(logit - _by_rows(shift, shape))
            den = den * alpha + w.sum(axis=1)
            acc = acc * _by_rows(alpha, acc.shape)
            weights = w.astype(jnp.bfloat16)
            plgpu.barrier_wait(v_bar.at[slot])

            def values(acc_ref):
                plgpu.wgmma(acc_ref, weights, v_smem.at[slot])

            acc = pl.run_state(values)(plgpu.ACC.init(acc))
            plgpu.barrier_arrive(v_free.at[slot])
            key_block = top - step
            return acc, m_new, den, mid + tot_ref[b, hk, n, key_block]

        e = o_smem.shape[-1]
        init = (plgpu.layout_cast(jnp.zeros((ROWS, e), jnp.float32), plgpu.Layout.WGMMA),
                _rows_vector(jnp.full((ROWS,), -jnp.inf, jnp.float32)),
                _rows_vector(jnp.zeros((ROWS,), jnp.float32)), jnp.zeros((), jnp.float32))
        first = top - block  # the diagonal's step
        carry = visit(first, init, diagonal=True)
        carry = carry[:3] + (jnp.zeros((), jnp.float32),)  # mid starts after the diagonal
        acc, m2, den, _ = lax.fori_loop(first + 1, steps,
                                        lambda s, c: visit(s, c, diagonal=False), carry)
        o_smem.at[wg][...] = acc
        den_smem.at[wg][...] = den
        m_smem.at[wg][...] = jnp.where(m2 == -jnp.inf, 0.0, m2 * LN2)
        plgpu.commit_smem()
        out = (b, hq, n, own)
        plgpu.copy_smem_to_gmem(o_smem.at[wg], o_ref.at[out])
        plgpu.copy_smem_to_gmem(den_smem.at[wg], den_ref.at[out])
        plgpu.copy_smem_to_gmem(m_smem.at[wg], m_ref.at[out])
        plgpu.wait_smem_to_gmem(0)

    @pl.when(wg == COMPUTE_WGS)
    def _memory():
        plgpu.set_max_registers(MEMORY_REGISTERS, action="decrease")

        def fetch(step, slot):
            src = (b, hk, n, key_rows(step))
            plgpu.copy_gmem_to_smem(k_ref.at[src], k_smem.at[slot], k_bar.at[slot])
            plgpu.copy_gmem_to_smem(tl_ref.at[src], tl_smem.at[slot], tl_bar.at[slot])
            plgpu.copy_gmem_to_smem(v_ref.at[src], v_smem.at[slot], v_bar.at[slot])

        for step in range(stages):
            pl.when(step < steps)(lambda step=step: fetch(step, step))

        @pl.loop(stages, steps)
        def _refill(step):
            slot = lax.rem(step, stages)
            plgpu.barrier_wait(k_free.at[slot])
            plgpu.barrier_wait(v_free.at[slot])
            fetch(step, slot)


def attention_fwd(q, k, v, a, head, tail, *, p: int, stages: int = 2):
    """(o [B,Hq,N,C,E], den, m [B,Hq,N,C]) float32, as the portable tier's `attention_fwd`,
    for q [B,Hq,N,C,D], k [B,Hk,N,C,D], v [B,Hk,N,C,E] (bfloat16; C a multiple of
    TILE_ROWS, d and e in WIDTHS) and the log gates a with their `block_gate_sums` (head,
    tail) over blocks of ROWS, each [B,Hk,N,C] float32."""
    b, hq, n, c, d = q.shape
    e = v.shape[-1]
    groups = hq // k.shape[1]
    tiles = c // TILE_ROWS
    totals = a.reshape(*a.shape[:-1], c // ROWS, ROWS).sum(axis=-1)  # [B, Hk, N, C / ROWS]
    f32, bf16 = jnp.float32, jnp.bfloat16
    smem = (
        _swizzled((COMPUTE_WGS, ROWS, d), bf16),  # q
        _swizzled((stages, ROWS, d), bf16),  # k
        _swizzled((stages, ROWS, e), bf16),  # v
        plgpu.SMEM((stages, ROWS), f32),  # tail of the key block
        plgpu.SMEM((COMPUTE_WGS, ROWS), f32),  # a of the query block (diagonal)
        plgpu.SMEM((COMPUTE_WGS, ROWS), f32),  # head of the query block
        _swizzled((COMPUTE_WGS, ROWS, ROWS), bf16),  # N of the diagonal product
        _swizzled((COMPUTE_WGS, ROWS, e), f32),  # o
        plgpu.SMEM((COMPUTE_WGS, ROWS), f32),  # den
        plgpu.SMEM((COMPUTE_WGS, ROWS), f32),  # m
    )
    loaded = (*(plgpu.Barrier(num_barriers=COMPUTE_WGS) for _ in range(3)),
              *(plgpu.Barrier(num_barriers=stages) for _ in range(3)))
    freed = tuple(plgpu.Barrier(num_arrivals=COMPUTE_WGS, num_barriers=stages)
                  for _ in range(2))

    def entry(*refs):
        pl.run_scoped(lambda *scoped: _fwd_kernel(*refs, *scoped, p=p, groups=groups,
                                                  stages=stages, tiles=tiles),
                      smem, loaded, freed, collective_axes="wg")

    return plgpu.kernel(
        entry,
        out_type=[jax.ShapeDtypeStruct((b, hq, n, c, e), f32),
                  jax.ShapeDtypeStruct((b, hq, n, c), f32),
                  jax.ShapeDtypeStruct((b, hq, n, c), f32)],
        grid=(tiles, n, b * hq), grid_names=("tile", "chunk", "bh"),
        num_threads=COMPUTE_WGS + 1, thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=True),
    )(q, k, v, a, head, tail, totals)
