"""The chunked sympow algorithm, written once over four swappable primitives.

Split T into N = ceil(T / C) chunks (the tail is zero-padded: zero keys add nothing, and
causality keeps padded queries from touching real rows). With a the log gates of a chunk,
g its inclusive cumulative sum (g_i = sum_{k<=i} a_k <= 0) and tail its suffix sums
(tail_j = sum_{k>j} a_k, `suffix_sums`):

1. update_state: per chunk n, S_n = sum_{j in n} exp(tail_j) V_j phi(K_j)^T and Z_n
   likewise with V_j -> 1.
2. prefix_sum: the state entering chunk n, P_n = exp(g_last,n-1) P_{n-1} + S_{n-1}, P_0 = 0.
3. attention: the causal C x C block of each chunk in log space with a row max m_i,
   o_i = sum_j exp(P log|Q_i.K_j| + sum_{j<k<=i} a_k - m_i) V_j and its normalizer den_i.
4. query_state: exp(g_i) phi(Q_i)^T P_n for numerator and normalizer, combined with
   (o, den, m) before the one division.

Every decay is a sum of log gates over the tokens it spans, never a difference of two
cumulative sums, so a strong gate early in a chunk costs later tokens no precision (each
sum of terms <= 0 is exact to the ulp of its own size).

`ChunkPrimitives` holds one implementation of each (pure JAX in `xla.py`, Pallas kernels in
`sympow.attention.pallas`). Shapes in chunk layout: q [B, Hq, N, C, D]; k [B, Hk, N, C, D];
v [B, Hk, N, C, E]; g [B, Hk, N, C]; states s [B, Hk, N, F, E], z [B, Hk, N, F].

Numerics: phi is homogeneous of degree P and each row of attention is a distribution, so
scaling Q_i by any c_i > 0 and all keys of a head by one c > 0 leaves Y unchanged (with
gating too). The driver divides each query by a power of two at least its norm and the keys
by one at least their largest norm (scales under stop_gradient, which keeps gradients exact;
powers of two add no rounding), so every |Q_i . K_j| <= 1 and no power can overflow,
whatever P and the input norms.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

from sympow.attention.reference import Keys, LogGates, Outputs, Queries, SympowState, Values
from sympow.numerics import compute_dtype, has_weight, safe_divide


class ChunkPrimitives(NamedTuple):
    """One implementation of each step of the chunked algorithm (see the module docstring).

    update_state(k, v, tail, *, p) -> (s [B,Hk,N,F,E], z [B,Hk,N,F])
    prefix_sum(s, z, g_last [B,Hk,N]) -> (s_in, z_in, s_final [B,Hk,F,E], z_final [B,Hk,F])
    attention(q, k, v, a, *, p) -> (o [B,Hq,N,C,E], den [B,Hq,N,C], m [B,Hq,N,C])
    query_state(q, s_in, z_in, g, o, den, m, *, p) -> y [B,Hq,N,C,E] (normalized)
    with a the log gates, g their inclusive and tail their suffix sums, [B,Hk,N,C] each.
    A tier may keep its per-chunk states in a layout of its own (the Hopper tier: N + 1
    slots, summed in place), which only its own prefix_sum and query_state read.
    """

    update_state: Callable[..., tuple[Array, Array]]
    prefix_sum: Callable[..., tuple[Array, Array, Array, Array]]
    attention: Callable[..., tuple[Array, Array, Array]]
    query_state: Callable[..., Array]


def combine(
    o: Float[Array, "... C E"],
    den: Float[Array, "... C"],
    m: Float[Array, "... C"],
    inter_o: Float[Array, "... C E"],
    inter_den: Float[Array, "... C"],
) -> Float[Array, "... C E"]:
    """Y = (o e^m + inter_o) / (den e^m + inter_den), evaluated against a shared max.

    (o, den) are scaled by exp(-m) (the intra-chunk row max); (inter_o, inter_den) are
    unscaled. Both are brought to exp(-M) by `combine_weights`. Rows with nothing to attend
    give 0.
    """
    w_intra, w_inter = combine_weights(den, m, inter_den)
    num = o * w_intra[..., None] + inter_o * w_inter[..., None]
    return safe_divide(num, den * w_intra + inter_den * w_inter)


def combine_weights(den: Array, m: Array, inter_den: Array) -> tuple[Array, Array]:
    """(w_intra, w_inter) = (e^(m - M), e^-M) of `combine`, M = max(m, log inter_den), so
    neither side overflows; M cancels, so it carries no gradient. w_inter is 0 where
    inter_den is (nothing from the state: e^-M overflows float32 for a row max m < -88,
    every score below ~1e-19 at p = 2, and 0 * inf was NaN), w_intra where den is."""
    has_intra, has_inter = has_weight(den), has_weight(inter_den)
    log_inter = jnp.where(has_inter, jnp.log(jnp.where(has_inter, inter_den, 1.0)), -jnp.inf)
    shared = jnp.maximum(jnp.where(has_intra, m, -jnp.inf), log_inter)
    shared = jax.lax.stop_gradient(jnp.where(jnp.isfinite(shared), shared, 0.0))
    w_intra = jnp.where(has_intra, jnp.exp(jnp.where(has_intra, m - shared, 0.0)), 0.0)
    w_inter = jnp.where(has_inter, jnp.exp(jnp.where(has_inter, -shared, 0.0)), 0.0)
    return w_intra, w_inter


def block_gate_sums(a: Float[Array, "... K"]) -> tuple[Array, Array]:
    """(head, tail) along the last axis (a block of log gates): head_i = sum_{k<=i} a_k,
    tail_j = sum_{k>j} a_k, the two local sums of a decay across blocks (design §4)."""
    return jnp.cumsum(a, axis=-1), suffix_sums(a)


def diagonal_straddle(dl: Float[Array, "... K K"]) -> Float[Array, "... K"]:
    """sum_{i >= k > j} dl_ij of a diagonal block's pair cotangents dl [.., i, j] (zero above
    the diagonal): the pairs of the block whose decay holds a_k. Cumulative sums down the
    rows only (the one direction the Pallas kernels use)."""
    rows = jnp.arange(dl.shape[-1])
    upto = jnp.cumsum(dl, axis=-2)  # [k, j]: sum_{i <= k} dl_ij
    from_k = jnp.sum(dl, axis=-2, keepdims=True) - upto + dl  # [k, j]: sum_{i >= k} dl_ij
    return jnp.sum(jnp.where(rows[None, :] < rows[:, None], from_k, 0.0), axis=-1)


def block_gate_cotangent(
    dhead: Float[Array, "... N K"],
    dtail: Float[Array, "... N K"],
    ddiag: Float[Array, "... N K"],
    pair_totals: Float[Array, "... N N"],
) -> Float[Array, "... N K"]:
    """da_k = sum_{i >= k > j} dl_ij of logits whose decays are built from local sums: the
    adjoint of `block_gate_sums` plus the totals between blocks, for blocks of K positions.

    For i in block I and j in block J < I the decay is head_i + mid_IJ + tail_j (mid the
    totals of the blocks strictly between); on the diagonal an in-block sum. Arguments:
      dhead [.., N, K]: per query i, sum of dl_ij over the keys of earlier blocks;
      dtail [.., N, K]: per key j, sum of dl_ij over the queries of later blocks;
      ddiag [.., N, K]: per k, sum_{i >= k > j} dl_ij within its diagonal block;
      pair_totals [.., N, N]: [I, J] the sum of dl over block pair (I, J), zero for J >= I.
    Every pair (i, j) enters each da_k it moves exactly once. The form dG_i = sum_j dl_ij,
    dG_j -= sum_i dl_ij, da = reverse cumsum of dG counts each pair twice, in two kernels
    with their own rounding, and relies on the copies cancelling: on an H100 the attention
    form's dlog_g erred 4e-5 at T = 65,536 that way (docs/design.md §4).
    """
    from_head = jnp.flip(jnp.cumsum(jnp.flip(dhead, -1), axis=-1), -1)  # head_i: k <= i
    from_tail = jnp.cumsum(dtail, axis=-1) - dtail  # tail_j: k > j
    before = jnp.cumsum(pair_totals, axis=-1) - pair_totals  # [I, M]: sum_{J < M}
    n = pair_totals.shape[-1]
    later = jnp.arange(n)[:, None] > jnp.arange(n)[None, :]  # [I, M]: I > M
    mid = jnp.sum(jnp.where(later, before, 0.0), axis=-2)  # [.., M]
    return from_head + from_tail + mid[..., None] + ddiag


def gates_or_zeros(log_g: LogGates | None, k: Keys, dtype) -> LogGates:
    """log_g [B, T, Hk] in dtype, or zeros for an ungated call. The zeros pass an
    optimization barrier: XLA's GPU compiler otherwise constant-folds every gate sum built
    from them (cumulative sums rewritten as reduce-windows, evaluated element by element on
    the host), which took minutes to compile an ungated model's training step on an H100."""
    if log_g is not None:
        return log_g.astype(dtype)
    return jax.lax.optimization_barrier(jnp.zeros(k.shape[:3], dtype))


