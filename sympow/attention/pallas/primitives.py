"""The portable tier as `ChunkPrimitives`: shapes padded to what the kernels take, or a
logged fallback to the pure-JAX primitives for shapes they do not support.

All four primitives decide alike (from the same `make_plan`), so the feature layouts of the
states always agree. `prefix_sum` returns the final state (the one `prefill` hands to
`decode_step`) gathered into the tile=1 layout, so the recurrent state is the same whatever
the tier.
"""

from __future__ import annotations

import functools
import logging

import jax.numpy as jnp

from sympow.attention import xla
from sympow.attention.chunked import ChunkPrimitives
from sympow.attention.config import AttentionConfig
from sympow.attention.pallas import vjps
from sympow.attention.pallas.phi import to_symmetric_layout
from sympow.attention.pallas.plan import Plan, make_plan, padded_width, prefix_plan, tiled_layout

logger = logging.getLogger(__name__)


@functools.lru_cache(maxsize=64)
def _log_fallback(reason: str) -> None:
    logger.warning("sympow impl='pallas' falls back to 'xla' for %s", reason)


def pad_to(x, axis: int, size: int, mode: str = "constant"):
    """x padded at the end of `axis` to `size` (with zeros, or as jnp.pad's `mode`)."""
    pad = size - x.shape[axis]
    if pad == 0:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, pad)
    return jnp.pad(x, widths, mode=mode)


def primitives(config: AttentionConfig, attention=vjps.attention) -> ChunkPrimitives:
    """ChunkPrimitives of the Pallas tier for a resolved AttentionConfig; ``attention`` is
    the intra-chunk attention (plan, q, k, v, a) -> (o, den, m) (the Hopper tier passes its
    own).

    Shapes the kernels do not take natively run padded inside each primitive, outputs sliced
    back (so states and outputs keep the caller's shapes): a value width e that is not a power
    of two >= 16 gets zero columns, a chunk C that is not one gets zero rows at its end (zero
    keys add nothing, causality keeps the real rows from the padded ones; log gates and
    suffix sums are padded with 0 and the inclusive sums g with their last value, so no real
    decay changes).
    """

    def plan_for(d, e, c, dtype) -> Plan | None:
        plan = make_plan(config.p, d, padded_width(e), padded_width(c), jnp.dtype(dtype).name,
                         config.interpret)
        if isinstance(plan, str):
            _log_fallback(plan)
            return None
        return plan

    def rows(x, plan):  # [B, H, N, C, ...] -> [B, H, N, plan.c, ...]
        return pad_to(x, 3, plan.c)

    def gates(g, plan):
        return pad_to(g, 3, plan.c, mode="edge")

    def cols(x, plan):
        return pad_to(x, -1, plan.e)

    def update_state_(k, v, tail, *, p):
        plan = plan_for(k.shape[-1], v.shape[-1], k.shape[3], k.dtype)
        if plan is None:
            return xla.update_state(k, v, tail, p=p)
        s, z = vjps.update_state(plan, rows(k, plan), rows(cols(v, plan), plan), rows(tail, plan))
        return s[..., :v.shape[-1]], z

    def prefix_sum_(s, z, g_last):
        layout = tiled_layout(s.shape[-2], config.p)
        if layout is None:
            return xla.prefix_sum(s, z, g_last)
        e = s.shape[-1]  # loads of [bf, E] need a power of two: pad as the other kernels do
        s_in, z_in, s_fin, z_fin = vjps.prefix_sum(prefix_plan(s.shape[-2], config.interpret),
                                              pad_to(s, -1, padded_width(e)), z, g_last)
        s_in, s_fin = s_in[..., :e], s_fin[..., :e]
        d, tile = layout
        index, scale = to_symmetric_layout(d, config.p, tile)
        return s_in, z_in, s_fin[..., index, :] * scale[:, None], z_fin[..., index] * scale

    def attention_(q, k, v, a, *, p):
        c, e = q.shape[3], v.shape[-1]
        plan = plan_for(q.shape[-1], e, c, q.dtype)
        if plan is None:
            return xla.attention(q, k, v, a, p=p)
        o, den, m = attention(plan, rows(q, plan), rows(k, plan), rows(cols(v, plan), plan),
                              rows(a, plan))
        return o[..., :c, :e], den[..., :c], m[..., :c]

    def query_state_(q, s_in, z_in, g, o, den, m, *, p):
        c, e = q.shape[3], s_in.shape[-1]
        plan = plan_for(q.shape[-1], e, c, q.dtype)
        if plan is None:
            return xla.query_state(q, s_in, z_in, g, o, den, m, p=p)
        y = vjps.query_state(plan, rows(q, plan), cols(s_in, plan), z_in, gates(g, plan),
                        rows(cols(o, plan), plan), rows(den, plan), rows(m, plan))
        return y[..., :c, :e]

    return ChunkPrimitives(update_state_, prefix_sum_, attention_, query_state_)
