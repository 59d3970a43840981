"""The static settings of one attention call: one frozen, hashable config.

It is the single non-differentiable argument of the op's `jax.custom_vjp` (sympow/attention/
api.py) and the key under which each setting compiles once. The API fills it from the
caller's arguments and the implementation table (sympow/attention/implementations.py).
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class AttentionConfig:
    """Hashable static settings of one call (docs/design.md §5.1).

    p: the even power. algorithm, backend: the key of the implementation in
    `implementations.IMPLEMENTATIONS` ('chunked' | 'attention' | 'recurrent', and
    'mosaic_gpu' | 'pallas' | 'xla' | 'reference'). chunk_size: C of the chunked algorithm
    (None for the others). interpret: run Pallas kernels in the interpreter (every platform
    but GPU).
    """

    p: int
    algorithm: str
    backend: str
    chunk_size: int | None = None
    interpret: bool = False
