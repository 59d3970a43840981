"""The chunked algorithm's state products on Hopper, p = 2, in the square layout.

The Hopper tier keeps a p = 2 state in the square layout: feature (i, j) at row i D + j for
all i, j < D (F = D^2, phi(u) = u (x) u with weight 1: the tiled embedding with one tile
of width D). A state is then D blocks S_i = S[i D : (i + 1) D] of shape [D, E], and every
product with phi is a sum over i of plain matrix products whose register A operand is a
block scaled by one column of u, built where the wgmma wants it (no phi tile, no
selection products):

* `rows_to_state`:  S_i = sum_r u_ri u_r a_r^T = sum_r (x^T diag(col_i))[:, r] a_r
  (rows -> state: the update_state forward, a state's cotangent);
* `state_to_rows`:  y_r = sum_i col_ir (x_r S_i)        = phi(u_r) S          (state -> rows)
  and, transposed, g_r = sum_j col_jr (a_r S_j^T)      (half the row gradient of phi(u) . S a).

with x the raw rows (keys or queries, bf16), u = x e^ls their scaled values and
col = x^T e^(2 ls) [D, C] in float32, so u_ri u_rj = col_ir x_rj and each product of a
scaled column with x rounds once, to bf16, where the MMA takes it (as the portable tier's
phi tiles do). Accumulators are float32. D = 64 (WIDTHS[0]); E in WIDTHS.

Programs (blocks.py): two compute warpgroups and a memory warpgroup feeding a `Ring`.
- rows_to_state: one program per (group of 2 x per_wg features i, chunk, kv head); the
  ring walks the row blocks of the chunk (over the query heads of a group too), each
  warpgroup accumulating its per_wg blocks S_i in registers (per_wg = 256 / E).
- state_to_rows: one program per (128 rows, chunk, head); each warpgroup holds its 64 rows
  of x (or a) and col; the ring walks the D blocks S_i of the chunk's state.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from sympow.attention.mosaic_gpu.blocks import (
    COL_VECTOR,
    COMPUTE_REGISTERS,
    COMPUTE_WGS,
    MEMORY_REGISTERS,
    ROW_VECTOR,
    ROWS,
    TILE_ROWS,
    WGMMA,
    Ring,
    accumulate,
    by_cols,
    by_rows,
    launch,
    load_own,
    own_scratch,
    store_own,
    swizzled,
    tile,
    zeros,
)
from sympow.attention.mosaic_gpu.blocks import WIDTHS as _WIDTHS

F32, BF16 = jnp.float32, jnp.bfloat16
DIM = _WIDTHS[0]  # d of the square layout: F = DIM^2 features
ACC_COLUMNS = 256  # float32 accumulator columns a rows_to_state warpgroup holds


def features_per_warpgroup(e: int) -> int:
    """Blocks S_i one rows_to_state warpgroup accumulates at once: [DIM, e] float32 each."""
    return ACC_COLUMNS // e


def rows_to_state(xt, col, a, *, kv_heads: int, stages: int = 3):
    """S [B, Hk, N, D^2, E] bf16: S[(i, j)] = sum over the rows r of the chunk and the heads
    of a group of col[i, r] xt[j, r] a[r].

    xt [B, Hx, N, D, C] bf16 (the rows, transposed); col [B, Hx, N, D, C] float32;
    a [B, Hx, N, C, E] bf16; Hx = R kv_heads (query head h in group h // R); C a multiple
    of TILE_ROWS, D = DIM.
    """
    b, hx, n, d, c = xt.shape
    e = a.shape[-1]
    per_wg = features_per_warpgroup(e)
    per_program = COMPUTE_WGS * per_wg
    groups, row_blocks = hx // kv_heads, c // ROWS
    steps = groups * row_blocks

    def kernel(xt_ref, col_ref, a_ref, s_ref, ring_arrays, ring_loaded, ring_freed, out):
        ring = Ring(ring_arrays, ring_loaded, ring_freed)
        bh, wg = lax.axis_index("bh"), lax.axis_index("wg")
        bi, hk, chunk = lax.div(bh, kv_heads), lax.rem(bh, kv_heads), lax.axis_index("chunk")
        first = lax.axis_index("features") * per_program  # this program's first i

        @pl.when(wg < COMPUTE_WGS)
        def _compute():
            plgpu.set_max_registers(COMPUTE_REGISTERS, action="increase")

            def visit(step, accs):
                slot = ring.slot(step)
                xt_block = plgpu.load(ring.wait(slot, 0), (), layout=WGMMA).astype(F32)
                col_rows = ring.wait(slot, 1)  # [per_program, ROWS]: col_i of this block
                a_smem = ring.wait(slot, 2)
                new = []
                for t, acc in enumerate(accs):
                    scale = plgpu.load(col_rows.at[wg * per_wg + t], (), layout=COL_VECTOR)
                    new.append(accumulate(acc, xt_block * by_cols(scale), a_smem))
                ring.release(slot)
                return tuple(new)

            accs = lax.fori_loop(0, steps, visit, tuple(zeros((d, e)) for _ in range(per_wg)))
            for t, acc in enumerate(accs):
                out.at[wg, t][...] = acc.astype(BF16)
            plgpu.commit_smem()
            for t in range(per_wg):
                i = first + wg * per_wg + t
                plgpu.copy_smem_to_gmem(out.at[wg, t], s_ref.at[bi, hk, chunk, pl.ds(i * d, d)])
            plgpu.wait_smem_to_gmem(0)

        @pl.when(wg == COMPUTE_WGS)
        def _memory():
            plgpu.set_max_registers(MEMORY_REGISTERS, action="decrease")

            def sources(step):
                h = hk * groups + lax.div(step, row_blocks)
                rows = pl.ds(lax.rem(step, row_blocks) * ROWS, ROWS)
                return (xt_ref.at[bi, h, chunk, :, rows],
                        col_ref.at[bi, h, chunk, pl.ds(first, per_program), rows],
                        a_ref.at[bi, h, chunk, rows])

            ring.fill(steps, sources)

    ring = Ring.scratch([tile(ROWS), ((per_program, ROWS), F32, False), tile(e)], stages)
    return launch(
        kernel, out_type=jax.ShapeDtypeStruct((b, kv_heads, n, d * d, e), BF16),
        scratch=(*ring, swizzled((COMPUTE_WGS, per_wg, d, e), BF16)),
        grid=(d // per_program, n, b * kv_heads), grid_names=("features", "chunk", "bh"),
        args=(xt, col, a))


def state_to_rows(rows, col, s, *, transposed: bool, stages: int = 3):
    """Float32 [B, Hx, N, C, W']: out_r = sum_i col[i, r] rows_r S_i, or with `transposed`
    out_r = sum_i col[i, r] rows_r S_i^T.

    rows [B, Hx, N, C, W] bf16 (x with W = D, or a with W = E when transposed); col
    [B, Hx, N, D, C] float32; s [B, Hk, N, D^2, E] bf16 read by query head h as kv head
    h // (Hx / Hk). W' = E, or D when transposed. C a multiple of TILE_ROWS, D = DIM.
    """
    b, hx, n, c, w = rows.shape
    d = col.shape[-2]
    hk, e = s.shape[1], s.shape[-1]
    groups, width = hx // hk, d if transposed else e

    def kernel(rows_ref, col_ref, s_ref, out_ref, own, own_bars, ring_arrays, ring_loaded,
               ring_freed, out):
        ring = Ring(ring_arrays, ring_loaded, ring_freed)
        bh, wg = lax.axis_index("bh"), lax.axis_index("wg")
        bi, h, chunk = lax.div(bh, hx), lax.rem(bh, hx), lax.axis_index("chunk")
        mine = pl.ds((lax.axis_index("tile") * COMPUTE_WGS + wg) * ROWS, ROWS)

        @pl.when(wg < COMPUTE_WGS)
        def _compute():
            plgpu.set_max_registers(COMPUTE_REGISTERS, action="increase")
            rows_smem, col_smem = own
            load_own([(rows_ref.at[bi, h, chunk, mine], rows_smem),
                      (col_ref.at[bi, h, chunk, :, mine], col_smem)], wg, own_bars)
            base = plgpu.load(rows_smem.at[wg], (), layout=WGMMA).astype(F32)  # [ROWS, W]

            def visit(i, acc):
                slot = ring.slot(i)
                block = ring.wait(slot, 0)  # S_i [D, E]
                scale = plgpu.load(col_smem.at[wg, i], (), layout=ROW_VECTOR)
                operand = base * by_rows(scale, base.shape)
                acc = accumulate(acc, operand, block.transpose((1, 0)) if transposed else block)
                ring.release(slot)
                return acc

            acc = lax.fori_loop(0, d, visit, zeros((ROWS, width)))
            store_own([(acc, out, out_ref.at[bi, h, chunk, mine])], wg)

        @pl.when(wg == COMPUTE_WGS)
        def _memory():
            plgpu.set_max_registers(MEMORY_REGISTERS, action="decrease")
            kv = lax.div(h, groups)
            ring.fill(d, lambda i: (s_ref.at[bi, kv, chunk, pl.ds(i * d, d)],))

    own = own_scratch(tile(w), ((d, ROWS), F32, False))
    own_bars = tuple(plgpu.Barrier(num_barriers=COMPUTE_WGS) for _ in own)
    ring = Ring.scratch([tile(e)], stages)
    return launch(
        kernel, out_type=jax.ShapeDtypeStruct((b, hx, n, c, width), F32),
        scratch=(own, own_bars, *ring, swizzled((COMPUTE_WGS, ROWS, width), F32)),
        grid=(c // TILE_ROWS, n, b * hx), grid_names=("tile", "chunk", "bh"),
        args=(rows, col, s))


# The same functions in plain JAX (float32, exact products): the specification the GPU
# check compares the kernels with, and what CPU tests put in their place.

def rows_to_state_reference(xt, col, a, *, kv_heads: int):
    b, hx, n, d, c = xt.shape
    grouped = lambda x: x.reshape(b, kv_heads, hx // kv_heads, *x.shape[2:])  # noqa: E731
    s = jnp.einsum("bhgnir,bhgnjr,bhgnre->bhnije", grouped(col), grouped(xt.astype(F32)),
                   grouped(a.astype(F32)), precision=lax.Precision.HIGHEST)
    return s.reshape(b, kv_heads, n, d * d, a.shape[-1]).astype(BF16)


def state_to_rows_reference(rows, col, s, *, transposed: bool):
    b, hx, n, c, _ = rows.shape
    d, hk = col.shape[-2], s.shape[1]
    blocks = jnp.repeat(s.astype(F32).reshape(b, hk, n, d, d, -1), hx // hk, axis=1)
    spec = "bhnrw,bhnir,bhnijw->bhnrj" if transposed else "bhnrw,bhnir,bhniwe->bhnre"
    return jnp.einsum(spec, rows.astype(F32), col, blocks, precision=lax.Precision.HIGHEST)
