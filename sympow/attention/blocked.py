"""The attention form, block by block in pure JAX: O(T x block) memory, forward and backward.

Causal gated sympow attention (docs/design.md §2.1) computed the way flash attention computes
softmax attention. Queries and keys are cut into blocks of K rows; every query block walks
the key blocks from its own (the diagonal) back to the first, keeping a running row max m,
normalizer den and accumulator acc of the weights exp(l_ij - m_i), with the log-space scores

    l_ij = p log|Q_i . K_j| + (G_i - G_j)      (j <= i, Q_i . K_j != 0; else no weight).

All query blocks advance together: step d pairs query block n with key block n - d (a scan
over d), so one step holds [.., N, K, K] scores, T x K per head; no [T, T] array exists,
forward or backward.

Decays come from sums that stay local (docs/design.md §4). For i in block n and j in an
earlier block m,

    G_i - G_j = tail_j + (tot_{m+1} + ... + tot_{n-1}) + head_i,

with head_i the gate sum from the start of block n to i, tail_j the sum from j + 1 to the end
of block m, and tot a block's total; the middle sum grows by one block total per step. On
the diagonal block the decay is summed per segment (as the reference does). No term is a
difference of two large cumulative sums, so a strong gate early in the sequence (or in a
block) costs no precision later.

The backward is its own `jax.custom_vjp`: it saves the row max and normalizer and recomputes
each block pair's weights, as flash attention's backward does. With P_ij = w_ij / den_i,
dP_ij = dY_i . V_j, delta_i = dY_i . Y_i and dl_ij = P_ij (dP_ij - delta_i):

    dV_j = sum_i P_ij dY_i,   dQ_i = sum_j dl_ij p / s_ij K_j,   dK_j = sum_i dl_ij p / s_ij Q_i,
    dlog_g_k = sum_{i >= k > j} dl_ij,

with s_ij = Q_i . K_j; dlog_g through the local sums the decays were built from
(`chunked.block_gate_cotangent`), so each pair enters once. The row max carries no gradient
(it cancels), as in the reference. Queries and keys are first scaled by powers of two as in
the chunked algorithm, so no score overflows whatever the input norms.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jaxtyping import Array

from sympow.attention.chunked import (
    block_gate_cotangent,
    block_gate_sums,
    capped_block,
    diagonal_straddle,
    from_chunks,
    gates_or_zeros,
    normalize_queries_and_keys,
    to_chunks,
)
from sympow.attention.reference import (
    Keys,
    LogGates,
    Outputs,
    Queries,
    Values,
    segment_sums_last,
)
from sympow.numerics import HIGHEST, compute_dtype, safe_divide, safe_reciprocal


class Blocks(NamedTuple):
    """Inputs in block layout (N blocks of K rows, zero-padded), in the compute dtype.

    q [B, Hk, R, N, K, D]; k [B, Hk, N, K, D]; v [B, Hk, N, K, E]; gate sums within a block:
    head [B, Hk, N, K] (from its start to i, inclusive), tail [B, Hk, N, K] (from j + 1 to
    its end), seg [B, Hk, N, K, K] (from j + 1 to i; -inf for j > i), tot [B, Hk, N].
    """

    q: Array
    k: Array
    v: Array
    head: Array
    tail: Array
    seg: Array
    tot: Array


def default_block_size(length: int) -> int:
    """K when the caller gives none: 128 rows ([K, K] scores per query block and step), at
    most the sequence rounded up to 8."""
    return capped_block(length, 128)


def to_blocks(q, k, v, log_g, block: int) -> Blocks:
    b, t, hq, d = q.shape
    hk = k.shape[2]
    n = math.ceil(t / block)
    ct = compute_dtype(q, k, v)
    qb = to_chunks(q.astype(ct), n, block).reshape(b, hk, hq // hk, n, block, d)
    a = to_chunks(log_g.astype(ct), n, block)  # [B, Hk, N, K]
    head, tail = block_gate_sums(a)
    seg = segment_sums_last(a)  # [B, Hk, N, K, K]
    return Blocks(qb, to_chunks(k.astype(ct), n, block), to_chunks(v.astype(ct), n, block),
                  head, tail, seg, head[..., -1])


class Pair(NamedTuple):
    """Query block n against key block n - d, for every n at once (wrapped where n < d)."""

    k: Array  # [B, Hk, N, K, D] key block n - d at index n
    v: Array  # [B, Hk, N, K, E]
    s: Array  # [B, Hk, R, N, K, K] scores Q_i . K_j
    valid: Array  # [B, Hk, R, N, K, K] j counts for i
    logits: Array  # [B, Hk, R, N, K, K] l_ij, -inf where not valid


def pair(blocks: Blocks, step, middle, p: int) -> Pair:
    """Scores and log weights of step `step` (d); middle [B, Hk, N]: the totals of the blocks
    strictly between each query block and its key block."""
    n, block = blocks.head.shape[-2:]
    shift = lambda x: jnp.roll(x, step, axis=2)  # noqa: E731  index n <- block n - d
    k, v, tail = shift(blocks.k), shift(blocks.v), shift(blocks.tail)
    s = jnp.einsum("bhrnid,bhnjd->bhrnij", blocks.q, k, precision=HIGHEST)
    diagonal = step == 0
    across = blocks.head[..., :, None] + middle[..., None, None] + tail[..., None, :]
    decay = jnp.where(diagonal, blocks.seg, across)  # [B, Hk, N, K, K]
    rows = jnp.arange(block)
    future = diagonal & (rows[:, None] < rows[None, :])  # j > i on the diagonal block
    present = jnp.arange(n)[:, None, None] >= step  # key block n - d exists
    valid = (s != 0) & ~future & present
    log_power = p * jnp.log(jnp.abs(jnp.where(valid, s, 1.0)))
    logits = jnp.where(valid, log_power + decay[:, :, None], -jnp.inf)
    return Pair(k, v, s, valid, logits)


def next_middle(blocks: Blocks, step, middle):
    """The middle sum of step d + 1: the block passed at step d >= 1 now lies between."""
    return middle + jnp.where(step >= 1, jnp.roll(blocks.tot, step, axis=2), 0.0)


def _forward(blocks: Blocks, p: int):
    """(y [B, Hk, R, N, K, E], row max m, normalizer den [B, Hk, R, N, K])."""
    n = blocks.head.shape[-2]
    shape = blocks.q.shape[:-1]

    def step(carry, d):
        acc, den, m, middle = carry
        pr = pair(blocks, d, middle, p)
        m_new = jnp.maximum(m, jnp.max(pr.logits, axis=-1))
        shift = jnp.where(m_new == -jnp.inf, 0.0, m_new)  # finite: no inf - inf
        alpha = jnp.exp(m - shift)
        w = jnp.exp(pr.logits - shift[..., None])  # [B, Hk, R, N, K, K]
        acc = acc * alpha[..., None] + jnp.einsum("bhrnij,bhnje->bhrnie", w, pr.v,
                                                  precision=HIGHEST)
        den = den * alpha + jnp.sum(w, axis=-1)
        return (acc, den, m_new, next_middle(blocks, d, middle)), None

    dtype = blocks.q.dtype
    init = (jnp.zeros((*shape, blocks.v.shape[-1]), dtype), jnp.zeros(shape, dtype),
            jnp.full(shape, -jnp.inf, dtype), jnp.zeros(blocks.tot.shape, dtype))
    (acc, den, m, _), _ = jax.lax.scan(step, init, jnp.arange(n))
    return safe_divide(acc, den), jnp.where(m == -jnp.inf, 0.0, m), den


def _backward(blocks: Blocks, y, m, den, dy, p: int):
    """Cotangents (dq, dk, dv in block layout, dlog_g [B, Hk, N, K]) for dy
    [B, Hk, R, N, K, E]."""
    n = blocks.head.shape[-2]
    delta = jnp.sum(dy * y, axis=-1)  # [B, Hk, R, N, K]
    inv_den = safe_reciprocal(den)
    back = lambda x, d: jnp.roll(x, -d, axis=2)  # noqa: E731  index n - d <- n

    def step(carry, d):
        dq, dk, dv, (dhead, dtail, ddiag), middle = carry
        pr = pair(blocks, d, middle, p)
        prob = jnp.exp(pr.logits - m[..., None]) * inv_den[..., None]  # 0 where not valid
        dprob = jnp.einsum("bhrnie,bhnje->bhrnij", dy, pr.v, precision=HIGHEST)
        dl = prob * (dprob - delta[..., None])
        dscore = jnp.where(pr.valid, dl * p / jnp.where(pr.valid, pr.s, 1.0), 0.0)
        dq = dq + jnp.einsum("bhrnij,bhnjd->bhrnid", dscore, pr.k, precision=HIGHEST)
        dk = dk + back(jnp.einsum("bhrnij,bhrnid->bhnjd", dscore, blocks.q,
                                  precision=HIGHEST), d)
        dv = dv + back(jnp.einsum("bhrnij,bhrnie->bhnje", prob, dy, precision=HIGHEST), d)
        dl = jnp.sum(dl, axis=2)  # [B, Hk, N, K, K]: the query heads of a kv head together
        across = d > 0
        dhead = dhead + jnp.where(across, jnp.sum(dl, axis=-1), 0.0)
        dtail = dtail + jnp.where(across, back(jnp.sum(dl, axis=-2), d), 0.0)
        ddiag = jnp.where(across, ddiag, diagonal_straddle(dl))
        gates = (dhead, dtail, ddiag)
        pair_totals = jnp.sum(dl, axis=(-2, -1))  # [B, Hk, N]: block pair (I, I - d)
        return (dq, dk, dv, gates, next_middle(blocks, d, middle)), pair_totals

    zeros = jnp.zeros_like(blocks.head)
    init = (jnp.zeros_like(blocks.q), jnp.zeros_like(blocks.k), jnp.zeros_like(blocks.v),
            (zeros, zeros, zeros), jnp.zeros_like(blocks.tot))
    (dq, dk, dv, gates, _), by_offset = jax.lax.scan(step, init, jnp.arange(n))  # [d, B,Hk,I]
    index = jnp.arange(n)
    offset = index[:, None] - index[None, :]  # [I, J]: d = I - J
    by_offset = jnp.moveaxis(by_offset, 0, -1)  # [B, Hk, I, d]
    pairs = jnp.take_along_axis(by_offset, jnp.broadcast_to(
        jnp.clip(offset, 0, n - 1), by_offset.shape[:-2] + (n, n)), axis=-1)  # [B, Hk, I, J]
    pairs = jnp.where(offset > 0, pairs, 0.0)  # J < I only (d = 0 is the diagonal)
    return dq, dk, dv, block_gate_cotangent(*gates, pairs)


def _unblock(x: Array, length: int) -> Array:
    """[B, Hk, R, N, K, W] (query side) -> [B, T, Hk R, W]."""
    b, hk, r, n, k, w = x.shape
    return from_chunks(x.reshape(b, hk * r, n, k, w), length)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _attention(q, k, v, log_g, p: int, block: int):
    blocks = to_blocks(q, k, v, log_g, block)
    return _unblock(_forward(blocks, p)[0], q.shape[1])


def _attention_fwd(q, k, v, log_g, p, block):
    blocks = to_blocks(q, k, v, log_g, block)
    y, m, den = _forward(blocks, p)
    return _unblock(y, q.shape[1]), (q, k, v, log_g, y, m, den)


def _attention_bwd(p, block, residuals, dy_out):
    q, k, v, log_g, y, m, den = residuals
    t = q.shape[1]
    blocks = to_blocks(q, k, v, log_g, block)
    b, hk, r, n, _, e = y.shape
    dy = to_chunks(dy_out.astype(y.dtype), n, block).reshape(b, hk, r, n, block, e)
    dq, dk, dv, dlog_g = _backward(blocks, y, m, den, dy, p)
    dlog_g = from_chunks(dlog_g[..., None], t)[..., 0]  # [B, T, Hk]
    return (_unblock(dq, t).astype(q.dtype), from_chunks(dk, t).astype(k.dtype),
            from_chunks(dv, t).astype(v.dtype), dlog_g.astype(log_g.dtype))


_attention.defvjp(_attention_fwd, _attention_bwd)


def blocked_attention(
    q: Queries, k: Keys, v: Values, log_g: LogGates | None, *, p: int, block: int,
) -> Outputs:
    """Causal gated sympow attention in O(T^2 (D + E)) time and O(T block) memory.

    Same contract as `reference.attention_form` (rows with no weight give 0); returns
    float32 [B, T, Hq, E] (float64 for float64 inputs). block: K rows per query and key block.
    """
    q, k, _ = normalize_queries_and_keys(q, k)  # exact (docs/design.md §4); scales carry no grad
    return _attention(q, k, v, gates_or_zeros(log_g, k, compute_dtype(q, k, v)), p, block)
