"""The Hopper tier as the portable tier's wrappers with its own attention primitive.

Both algorithms take the Mosaic GPU attention kernels (`vjps.attention`, forward and
backward): the chunked algorithm for its intra-chunk attention, the attention form for all
of it. Every other primitive, the padding and the fallbacks are the portable tier's
(`sympow.attention.pallas.primitives`, `sympow.attention.pallas.attention_form`); where the
Hopper forward cannot run a problem, `vjps.attention` logs why and runs the portable one.
"""

from __future__ import annotations

from sympow.attention.chunked import ChunkPrimitives
from sympow.attention.config import AttentionConfig
from sympow.attention.mosaic_gpu import blocks, vjps
from sympow.attention.pallas import attention_form as portable_form
from sympow.attention.pallas import primitives as portable_primitives
from sympow.attention.reference import Keys, LogGates, Outputs, Queries, Values


def primitives(config: AttentionConfig) -> ChunkPrimitives:
    """ChunkPrimitives of the Hopper tier for a resolved AttentionConfig."""
    return portable_primitives.primitives(config, attention=vjps.attention)


def attention_form(config: AttentionConfig, q: Queries, k: Keys, v: Values,
                   log_g: LogGates | None) -> Outputs:
    """The attention form, float32 [B, T, Hq, E], T padded to whole programs of the kernel."""
    return portable_form.attention_form(config, q, k, v, log_g, attention=vjps.attention,
                                        min_length=blocks.TILE_ROWS)
