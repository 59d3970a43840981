"""The attention kernels on Hopper: Mosaic GPU, wgmma, TMA, warp specialization.

The same functions as `sympow.attention.pallas.attention_kernels` (whose module docstring
states them: l_ij = p log|Q_i . K_j| + D_ij, the online row max m, o = sum_j w_ij V_j and
den = sum_j w_ij with w_ij = exp(l_ij - m_i); the backward's dl = w (dO . V_j + dden),
ds = p dl / s and the gate cotangent from local sums), with the same inputs and outputs, so
the two tiers' kernels can stand in for each other; but m, the rows' shift, may exceed the
exact max by at most SEPARABLE_SPREAD log2 units (o and den carry the same exp(-m), all the
callers use). bf16 operands, float32 accumulators.

Programs (blocks.py): 128 rows, two compute warpgroups of 64 and a memory warpgroup.
- forward (this module): one program per 128 query rows of a chunk and query head; the
  ring walks the key blocks (k, v, tail, exp(tail)) from the last compute warpgroup's
  diagonal back to block 0.
- backward (`backward_kernel`, one pass): one program per 128 key rows and kv head; the ring
  walks the query blocks (q, dO, m, dden, head, c) of every query head of the group, from
  the first warpgroup's diagonal to the end of the chunk. Each warpgroup skips the steps
  before its own diagonal.

Decays from local sums: off the diagonal D_ij = head_i + mid_IJ + tail_j with mid the
carried sum of the block totals passed (sums of terms <= 0, never differences of long
sums); on the diagonal an exact in-block product (`blocks.decay_product`), once per
warpgroup. Off the diagonal that sum is a row term plus a column term, so no score needs an
exponential there: the forward's weights are (s_ij r_i)^p exp(tail_j) against a shift
bounded from the block's largest |s| (`weights.separable_weights`; one log2, one exp2 and one
division per row and step), for key blocks whose gates sum to at least -SEPARABLE_SPREAD
(the others, and the diagonal, keep the logits in base 2: one lg2 and one ex2 per score).
The forward stores m in natural units, and with it each row's scale c = -log2 max_j |s_ij|.
The backward takes no logarithm and no division: w = s'^p e and ds = p dl / s =
p s'^(p-1) e 2^c dw with s' = s 2^c and e = exp2(D - m - p c) (`weights.power_terms`):
on the diagonal one ex2 per score, off it a capped exp2 per row times exp(tail) per column.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from sympow.attention.mosaic_gpu.blocks import (
    COL_VECTOR,
    COMPUTE_REGISTERS,
    COMPUTE_WGS,
    LN2,
    LOG2E,
    MEMORY_REGISTERS,
    ROW_VECTOR,
    ROWS,
    TILE_ROWS,
    VECTOR,
    Ring,
    accumulate,
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
    swizzled,
    tile,
    write_mask,
    zeros,
)
from sympow.attention.mosaic_gpu.weights import (
    SEPARABLE_SPREAD,
    finite,
    separable_weights,
)
from sympow.numerics import safe_reciprocal

F32, BF16 = jnp.float32, jnp.bfloat16


# The forward: query programs walking the key blocks back from the diagonal.

@dataclasses.dataclass(frozen=True)
class _KeyWalk:
    """A query program's walk over the key blocks J = top - step (the forward's): from the
    last compute warpgroup's diagonal block `top` back to block 0, the ring holding (k, v,
    tail, exp(tail)) of each; `block` is this warpgroup's query block I, `first` the step of
    its diagonal."""

    b: jax.Array
    hq: jax.Array
    hk: jax.Array
    n: jax.Array
    wg: jax.Array
    top: jax.Array
    block: jax.Array
    ring: Ring

    @staticmethod
    def of(q_ref, tiles: int, groups: int, ring: Ring) -> _KeyWalk:
        b, hq, n, tile, wg = program_position(heads_of(q_ref))
        tile = tiles - 1 - tile  # the longest walks first
        return _KeyWalk(b, hq, lax.div(hq, groups), n, wg, COMPUTE_WGS * tile + COMPUTE_WGS - 1,
                        COMPUTE_WGS * tile + wg, ring)

    @property
    def steps(self):
        return self.top + 1

    @property
    def first(self):
        return self.top - self.block

    @property
    def rows(self):
        """This warpgroup's query rows."""
        return pl.ds(self.block * ROWS, ROWS)

    def fill(self, k_ref, v_ref, tl_ref, tail_factor_ref, chunk: int) -> None:
        """The memory warpgroup's part."""
        plgpu.set_max_registers(MEMORY_REGISTERS, action="decrease")

        def sources(step):
            keys = pl.ds((self.top - step) * ROWS, ROWS)
            wide = tuple(rows_at(x, self.b, self.hk, self.n, keys, chunk) for x in (k_ref, v_ref))
            return (*wide, *(x.at[self.b, self.hk, self.n, keys]
                             for x in (tl_ref, tail_factor_ref)))

        self.ring.fill(self.steps, sources)

    def blocks(self, slot):
        """(k, v, tail in shared memory, exp2(tail log2(e)) [ROWS] column vector) of a
        step's key block, once all have landed (one barrier group)."""
        k_smem, v_smem, tail_smem, tail_factor_smem = self.ring.wait(slot)
        return k_smem, v_smem, tail_smem, load(tail_factor_smem, COL_VECTOR)

    def decays(self, a_smem, hd_smem, ones_smem):
        """(decay, head): decay(tail_smem, mid, on_diagonal) -> D log2(e) [ROWS, ROWS] of a
        step, from this warpgroup's gates and head sums (shared memory, loaded) and the key
        block's tail; head the row vector head log2(e). Also passes the step above this
        warpgroup's diagonal, if any."""
        write_mask(ones_smem, lambda k, j: k > j)
        diagonal = decay_product(a_smem, lambda i, k: k <= i, ones_smem) * LOG2E
        head = load(hd_smem, ROW_VECTOR) * LOG2E
        pl.when(self.first > 0)(lambda: self.ring.skip(0))

        def decay(tail_smem, mid, on_diagonal: bool):
            if on_diagonal:
                return diagonal
            tail = load(tail_smem, COL_VECTOR)
            return by_rows(head) + by_cols((tail + mid) * LOG2E)

        return decay, head

    def run(self, visit, init):
        """visit(step, carry, on_diagonal) over the diagonal, then the blocks before it; the
        carry's last element is mid, restarted after the diagonal."""
        carry = visit(self.first, init, on_diagonal=True)
        carry = (*carry[:-1], jnp.zeros((), F32))
        return lax.fori_loop(self.first + 1, self.steps,
                             lambda s, c: visit(s, c, on_diagonal=False), carry)


