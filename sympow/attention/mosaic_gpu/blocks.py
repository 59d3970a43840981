"""What the Hopper tier's kernels share: block sizes, shared-memory tiles, the ring of blocks
the memory warpgroup fetches ahead, and the exact in-block decay product.

Every kernel of the tier is one program per 128 rows of a chunk (two compute warpgroups of
64 rows, one wgmma M each) plus a memory warpgroup that only issues TMA copies: it walks the
blocks the compute warpgroups visit, `stages` steps ahead, into the slots of a `Ring`, and
refills a slot once both compute warpgroups have released it.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import math
from collections.abc import Callable, Sequence

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

ROWS = 64  # rows of a compute warpgroup's block and of every streamed block (one wgmma M)
COMPUTE_WGS = 2
TILE_ROWS = ROWS * COMPUTE_WGS  # rows of one program
WIDTHS = (64, 128)  # d and e the kernels take (bf16 rows of 128 or 256 bytes)
LOG2E = math.log2(math.e)
LN2 = math.log(2.0)
COMPUTE_REGISTERS, MEMORY_REGISTERS = 232, 40  # per thread, after setmaxnreg
WGMMA = plgpu.Layout.WGMMA
WGMMA_TRANSPOSED = plgpu.Layout.WGMMA_TRANSPOSED  # a [M, N] tile read or stored transposed
ROW_VECTOR = WGMMA.reduce(1)  # one value per row of a [ROWS, ROWS] wgmma result
COL_VECTOR = WGMMA.reduce(0)  # one value per column
SQUARE = (ROWS, ROWS)


def load(ref, layout):
    """The whole of `ref` (shared memory) in registers in `layout`: `plgpu.load` without an
    index where the installed jax takes none (0.11 deprecates passing one), with the empty
    index where it requires one (0.10)."""
    if _takes_index(plgpu.load):
        return plgpu.load(ref, (), layout=layout)
    return plgpu.load(ref, layout=layout)


@functools.cache
def _takes_index(load_fn) -> bool:
    """Whether load_fn (`plgpu.load`) requires an index argument."""
    index = inspect.signature(load_fn).parameters.get("idx")
    return index is not None and index.default is inspect.Parameter.empty


def swizzled(shape, dtype, max_swizzle: int = 128) -> plgpu.SMEM:
    """Shared memory for a TMA / wgmma tile: the widest swizzle up to max_swizzle bytes the
    rows allow (128 for the tier's kernels), with the tiling it implies."""
    itemsize = jnp.dtype(dtype).itemsize
    swizzle = min(max_swizzle, shape[-1] * itemsize)
    return plgpu.SMEM(shape, dtype, transforms=(
        plgpu.TilingTransform((8, swizzle // itemsize)), plgpu.SwizzleTransform(swizzle)))


def tile(width: int, dtype=jnp.bfloat16, max_swizzle: int = 128):
    """A [ROWS, width] block for the tensor cores (a `Ring` array spec), swizzled at up to
    max_swizzle bytes: a wgmma takes its K in multiples of the swizzle's width, so a
    product over 16-row slices of a B block needs 32 bytes (16 bf16 columns)."""
    return (ROWS, width), dtype, max_swizzle


VECTOR = ((ROWS,), jnp.float32, False)  # a [ROWS] float32 block (a `Ring` array spec)


def smem(shape, dtype, tiled: bool | int) -> plgpu.SMEM:
    """Shared memory of a (shape, dtype, tiled) spec: tiled False for a plain array, True
    for a 128-byte `swizzled` tile, or a swizzle cap in bytes (`tile`)."""
    if tiled is False:
        return plgpu.SMEM(shape, dtype)
    return swizzled(shape, dtype, 128 if tiled is True else tiled)


def by_rows(x, shape=SQUARE):
    """A row vector (one value per row) broadcast along the columns."""
    return lax.broadcast_in_dim(x, shape, [0])


def by_cols(x, shape=SQUARE):
    """A column vector (one value per column) broadcast along the rows."""
    return lax.broadcast_in_dim(x, shape, [1])


def indices():
    """(rows, cols) int32 [ROWS, ROWS] in the wgmma layout."""
    return tuple(plgpu.broadcasted_iota(jnp.int32, SQUARE, axis, layout=WGMMA)
                 for axis in (0, 1))


def row_vector(value: float):
    return plgpu.layout_cast(jnp.full((ROWS,), value, jnp.float32), ROW_VECTOR)


def zeros(shape):
    return plgpu.layout_cast(jnp.zeros(shape, jnp.float32), WGMMA)


def program_position(heads: int):
    """(b, h, n, tile, wg) of this program on an attention kernel's grid (chunk,
    b * heads, tile) and its warpgroup."""
    bh = lax.axis_index("bh")
    return (lax.div(bh, heads), lax.rem(bh, heads), lax.axis_index("chunk"),
            lax.axis_index("tile"), lax.axis_index("wg"))


def in_tokens(x) -> bool:
    """Whether a wide array (q, k, v, o and their cotangents) is in token layout
    [B, T, H, W] rather than chunk layout [B, H, N, C, W]: its rank tells."""
    if len(x.shape) not in (4, 5):
        raise ValueError(f"a wide array is [B, H, N, C, W] or [B, T, H, W]; got {x.shape}")
    return len(x.shape) == 4


def heads_of(x) -> int:
    """The heads of a wide array in either layout (`in_tokens`)."""
    return x.shape[2] if in_tokens(x) else x.shape[1]


def rows_at(ref, b, h, n, rows, chunk: int, cols=slice(None)):
    """Block `rows` (a pl.ds within chunk n) of head h of a wide array, in either layout
    (`in_tokens`): in token layout the rows start at n * chunk + rows.start and lie H * W
    elements apart, which a TMA copy reads as one strided box (the attention form's q, k, v
    and outputs need no transposes to and from chunk layout around the kernels)."""
    if not in_tokens(ref):
        return ref.at[b, h, n, rows, cols]
    return ref.at[b, pl.ds(n * chunk + rows.start, rows.size), h, cols]


def scores(a_ref, b_ref):
    """a @ b^T of two [ROWS, width] shared-memory tiles, float32 [ROWS, ROWS]."""
    def product(acc_ref):
        plgpu.wgmma(acc_ref, a_ref, b_ref.transpose((1, 0)))
        return acc_ref[...]
    return pl.run_scoped(product, plgpu.ACC(SQUARE, jnp.float32))


def block_totals(a):
    """The sums of a [..., C] over its blocks of ROWS: [..., C / ROWS]."""
    return a.reshape(*a.shape[:-1], a.shape[-1] // ROWS, ROWS).sum(axis=-1)


def write_mask(smem, mask: Callable) -> None:
    """Writes the 0/1 bf16 matrix [r, c] = mask(r, c) to `smem` [ROWS, ROWS] for the tensor
    cores to read."""
    rows, cols = indices()
    smem[...] = jnp.where(mask(rows, cols), 1.0, 0.0).astype(jnp.bfloat16)
    plgpu.commit_smem()


def decay_product(a_smem, a_mask: Callable, ones_smem):
    """sum_k A[r, k] B[k, c] (float32 [ROWS, ROWS], wgmma layout) for A[r, k] = a_k where
    a_mask(r, k) (a [ROWS] float32 in shared memory) and the 0/1 matrix B in `ones_smem`
    (`write_mask`): an in-block decay. A is split into three bf16 parts whose products with
    B are exact, so each sum carries float32 accuracy relative to itself (a difference of
    in-block prefix sums would carry the ulp of the larger prefix into every decay)."""
    rows, cols = indices()
    a = load(a_smem, COL_VECTOR)
    parts = bf16_parts(jnp.where(a_mask(rows, cols), by_cols(a), 0.0))

    def product(acc_ref):
        for part in parts:
            plgpu.wgmma(acc_ref, part, ones_smem)
        return acc_ref[...]

    return pl.run_scoped(product, plgpu.ACC(SQUARE, jnp.float32))


def bf16_parts(x):
    """(low, middle, high): float32 x as three bf16 parts whose sum is x to float32
    accuracy (each remainder is exact in float32), smallest first (the order to accumulate
    them in: small parts round least). A product of each with a 0/1 matrix is exact."""
    high = x.astype(jnp.bfloat16)
    rest = x - high.astype(jnp.float32)
    middle = rest.astype(jnp.bfloat16)
    return (rest - middle.astype(jnp.float32)).astype(jnp.bfloat16), middle, high


def load_own(pairs, wg, bars) -> None:
    """Each compute warpgroup's own blocks: (GMEM slice, [COMPUTE_WGS, ...] SMEM) pairs."""
    for (src, dst), bar in zip(pairs, bars, strict=True):
        plgpu.copy_gmem_to_smem(src, dst.at[wg], bar.at[wg])
    for bar in bars:
        plgpu.barrier_wait(bar.at[wg])


def store_own(pairs, wg) -> None:
    """Registers -> shared memory -> GMEM: (value, [COMPUTE_WGS, ...] SMEM, GMEM slice)."""
    for value, buf, _ in pairs:
        buf.at[wg][...] = value
    plgpu.commit_smem()
    for _, buf, dst in pairs:
        plgpu.copy_smem_to_gmem(buf.at[wg], dst)
    plgpu.wait_smem_to_gmem(0)


def own_scratch(*specs):
    """[COMPUTE_WGS, ...] scratch for each (shape, dtype, tiled) spec: one block per compute
    warpgroup."""
    return tuple(smem((COMPUTE_WGS, *shape), dtype, tiled) for shape, dtype, tiled in specs)


def accumulate(acc, weights, b_ref):
    """acc + weights @ b for weights in registers (cast to bf16) and b [ROWS, width]."""
    def product(acc_ref):
        plgpu.wgmma(acc_ref, weights.astype(jnp.bfloat16), b_ref)
    return pl.run_state(product)(plgpu.ACC.init(acc))


@dataclasses.dataclass(frozen=True)
class Ring:
    """Blocks of several arrays in `stages` shared-memory slots, fetched by the memory
    warpgroup and released by both compute warpgroups (arrays: [stages, ...] refs; loaded:
    one barrier ring per group of arrays, on which each of the group's copies of a step
    arrives with its bytes; freed: a ring with COMPUTE_WGS arrivals; groups: the array
    indices of each barrier group, a partition of the arrays).

    A consumer pays one barrier check per group and step: each check is a round trip, and
    in the forward kernel the four checks of a step held ~20 % of the compute warps' stall
    samples (ncu, H100, 2026-11-25), most for blocks already there. So the arrays a step
    uses at once share a group (the forward); a kernel that uses its blocks at different
    points of a step (the backward: q for the scores, m, head and c for the weights, dO
    after) keeps a group per array, so each wait is for the block needed next: every
    grouping of its blocks measured slower (docs/kernels.md)."""

    arrays: Sequence
    loaded: Sequence
    freed: object
    groups: tuple[tuple[int, ...], ...]
    arrivals: tuple[int, ...]  # per group: the arrivals a step's barrier takes

    @property
    def stages(self) -> int:
        return self.arrays[0].shape[0]

    @staticmethod
    def scratch(specs: Sequence, stages: int, groups: Sequence[Sequence[int]] | None = None,
                arrivals: Sequence[int] | None = None):
        """(arrays, loaded, freed) scratch to allocate for blocks of `specs` ((shape,
        dtype, tiled): `tile`, `VECTOR`), one barrier ring per group of array indices
        (default: one group per array). arrivals: per group, the arrivals its barrier
        takes a step (default: one copy per array; `fill` makes up a step with fewer
        copies by plain arrivals)."""
        groups = _partition(len(specs), groups)
        arrays = tuple(smem((stages, *shape), dtype, tiled) for shape, dtype, tiled in specs)
        loaded = tuple(plgpu.Barrier(num_arrivals=count, num_barriers=stages)
                       for count in _arrivals(groups, arrivals))
        return arrays, loaded, plgpu.Barrier(num_arrivals=COMPUTE_WGS, num_barriers=stages)

    @staticmethod
    def of(arrays, loaded, freed, groups: Sequence[Sequence[int]] | None = None,
           arrivals: Sequence[int] | None = None) -> Ring:
        """The ring over scratch refs allocated by `scratch` with the same groups and
        arrivals."""
        groups = _partition(len(arrays), groups)
        if len(loaded) != len(groups):
            raise ValueError(f"{len(groups)} barrier groups need as many barrier rings; "
                             f"got {len(loaded)}")
        return Ring(tuple(arrays), tuple(loaded), freed, groups, _arrivals(groups, arrivals))

    def _group_of(self, index: int) -> int:
        return next(g for g, group in enumerate(self.groups) if index in group)

    def fill(self, steps, sources: Callable, start: int = 0) -> None:
        """Memory warpgroup: the blocks `sources(step)` of steps start .. steps - 1, each
        into slot step % stages once both consumers freed it (the steps before `stages`
        need no wait). sources gives one entry per array: a GMEM ref filling the slot,
        (GMEM ref, rows) filling the slot's rows (a pl.ds), or a list of such pairs
        (several blocks in one slot). A walk whose blocks change shape along the way fills
        one static segment of steps at a time (start = where the segment begins, steps =
        where it ends). A group whose step takes fewer copies than its barrier's arrivals
        makes up the rest by plain arrivals (the phase still waits for every copy's
        bytes)."""
        def fetch(step, slot):
            copies = [0] * len(self.groups)
            for index, (entry, dst) in enumerate(zip(sources(step), self.arrays, strict=True)):
                group = self._group_of(index)
                for piece in entry if isinstance(entry, list) else [entry]:
                    src, rows = piece if isinstance(piece, tuple) else (piece, None)
                    target = dst.at[slot] if rows is None else dst.at[slot, rows]
                    plgpu.copy_gmem_to_smem(src, target, self.loaded[group].at[slot])
                    copies[group] += 1
            for group, (count, expected) in enumerate(zip(copies, self.arrivals, strict=True)):
                if count > expected:
                    raise ValueError(f"ring group {group}: {count} copies a step, more than "
                                     f"its barrier's {expected} arrivals")
                for _ in range(expected - count):
                    plgpu.barrier_arrive(self.loaded[group].at[slot])

        for step in range(start, self.stages):
            pl.when(step < steps)(lambda step=step: fetch(step, step))

        @pl.loop(max(start, self.stages), steps)
        def _refill(step):
            slot = lax.rem(step, self.stages)
            plgpu.barrier_wait(self.freed.at[slot])
            fetch(step, slot)

    def slot(self, step):
        return lax.rem(step, self.stages)

    def wait(self, slot, group: int = 0) -> tuple:
        """The blocks in `slot` of the arrays of barrier group `group` (in the group's
        order) once they have landed. A consumer waits for every group of every step it
        visits, used or not: each wait advances this thread's phase bit of that barrier, so
        a skipped wait would leave it one phase behind when the slot comes round again (a
        deadlock)."""
        plgpu.barrier_wait(self.loaded[group].at[slot])
        return tuple(self.arrays[index].at[slot] for index in self.groups[group])

    def wait_all(self, slot) -> tuple:
        """The blocks in `slot` of every array, in the arrays' order, once all have landed
        (each group's barrier waited for, in the groups' order)."""
        for group in range(len(self.groups)):
            self.wait(slot, group)
        return tuple(array.at[slot] for array in self.arrays)

    def release(self, slot) -> None:
        plgpu.barrier_arrive(self.freed.at[slot])

    def skip(self, step) -> None:
        """A step this warpgroup does not need: waited for (every barrier's phase stays in
        step with the other warpgroup's) and released."""
        slot = self.slot(step)
        self.wait_all(slot)
        self.release(slot)


def _arrivals(groups, arrivals) -> tuple[int, ...]:
    """Per group, the arrivals its barrier takes a step: `arrivals`, or one per array."""
    if arrivals is None:
        return tuple(len(group) for group in groups)
    arrivals = tuple(arrivals)
    if len(arrivals) != len(groups) or any(a < len(g) for a, g in zip(arrivals, groups,
                                                                       strict=True)):
        raise ValueError(f"arrivals: one count per barrier group ({len(groups)}), each at "
                         f"least the group's arrays ({[len(g) for g in groups]}); got {arrivals}")
    return arrivals


def _partition(count: int, groups) -> tuple[tuple[int, ...], ...]:
    """`groups` as tuples (None: one group per array), checked to hold each of the `count`
    array indices once."""
    groups = (tuple((index,) for index in range(count)) if groups is None
              else tuple(tuple(g) for g in groups))
    flat = sorted(index for group in groups for index in group)
    if flat != list(range(count)) or not all(groups):
        raise ValueError(f"ring groups must split the array indices 0..{count - 1} into "
                         f"non-empty groups, each index once; got {groups}")
    return groups


def launch(body, *, name: str, out_type, scratch, grid, grid_names, args):
    """A Mosaic GPU kernel `name` (what profilers show) of `body(*refs, *scratch_refs)` with
    COMPUTE_WGS + 1 warpgroups (axis 'wg'), the scratch shared by all of them. `args` may
    hold refs (`jax.new_ref`): the kernel reads and writes them in place, after the
    operands and before the outputs in `body`'s arguments' order.

    `grid`'s last axis is CUDA's x, the one the GPU dispatches fastest: the kernels put
    there the axis whose programs read the same blocks (a chunk's tiles, a state's
    features), so they run together and all but the first find the blocks in L2. With
    that axis first, rows_to_state and state_to_rows read every shared block from DRAM
    once per program (ncu, H200, 2026-11-27: 1.14 and 1.21 GB a call, exactly that)."""
    def entry(*refs):
        pl.run_scoped(lambda *scoped: body(*refs, *scoped), *scratch, collective_axes="wg")

    mesh = plgpu.Mesh(grid=grid, grid_names=grid_names, num_threads=COMPUTE_WGS + 1,
                      thread_name="wg")
    return pl.kernel(entry, out_type=out_type, mesh=mesh, name=name,
                     compiler_params=plgpu.CompilerParams(
                         approx_math=True,
                         lowering_semantics=plgpu.LoweringSemantics.Warpgroup))(*args)


def products(acc_refs, operands, rhs) -> None:
    """acc_refs[k] += operands[k] @ rhs[k] for register operands built beforehand, then
    wait.

    A running wgmma reads its A registers asynchronously, and nothing keeps a traced value
    alive past the call that consumes it: building the next operand while a product runs
    could reuse those registers (it did: wrong sums at E = 128). So every operand of a step
    is built first, all products issued, and the step waits for them; the other compute
    warpgroup's products fill the tensor cores meanwhile. (Building each operand just
    before its product, every operand kept alive past the wait by an optimization
    barrier, measured the same on an H200, 2026-11-27: ptxas schedules both alike.)
    `products_in_halves` keeps half a step in flight instead."""
    for acc_ref, operand, b in zip(acc_refs, operands, rhs, strict=True):
        plgpu.wgmma(acc_ref, operand, b)
    plgpu.wgmma_wait(0)


def products_in_halves(ring: Ring, first_step, end, halves: Callable) -> None:
    """acc += operand @ b over ring steps first_step .. end - 1 (at least one), a step's
    products in two halves, each half's register operands built while the other half's
    products run (`products` builds a whole step, then waits for it).

    halves(step, slot) waits for the blocks of ring step `step` in its slot and returns two
    callables, each building its half's products as [(acc_ref, operand, b)] when called
    (non-empty halves: an empty one would leave nothing to overlap). A half runs while the
    next is built: the step's first half while its second is, and its second while the
    next step's first is. A step's slot is released once its second half is done, in the
    next step, after that step has waited for its own slot: the ring needs two slots or
    more. At most two halves are in flight, so as many operands are alive as in
    `products` when the halves are equal: the half built next takes the registers of the
    half the last wait saw finish. A running half is carried on (through the walk's loop)
    and past that wait by `lax.optimization_barrier`, so that no value reuses its
    registers while its products read them (`products`). The first step runs before the
    loop, with nothing in flight before it."""
    if ring.stages < 2:
        raise ValueError(f"products_in_halves holds a step's slot into the next step: "
                         f"it needs a ring of 2 slots or more; got {ring.stages}")
    if isinstance(first_step, int) and isinstance(end, int) and end <= first_step:
        raise ValueError(f"products_in_halves walks at least one step; got steps "
                         f"{first_step} .. {end - 1}")

    def issue(half):
        if not half:
            raise ValueError("products_in_halves: each half of a step needs a product")
        for acc_ref, operand, b in half:
            plgpu.wgmma(acc_ref, operand, b)
        return [operand for _, operand, _ in half]

    def visit(step, in_flight):  # in_flight: the last step's second half, running
        build_first, build_second = halves(step, ring.slot(step))
        first = issue(build_first())
        plgpu.wgmma_wait(len(first))  # the last step's second half is done
        if in_flight is not None:
            in_flight, first = lax.optimization_barrier((in_flight, first))
            ring.release(ring.slot(step - 1))
        second = issue(build_second())
        plgpu.wgmma_wait(len(second))  # this step's first half is done
        return lax.optimization_barrier((first, second))[1]

    last = lax.fori_loop(first_step + 1, end, visit, visit(first_step, None))
    plgpu.wgmma_wait(0)
    lax.optimization_barrier(last)
    ring.release(ring.slot(end - 1))
