"""rows_to_state on Hopper, p = 2: a chunk's rows summed into its state in the square layout
(or stored in the upper layout), S_i = sum_r col_ir x_r a_r^T: the update_state forward and
a state's cotangent (`state_kernels` has the layout, the products and the other kernels).

Programs (blocks.py): one per (group of 2 x per_wg features i, chunks_per_program chunks,
kv head); the ring walks the 64-row blocks of a chunk (over the query heads of a group
too; a step's xt, col and a blocks on one barrier), each compute warpgroup accumulating
its per_wg blocks S_i in registers (per_wg = 256 / E), a step's products in two halves
(`blocks.products_in_halves`). Stored in the upper layout at E = 64, a warpgroup's four
features are one of each group of 16 i and each S_i is summed transposed over its stored
rows only, S_i^T = (a^T diag(col_i)) x[:, 16 b:] (`rows_to_state`'s docstring).
"""

from __future__ import annotations

import functools
import math

import jax
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from sympow.attention.mosaic_gpu.blocks import (
    COL_VECTOR,
    COMPUTE_REGISTERS,
    COMPUTE_WGS,
    MEMORY_REGISTERS,
    ROWS,
    VECTOR,
    WGMMA,
    WGMMA_TRANSPOSED,
    Ring,
    by_cols,
    launch,
    load,
    products,
    products_in_halves,
    swizzled,
    tile,
)
from sympow.attention.mosaic_gpu.column_forms import (
    column_parts,
    formed_column,
)
from sympow.attention.mosaic_gpu.state_kernels import (
    BF16,
    F32,
    check_chunks_per_program,
    check_slots,
    check_stages,
)
from sympow.attention.mosaic_gpu.state_walks import BLOCK, upper_shapes

ACC_COLUMNS = 256  # float32 accumulator columns a rows_to_state warpgroup holds
# A program's chunks: 8-step chunks (of 512 rows) paid a program's fixed cost less often
# over 4 (0.82 -> 0.78 ms a call on an H200, 2026-11-27, profile_states.py).
CHUNKS_PER_PROGRAM = 4
# ... and over the stored rows only (`by_groups`), 16 (H100, T = 65,536, H = 8, chunks of
# 1,024, in turns: 404.5 / 394.9 / 391.1 / 389.4 us at 4 / 8 / 16 / 32, 2026-11-28), as
# long as the grid keeps MIN_PROGRAMS programs (two an SM of an H100 or H200): fewer
# chunks a program where the problem is small, never fewer programs than CHUNKS_PER_PROGRAM
# would give.
BY_GROUPS_CHUNKS_PER_PROGRAM = 16
MIN_PROGRAMS = 256


def features_per_warpgroup(e: int) -> int:
    """Blocks S_i one rows_to_state warpgroup accumulates at once: [DIM, e] float32 each."""
    return ACC_COLUMNS // e


def default_chunks_per_program(n: int, programs_a_chunk: int, by_groups: bool) -> int:
    """rows_to_state's chunks a program for N chunks and a grid of programs_a_chunk
    programs per chunk (B Hk D / per_program): gcd(N, CHUNKS_PER_PROGRAM); by_groups,
    gcd(N, BY_GROUPS_CHUNKS_PER_PROGRAM), halved while the grid would hold fewer than
    MIN_PROGRAMS programs, but never below gcd(N, CHUNKS_PER_PROGRAM)."""
    least = math.gcd(n, CHUNKS_PER_PROGRAM)
    if not by_groups:
        return least
    chunks = math.gcd(n, BY_GROUPS_CHUNKS_PER_PROGRAM)
    while chunks > least and n // chunks * programs_a_chunk < MIN_PROGRAMS:
        chunks //= 2  # powers of two dividing N, down to least
    return chunks


