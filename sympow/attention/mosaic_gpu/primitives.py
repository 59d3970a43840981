"""The Hopper tier's primitives: its own attention and state kernels, the portable tier's
wrappers and fallbacks around them.

Both algorithms take the Mosaic GPU attention kernels (`vjps.attention`, forward and
backward): the chunked algorithm for its intra-chunk attention, the attention form for all
of it. For p = 2 and d = 64 the chunked algorithm's state primitives are the Mosaic GPU
ones (`states`: the square layout, stored in its upper layout); every other problem runs
the portable tier's (`sympow.attention.pallas.primitives`) with the reason logged. All three
state primitives decide from the same shapes, so a state's layout is the same wherever it
goes (the prefix sum tells the tier's states by their layout: `states.holds`).
"""

from __future__ import annotations

from sympow.attention.chunked import ChunkPrimitives
from sympow.attention.config import AttentionConfig
from sympow.attention.mosaic_gpu import blocks, states, vjps
from sympow.attention.pallas import attention_form as portable_form
from sympow.attention.pallas import primitives as portable_primitives
from sympow.attention.reference import Keys, LogGates, Outputs, Queries, Values


def primitives(config: AttentionConfig) -> ChunkPrimitives:
    """ChunkPrimitives of the Hopper tier for a resolved AttentionConfig."""
    def attention(plan, q, k, v, a):  # o in the combine's dtype (read at each call)
        return vjps.attention(plan, q, k, v, a, o_dtype=states.PARTIALS_DTYPE)

    portable = portable_primitives.primitives(config, attention=attention)

    def square(x, values, dtype) -> bool:  # x [B, H, N, C, d], values [..., E]
        reason = states.unsupported(config, x.shape[-1], values.shape[-1], x.shape[3], dtype)
        if reason is not None:
            vjps.log_fallback("state", reason)
        return reason is None

    def update_state_(k, v, tail, *, p):
        if square(k, v, k.dtype):
            return states.update_state(k, v, tail)
        return portable.update_state(k, v, tail, p=p)

    def prefix_sum_(s, z, g_last):
        if states.holds(s, config.p):
            return states.prefix_sum(config, s, z, g_last)
        return portable.prefix_sum(s, z, g_last)

    def query_state_(q, s_in, z_in, g, o, den, m, *, p):
        if square(q, states.first_array(s_in), q.dtype):
            return states.query_state(q, s_in, z_in, g, o, den, m)
        return portable.query_state(q, s_in, z_in, g, o, den, m, p=p)

    return ChunkPrimitives(update_state_, prefix_sum_, portable.attention, query_state_)


def attention_form(config: AttentionConfig, q: Queries, k: Keys, v: Values,
                   log_g: LogGates | None) -> Outputs:
    """The attention form [B, T, Hq, E], T padded to whole programs of the kernel: where the
    Mosaic GPU kernels run (`vjps.unsupported`), q, k, v and y in token layout and y = o /
    den from the forward kernel in v's dtype (`vjps.normalized_in_tokens`); else float32
    from the portable kernels' chunk layout."""
    def in_tokens(plan):
        return vjps.normalized_in_tokens if vjps.unsupported(plan) is None else None

    return portable_form.attention_form(config, q, k, v, log_g, attention=vjps.attention,
                                        min_length=blocks.TILE_ROWS, in_tokens=in_tokens)
