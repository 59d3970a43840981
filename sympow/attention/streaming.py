"""The recurrent state after a prompt without per-chunk states: streamed over feature tiles.

After T tokens the recurrence (reference.recurrent_form) holds, per key/value head,

    S = sum_j b_j phi(K_j) V_j^T,   Z = sum_j b_j phi(K_j),   b_j = exp(sum_{k > j} log_g_k).

The chunked algorithm gets it from its per-chunk states, N of F x E numbers per head alive at
once; at p = 4, d = 64 (F = 766,480) those do not fit in any GPU. Here the F features are
cut into tiles of `tile` columns instead, and the state is written one tile at a time:

    S[f-tile] = phi(K)[:, f-tile]^T (b V),   Z[f-tile] = phi(K)[:, f-tile]^T b,

one [B, Hk, T, tile] block of phi alive at a time and one matmul per tile, so besides the
output only `tile_bytes` of working memory are needed and the state is never re-read (a
scan over time blocks would rewrite all of S once per block). The cost is the state's own,
2 T F (E + 1) multiply-adds per head, which is what the attention form saves during training
and `prefill` pays once (api.py): GPT-2 small at p = 4 (F E = 49M per head) prefills and
decodes on one GPU.

Numerics (docs/design.md §4): b_j comes from suffix sums of log_g (a reverse exclusive
cumulative sum), never a difference of two large cumulative sums, so early strong gates cost
no precision; keys are divided by a power of two at least their largest norm per (batch,
head), as in the chunked algorithm, and the state is multiplied back by that scale^p at the
end, so no intermediate phi(K) over- or underflows where the true state does not.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float

from sympow.attention.chunked import normalize_keys, suffix_sums
from sympow.attention.reference import Keys, LogGates, SympowState, Values
from sympow.embedding import embedding_tables
from sympow.numerics import HIGHEST, compute_dtype

DEFAULT_TILE_BYTES = 1 << 30  # the phi block of one tile, all heads: 1 GiB


def feature_tile(batch: int, kv_heads: int, length: int, features: int, itemsize: int = 4,
                 tile_bytes: int = DEFAULT_TILE_BYTES) -> int:
    """Columns per feature tile: the most (a multiple of 128, at least 128, at most F rounded
    up to 8) whose phi block [B, Hk, T, tile] fits in `tile_bytes`."""
    if tile_bytes <= 0:
        raise ValueError(f"tile_bytes must be positive, got tile_bytes={tile_bytes!r}")
    fit = tile_bytes // (batch * kv_heads * length * itemsize)
    return int(min(-(-features // 8) * 8, max(128, fit // 128 * 128)))


def suffix_decays(log_g: Float[Array, "B T Hk"]) -> Float[Array, "B Hk T"]:
    """b_j = exp(sum_{k > j} log_g_k): the decay from token j to the end of the prompt."""
    return jnp.exp(suffix_sums(jnp.moveaxis(log_g, 1, -1)))  # [B, Hk, T]


def streamed_state(k: Keys, v: Values, log_g: LogGates | None, *, p: int,
                   tile: int | None = None) -> SympowState:
    """The recurrent state after the last token of (k, v, log_g), tile=1 layout.

    Args:
      k: [B, T, Hk, D] keys; v: [B, T, Hk, E] values; log_g: [B, T, Hk] or None.
      p: positive even power.
      tile: feature columns per step; None sizes it by `feature_tile`.

    Returns:
      SympowState(s [B, Hk, F, E], z [B, Hk, F]) in float32 (float64 for float64 inputs),
      F = expanded_dim(D, p): what `prefill` returns and `decode_step` continues.
    """
    b, t, hk, d = k.shape
    ct = compute_dtype(k, v)
    k_unit, key_scale = normalize_keys(k)  # key_scale [B, Hk]
    decay = (jnp.ones((b, hk, t), ct) if log_g is None
             else suffix_decays(log_g.astype(ct)))  # [B, Hk, T]
    keys = jnp.moveaxis(k_unit.astype(ct), 1, 2)  # [B, Hk, T, D]
    # [B, Hk, T, E + 1]: b V with b as a last column, so one product gives S and Z.
    weighted = decay[..., None] * jnp.concatenate(
        [jnp.moveaxis(v.astype(ct), 1, 2), jnp.ones((b, hk, t, 1), ct)], axis=-1)

    index, weight = embedding_tables(d, p)
    f = len(weight)
    tile = tile or feature_tile(b, hk, t, f, jnp.dtype(ct).itemsize)
    n_tiles = math.ceil(f / tile)
    pad = n_tiles * tile - f  # zero-weight features past F, dropped below
    index = np.pad(index, [(0, pad), (0, 0)]).reshape(n_tiles, tile, p)
    weight = np.pad(weight, (0, pad)).reshape(n_tiles, tile)

    def one_tile(tables):
        idx, w = tables  # [tile, p], [tile]
        phi = jnp.take(keys, idx[:, 0], axis=-1)  # [B, Hk, T, tile]
        for factor in range(1, p):
            phi = phi * jnp.take(keys, idx[:, factor], axis=-1)
        phi = phi * w.astype(ct)
        return jnp.einsum("bhtf,bhte->bhfe", phi, weighted, precision=HIGHEST)

    tables = (jnp.asarray(index), jnp.asarray(weight))
    tiles = jax.lax.map(one_tile, tables)  # [n, B, Hk, tile, E + 1]
    state = jnp.moveaxis(tiles, 0, 2).reshape(b, hk, n_tiles * tile, -1)[:, :, :f]
    restore = (key_scale.astype(ct) ** p)[..., None, None]  # phi(K / c) = phi(K) / c^p
    state = state * restore
    return SympowState(state[..., :-1], state[..., -1])
