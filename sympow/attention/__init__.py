"""The sympow attention op: reference forms, the chunked algorithm and its primitives."""

from sympow.attention.api import decode_step, prefill, sympow_attention
from sympow.attention.chunked import ChunkPrimitives, chunked_attention
from sympow.attention.config import IMPLS, AttentionConfig, available_impls
from sympow.attention.reference import (
    SympowState,
    attention_form,
    init_state,
    recurrent_form,
    recurrent_step,
)

__all__ = [
    "IMPLS", "AttentionConfig", "ChunkPrimitives", "SympowState", "attention_form", "available_impls",
    "chunked_attention", "decode_step", "init_state", "prefill", "recurrent_form",
    "recurrent_step", "sympow_attention",
]
