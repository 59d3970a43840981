"""Symmetric power embedding phi^p and state sizes.

phi^p maps x in R^d to R^F so that phi(q) . phi(k) = (q . k)^p exactly. One family covers
the three embeddings of the articles (docs/references.md), indexed by a tile width t dividing d:

* t = 1: the symmetric power ([sympow] §4; docs/references.md): one feature per non-decreasing
  multi-index alpha over [0, d), value sqrt(multinomial(alpha)) * prod_k x[alpha_k];
  F = C(d + p - 1, p).
* t = d: the tensor power, F = d^p.
* 1 < t < d: tiled interpolation ([kernel-notes]). Cut [0, d) into d/t blocks; keep one t^p tile
  (outer product of block slices) per non-decreasing sequence of block indices, weighted by
  the square root of that sequence's multinomial count; F = C(d/t + p - 1, p) * t^p.

Every variant is a gather: feature f is weight[f] * prod_k x[index[f, k]]. The tables are
built once with numpy and cached per (d, p, tile).
"""

from __future__ import annotations

import functools
import itertools
import math

import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float

from sympow.numerics import is_finite_number, is_int

__all__ = ["expanded_dim", "state_bytes", "sympow_embedding", "embedding_tables"]


def _check_power_and_tile(d: int, p: int, tile: int) -> tuple[int, int, int]:
    """(d, p, tile) as Python ints (numpy ints would wrap around in the sizes' products)."""
    if not is_int(p) or p < 1:
        raise ValueError(f"p must be a positive int, got p={p!r}")
    if not is_int(d) or d < 1:
        raise ValueError(f"d must be a positive int, got d={d!r}")
    if not is_int(tile) or tile < 1 or d % tile:
        raise ValueError(f"tile must be a positive divisor of d={d}, got tile={tile!r}")
    return int(d), int(p), int(tile)


def expanded_dim(d: int, p: int, tile: int = 1) -> int:
    """Feature dimension F of phi^p on R^d with tile width `tile`.

    F = C(d/tile + p - 1, p) * tile^p: C(d + p - 1, p) for the symmetric power (tile=1),
    d^p for the tensor power (tile=d).
    """
    d, p, tile = _check_power_and_tile(d, p, tile)
    blocks = d // tile
    return math.comb(blocks + p - 1, p) * tile**p


@functools.lru_cache(maxsize=64)
def embedding_tables(d: int, p: int, tile: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """Gather tables of phi^p: `index` [F, p] int32 and `weight` [F] float64.

    phi(x)[f] = weight[f] * prod_k x[index[f, k]]. Cached; treat the arrays as read-only.
    """
    d, p, tile = _check_power_and_tile(d, p, tile)
    blocks = d // tile
    # Non-decreasing block sequences [n, p] and all t^p ordered within-tile offsets [t^p, p].
    block_seqs = np.array(
        list(itertools.combinations_with_replacement(range(blocks), p)), dtype=np.int64
    ).reshape(-1, p)
    offsets = np.array(list(itertools.product(range(tile), repeat=p)), dtype=np.int64)
    offsets = offsets.reshape(-1, p)
    # multinomial = p! / prod(c!): in a sorted sequence the running length of each run of
    # equal indices takes the values 1..c, so their product over positions is prod(c!).
    run_length = np.ones_like(block_seqs)
    for k in range(1, p):
        same = block_seqs[:, k] == block_seqs[:, k - 1]
        run_length[:, k] = np.where(same, run_length[:, k - 1] + 1, 1)
    multinomial = math.factorial(p) / np.prod(run_length, axis=1).astype(np.float64)
    index = (block_seqs[:, None, :] * tile + offsets[None]).reshape(-1, p).astype(np.int32)
    weight = np.repeat(np.sqrt(multinomial), len(offsets))
    assert index.shape == (expanded_dim(d, p, tile), p)
    index.setflags(write=False)
    weight.setflags(write=False)
    return index, weight


def sympow_embedding(x: Float[Array, "... D"], p: int, tile: int = 1) -> Float[Array, "... F"]:
    """Embed `x` [..., D] into phi^p(x) [..., F] with phi(q) . phi(k) = (q . k)^p.

    Args:
      x: [..., D] any leading shape, floating dtype (the output keeps it).
      p: positive int power (the attention needs it even; the identity holds for any p).
      tile: tile width dividing D; 1 = symmetric power, D = tensor power.

    Returns:
      [..., F] with F = expanded_dim(D, p, tile). Differentiable and jit-able; the product is
      built one factor at a time so memory stays at O(F) per row.
    """
    x = jnp.asarray(x)
    if x.ndim < 1:
        raise ValueError(f"x must have at least one dimension, got shape {x.shape}")
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise ValueError(f"x must be floating point, got dtype {x.dtype}")
    index, weight = embedding_tables(x.shape[-1], p, tile)
    out = jnp.take(x, index[:, 0], axis=-1)  # [..., F]
    for k in range(1, p):
        out = out * jnp.take(x, index[:, k], axis=-1)
    return out * jnp.asarray(weight, dtype=x.dtype)


def state_bytes(
    d: int,
    p: int,
    *,
    e: int | None = None,
    layers: int = 1,
    heads: int = 1,
    tile: int = 1,
    bytes_per_number: int = 2,
) -> int:
    """Bytes of the recurrent state: layers * heads * F * (e + 1) * bytes_per_number.

    Per head the state is S [E, F] plus the normalizer Z [F] ([sympow] §1). With
    GPT-2 small (layers=12, heads=12, d=e=64, 2 bytes) this gives the tables of [sympow]: 39 MB
    (p=2), 14 GB (4), 2.2 TB (6), 199 TB (8) for the symmetric power and 77 MB, 314 GB,
    1.3 PB, 5.3 EB for the tensor power (tile=d); decimal units.
    """
    # d first: a bad d is reported as d, not as the e it defaults.
    f = expanded_dim(d, p, tile)
    e = d if e is None else e
    for name, value in (("e", e), ("layers", layers), ("heads", heads)):
        if not is_int(value) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {name}={value!r}")
    if not is_finite_number(bytes_per_number) or bytes_per_number <= 0:
        raise ValueError("bytes_per_number must be a finite number > 0, got "
                         f"bytes_per_number={bytes_per_number!r}")
    return int(layers) * int(heads) * f * (int(e) + 1) * bytes_per_number