def suffix_sums(a: Float[Array, "... C"]) -> Float[Array, "... C"]:
    """sum_{k > j} a_k along the last axis: an exclusive cumulative sum from the end.

    Computed directly, never as total - prefix: for a strong gate a_j that difference would
    cancel to the ulp of the total (docs/design.md §4)."""
    later = jnp.flip(jnp.cumsum(jnp.flip(a[..., 1:], -1), axis=-1), -1)
    return jnp.concatenate([later, jnp.zeros_like(a[..., :1])], axis=-1)


def capped_block(length: int, cap: int) -> int:
    """A block (or chunk) of `cap` rows, or fewer for a short sequence: `length` rounded up
    to a multiple of 8."""
    return max(1, min(cap, -(-length // 8) * 8))


def to_chunks(x: Array, num_chunks: int, chunk: int) -> Array:
    """[B, T, H, ...] -> zero-padded [B, H, N, C, ...]."""
    pad = num_chunks * chunk - x.shape[1]
    x = jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
    x = x.reshape(x.shape[0], num_chunks, chunk, *x.shape[2:])
    return jnp.moveaxis(x, 3, 1)


def from_chunks(y: Float[Array, "B H N C E"], length: int) -> Float[Array, "B T H E"]:
    """[B, H, N, C, E] -> [B, T, H, E], dropping the padding."""
    b, h, n, c, e = y.shape
    return jnp.moveaxis(y, 1, 3).reshape(b, n * c, h, e)[:, :length]


def normalize_queries_and_keys(q: Array, k: Array) -> tuple[Array, Array, Float[Array, "B Hk"]]:
    """Q_i / s_i and K / s per (batch, head) with power-of-two scales s_i >= |Q_i|,
    s >= max_j |K_j|, in the inputs' dtype.

    Exact for the outputs (see the module docstring). Dividing by a power of two only shifts
    exponents, so the scaled bf16 inputs carry no extra rounding. Returns (q, k, key_scale)
    with key_scale = s [B, Hk] (1 where every key is zero), to restore true states.
    """
    ct = compute_dtype(q, k)
    q_unit = (q.astype(ct) / norm_bound(q.astype(ct), axis=(-1,))).astype(q.dtype)
    return (q_unit, *normalize_keys(k))


def norm_bound(x: Array, axis: tuple[int, ...]) -> Array:
    """A power of two >= the norm of every vector x[..., :] within the `axis` reduced (the
    last, the vectors' own, among them; keepdims) and < 2 sqrt(D) times the largest: the
    smallest power of two >= sqrt(D) max |x_d| (1 where all are 0), constant for autodiff.

    From the largest magnitude, not the norm: a norm's sum of squares overflows float32
    above ~1.8e19 (the scale inf, every output 0) and underflows to 0 below ~1e-19 (the scale
    1, and q . k underflows with it); a maximum does neither."""
    bound = jnp.max(jnp.abs(x), axis=axis, keepdims=True) * math.sqrt(x.shape[-1])
    # frexp and ldexp are exact where exp2(ceil(log2(.))) is not (exp2(-96.) != 2^-96 in
    # float32 on a CPU): bound = mantissa 2^exponent with mantissa in [0.5, 1)
    mantissa, exponent = jnp.frexp(jnp.where(bound > 0, bound, 1.0))
    exponent = jnp.where(mantissa == 0.5, exponent - 1, exponent)
    return jax.lax.stop_gradient(jnp.ldexp(jnp.ones_like(bound), exponent))


def normalize_keys(k: Array) -> tuple[Array, Float[Array, "B Hk"]]:
    """The key half of `normalize_queries_and_keys`: (K / s, s) per (batch, head)."""
    ct = compute_dtype(k)
    k_scale = norm_bound(k.astype(ct), axis=(1, -1))  # [B, 1, Hk, 1]
    return (k.astype(ct) / k_scale).astype(k.dtype), k_scale[:, 0, :, 0]


def chunked_attention(
    q: Queries, k: Keys, v: Values, log_g: LogGates | None,
    *,
    p: int,
    chunk_size: int,
    primitives: ChunkPrimitives,
) -> tuple[Outputs, SympowState]:
    """Causal gated sympow attention in O(T C D + T F E), composed from `primitives`.

    Returns (y [B, T, Hq, E] in float32 (float64 for float64 inputs), final state after the
    last token in true units).
    """
    t = q.shape[1]
    n = math.ceil(t / chunk_size)
    ct = compute_dtype(q, k, v)
    q, k, k_scale = normalize_queries_and_keys(q, k)
    log_g = gates_or_zeros(log_g, k, ct)
    qc, kc, vc = (to_chunks(x, n, chunk_size) for x in (q, k, v))
    a = to_chunks(log_g, n, chunk_size)  # [B, Hk, N, C]
    g = jnp.cumsum(a, axis=-1)  # inclusive, within the chunk

    s, z = primitives.update_state(kc, vc, suffix_sums(a), p=p)
    s_in, z_in, s_final, z_final = primitives.prefix_sum(s, z, g[..., -1])
    o, den, m = primitives.attention(qc, kc, vc, a, p=p)
    y = primitives.query_state(qc, s_in, z_in, g, o, den, m, p=p)

    # phi(K / c) = phi(K) / c^P: restore the true scale of the final state for decoding.
    restore = k_scale ** p
    final = SympowState(s_final * restore[..., None, None], z_final * restore[..., None])
    return from_chunks(y, t), final
