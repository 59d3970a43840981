"""Flax NNX layers: sympow / conformal-sympow attention and GPT-2 style models.

    from sympow.layers import GPT, GPTConfig, generate
    model = GPT(GPTConfig.preset("conformal", size="small", p=2), rngs=nnx.Rngs(0))
"""

from sympow.layers.attention import (
    KVCache,
    Rotary,
    SoftmaxAttention,
    SympowAttention,
    SympowCache,
)
from sympow.layers.decode import GPTCache, decode_step, generate, prefill
from sympow.layers.model import (
    GPT,
    PRESETS,
    SIZES,
    Block,
    GPTConfig,
    ModelReport,
    model_report,
    state_bytes,
)

__all__ = [
    "GPT", "GPTCache", "GPTConfig", "PRESETS", "SIZES", "Block", "KVCache", "ModelReport",
    "Rotary", "SoftmaxAttention", "SympowAttention", "SympowCache", "decode_step", "generate",
    "model_report", "prefill", "state_bytes",
]
