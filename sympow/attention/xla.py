"""Pure-JAX primitives of the chunked algorithm: the oracle for the kernels and the CPU path.

Everything is computed in float32 (float64 for float64 inputs). phi is expanded one chunk
at a time (lax.map over chunks, each step under jax.checkpoint so the backward pass
recomputes it instead of storing phi for every token).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

from sympow.attention.chunked import ChunkPrimitives, capped_block, combine
from sympow.attention.reference import segment_sums_last
from sympow.embedding import sympow_embedding
from sympow.numerics import HIGHEST, compute_dtype


def _map_chunks(fn, *xs):
    """lax.map of fn over the chunk axis (axis 2) of each x; outputs get it back at axis 2."""
    moved = [jnp.moveaxis(x, 2, 0) for x in xs]
    out = jax.lax.map(lambda args: jax.checkpoint(fn)(*args), moved)
    return jax.tree.map(lambda y: jnp.moveaxis(y, 0, 2), out)


def update_state(
    k: Float[Array, "B Hk N C D"], v: Float[Array, "B Hk N C E"],
    tail: Float[Array, "B Hk N C"], *, p: int,
) -> tuple[Float[Array, "B Hk N F E"], Float[Array, "B Hk N F"]]:
    """Per-chunk states decayed to the chunk's end: S_n = sum_j exp(tail_j) phi(K_j) V_j^T,
    tail_j the sum of the chunk's log gates after j."""
    decay = jnp.exp(tail)  # [B, Hk, N, C], <= 1
    ct = compute_dtype(k, v, tail)

    def one_chunk(k_c, v_c, decay_c):
        phi = sympow_embedding(k_c.astype(ct), p) * decay_c[..., None]  # [B, Hk, C, F]
        s = jnp.einsum("bhcf,bhce->bhfe", phi, v_c.astype(ct), precision=HIGHEST)
        return s, phi.sum(axis=-2)

    return _map_chunks(one_chunk, k, v, decay)


def prefix_sum(
    s: Float[Array, "B Hk N F E"], z: Float[Array, "B Hk N F"], g_last: Float[Array, "B Hk N"],
):
    """Gated exclusive prefix sum over chunks: the state entering each chunk, and the final one.

    P_0 = 0, P_{n+1} = exp(g_last_n) P_n + S_n. Returns (s_in, z_in, s_final, z_final).
    """

    def step(carry, x):
        s_n, z_n, decay_n = x
        s_prev, z_prev = carry
        nxt = (decay_n[..., None, None] * s_prev + s_n, decay_n[..., None] * z_prev + z_n)
        return nxt, carry

    xs = (jnp.moveaxis(s, 2, 0), jnp.moveaxis(z, 2, 0), jnp.moveaxis(jnp.exp(g_last), 2, 0))
    init = (jnp.zeros_like(xs[0][0]), jnp.zeros_like(xs[1][0]))
    (s_final, z_final), (s_in, z_in) = jax.lax.scan(step, init, xs)
    return jnp.moveaxis(s_in, 0, 2), jnp.moveaxis(z_in, 0, 2), s_final, z_final


def attention(
    q: Float[Array, "B Hq N C D"], k: Float[Array, "B Hk N C D"], v: Float[Array, "B Hk N C E"],
    a: Float[Array, "B Hk N C"], *, p: int,
):
    """Intra-chunk causal attention, unnormalized against the row max in log space.

    Returns (o [B, Hq, N, C, E], den [B, Hq, N, C], m [B, Hq, N, C]) with
    o_i = sum_{j<=i} exp(l_ij - m_i) V_j, den_i = sum_{j<=i} exp(l_ij - m_i),
    l_ij = P log|Q_i . K_j| + sum_{j<k<=i} a_k (a the log gates, summed per segment),
    m_i = max_j l_ij (0 where no j counts).
    """
    b, hq, n, c, d = q.shape
    hk = k.shape[1]
    ct = compute_dtype(q, k, v, a)
    qg = q.astype(ct).reshape(b, hk, hq // hk, n, c, d)
    scores = jnp.einsum("bhrnid,bhnjd->bhrnij", qg, k.astype(ct), precision=HIGHEST)
    nonzero = scores != 0
    log_power = p * jnp.log(jnp.abs(jnp.where(nonzero, scores, 1.0)))
    causal = jnp.tril(jnp.ones((c, c), bool))
    log_decay = jnp.where(causal, segment_sums_last(a), 0.0)[:, :, None]  # [B, Hk, 1, N, C, C]
    valid = nonzero & causal
    logits = jnp.where(valid, log_power + log_decay, -jnp.inf)
    m = jax.lax.stop_gradient(jnp.max(logits, axis=-1))
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    w = jnp.where(valid, jnp.exp(logits - m[..., None]), 0.0)  # [B, Hk, R, N, C, C]
    o = jnp.einsum("bhrnij,bhnje->bhrnie", w, v.astype(ct), precision=HIGHEST)
    merge = lambda x: x.reshape(b, hq, *x.shape[3:])  # noqa: E731
    return merge(o), merge(w.sum(-1)), merge(m)


def query_state(
    q: Float[Array, "B Hq N C D"], s_in: Float[Array, "B Hk N F E"], z_in: Float[Array, "B Hk N F"],
    g: Float[Array, "B Hk N C"], o, den, m, *, p: int,
) -> Float[Array, "B Hq N C E"]:
    """exp(g_i) phi(Q_i)^T P_n for numerator and normalizer, then `combine` with (o, den, m)."""
    b, hq, n, c, d = q.shape
    hk = s_in.shape[1]
    qg = q.reshape(b, hk, hq // hk, n, c, d)
    og, deng, mg = (x.reshape(b, hk, hq // hk, *x.shape[2:]) for x in (o, den, m))

    def one_chunk(q_c, s_c, z_c, g_c, o_c, den_c, m_c):
        # q_c [B, Hk, R, C, D]; s_c [B, Hk, F, E]; g_c [B, Hk, C]
        phi = sympow_embedding(q_c.astype(s_c.dtype), p) * jnp.exp(g_c)[:, :, None, :, None]
        inter_o = jnp.einsum("bhrcf,bhfe->bhrce", phi, s_c, precision=HIGHEST)
        inter_den = jnp.einsum("bhrcf,bhf->bhrc", phi, z_c, precision=HIGHEST)
        return combine(o_c, den_c, m_c, inter_o, inter_den)

    # Chunk axis: 3 for the grouped query side, 2 for the state side.
    moved = [jnp.moveaxis(x, 3, 2) for x in (qg, og, deng, mg)]
    y = _map_chunks(lambda q_c, o_c, den_c, m_c, s_c, z_c, g_c:
                    one_chunk(q_c, s_c, z_c, g_c, o_c, den_c, m_c),
                    *moved, s_in, z_in, g)  # [B, Hk, N, R, C, E]
    return jnp.moveaxis(y, 2, 3).reshape(b, hq, n, c, -1)


PRIMITIVES = ChunkPrimitives(update_state, prefix_sum, attention, query_state)


def default_chunk_size(length: int) -> int:
    """C when the caller gives none: 64 balances the O(T C) intra-chunk work against the
    O(T F E / C) state work for d = 64, p = 2, and never more than the (8-rounded) sequence."""
    return capped_block(length, 64)
