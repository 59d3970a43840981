"""The chunked algorithm's state products on Hopper, p = 2, in the square layout.

The Hopper tier keeps a p = 2 state in the square layout: feature (i, j) at row i D + j for
all i, j < D (F = D^2, phi(u) = u (x) u with weight 1: the tiled embedding with one tile
of width D). A state is then D blocks S_i = S[i D : (i + 1) D] of shape [D, E], and every
product with phi is a sum over i of plain matrix products whose register A operand is a
block scaled by one column of u, built where the wgmma wants it (no phi tile, no
selection products):

* `rows_to_state` (in `state_sums`):  S_i = sum_r u_ri u_r a_r^T
  = sum_r (x^T diag(col_i))[:, r] a_r (rows -> state: the update_state forward, a state's
  cotangent);
* `state_to_rows`:  y_r = sum_i col_ir (x_r S_i)        = phi(u_r) S          (state -> rows)
  and, transposed, g_r = sum_j col_jr (a_r S_j^T)      (half the row gradient of phi(u) . S a);
* `row_gradients`: the transposed product as the backward uses it, dx = 2 g in bf16 and
  dls_r = sum_j dx_rj x_rj from the float32 accumulator.

with x the raw rows (keys or queries, bf16), u = x e^ls their scaled values and
col = x^T e^(2 ls) [D, C], so u_ri u_rj = col_ir x_rj. The operand is a bf16 product: col
in bf16 (stored so, or rounded where the kernel loads it: the same numbers, and bf16 halves
its traffic; or formed there from x^T and e^(2 ls), `column_forms`), times x (bf16 x
bf16 is exact in float32, so the product rounds once more, to bf16, where the MMA takes
it; no float32 copy of the block, no conversions).
Accumulators are float32. D = 64 (WIDTHS[0]); E in WIDTHS.

Programs (blocks.py): two compute warpgroups and a memory warpgroup feeding a `Ring`.
- rows_to_state: one program per (group of 2 x per_wg features i, chunk, kv head); the
  ring walks the 64-row blocks of the chunk (over the query heads of a group too; a
  step's xt, col and a blocks on one barrier), each warpgroup accumulating its per_wg
  blocks S_i in registers (per_wg = 256 / E); with chunks_per_program > 1 a program does
  so for consecutive chunks in turn. In the upper layout at E = 64 a program's features
  are two of each group of 16 i, each S_i summed over its stored rows only.
- state_to_rows: one program per (128 or 256 rows, chunk, head); each warpgroup holds its
  one or two 64-row blocks of x (or a) and col; the ring walks the D blocks S_i of the
  chunk's state two at a time (BLOCKS_PER_STEP), each read once for both row blocks (with
  chunks_per_program > 1, of consecutive chunks in turn, the rows loaded for each). With
  `upper` (y = phi(u) S of a symmetric S, the tier's) it reads only the upper 16 x 16
  blocks of each S_i, counting those right of the diagonal block twice (`upper_pieces`:
  62.5 % of the products), with `packed` its short blocks several to a ring tile (285
  against 388 us square on an H200, 2026-11-27).
A step's register operands are built before their products are issued: all of the step's
(`blocks.products`), or with `pipelined` (rows_to_state's default, the tier's upper
state_to_rows) one half of them while the other half's products run
(`blocks.products_in_halves`). The ring's walk over a state is `state_walks`, and so is
the upper layout a state may be stored in (`state_walks.upper_shapes`: the rows j >= 16
(i // 16) of each S_i, 62.5 % of the bytes), which rows_to_state writes with `upper` (at
E = 64 summing only those rows, each S_i transposed: 404 against 438 us on an H100,
2026-11-28) and state_to_rows and row_gradients read when s is a tuple: the tier's layout
(`states.STORED_UPPER`).
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu
from jaxtyping import Array

from sympow.attention.mosaic_gpu.blocks import (
    COMPUTE_REGISTERS,
    COMPUTE_WGS,
    MEMORY_REGISTERS,
    ROW_VECTOR,
    ROWS,
    TILE_ROWS,
    WGMMA,
    WIDTHS,
    Ring,
    by_rows,
    launch,
    load,
    load_own,
    own_scratch,
    products,
    products_in_halves,
    swizzled,
    tile,
)
from sympow.attention.mosaic_gpu.column_forms import (
    column_parts,
    formed_column,
)
from sympow.attention.mosaic_gpu.state_walks import (
    BLOCK,
    BLOCKS_PER_STEP,
    UpperSegment,
    upper_pieces,
    upper_segments,
    upper_shapes,
    whole_block_pieces,
)

F32, BF16 = jnp.float32, jnp.bfloat16
DIM = WIDTHS[0]  # d of the square layout: F = DIM^2 features
# Shared memory a state_to_rows program may fill: the H100's 227 KiB a block, less 4 KiB for
# barriers and alignment (a kernel that asked for 3 slots was 2.1 KiB over its blocks' sum).
SHARED_MEMORY = (227 - 4) * 1024
# Measured on an H200 (2026-11-27, profile_states.py): state_to_rows and row_gradients wait
# on their ring (2 -> 3 -> 5 slots: 0.73 -> 0.63 -> 0.59 ms a call), so they take as many
# slots as fit, up to MAX_STAGES (4 with the normalizer's parts).
MAX_STAGES = 5


def _bytes(shape, dtype) -> int:
    return math.prod(shape) * jnp.dtype(dtype).itemsize


def check_chunks_per_program(chunks_per_program: int, n: int) -> None:
    if chunks_per_program < 1 or n % chunks_per_program:
        raise ValueError(f"chunks_per_program={chunks_per_program} must divide the {n} chunks")


def check_stages(stages: int, pipelined: bool) -> None:
    if stages < (2 if pipelined else 1):
        raise ValueError(f"stages={stages}: a ring needs a slot, and 2 with pipelined=True "
                         f"(a step's slot is held into the next step)")


def check_slots(slots: int, n: int, slot_offset: int) -> None:
    """A state array's slots must hold chunk n at slot n + slot_offset for every n < N."""
    if slot_offset < 0 or slots < n + slot_offset:
        raise ValueError(f"states of {slots} slots cannot hold {n} chunks from slot "
                         f"slot_offset={slot_offset}")