def _fwd_kernel(q_ref, k_ref, v_ref, a_ref, hd_ref, tl_ref, tot_ref, tf_ref, o_ref, den_ref,
                m_ref, c_ref, own, own_bars, ring_arrays, ring_loaded, ring_freed, out, *, p,
                groups, tiles, normalized):
    walk = _KeyWalk.of(q_ref, tiles, groups,
                       Ring.of(ring_arrays, ring_loaded, ring_freed, _KEY_GROUPS))
    b, hq, hk, n, wg, ring = walk.b, walk.hq, walk.hk, walk.n, walk.wg, walk.ring
    chunk = tiles * TILE_ROWS

    @pl.when(wg < COMPUTE_WGS)
    def _compute():
        plgpu.set_max_registers(COMPUTE_REGISTERS, action="increase")
        q_smem, a_smem, hd_smem, ones_smem = own
        mine = (b, hq, n, walk.rows)
        load_own([(rows_at(q_ref, *mine, chunk), q_smem), (a_ref.at[b, hk, n, walk.rows], a_smem),
                   (hd_ref.at[b, hk, n, walk.rows], hd_smem)], wg, own_bars)
        decay_of, head = walk.decays(a_smem.at[wg], hd_smem.at[wg], ones_smem.at[wg])
        rows, cols = indices()

        def visit(step, carry, on_diagonal: bool):
            acc, m2, den, size, mid = carry
            slot = ring.slot(step)
            k_smem, v_smem, tail_smem, tail_factor = walk.blocks(slot)
            s = scores(q_smem.at[wg], k_smem)
            magnitude = jnp.abs(s)
            if on_diagonal:
                magnitude = jnp.where(cols <= rows, magnitude, 0.0)
            top = magnitude.max(axis=1)

            def exact():  # an exp2 and a log2 per score
                logit = p * jnp.log2(magnitude) + decay_of(tail_smem, mid, on_diagonal)
                if on_diagonal:  # log2|0| = -inf: no weight
                    logit = jnp.where(cols <= rows, logit, -jnp.inf)
                m_new = jnp.maximum(m2, logit.max(axis=1))
                return jnp.exp2(logit - by_rows(finite(m_new))), m_new

            total = tot_ref[b, hk, n, walk.top - step]
            if on_diagonal:
                w, m_new = exact()
            else:
                w, m_new = lax.cond(
                    total * LOG2E >= -SEPARABLE_SPREAD,
                    lambda: separable_weights(s, top, head + mid * LOG2E, tail_factor, m2, p),
                    exact)
            alpha = jnp.exp2(m2 - finite(m_new))
            den = den * alpha + w.sum(axis=1)
            acc = accumulate(acc * by_rows(alpha, acc.shape), w, v_smem)
            ring.release(slot)
            return acc, m_new, den, jnp.maximum(size, top), mid + total

        e = o_ref.shape[-1]
        acc, m2, den, size, _ = walk.run(visit, (
            zeros((ROWS, e)), row_vector(-jnp.inf), row_vector(0.0), row_vector(0.0),
            jnp.zeros((), F32)))
        o_smem, den_smem, m_smem, c_smem = out
        if normalized:  # y = o / den, 0 for a row without weight (`numerics.safe_divide`)
            acc = acc * by_rows(safe_reciprocal(den), acc.shape)
        acc = acc.astype(o_ref.dtype)
        scale_exponent = jnp.where(size > 0, -jnp.log2(jnp.where(size > 0, size, 1.0)), 0.0)
        store_own([(acc, o_smem, rows_at(o_ref, *mine, chunk)), (den, den_smem, den_ref.at[mine]),
                    (jnp.where(m2 == -jnp.inf, 0.0, m2 * LN2), m_smem, m_ref.at[mine]),
                    (scale_exponent, c_smem, c_ref.at[mine])], wg)

    pl.when(wg == COMPUTE_WGS)(lambda: walk.fill(k_ref, v_ref, tl_ref, tf_ref, chunk))


