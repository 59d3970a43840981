"""Probe (issue 13): the row gradients from the stored rows of the upper layout only.

`state_kernels.row_gradients` computes g_r = sum_k col[k, r] a_r S_k^T (half the row
gradient of phi(u) . S a, u = x e^ls, col = x^T e^(2 ls)) as 64 products a row block, one
per whole block S_k [D, E] (its A operand a scaled by the row vector col_k, its B operand
S_k^T): 4,096 features a row, of which the symmetric state holds 2,080, and the upper
layout's mirrors read back into whole blocks. At 89.8 % of XLA's matmul rate by kernel time
(H200, 2026-11-28) it cannot reach issue 13's 45 % of useful rate that way: the products
themselves are the bound.

With M_k = a S_k[lo:]^T [ROWS, D - lo] (the rows j >= lo = 16 (k // 16) the upper layout
stores; M_r[k, j] = a_r . S[(k, j)] is symmetric in (k, j)) the same g is

    direct:  g[:, j] += col_k * M_k[:, j]                    for j >= lo (row vector col_k)
    mirror:  g[:, k] += sum_{j >= lo + 16} col[j] * M_k[:, j]  (a dot product a row)

(the pairs (k, j) of k's diagonal block of 16 are all stored and taken once by `direct`;
those right of it stand for their mirrors (j, k) in `mirror`): 2,560 features a row on the
tensor cores (62.5 %), A = a's tile as it is (no operand built a block), and on the CUDA
cores one multiply-add per entry of M_k for `direct`, one more right of the diagonal block
for `mirror` plus a row sum and a select into column k. This probe builds that kernel
without the normalizer's quadratic form and dls (g in float32), checks it against the
definition, and times it against `state_kernels.row_gradients` (no normalizer) over the
same stored state, by kernel time in turns, under three schedules of the CUDA-core work
against the products (`SCHEDULES`) and with its parts left out. Measured (H200,
2026-11-28, docs/kernels.md): serial 572-585 us against row_gradients' 388, its products
alone 306; "in_step" 573 (no overlap), "lagged" 691 (ptxas serializes its wgmmas, C7515:
the accumulators zeroed between a product's issue and its wait).

  PYTHONPATH=. python3 experiments/probe_row_gradients_upper.py --out=$OUT

Its kernel lowers for CUDA in CI (tests/configs/test_probe_row_gradients_upper.py).
"""

import functools
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from absl import app, flags  # noqa: E402
from jax import lax  # noqa: E402
from jax.experimental import pallas as pl  # noqa: E402
from jax.experimental.pallas import mosaic_gpu as plgpu  # noqa: E402
from probes import against, attempt, hopper_main  # noqa: E402  (beside this script)

from sympow.attention.mosaic_gpu.blocks import (  # noqa: E402
    COMPUTE_REGISTERS,
    COMPUTE_WGS,
    MEMORY_REGISTERS,
    ROW_VECTOR,
    ROWS,
    WGMMA,
    Ring,
    by_rows,
    launch,
    load,
    load_own,
    own_scratch,
    swizzled,
    tile,
)
from sympow.attention.mosaic_gpu.state_walks import BLOCK, upper_segments  # noqa: E402

F32, BF16 = jnp.float32, jnp.bfloat16

_OUT = flags.DEFINE_string("out", None, "directory for probe_row_gradients_upper.json")
_T = flags.DEFINE_integer("t", 65536, "tokens of the timed problem")
_HEADS = flags.DEFINE_integer("heads", 8, "heads of the timed problem (as many kv heads)")
_CHUNK = flags.DEFINE_integer("chunk", 1024, "chunk of the timed problem")
_REPS = flags.DEFINE_integer("reps", 30, "timed rounds in turns")


SCHEDULES = ("serial", "in_step", "lagged")


