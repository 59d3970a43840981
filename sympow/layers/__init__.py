"""Flax NNX layers: sympow / conformal-sympow attention and GPT-2 style models.

    from sympow.layers import GPT, GPTConfig, decode_step, decode_weights, generate
    model = GPT(GPTConfig.preset("conformal", size="small", p=2), rngs=nnx.Rngs(0))
    tokens = generate(model, prompt, 32)       # fused decoding step on a GPU (B <= 64)
    logits, cache = decode_step(model, token, cache, weights=decode_weights(model))
"""

from sympow.layers.attention import (
    KVCache,
    Rotary,
    SoftmaxAttention,
    SympowAttention,
    SympowCache,
)
from sympow.layers.decode import GPTCache, decode_step, generate, prefill
from sympow.layers.fused_decode import decode_weights
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
    "Rotary", "SoftmaxAttention", "SympowAttention", "SympowCache", "decode_step",
    "decode_weights", "generate",
    "model_report", "prefill", "state_bytes",
]