class Normalizer(NamedTuple):
    """The normalizer's share of a `state_to_rows` or `row_gradients` call: per row the
    quadratic form w_r x_r^T Z x_r (= phi(u_r) . z for w = e^(2 ls)), with

    parts [B, Hk, N, 3 D, D] bf16: each chunk's symmetric float32 Z [D, D] as three bf16
      parts stacked (`blocks.bf16_parts`, smallest first; read by query head h as kv head
      h // (Hx / Hk)), so x Z on the tensor cores is float32-accurate for bf16 rows x;
    weights [B, Hx, N, C] float32: w_r, applied to the float32 product.
    """

    parts: Array
    weights: Array


def state_to_rows(rows, col, s, *, transposed: bool, normalizer: Normalizer | None = None,
                  stages: int | None = None, slot_offset: int = 0, chunks_per_program: int = 1,
                  upper: bool = False, packed: bool = False, pipelined: bool = False,
                  out_dtype=F32):
    """[B, Hx, N, C, W'] in out_dtype (float32, or bfloat16: the float32 sums rounded in
    the epilogue, as XLA's cast would round them, at half the bytes written and held):
    out_r = sum_i col[i, r] rows_r S_i, or with `transposed` out_r = sum_i col[i, r]
    rows_r S_i^T. With a `normalizer` (not transposed) also den [B, Hx, N, C] float32,
    den_r = w_r rows_r^T Z rows_r: (out, den).

    rows [B, Hx, N, C, W] bf16 (x with W = D, or a with W = E when transposed); col
    [B, Hx, N, D, C] bf16 or float32, or `column_forms.Columns` (formed in the kernel); s
    [B, Hk, N, D^2, E] bf16 read by query head h as kv head h // (Hx / Hk), or the same
    state in the upper layout, a tuple or list of the arrays of
    `state_walks.upper_shapes((B, Hk, N), D, E)` (its whole blocks read from their held
    rows and their mirrors). W' = E, or D when transposed. C a multiple of TILE_ROWS,
    D = DIM.
    stages: ring slots (default: as many as fit in shared memory). slot_offset: chunk n
    reads s at slot n + slot_offset (s may hold more slots than N; Z's parts stay by chunk).
    chunks_per_program (dividing N; without a normalizer): consecutive chunks one program
    takes in turn, its ring running on into the next chunk's blocks S_i while the last
    chunk's rows are stored, its own rows loaded again for each (1, the default: 2 or 4
    were at most 1 % faster on an H200, 2026-11-27, where rows_to_state's 4 gained 10 %).

    upper (not transposed, one chunk a program): the kernel reads only the blocks of
    `upper_pieces` (rows j >= 16 (i // 16) of each S_i, those right of the diagonal block
    counted twice: `upper_weights`), 62.5 % of the products and bytes. That is the square
    sum where S is symmetric in (i, j) and col_ir rows_rj is too, as for every state,
    state cotangent and col = x^T e^(2 ls) of the tier; for other inputs it is not.
    packed (with upper): the short blocks of the last rows i (32 and 16 rows j) two and
    four to a ring tile (`upper_segments`), the same products in fewer ring steps.
    pipelined: a step's blocks S_i in two halves, each half's operands built while the
    other half's products run (`blocks.products_in_halves`; the tier's choice with upper,
    where it measured 2 % faster on an H200, 2026-11-27; square, 0-1 %). Same sums, same
    order.
    """
    if normalizer is not None and transposed:
        raise ValueError("normalizer: the quadratic form takes the rows x (transposed=False)")
    if upper and (transposed or chunks_per_program > 1):
        raise ValueError(f"upper: the untransposed product one chunk a program (transposed="
                         f"{transposed}, chunks_per_program={chunks_per_program})")
    if packed and not upper:
        raise ValueError("packed: the upper blocks' ring (upper=True) packs its short blocks")
    if jnp.dtype(out_dtype) not in (jnp.dtype(F32), jnp.dtype(BF16)):
        raise ValueError(f"out_dtype must be float32 or bfloat16; got {jnp.dtype(out_dtype)}")
    return _state_to_rows(rows, col, s, None, normalizer, transposed=transposed, stages=stages,
                          slot_offset=slot_offset, chunks_per_program=chunks_per_program,
                          segments=upper_segments(column_parts(col)[0].shape[-2], packed)
                          if upper else None,
                          pipelined=pipelined, out_dtype=jnp.dtype(out_dtype))


