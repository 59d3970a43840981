"""The sympow attention op, in one folder with fixed roles (docs/design.md §5.1).

  api.py              public functions, argument validation, the one custom_vjp
  config.py           the frozen static config of a call
  implementations.py  the one implementation table, keyed by (algorithm, backend)
  reference.py        the specification: quadratic attention form, recurrent form
  chunked.py          the chunked algorithm, written once over swappable primitives
  xla.py              pure-JAX primitives (the kernels' oracle, the CPU path)
  blocked.py          the attention form block by block in pure JAX (O(T x block) memory)
  pallas/             the portable Pallas kernel tier, split by role
  testing.py          cases and checks shared by the tests and the GPU runner

This package's namespace is the op's public face, what `sympow.layers` and the rest of the
library import.
"""

from sympow.attention.api import (
    DECODE_IMPLS,
    check_settings,
    chosen_algorithm,
    decode_step,
    default_decode_impl,
    prefill,
    sympow_attention,
)
from sympow.attention.chunked import ChunkPrimitives, chunked_attention
from sympow.attention.config import AttentionConfig
from sympow.attention.implementations import (
    ALGORITHMS,
    IMPLEMENTATIONS,
    IMPLS,
    available_impls,
)
from sympow.attention.reference import (
    SympowState,
    attention_form,
    init_state,
    recurrent_form,
    recurrent_step,
)

__all__ = [
    "ALGORITHMS", "DECODE_IMPLS", "IMPLEMENTATIONS", "IMPLS", "AttentionConfig",
    "ChunkPrimitives", "SympowState", "attention_form", "available_impls", "check_settings",
    "chosen_algorithm",
    "chunked_attention", "decode_step", "default_decode_impl", "init_state", "prefill",
    "recurrent_form", "recurrent_step", "sympow_attention",
]