def row_gradients_upper(a, x, w, col, s, leave_out: str = "", schedule: str = "serial"):
    """g [B, H, N, C, D] float32 = sum_k col[k, r] a_r S_k^T from the upper layout's
    arrays s (`state_walks.upper_shapes`, kv heads = H) of a symmetric state: a
    [B, H, N, C, E], x [B, H, N, C, D] bf16, w = e^(2 ls) [B, H, N, C] float32 and
    col [B, H, N, D, C] bf16 (col[k, r] = x[r, k] w[r], rounded as `states.columns`).
    leave_out: "direct", "mirror" or both ("direct+mirror") skips that part's CUDA-core
    work (a wrong g: to time what each part costs). schedule: "serial" waits for a step's
    two products, then does both blocks' CUDA-core work; "in_step" does the first block's
    work while the second product runs; "lagged" does every block's work while the next
    block's product runs (the next step's first under this step's second: two
    accumulators, each zeroed once read)."""
    b, h, n, c, e = a.shape
    d = x.shape[-1]
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule must be one of {SCHEDULES}; got {schedule!r}")
    if c % (COMPUTE_WGS * ROWS) or d != 64 or e != 64:
        raise ValueError(f"the probe takes d = e = 64 and C a multiple of {COMPUTE_WGS * ROWS}; "
                         f"got d={d}, e={e}, C={c}")
    groups = d // BLOCK
    segments = upper_segments(d, packed=False)  # two blocks S_k a step, one a tile
    own = own_scratch(((ROWS, e), BF16, True), ((ROWS, d), BF16, True),
                      ((ROWS,), F32, False), ((d, ROWS), BF16, False))
    outs = tuple(swizzled((COMPUTE_WGS, ROWS, BLOCK), F32) for _ in range(groups))

    def kernel(a_ref, x_ref, w_ref, col_ref, *refs):
        s_refs, g_ref = refs[:groups], refs[groups]
        own, own_bars, ring_arrays, ring_loaded, ring_freed, *out_smem = refs[groups + 1:]
        ring = Ring.of(ring_arrays, ring_loaded, ring_freed, [(0, 1)])
        bh, wg, chunk = lax.axis_index("bh"), lax.axis_index("wg"), lax.axis_index("chunk")
        bi, hi = lax.div(bh, h), lax.rem(bh, h)
        mine = pl.ds((lax.axis_index("tile") * COMPUTE_WGS + wg) * ROWS, ROWS)

        @pl.when(wg < COMPUTE_WGS)
        def _compute():
            plgpu.set_max_registers(COMPUTE_REGISTERS, action="increase")
            a_smem, x_smem, w_smem, col_smem = own
            load_own([(a_ref.at[bi, hi, chunk, mine], a_smem), (x_ref.at[bi, hi, chunk, mine],
                                                                x_smem),
                      (w_ref.at[bi, hi, chunk, mine], w_smem),
                      (col_ref.at[bi, hi, chunk, :, mine], col_smem)], wg, own_bars)
            # col^T [ROWS, D]: the mirror's weights col[j] by row, rounded as col is
            weights = load(w_smem.at[wg], ROW_VECTOR)
            col_t = (load(x_smem.at[wg], WGMMA).astype(F32)
                     * by_rows(weights, (ROWS, d))).astype(BF16).astype(F32)
            column = plgpu.broadcasted_iota(jnp.int32, (ROWS, BLOCK), 1, layout=WGMMA)

            def block_work(seg, step, u, m, gs):  # block u of the step: its M into g
                lo, group = seg.lo, seg.lo // BLOCK
                gs = list(gs)
                k = seg.place(step, u, d)[0]
                col_k = load(col_smem.at[wg, k], ROW_VECTOR)
                col_k = by_rows(col_k.astype(F32), (ROWS, BLOCK))
                for target in range(group, groups) if "direct" not in leave_out else ():
                    start = BLOCK * (target - group)  # direct: columns j >= lo
                    gs[target] = gs[target] + col_k * m[:, start:start + BLOCK]
                if lo + BLOCK < d and "mirror" not in leave_out:  # mirror: into column k,
                    dot = jnp.sum(m[:, BLOCK:] * col_t[:, lo + BLOCK:], axis=1)  # j >= lo + 16
                    gs[group] = gs[group] + jnp.where(
                        column == k - lo, by_rows(dot, (ROWS, BLOCK)), 0.0)
                return tuple(gs)

            def issue(seg, step, u, acc_ref):  # M of block u of the step, into acc_ref
                tile_ref = ring.arrays[u].at[ring.slot(step)]
                plgpu.wgmma(acc_ref, a_smem.at[wg],
                            tile_ref.at[pl.ds(0, d - seg.lo)].transpose((1, 0)))

            def walk_in_steps(seg, gs):  # a step's two products, then its two blocks' work
                def visit(step, gs):
                    slot = ring.slot(step)
                    ring.wait(slot, 0)

                    def body(*acc_refs):
                        for u, acc_ref in enumerate(acc_refs):
                            issue(seg, step, u, acc_ref)
                        out = gs
                        for u, acc_ref in enumerate(acc_refs):  # in_step: block 0's work
                            in_flight = 1 - u if schedule == "in_step" else 0  # under 1's
                            out = block_work(seg, step, u, plgpu.wgmma_accumulator_load(
                                acc_ref, wait_n=in_flight), out)
                        return out
                    gs = pl.run_scoped(body, *(plgpu.ACC((ROWS, d - seg.lo), F32)
                                               for _ in range(2)))
                    ring.release(slot)
                    return gs
                return lax.fori_loop(seg.first, seg.first + seg.steps, visit, gs)

            def walk_lagged(seg, gs):  # each block's work under the next block's product
                end = seg.first + seg.steps

                def body(acc0, acc1):
                    zeros_ = plgpu.layout_cast(jnp.zeros((ROWS, d - seg.lo), F32), WGMMA)

                    def taken(acc_ref, in_flight):  # its M, the ref zeroed for the next
                        m = plgpu.wgmma_accumulator_load(acc_ref, wait_n=in_flight)
                        acc_ref[...] = zeros_
                        return m

                    def visit(step, gs, last: bool):
                        issue(seg, step, 1, acc1)
                        gs = block_work(seg, step, 0, taken(acc0, 1), gs)
                        if not last:  # the next step's first block under this one's second
                            ring.wait(ring.slot(step + 1), 0)
                            issue(seg, step + 1, 0, acc0)
                        m = taken(acc1, 0 if last else 1)
                        ring.release(ring.slot(step))
                        return block_work(seg, step, 1, m, gs)

                    ring.wait(ring.slot(seg.first), 0)
                    issue(seg, seg.first, 0, acc0)
                    gs_ = lax.fori_loop(seg.first, end - 1,
                                        lambda step, g: visit(step, g, last=False), gs)
                    return visit(end - 1, gs_, last=True)

                return pl.run_scoped(body, *(plgpu.ACC((ROWS, d - seg.lo), F32)
                                             for _ in range(2)))

            gs = tuple(plgpu.layout_cast(jnp.zeros((ROWS, BLOCK), F32), WGMMA)
                       for _ in range(groups))
            for seg in segments:
                gs = (walk_lagged if schedule == "lagged" else walk_in_steps)(seg, gs)
            for g, buf in zip(gs, out_smem, strict=True):
                buf.at[wg][...] = g
            plgpu.commit_smem()
            for group, buf in enumerate(out_smem):
                plgpu.copy_smem_to_gmem(buf.at[wg], g_ref.at[bi, hi, chunk, mine,
                                                             pl.ds(BLOCK * group, BLOCK)])
            plgpu.wait_smem_to_gmem(0)

        @pl.when(wg == COMPUTE_WGS)
        def _memory():
            plgpu.set_max_registers(MEMORY_REGISTERS, action="decrease")

            def sources(step, seg):  # a step's two blocks S_k[lo:], each from row 0 of a tile
                rows = pl.ds(0, d - seg.lo)
                return tuple((s_refs[seg.lo // BLOCK].at[bi, hi, chunk, i - seg.lo], rows)
                             for i, _, _ in (seg.place(step, u, d) for u in range(2)))

            for seg in segments:
                ring.fill(seg.first + seg.steps, functools.partial(sources, seg=seg),
                          start=seg.first)

    own_bars = tuple(plgpu.Barrier(num_barriers=COMPUTE_WGS) for _ in own)
    ring = Ring.scratch([tile(e), tile(e)], 4, [(0, 1)])
    return launch(kernel, name="sympow_states_row_gradients_upper_probe",
                  out_type=jax.ShapeDtypeStruct((b, h, n, c, d), F32),
                  scratch=(own, own_bars, *ring, *outs),
                  grid=(n, b * h, c // (COMPUTE_WGS * ROWS)),
                  grid_names=("chunk", "bh", "tile"), args=(a, x, w, col, *s))


def problem(key, b: int, h: int, n: int, c: int):
    """(a, x, w, col, square S, upper arrays): random rows at the tier's scales, a random
    state symmetric in (i, j)."""
    from sympow.attention.mosaic_gpu import state_references, states

    d = e = 64
    ka, kx, kl, ks = jax.random.split(key, 4)
    a = (jax.random.normal(ka, (b, h, n, c, e)) / 8).astype(BF16)
    x = (jax.random.normal(kx, (b, h, n, c, d)) / 8).astype(BF16)
    ls = jax.random.uniform(kl, (b, h, n, c), minval=-1.0, maxval=0.0)
    blocks_ = jax.random.normal(ks, (b, h, n, d, d, e)) / 8
    square = (0.5 * (blocks_ + jnp.swapaxes(blocks_, 3, 4))).reshape(b, h, n, d * d, e)
    square = square.astype(BF16)
    return (a, x, jnp.exp(2.0 * ls), states.columns(x, ls), square,
            state_references.upper_arrays(square))


def _probe(schedule: str = "serial", leave_out: str = ""):
    return jax.jit(lambda *args: row_gradients_upper(*args[:4], args[4:], leave_out, schedule))


def correctness() -> list[dict]:
    """Each schedule against the definition over whole blocks (float32 sums of the same bf16
    operands, in another order)."""
    from sympow.attention.mosaic_gpu import state_references

    def measure():
        a, x, w, col, square, upper = problem(jax.random.key(0), 1, 2, 2, 256)
        want = state_references.state_to_rows_reference(a, col, square, transposed=True)
        return {schedule: against(_probe(schedule)(a, x, w, col, *upper), want)
                for schedule in SCHEDULES}
    return [attempt({"probe": "against_definition", "shape": [1, 2, 2, 256]}, measure)]


def timing() -> list[dict]:
    """T tokens, H heads: each kernel's own duration in turns with `row_gradients` over the
    same stored state (no normalizer): the probe under each schedule, and serial with its
    parts left out; each schedule against row_gradients' dx / 2 (bf16)."""
    from timing import kernel_times_interleaved

    from sympow.attention.mosaic_gpu import state_kernels

    variants = [(schedule, "") for schedule in SCHEDULES] + [
        ("serial", left) for left in ("mirror", "direct", "direct+mirror")]

    def measure():
        n, c, h = _T.value // _CHUNK.value, _CHUNK.value, _HEADS.value
        a, x, w, col, _, upper = problem(jax.random.key(1), 1, h, n, c)
        tier = jax.jit(lambda *args: state_kernels.row_gradients(*args[:3], args[3:]))
        calls = [(tier, (a, x, col, *upper))] + [
            (_probe(schedule, left), (a, x, w, col, *upper)) for schedule, left in variants]
        us = kernel_times_interleaved(calls, reps=_REPS.value,
                                      prefix="sympow_states_row_gradients")
        useful = 2 * h * _T.value * (64 * 65 // 2) * 64  # profile_states' useful FLOP
        dx_half = tier(a, x, col, *upper)[0].astype(F32) / 2.0  # dx = 2 g in bf16
        names = [f"{schedule}{' without ' + left if left else ''}" for schedule, left in variants]
        return {"row_gradients_us": us[0],
                "probe_us": dict(zip(names, us[1:], strict=True)),
                "useful_tflops": dict(zip(["row_gradients", *names],
                                          [useful / t / 1e6 for t in us], strict=True)),
                "against_row_gradients": {schedule: against(
                    _probe(schedule)(a, x, w, col, *upper), dx_half, tol=1e-2)
                    for schedule in SCHEDULES}}
    return [attempt({"probe": "timing", "t": _T.value, "heads": _HEADS.value,
                     "chunk": _CHUNK.value}, measure)]


def main(argv):
    del argv
    hopper_main("probe_row_gradients_upper", _OUT.value, correctness, timing)


if __name__ == "__main__":
    app.run(main)
