"""The attention kernels' weights as arithmetic on register tiles (plain jnp, so a CPU
checks it too): the forward's weights off the diagonal without an exponential per score,
the backward's power form, and the capped decay exponential both use.

Off the diagonal a block's decay D_ij = head_i + mid + tail_j (log2 units, every term
<= 0) is a row term plus a column term, so exp2(D) is a row factor times a column factor
(exp(tail), one per key, fetched with the keys): `separable_weights` (forward) and the
backward's factors in `power_terms`. On a diagonal block the decay is an exact in-block
product with no such split; there the kernels take exp2 per score.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from sympow.attention.mosaic_gpu.blocks import by_cols, by_rows

EXP2_CAP = 126.0  # the largest decay factor exp2 may give (float32's range: 2^127)
# Off the diagonal the forward takes `separable_weights` for key blocks whose gates sum to
# at least -SEPARABLE_SPREAD (log2 units): its running max then exceeds the exact one by at
# most that much, 2^-32 of float32's 2^-126 range; blocks with stronger gates take exp2.
SEPARABLE_SPREAD = 32.0


def power_terms(s, factors, scale, p_scale, p: int):
    """(w, ds / dw) of the backward without logarithms or divisions: with s' = s scale,
    w = s'^p e and ds / dw = p dl / (s dw) = s'^(p-1) e p scale (p_scale = p scale,
    broadcast like scale), e the product of `factors` (the decay against the row's shift,
    applied in order to s'^(p-1), which keeps every partial product finite): on a diagonal
    block exp2 of the exact exponent, elsewhere a row factor and a column factor."""
    scaled = s * scale
    odd = scaled if p == 2 else lax.integer_pow(scaled, p - 1)
    for factor in factors:
        odd = odd * factor
    return odd * scaled, odd * p_scale


def capped_exp2(exponent):
    """exp2 of a decay exponent against a row's shift, capped at 2^EXP2_CAP: the forward's
    row scale keeps the largest |s'| of a row near 1, so the factor stays finite for every
    weight that is not negligible; past the cap s'^p underflows."""
    return jnp.exp2(jnp.minimum(exponent, EXP2_CAP))


def finite(m):
    """A row shift: m, or 0 where no weight was seen yet (no inf - inf)."""
    return jnp.where(m == -jnp.inf, 0.0, m)


def separable_weights(s, top, row_decay, col_factor, m_old, p: int):
    """(w, m_new) of a block off the diagonal with no exponential per score: the decay
    D_ij = row_i + tail_j (row = head + mid, tail <= 0, log2 units) factors into a row
    and a column term, so with the block's bound on its logits

        bound_i = p log2 max_j |s_ij| + row_i  (>= every p log2|s_ij| + D_ij: tails <= 0),

    m_new = max(m_old, bound) and w_ij = (s_ij r_i)^p f_j, r_i = exp2((bound_i - m_new_i)
    / p) / max_j |s_ij| (|s_ij| r_i <= 1) and f_j = exp2(tail_j) = `col_factor` (<= 1):
    every factor at most 1, nothing overflows. m_new exceeds the exact running max by at
    most the block's tail spread, so the kernel takes this path only for blocks whose gates
    sum to at least -SEPARABLE_SPREAD (the weights then lose no range); rows whose largest
    |s| is below float32's normal range get no weight (as log2 flushes them on the GPU).
    s [R, K], top = max_j |s_ij| [R], row_decay [R], col_factor [K], m_old [R] (log2
    units); plain jnp, so the arithmetic is checked on a CPU as well."""
    bound = p * jnp.log2(top) + row_decay
    m_new = jnp.maximum(m_old, bound)
    normal = top >= jnp.finfo(jnp.float32).tiny
    r = jnp.where(normal, jnp.exp2((bound - finite(m_new)) / p)
                  / jnp.where(normal, top, 1.0), 0.0)
    t = s * by_rows(r, s.shape)
    w = t * t if p == 2 else lax.integer_pow(t, p)
    return w * by_cols(col_factor, s.shape), m_new
