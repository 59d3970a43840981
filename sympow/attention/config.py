"""Static settings of one sympow attention call and the heuristics that choose them."""

from __future__ import annotations

import dataclasses

import jax

# Fastest first; `resolve_impl(None)` takes the first one available on the backend.
IMPLS = ("mosaic_gpu", "pallas", "xla", "reference")


@dataclasses.dataclass(frozen=True)
class AttentionConfig:
    """Hashable static settings, the one non-differentiable argument of the custom_vjp.

    p: even power. chunk_size: C of the chunked algorithm. impl: one of IMPLS.
    interpret: run Pallas kernels in interpret mode (automatic off GPU).
    """

    p: int
    chunk_size: int
    impl: str
    interpret: bool = False


def on_gpu() -> bool:
    return jax.default_backend() == "gpu"


def available_impls() -> tuple[str, ...]:
    """Implementations usable on the default backend, fastest first.

    Off GPU the kernel tiers run only in interpret mode (for tests), so they come last and
    are never the default.
    """
    from sympow import kernels

    order = IMPLS if on_gpu() else ("xla", "reference", "mosaic_gpu", "pallas")
    return tuple(i for i in order if i in ("xla", "reference") or kernels.is_available(i))


def resolve_impl(impl: str | None) -> str:
    if impl is None:
        return available_impls()[0]
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS} or None, got impl={impl!r}")
    if impl not in available_impls():
        raise ValueError(f"impl={impl!r} is not available on backend {jax.default_backend()!r}; "
                         f"available: {available_impls()}")
    return impl


def default_chunk_size(length: int, impl: str) -> int:
    """C when the caller gives none.

    xla/reference: 64 balances the O(T C) intra-chunk work against the O(T F E / C) state
    work for d = 64, p = 2, and never more than the (8-rounded) sequence itself.
    """
    from sympow import kernels

    if impl in ("pallas", "mosaic_gpu"):
        return kernels.default_chunk_size(length, impl)
    return max(1, min(64, -(-length // 8) * 8))