# The key blocks' barrier group (`Ring`): a forward step uses k, v, tail and exp(tail) at
# once. The backward's query blocks keep a barrier each: it uses q long before dO, and both
# groupings tried ((q, m, head, c) with (dO, dden); q with the other five) made it slower
# (docs/kernels.md).
_KEY_GROUPS = ((0, 1, 2, 3),)


def attention_fwd(q, k, v, a, head, tail, *, p: int, stages: int = 2,
                  normalized: bool = False, o_dtype=None):
    """(o [B,Hq,N,C,E], den, m [B,Hq,N,C]) float32 (o in o_dtype where given: the float32
    sums rounded once where they are stored), as the portable tier's `attention_fwd`
    but for m, the rows' shift: the exact row max of the logits or above it by at most
    SEPARABLE_SPREAD log2 units (`weights.separable_weights`; o and den are scaled by the same
    exp(-m), which is all the chunked combine and the backward need), and c [B,Hq,N,C]:
    -log2 of the largest |Q_i . K_j| of each row (0 for none), the row scale of the
    backward (`weights.power_terms`); for q [B,Hq,N,C,D], k [B,Hk,N,C,D],
    v [B,Hk,N,C,E] (bfloat16; C a multiple of TILE_ROWS, d and e in WIDTHS) and the log
    gates a with their `block_gate_sums` (head, tail) over blocks of ROWS, each [B,Hk,N,C]
    float32. The wide arrays q, k, v (and o) may come in token layout instead, [B, T, H, W]
    with T = N C (`blocks.in_tokens`; all three alike): o is then [B, T, Hq, E].
    normalized: o comes divided by den (0 where den = 0) and in q's dtype, the attention
    form's output Y (a chunk covers the sequence, so nothing is added to o and den later):
    no float32 o in device memory, no division in XLA. o_dtype: float32 or q's dtype
    (default: float32, q's with normalized); the chunked combine takes o in bf16, half the
    bytes written and read, its sums rounded once (`states.PARTIALS_DTYPE`).
    """
    b, hk, n, c = a.shape
    hq, d, e = heads_of(q), q.shape[-1], v.shape[-1]
    tiles = c // TILE_ROWS
    o_shape = (b, n * c, hq, e) if in_tokens(q) else (b, hq, n, c, e)
    own = own_scratch(tile(d), VECTOR, VECTOR, tile(ROWS))
    own_bars = tuple(plgpu.Barrier(num_barriers=COMPUTE_WGS) for _ in range(3))
    ring = Ring.scratch([tile(d), tile(e), VECTOR, VECTOR], stages, _KEY_GROUPS)
    o_dtype = jnp.dtype(o_dtype or (q.dtype if normalized else F32))
    if o_dtype not in (jnp.dtype(F32), jnp.dtype(q.dtype)):
        raise ValueError(f"o_dtype must be float32 or q's {jnp.dtype(q.dtype)}; got {o_dtype}")
    out = (swizzled((COMPUTE_WGS, ROWS, e), o_dtype), *own_scratch(VECTOR, VECTOR, VECTOR))
    return launch(
        lambda *refs: _fwd_kernel(*refs, p=p, groups=hq // hk, tiles=tiles,
                                  normalized=normalized),
        name="sympow_attention_fwd",
        out_type=[jax.ShapeDtypeStruct(o_shape, o_dtype),
                  *(jax.ShapeDtypeStruct((b, hq, n, c), F32) for _ in range(3))],
        scratch=(own, own_bars, *ring, out), grid=(n, b * hq, tiles),
        grid_names=("chunk", "bh", "tile"),
        args=(q, k, v, a, head, tail, block_totals(a), jnp.exp(tail)))