def row_gradients(a, x, col, s, *, normalizer: Normalizer | None = None,
                  stages: int | None = None, slot_offset: int = 0, chunks_per_program: int = 1,
                  pipelined: bool = False):
    """(dx [B, Hx, N, C, D] bf16, dls [B, Hx, N, C] float32): the row gradients of
    sum_r phi(u_r) . (S a_r) (+ w_r x_r^T Z x_r with a `normalizer`) with u = x e^ls,
    col = x^T e^(2 ls): dx_r = 2 sum_j col[j, r] a_r S_j^T (the transposed `state_to_rows`,
    doubled by the symmetry of S) + 2 w_r Z x_r, and dls_r = sum_j dx_rj x_rj (the scale's
    cotangent: both terms are homogeneous of degree 2 in u), all from float32 in the
    kernel's epilogue (one read of dx less, and dx leaves in bf16).

    a [B, Hx, N, C, E] bf16; x [B, Hx, N, C, D] bf16; col, s (square, or in the upper
    layout), slot_offset, chunks_per_program, pipelined as `state_to_rows`.
    """
    return _state_to_rows(a, col, s, x, normalizer, transposed=True, stages=stages,
                          slot_offset=slot_offset, chunks_per_program=chunks_per_program,
                          segments=None, pipelined=pipelined, out_dtype=jnp.dtype(BF16))


