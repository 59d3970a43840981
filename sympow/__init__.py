"""sympow: symmetric power transformers in JAX.

Linear-cost attention where exp(q . k) becomes (q . k)^p for even p, with data-dependent
gating and learned rotary embeddings (conformal-sympow).
"""

from sympow.attention import (
    AttentionConfig,
    SympowState,
    available_impls,
    decode_step,
    init_state,
    prefill,
    sympow_attention,
)
from sympow.embedding import embedding_tables, expanded_dim, state_bytes, sympow_embedding
from sympow.rotary import apply_rotary, fixed_rotary_angles, learned_rotary_angles, rotary_rates

__version__ = "0.1.0"

__all__ = [
    "AttentionConfig", "SympowState", "apply_rotary", "available_impls", "decode_step",
    "embedding_tables", "expanded_dim", "fixed_rotary_angles", "init_state",
    "learned_rotary_angles", "prefill", "rotary_rates", "state_bytes", "sympow_attention",
    "sympow_embedding",
]
