"""Pallas GPU kernels for the chunked sympow algorithm.

Each kernel tier registers a `ChunkPrimitives` factory under its impl name; the public
`sympow.sympow_attention` picks the fastest registered tier that runs on the backend.
"""

from __future__ import annotations

from collections.abc import Callable

# impl name -> (is_available() -> bool, default_chunk_size(T) -> int, primitives(config))
_REGISTRY: dict[str, tuple[Callable[[], bool], Callable[[int], int], Callable]] = {}


def register(impl: str, is_available, default_chunk_size, primitives) -> None:
    _REGISTRY[impl] = (is_available, default_chunk_size, primitives)


def is_available(impl: str) -> bool:
    return impl in _REGISTRY and _REGISTRY[impl][0]()


def default_chunk_size(length: int, impl: str) -> int:
    return _REGISTRY[impl][1](length)


def primitives(config):
    """The ChunkPrimitives of a kernel impl for a resolved AttentionConfig."""
    return _REGISTRY[config.impl][2](config)
from sympow.kernels import pallas as _pallas  # noqa: E402,F401  (registers impl="pallas")