def _state_to_rows(rows, col, s, x, normalizer, *, transposed: bool, stages: int | None,
                   slot_offset: int, chunks_per_program: int,
                   segments: list[UpperSegment] | None, pipelined: bool, out_dtype):
    """`state_to_rows`, or with x given (transposed) `row_gradients` (out_dtype bf16); with
    a normalizer, the quadratic form of its Z against the rows x (three products with Z's
    parts per block of rows, after the state's) in the epilogue."""
    b, hx, n, c, w = rows.shape
    source, col_weights = column_parts(col)
    d, formed = source.shape[-2], col_weights is not None
    stored_upper = isinstance(s, (tuple, list))  # the upper layout: one array per group
    arrays = tuple(s) if stored_upper else (s,)
    hk, slots, e = arrays[0].shape[1], arrays[0].shape[2], arrays[0].shape[-1]
    check_slots(slots, n, slot_offset)
    if stored_upper and [a.shape for a in s] != upper_shapes((b, hk, slots), d, e):
        raise ValueError(f"s in the upper layout: {upper_shapes((b, hk, slots), d, e)}; got "
                         f"{[a.shape for a in s]}")
    if stored_upper and chunks_per_program > 1:
        raise ValueError(f"chunks_per_program={chunks_per_program}: s in the upper layout is "
                         f"read one chunk a program")
    groups, width = hx // hk, d if transposed else e
    gradient, quadratic = x is not None, normalizer is not None
    check_chunks_per_program(chunks_per_program, n)
    if chunks_per_program > 1 and quadratic:
        raise ValueError(f"chunks_per_program={chunks_per_program}: a program takes one chunk "
                         f"with a normalizer (Z's parts are one chunk's)")
    several = chunks_per_program > 1
    # 64-row blocks per warpgroup: two share each S_i read (half the traffic per product)
    # where their shared memory fits (E = 64: 202 KiB with the ring and Z's parts).
    sub = 2 if e == min(WIDTHS) and c % (2 * TILE_ROWS) == 0 else 1
    rows_per_wg = sub * ROWS
    per_step = BLOCKS_PER_STEP  # blocks S_i a ring slot holds: one wait for all their
    # products (pipelined: one for each half of them)
    inputs = (rows, source, *arrays, *((x,) if gradient else ()),
              *((normalizer.parts, normalizer.weights) if quadratic else ()),
              *((col_weights,) if formed else ()))
    # each warpgroup's own blocks: its rows, col (or xt), x, the normalizer's weights, w
    own_specs = [((rows_per_wg, w), BF16, True), ((d, rows_per_wg), source.dtype, False)]
    own_specs += [((rows_per_wg, d), BF16, True)] if gradient else []
    own_specs += [((rows_per_wg,), F32, False)] if quadratic else []
    own_specs += [((rows_per_wg,), F32, False)] if formed else []
    out_type = [jax.ShapeDtypeStruct((b, hx, n, c, width), out_dtype)]
    out_scratch = [swizzled((COMPUTE_WGS, rows_per_wg, width), out_dtype)]
    if gradient or quadratic:  # dls, or den: one float32 per row
        out_type.append(jax.ShapeDtypeStruct((b, hx, n, c), F32))
        out_scratch += own_scratch(((rows_per_wg,), F32, False))
    # Z's parts: one copy per program (both warpgroups read the same chunk's), fetched by
    # the memory warpgroup before the ring.
    parts_scratch = ([swizzled((3 * d, d), BF16), plgpu.Barrier(num_barriers=1)]
                     if quadratic else [])
    own = own_scratch(*own_specs)
    # Ring slots: as many as fit (up to MAX_STAGES) beside the own blocks, the outputs and
    # Z's parts.
    fixed = sum(_bytes(buf.shape, buf.dtype) for buf in (*own, *out_scratch, *parts_scratch[:1]))
    stages = stages or min(MAX_STAGES, (SHARED_MEMORY - fixed) // _bytes((per_step * d, e), BF16))
    check_stages(stages, pipelined)
    # A slot holds per_step blocks S_i: one [per_step D, E] slab, or over the upper blocks
    # (segments) per_step tiles [D, E], each block's rows j >= lo stacked from a tile's row
    # 0, swizzled at 32 bytes for the K = 16 slices, all on one barrier (which takes the
    # most copies a step; `Ring.fill` makes up the rest).
    upper = segments is not None
    ring_specs, ring_groups = (([tile(e, max_swizzle=32)] * per_step, [tuple(range(per_step))])
                               if upper else ([((per_step * d, e), BF16, True)], None))
    # the most copies a step: over the upper blocks, a step's blocks; over whole blocks of
    # the upper layout, each block's held rows and a box per mirror group
    ring_arrivals = ([max(seg.blocks for seg in segments)] if upper else
                     [per_step * len(arrays)] if stored_upper else None)

    def kernel(*refs):
        refs = list(refs)
        rows_ref, col_ref = refs[:2]
        s_refs, refs_after = refs[2:2 + len(arrays)], refs[2 + len(arrays):]
        s_ref = s_refs[0]
        x_ref = refs_after[0] if gradient else None
        parts_ref, weights_ref = (refs_after[gradient:2 + gradient] if quadratic
                                  else (None, None))
        col_weights_ref = refs[len(inputs) - 1] if formed else None
        out_refs = refs[len(inputs):len(inputs) + len(out_type)]
        own, own_bars, ring_arrays, ring_loaded, ring_freed, *rest = refs[
            len(inputs) + len(out_type):]
        parts_smem, parts_bar = rest[:2] if quadratic else (None, None)
        outs = rest[len(parts_scratch):]
        ring = Ring.of(ring_arrays, ring_loaded, ring_freed, ring_groups, ring_arrivals)
        bh, wg = lax.axis_index("bh"), lax.axis_index("wg")
        bi, h = lax.div(bh, hx), lax.rem(bh, hx)
        chunk = lax.axis_index("chunk")  # with several chunks a program, its first
        chunk = chunk * chunks_per_program if several else chunk
        kv = lax.div(h, groups)
        mine = pl.ds((lax.axis_index("tile") * COMPUTE_WGS + wg) * rows_per_wg, rows_per_wg)
        steps = d // per_step  # ring steps a chunk

        def one_chunk(chunk, k):  # a compute warpgroup's rows of chunk `chunk`, k-th here
            rows_smem, col_smem = own[:2]
            x_smem = own[2] if gradient else rows_smem  # the rows of the quadratic form
            weights_smem = own[2 + gradient] if quadratic else None
            sources = [rows_ref.at[bi, h, chunk, mine], col_ref.at[bi, h, chunk, :, mine]]
            sources += [x_ref.at[bi, h, chunk, mine]] if gradient else []
            sources += [weights_ref.at[bi, h, chunk, mine]] if quadratic else []
            sources += [col_weights_ref.at[bi, h, chunk, mine]] if formed else []
            if several:  # the last chunk's reads of the own blocks done before they refill
                plgpu.commit_smem()
            load_own(list(zip(sources, own, strict=True)), wg, own_bars)
            blocks = [pl.ds(j * ROWS, ROWS) for j in range(sub)]
            bases = [load(rows_smem.at[wg, r], WGMMA) for r in blocks]
            col_weights_smem = own[-1] if formed else None  # w: the last own block
            row_weights = ([load(col_weights_smem.at[wg, r], ROW_VECTOR) for r in blocks]
                           if formed else [None] * sub)  # w by row block

            def accumulate_all(*acc_refs):
                def step_blocks(slot, step, seg=None):
                    """A step's blocks S_i, once landed, as (i, its tile, its first row):
                    one slab of whole blocks S_i, or with the upper blocks S_i[lo:]
                    stacked per_tile to a tile."""
                    step_in_chunk = step - k * steps if several else step
                    tiles = ring.wait(slot, 0)
                    return ([(step_in_chunk * per_step + u, tiles[0], u * d)
                             for u in range(per_step)] if seg is None else
                            [(i, tiles[t], row) for i, t, row in (
                                seg.place(step, u, d) for u in range(seg.blocks))])

                def build(entries, seg=None):
                    """[(acc_ref, operand, b)]: the products of blocks `entries`."""
                    built = []
                    for i, tile_ref, row in entries:
                        block = tile_ref.at[pl.ds(row, d)] if seg is None else None
                        for acc_ref, base, r, w_r in zip(acc_refs, bases, blocks, row_weights,
                                                         strict=True):
                            x = formed_column(load(col_smem.at[wg, i, r], ROW_VECTOR), w_r)
                            if seg is None:  # the whole block
                                pieces = [(base, x, block.transpose((1, 0)) if transposed
                                           else block)]
                            else:  # base's columns j of each piece against S_i's rows j
                                pieces = [(base[:, start:stop], weight * x, tile_ref.at[
                                    pl.ds(row + start - seg.lo, stop - start)])
                                          for start, stop, weight in upper_pieces(seg.lo, d)]
                            built += [(acc_ref, part * by_rows(scale, part.shape), b_block)
                                      for part, scale, b_block in pieces]
                    return built

                def visit(step, _, seg=None):  # a step's blocks S_i (the ring's step counts
                    slot = ring.slot(step)     # over the chunks)
                    products(*zip(*build(step_blocks(slot, step, seg), seg), strict=True))
                    ring.release(slot)

                def halves(step, slot, seg=None):  # a step's blocks S_i in two halves
                    entries = step_blocks(slot, step, seg)
                    half = len(entries) // 2
                    return (functools.partial(build, entries[:half], seg),
                            functools.partial(build, entries[half:], seg))

                # one static segment of steps per 16 rows i (their pieces' shapes), or the
                # chunk's steps
                walks = ([(seg.first, seg.first + seg.steps, seg) for seg in segments]
                         if upper else [(k * steps, (k + 1) * steps, None)])
                for first_step, end, seg in walks:
                    if pipelined:
                        products_in_halves(ring, first_step, end,
                                           functools.partial(halves, seg=seg))
                    else:
                        lax.fori_loop(first_step, end, functools.partial(visit, seg=seg), None)
                return tuple(acc_ref[...] for acc_ref in acc_refs)

            accs = pl.run_scoped(accumulate_all,
                                 *(plgpu.ACC((ROWS, width), F32) for _ in range(sub)))
            if several:  # the last chunk's stores have read the outputs' shared memory
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)
            if quadratic:
                plgpu.barrier_wait(parts_bar.at[0])
            for r, acc in zip(blocks, accs, strict=True):
                if quadratic:  # x Z [ROWS, D] and the rows' weights
                    xz = quadratic_product(x_smem.at[wg, r], parts_smem)
                    weights = load(weights_smem.at[wg, r], ROW_VECTOR)
                if gradient:  # [ROWS, D]: dx = 2 (acc + w x Z), dls its row sums against x
                    dx = 2.0 * (acc + by_rows(weights, acc.shape) * xz if quadratic else acc)
                    rows_x = load(x_smem.at[wg, r], WGMMA).astype(F32)
                    outs[1].at[wg, r][...] = jnp.sum(dx * rows_x, axis=1)
                    acc = dx.astype(BF16)
                elif quadratic:  # den = w x^T Z x
                    rows_x = load(x_smem.at[wg, r], WGMMA).astype(F32)
                    outs[1].at[wg, r][...] = weights * jnp.sum(xz * rows_x, axis=1)
                outs[0].at[wg, r][...] = acc.astype(out_dtype)
            plgpu.commit_smem()
            for buf, out_ref in zip(outs, out_refs, strict=True):
                plgpu.copy_smem_to_gmem(buf.at[wg], out_ref.at[bi, h, chunk, mine])

        @pl.when(wg < COMPUTE_WGS)
        def _compute():
            plgpu.set_max_registers(COMPUTE_REGISTERS, action="increase")
            if several:
                lax.fori_loop(0, chunks_per_program, lambda k, _: one_chunk(chunk + k, k), None)
            else:
                one_chunk(chunk, 0)
            plgpu.wait_smem_to_gmem(0)

        @pl.when(wg == COMPUTE_WGS)
        def _memory():
            plgpu.set_max_registers(MEMORY_REGISTERS, action="decrease")
            if quadratic:
                plgpu.copy_gmem_to_smem(parts_ref.at[bi, kv, chunk], parts_smem, parts_bar.at[0])
            if several:
                ring.fill(chunks_per_program * steps, lambda step: (s_ref.at[
                    bi, kv, chunk + lax.div(step, steps) + slot_offset,
                    pl.ds(lax.rem(step, steps) * per_step * d, per_step * d)],))
            elif upper:  # rows j >= lo of each S_i, one segment of steps per lo
                def upper_sources(step, seg):  # per tile, its blocks' (rows, place) pairs
                    pieces = [[] for _ in range(per_step)]
                    for u in range(seg.blocks):
                        i, t, row = seg.place(step, u, d)
                        source = (s_refs[seg.lo // BLOCK].at[bi, kv, chunk + slot_offset,
                                                             i - seg.lo]
                                  if stored_upper else s_ref.at[bi, kv, chunk + slot_offset,
                                                                pl.ds(i * d + seg.lo, d - seg.lo)])
                        pieces[t].append((source, pl.ds(row, d - seg.lo)))
                    return tuple(pieces)

                for seg in segments:
                    ring.fill(seg.first + seg.steps,
                              functools.partial(upper_sources, seg=seg), start=seg.first)
            elif stored_upper:  # whole blocks S_j from the upper layout: their held rows
                # and, per group below theirs, the mirrors S_i[j] as one box
                def whole_sources(step, group):
                    slot, pieces = chunk + slot_offset, []
                    for u in range(per_step):
                        j = step * per_step + u  # traced; its group is the segment's
                        for piece in whole_block_pieces(BLOCK * group, d):
                            at = j - BLOCK * piece.group
                            src = s_refs[piece.group].at[
                                (bi, kv, slot, slice(None), at) if piece.mirror
                                else (bi, kv, slot, at)]
                            pieces.append((src, pl.ds(u * d + piece.first, piece.rows)))
                    return (pieces,)

                per_group = BLOCK // per_step  # steps whose blocks S_j share j's group
                for group in range(len(arrays)):
                    ring.fill(per_group * (group + 1),
                              functools.partial(whole_sources, group=group),
                              start=per_group * group)
            else:
                ring.fill(steps, lambda step: (s_ref.at[
                    bi, kv, chunk + slot_offset, pl.ds(step * per_step * d, per_step * d)],))

    own_bars = tuple(plgpu.Barrier(num_barriers=COMPUTE_WGS) for _ in own)
    ring = Ring.scratch(ring_specs, stages, ring_groups, ring_arrivals)
    name = "row_gradients" if gradient else "state_to_rows"
    result = launch(
        kernel, name=f"sympow_states_{name}{'_normalized' if quadratic else ''}",
        out_type=out_type, scratch=(own, own_bars, *ring, *parts_scratch, *out_scratch),
        grid=(n // chunks_per_program, b * hx, c // (COMPUTE_WGS * rows_per_wg)),
        grid_names=("chunk", "bh", "tile"),
        args=inputs)
    return tuple(result) if len(out_type) > 1 else result[0]


def quadratic_product(x_smem, parts_smem):
    """x Z (float32 [ROWS, D], wgmma layout) for a block of bf16 rows x [ROWS, D] and Z's
    three bf16 parts [3 D, D], both in shared memory: exact products, float32 sums, the
    smallest part first."""
    d = x_smem.shape[-1]

    def product(acc_ref):
        for part in range(3):
            plgpu.wgmma(acc_ref, x_smem, parts_smem.at[pl.ds(part * d, d)])
        return acc_ref[...]

    return pl.run_scoped(product, plgpu.ACC((ROWS, d), F32))
