"""Quadratic attention form and recurrent form of gated sympow attention: the specification.

Both take the public layout q [B, T, Hq, D], k [B, T, Hk, D], v [B, T, Hk, E] and
log_g [B, T, Hk] (log of the gate, <= 0; None = no gating); query head n reads key/value
head n // (Hq // Hk). They compute, in float32,

  Y_i = sum_{j<=i} B_ij V_j / sum_{j<=i} B_ij,   B_ij = exp(G_i - G_j) (Q_i . K_j)^P,

with G = cumsum(log_g). A row whose B_ij are all zero (a zero query, or keys orthogonal to
it) has no distribution to average with; its output is defined as 0 in every form.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

from sympow.embedding import expanded_dim, sympow_embedding
from sympow.numerics import HIGHEST, compute_dtype, is_int, safe_divide

# The public layout of the op (docs/design.md §1, §5.1), as in jax.nn.dot_product_attention.
Queries = Float[Array, "B T Hq D"]
Keys = Float[Array, "B T Hk D"]
Values = Float[Array, "B T Hk E"]
LogGates = Float[Array, "B T Hk"]
Outputs = Float[Array, "B T Hq E"]


def segment_sums(log_g: Float[Array, "B T H"]) -> Float[Array, "B H T T"]:
    """log b_ij = sum_{k=j+1..i} log_g_k for i >= j (0 on the diagonal), -inf above it.

    Summed per segment rather than as G_i - G_j, so long sequences of strong gates do not
    lose precision to cancellation.
    """
    return segment_sums_last(jnp.moveaxis(log_g, 1, -1))


def segment_sums_last(a: Float[Array, "... T"]) -> Float[Array, "... T T"]:
    """`segment_sums` along the last axis of a: [..., i, j] = sum_{k=j+1..i} a_k, -inf
    above the diagonal."""
    t = a.shape[-1]
    strictly_lower = jnp.tril(jnp.ones((t, t), bool), k=-1)
    # Entry (i, j) accumulates a_i' for j < i' <= i by a cumulative sum down the rows.
    terms = jnp.where(strictly_lower, a[..., :, None], 0.0)  # [B, H, T, T]
    sums = jnp.cumsum(terms, axis=-2)
    return jnp.where(jnp.tril(jnp.ones((t, t), bool)), sums, -jnp.inf)


def attention_form(
    q: Queries, k: Keys, v: Values, log_g: LogGates | None,
    p: int,
) -> Outputs:
    """Causal gated sympow attention in O(T^2), stable as in [sympow] §4
    (docs/references.md).

    Scores go to log space, P log|Q_i . K_j| + log b_ij, minus the row max, then back with
    exp; sums accumulate in float32. Returns float32 [B, T, Hq, E].
    """
    b, t, hq, d = q.shape
    hk = k.shape[2]
    ct = compute_dtype(q, k, v)
    qf = q.astype(ct).reshape(b, t, hk, hq // hk, d)
    scores = jnp.einsum("bihrd,bjhd->bhrij", qf, k.astype(ct), precision=HIGHEST)
    nonzero = scores != 0
    log_power = p * jnp.log(jnp.abs(jnp.where(nonzero, scores, 1.0)))  # [B, Hk, R, T, T]
    if log_g is None:
        log_decay = jnp.where(jnp.tril(jnp.ones((t, t), bool)), 0.0, -jnp.inf)
    else:
        log_decay = segment_sums(log_g.astype(ct))[:, :, None]  # [B, Hk, 1, T, T]
    valid = nonzero & (log_decay != -jnp.inf)  # NaN counts: carried, not dropped
    logits = jnp.where(valid, log_power + jnp.where(valid, log_decay, 0.0), -jnp.inf)
    # The row max cancels between numerator and denominator: no gradient through it.
    row_max = jax.lax.stop_gradient(jnp.max(logits, axis=-1, keepdims=True))
    row_max = jnp.where(jnp.isfinite(row_max), row_max, 0.0)
    weights = jnp.where(valid, jnp.exp(logits - row_max), 0.0)
    num = jnp.einsum("bhrij,bjhe->bihre", weights, v.astype(ct), precision=HIGHEST)
    den = jnp.moveaxis(weights.sum(-1), -1, 1)  # [B, T, Hk, R]
    return safe_divide(num, den).reshape(b, t, hq, -1)


class SympowState(NamedTuple):
    """Recurrent state of one sympow layer, per key/value head (float32).

    s: [B, Hk, F, E], sum_j b_ij V_j phi(K_j)^T (stored transposed, F first).
    z: [B, Hk, F], sum_j b_ij phi(K_j).
    """

    s: Float[Array, "B Hk F E"]
    z: Float[Array, "B Hk F"]


def check_p(p) -> None:
    """ValueError unless p is a positive even int (the sympow powers: (q . k)^p >= 0)."""
    if not isinstance(p, int) or isinstance(p, bool) or p <= 0 or p % 2:
        raise ValueError(f"p must be a positive even int, got p={p!r}")


def init_state(
    batch: int, kv_heads: int, d: int, e: int, p: int, tile: int = 1, dtype=jnp.float32
) -> SympowState:
    """An all-zero state (no context yet) of F = expanded_dim(d, p, tile) features:
    s [batch, kv_heads, F, e], z [batch, kv_heads, F], both of the floating `dtype`."""
    sizes = {"batch": batch, "kv_heads": kv_heads, "d": d, "e": e}
    for name, size in sizes.items():
        if not is_int(size) or size < 1:
            raise ValueError(f"{name} must be a positive int, got {name}={size!r}")
    check_p(p)
    if not jnp.issubdtype(dtype, jnp.floating):
        raise ValueError(f"dtype must be floating point, got dtype={jnp.dtype(dtype)}")
    f = expanded_dim(d, p, tile)
    return SympowState(jnp.zeros((batch, kv_heads, f, e), dtype),
                       jnp.zeros((batch, kv_heads, f), dtype))


def recurrent_step(
    state: SympowState,
    q: Float[Array, "B Hq D"],
    k: Float[Array, "B Hk D"],
    v: Float[Array, "B Hk E"],
    log_g: Float[Array, "B Hk"] | None,
    p: int,
    tile: int = 1,
) -> tuple[SympowState, Float[Array, "B Hq E"]]:
    """One token: S <- g S + phi(K) V^T, Z <- g Z + phi(K); Y = S phi(Q) / (Z phi(Q)).

    O(F E) time and memory, independent of the context length; computes in the state's
    dtype (float32 normally). Returns (new state, y [B, Hq, E]).
    """
    b, hq, _ = q.shape
    hk = k.shape[1]
    ct = state.s.dtype
    phi_k = sympow_embedding(k.astype(ct), p, tile)  # [B, Hk, F]
    v = v.astype(ct)
    s, z = state
    if log_g is not None:
        gate = jnp.exp(log_g.astype(ct))  # [B, Hk]
        s, z = gate[..., None, None] * s, gate[..., None] * z
    s = s + phi_k[..., :, None] * v[..., None, :]
    z = z + phi_k
    phi_q = sympow_embedding(q.astype(ct), p, tile).reshape(b, hk, hq // hk, -1)
    num = jnp.einsum("bhrf,bhfe->bhre", phi_q, s, precision=HIGHEST)
    den = jnp.einsum("bhrf,bhf->bhr", phi_q, z, precision=HIGHEST)
    return SympowState(s, z), safe_divide(num, den).reshape(b, hq, -1)


def recurrent_form(
    q: Queries, k: Keys, v: Values, log_g: LogGates | None,
    p: int,
    tile: int = 1,
    state: SympowState | None = None,
) -> tuple[Outputs, SympowState]:
    """The recurrence of [conformal] §A.1 as a lax.scan over time, carrying (S, Z).

    Returns (y float32 [B, T, Hq, E], final state). `state` continues an earlier call.
    """
    b, _, _, d = q.shape
    if state is None:
        state = init_state(b, k.shape[2], d, v.shape[-1], p, tile, compute_dtype(q, k, v))
    xs = (q, k, v, log_g)
    time_major = jax.tree.map(lambda x: jnp.moveaxis(x, 1, 0), xs)

    def step(carry, x):
        q_t, k_t, v_t, g_t = x
        return recurrent_step(carry, q_t, k_t, v_t, g_t, p, tile)

    state, ys = jax.lax.scan(step, state, time_major)
    return jnp.moveaxis(ys, 0, 1), state