def rows_to_state(xt, col, a, *, kv_heads: int, stages: int = 4, slots: int | None = None,
                  slot_offset: int = 0, chunks_per_program: int | None = None,
                  step_barriers: int = 1, pipelined: bool = True, upper: bool = False,
                  square_products: bool = False):
    """S [B, Hk, slots, D^2, E] bf16 with chunk n's state at slot n + slot_offset:
    S[(i, j)] = sum over the rows r of the chunk and the heads of a group of
    col[i, r] xt[j, r] a[r]. Slots no chunk maps to are left unwritten. slots: None = N.
    upper: S in the upper layout instead (`state_walks.upper_shapes`: a tuple of four
    arrays [B, Hk, slots, 16, D - 16 b, E], S[(i, j)] for j >= 16 (i // 16) only, 62.5 %
    of the bytes). At E = DIM the products are then only those of the stored rows
    (`by_groups`): each S_i is summed transposed, S_i^T [E, D - 16 b] = (a^T diag(col_i))
    x[:, 16 b:], its A operand a^T scaled in registers and its B the stored rows of the
    xt block (N = 64 - 16 b, 62.5 % of the square products), a warpgroup's four features
    one of each group, and stored through a transposed view of shared memory; with
    square_products (or E = 128) each S_i is the square layout's M = 64 product of which
    the rows j >= 16 b are stored (the layout before 2026-11-28).

    xt [B, Hx, N, D, C] bf16 (the rows, transposed); col [B, Hx, N, D, C] bf16 or float32,
    or `column_forms.Columns` (formed in the kernel from its xt, normally xt itself, and
    w: a ring block of w a step beside the col rows); a [B, Hx, N, C, E] bf16; Hx = R
    kv_heads (query head h in group h // R); C a multiple of TILE_ROWS, D = DIM.

    chunks_per_program (dividing N; None: `default_chunks_per_program`): consecutive chunks
    one program sums, one after the other, its ring running on into the next chunk while the
    last one's states are stored (a program's first copies and last stores, which nothing
    overlaps while one program holds an SM, then come once per program, not once per
    chunk). Same sums, same order, whatever the value.

    stages: the ring's slots (2 or more with pipelined; deeper measured the same on an
    H200, 2026-11-27).

    step_barriers: 1, a step's three blocks (xt, col, a; and w) arrive on one barrier,
    which a compute warpgroup checks once a step (they are used together); 3, a barrier
    each, w on col's (the layout before 2026-11-27, kept to measure against: each check
    is a round trip, and the three held ~10 % of the kernel's warp samples, ncu, H200).

    pipelined (the default): a warpgroup issues a step's products in two halves of its
    features and builds each half's operands while the other half's products run
    (`blocks.products_in_halves`); False builds all of them and then waits for all
    (`products`: the layout before 2026-11-27's sixteenth session, 4 % slower on an H200).
    Same sums, same order.
    """
    b, hx, n, d, c = xt.shape
    e = a.shape[-1]
    source, col_weights = column_parts(col)
    formed = col_weights is not None
    slots = n if slots is None else slots
    check_slots(slots, n, slot_offset)
    per_wg = features_per_warpgroup(e)
    per_program = COMPUTE_WGS * per_wg
    by_groups = upper and not square_products and e == d == per_wg * BLOCK
    if chunks_per_program is None:
        chunks_per_program = default_chunks_per_program(n, b * kv_heads * d // per_program,
                                                        by_groups)
    check_chunks_per_program(chunks_per_program, n)
    if step_barriers not in (1, 3):
        raise ValueError(f"step_barriers={step_barriers}: 1 (one for xt, col and a) or 3")
    check_stages(stages, pipelined)
    groups, row_blocks = hx // kv_heads, c // ROWS
    steps = groups * row_blocks
    # by_groups: a warpgroup's feature t is i = 16 t + 2 p + wg of program p, its col row
    # 2 t + wg of the step's block (one copy of 2 rows per group); otherwise its features
    # are per_wg consecutive i, its col row wg * per_wg + t.
    col_copies = per_wg if by_groups else 1
    ring_groups = ([(0, 1, 2, 3) if formed else (0, 1, 2)] if step_barriers == 1
                   else [(0,), (1, 3), (2,)] if formed else None)  # w rides with col
    arrivals = ([2 + col_copies + formed] if step_barriers == 1
                else [1, col_copies + formed, 1]) if by_groups else None

    def col_row(t, wg):
        return COMPUTE_WGS * t + wg if by_groups else wg * per_wg + t

    def kernel(xt_ref, col_ref, a_ref, *refs):
        w_ref, refs = (refs[0], refs[1:]) if formed else (None, refs)
        outputs = d // BLOCK if upper else 1
        s_refs, (ring_arrays, ring_loaded, ring_freed), outs = (
            refs[:outputs], refs[outputs:outputs + 3], refs[outputs + 3:])
        ring = Ring.of(ring_arrays, ring_loaded, ring_freed, ring_groups, arrivals)
        bh, wg = lax.axis_index("bh"), lax.axis_index("wg")
        bi, hk = lax.div(bh, kv_heads), lax.rem(bh, kv_heads)
        chunk0 = lax.axis_index("chunk") * chunks_per_program  # this program's first chunk
        program = lax.axis_index("features")
        first = program * per_program  # this program's first i (not by_groups)

        @pl.when(wg < COMPUTE_WGS)
        def _compute():
            plgpu.set_max_registers(COMPUTE_REGISTERS, action="increase")

            def step_blocks(slot):
                """A step's operand builder (the warpgroup's features t -> their operands
                base diag(col_i), i its t-th feature, base the xt block or, by_groups, the
                a block transposed) and each feature's B operand, once the blocks in its
                ring slot have landed."""
                # [D, ROWS], [per_program, ROWS] (col_i of the block, or xt's rows i),
                # [ROWS, E] (and w [ROWS])
                xt_smem, col_rows, a_smem, *w_smem = ring.wait_all(slot)
                w = load(w_smem[0], COL_VECTOR) if formed else None
                if by_groups:  # a^T [E, ROWS], read transposed from its [ROWS, E] tile
                    base = plgpu.layout_cast(load(
                        a_smem.transpose((1, 0)), WGMMA_TRANSPOSED), WGMMA)
                    rhs = [xt_smem.at[pl.ds(BLOCK * t, d - BLOCK * t)].transpose((1, 0))
                           for t in range(per_wg)]  # [ROWS, D - 16 t]: rows j >= 16 t
                else:
                    base, rhs = load(xt_smem, WGMMA), [a_smem] * per_wg

                def operands(features):
                    scales = [load(col_rows.at[col_row(t, wg)], COL_VECTOR)
                              for t in features]
                    return [base * by_cols(formed_column(x, w)) for x in scales]
                return operands, rhs

            def accumulate_all(k, *acc_refs):  # the ring's steps of the program's chunk k
                def visit(step, _):
                    slot = ring.slot(step)
                    operands, rhs = step_blocks(slot)
                    products(acc_refs, operands(range(per_wg)), rhs)
                    ring.release(slot)

                def halves(step, slot):  # the warpgroup's features in two halves
                    operands, rhs = step_blocks(slot)

                    def half(ts):
                        return lambda: [(acc_refs[t], operand, rhs[t]) for t, operand in
                                        zip(ts, operands(ts), strict=True)]
                    return tuple(half(ts) for ts in feature_halves)

                if pipelined:
                    products_in_halves(ring, k * steps, (k + 1) * steps, halves)
                else:
                    lax.fori_loop(k * steps, (k + 1) * steps, visit, None)
                return tuple(acc_ref[...] for acc_ref in acc_refs)

            def sum_and_store(k, _=None):
                accs = pl.run_scoped(functools.partial(accumulate_all, k),
                                     *(plgpu.ACC(shape, F32) for shape in acc_shapes))
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the last chunk's stores
                slot = chunk0 + k + slot_offset
                if by_groups:  # S_i^T stored transposed: S_i's rows j >= 16 t, [D - 16 t, E]
                    for acc, out in zip(accs, outs, strict=True):
                        out.at[wg].transpose((1, 0))[...] = plgpu.layout_cast(
                            acc.astype(BF16), WGMMA_TRANSPOSED)
                    plgpu.commit_smem()
                    for t, out in enumerate(outs):
                        plgpu.copy_smem_to_gmem(out.at[wg], s_refs[t].at[
                            bi, hk, slot, COMPUTE_WGS * program + wg])
                    return
                out, = outs
                for t, acc in enumerate(accs):
                    out.at[wg, t][...] = acc.astype(BF16)
                plgpu.commit_smem()
                for t in range(per_wg):
                    i = first + wg * per_wg + t
                    if not upper:
                        plgpu.copy_smem_to_gmem(out.at[wg, t], s_refs[0].at[
                            bi, hk, slot, pl.ds(i * d, d)])
                    for group, s_ref in enumerate(s_refs if upper else ()):
                        lo = BLOCK * group  # the program's features lie in one group
                        pl.when(lax.div(first, BLOCK) == group)(functools.partial(
                            plgpu.copy_smem_to_gmem, out.at[wg, t, pl.ds(lo, d - lo)],
                            s_ref.at[bi, hk, slot, i - lo]))

            lax.fori_loop(0, chunks_per_program, sum_and_store, None)
            plgpu.wait_smem_to_gmem(0)

        @pl.when(wg == COMPUTE_WGS)
        def _memory():
            plgpu.set_max_registers(MEMORY_REGISTERS, action="decrease")

            def sources(step):
                chunk, step_in_chunk = chunk0 + lax.div(step, steps), lax.rem(step, steps)
                h = hk * groups + lax.div(step_in_chunk, row_blocks)
                rows = pl.ds(lax.rem(step_in_chunk, row_blocks) * ROWS, ROWS)
                if by_groups:  # group t's two rows i = 16 t + 2 p + (0, 1)
                    cols = [(col_ref.at[bi, h, chunk, pl.ds(BLOCK * t + COMPUTE_WGS * program,
                                                            COMPUTE_WGS), rows],
                             pl.ds(COMPUTE_WGS * t, COMPUTE_WGS)) for t in range(per_wg)]
                else:
                    cols = col_ref.at[bi, h, chunk, pl.ds(first, per_program), rows]
                return (xt_ref.at[bi, h, chunk, :, rows], cols, a_ref.at[bi, h, chunk, rows],
                        *((w_ref.at[bi, h, chunk, rows],) if formed else ()))

            ring.fill(chunks_per_program * steps, sources)

    if upper and not by_groups and BLOCK % per_program:
        raise ValueError(f"upper: a program's {per_program} features must lie in one group of "
                         f"{BLOCK} rows i")
    if by_groups:  # S_i^T [E, D - 16 t]; halves of equal products (t = 0, 3 and 1, 2)
        acc_shapes = [(e, d - BLOCK * t) for t in range(per_wg)]
        feature_halves = ((0, per_wg - 1), tuple(range(1, per_wg - 1)))
        out_scratch = [swizzled((COMPUTE_WGS, d - BLOCK * t, e), BF16) for t in range(per_wg)]
    else:
        acc_shapes = [(d, e)] * per_wg
        feature_halves = (tuple(range(per_wg // 2)), tuple(range(per_wg // 2, per_wg)))
        out_scratch = [swizzled((COMPUTE_WGS, per_wg, d, e), BF16)]
    ring = Ring.scratch([tile(ROWS), ((per_program, ROWS), source.dtype, False), tile(e),
                         *([VECTOR] if formed else [])], stages, ring_groups, arrivals)
    lead = (b, kv_heads, slots)
    out_type = ([jax.ShapeDtypeStruct(shape, BF16) for shape in upper_shapes(lead, d, e)]
                if upper else jax.ShapeDtypeStruct((*lead, d * d, e), BF16))
    result = launch(
        kernel, name="sympow_states_rows_to_state",
        out_type=out_type,
        scratch=(*ring, *out_scratch),
        grid=(n // chunks_per_program, b * kv_heads, d // per_program),
        grid_names=("chunk", "bh", "features"),
        args=(xt, source, a, *((col_weights,) if formed else ())))
    return tuple(result) if upper else result
