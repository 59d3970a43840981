"""phi tiles on chip: one tile of the tiled symmetric power embedding inside a kernel.

A tile of width t holds the t^p products x[a_1 t + u_1] ... x[a_p t + u_p] for one
non-decreasing block sequence (a_1 <= ... <= a_p), in the feature order of
`sympow.embedding.embedding_tables(d, p, t)`, so the kernels' layout of F is that table's
(docs/design.md §2.2, §5.2). Two ways to build a tile, each where it measured faster
(docs/kernels.md): outer products in registers (`tile_products`, the state -> rows kernels)
and exact products against 0/1 selections (`expand_factors_t`, the rows -> state kernel).
Also the host-side tables: each tile's block sequence and weight, and the gather from the
tiled layout to the tile=1 layout of the recurrent state.
"""

from __future__ import annotations

import functools

import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from sympow.attention.pallas.launch import dot
from sympow.attention.pallas.plan import Plan
from sympow.embedding import embedding_tables


@functools.lru_cache(maxsize=64)
def tile_tables(d: int, p: int, tile: int) -> tuple[np.ndarray, np.ndarray]:
    """Per tile of the tiled embedding: block indices [n_tiles, p] int32, weight [n_tiles] f32.

    Read off `embedding_tables(d, p, tile)`: the first feature of each tile has all offsets 0.
    """
    index, weight = embedding_tables(d, p, tile)
    first = np.arange(0, index.shape[0], tile ** p)
    return (index[first] // tile).astype(np.int32), weight[first].astype(np.float32)


@functools.lru_cache(maxsize=64)
def to_symmetric_layout(d: int, p: int, tile: int) -> tuple[np.ndarray, np.ndarray]:
    """Gather that maps a tile-`tile` state to the tile=1 layout: (rows [F1], scale [F1]).

    Every tiled feature whose sorted multi-index is alpha holds the same monomial of alpha,
    weighted by its tile's weight, so S_sym[alpha] = S_tiled[rows[alpha]] * scale[alpha].
    """
    t_index, t_weight = embedding_tables(d, p, tile)
    s_index, s_weight = embedding_tables(d, p, 1)
    first: dict[tuple[int, ...], int] = {}
    for f, alpha in enumerate(map(tuple, np.sort(t_index, axis=1))):
        first.setdefault(alpha, f)
    rows = np.array([first[tuple(alpha)] for alpha in s_index], np.int32)
    return rows, (s_weight / t_weight[rows]).astype(np.float32)


# ---------------------------------------------------------------------------------------
# In-kernel phi tiles. `blocks` are p traced int32 scalars (the tile's block sequence);
# factors are [R, t] float32 slices x[:, a t : (a + 1) t], already scaled per row.


def load_factors(ref, blocks, tile: int, scale, rows=slice(None), lead=()):
    """p factors [R, t] f32: ref[*lead, rows, a t : a t + t] * scale[:, None] for a in blocks."""
    return [ref[(*lead, rows, pl.ds(pl.multiple_of(a * tile, tile), tile))]
            .astype(jnp.float32) * scale[:, None] for a in blocks]


def tile_products(factors):
    """Prefix outer products: [x1], [x1 (x) x2] ([R, t^2]), ...; the last is the tile [R, t^p]."""
    prods = [factors[0]]
    for x in factors[1:]:
        prev = prods[-1]
        prods.append((prev[:, :, None] * x[:, None, :]).reshape(prev.shape[0], -1))
    return prods


def tile_factor_grads(dtile, factors, prods):
    """Backward of `tile_products`: d(tile) [R, t^p] -> [d factor_k [R, t] for k]."""
    grads = [None] * len(factors)
    for k in range(len(factors) - 1, 0, -1):
        prev, x = prods[k - 1], factors[k]
        d3 = dtile.reshape(prev.shape[0], prev.shape[1], x.shape[1])  # [R, t^k, t]
        grads[k] = jnp.sum(d3 * prev[:, :, None], axis=1)
        dtile = jnp.sum(d3 * x[:, None, :], axis=2)
    grads[0] = dtile
    return grads


def scatter_blocks(acc, grads, blocks):
    """acc [R, D/t, t] += each grads[k] [R, t] placed at block blocks[k] (masked broadcast)."""
    block_ids = jnp.arange(acc.shape[1], dtype=jnp.int32)[None, :, None]
    for g, a in zip(grads, blocks, strict=True):
        acc = acc + jnp.where(block_ids == a, g[:, None, :], 0.0)
    return acc


# ---------------------------------------------------------------------------------------
# phi^T tiles by matrix products, for the rows -> state kernel. Factor k
# of feature f of a tile is x[:, a_k t + u_k(f)] with u_k(f) the k-th base-t digit of f; it
# is read off a W-wide window of x (W = plan.window, aligned) by a product with a 0/1
# selection [tp, W]. The products are exact (one nonzero term) and land in the accumulator
# layout, where the elementwise product over k and the next MMA (phi^T as its register A
# operand) take them without layout changes.


def _window(a, plan: Plan):
    """(start, offset): the aligned window of block a and the block's offset inside it."""
    first = a * plan.tile
    start = jnp.bitwise_and(first, -plan.window)
    return start, first - start


def selection_t(k: int, offset, plan: Plan):
    """[tp, W] 0/1 in the matmul dtype: row f picks window column offset + u_k(f)."""
    t = plan.tile
    f = jnp.arange(plan.tile_features, dtype=jnp.int32)
    digit = jnp.bitwise_and(jnp.right_shift(f, (plan.p - 1 - k) * (t.bit_length() - 1)), t - 1)
    col = jnp.arange(plan.window, dtype=jnp.int32)
    return (digit[:, None] + offset == col[None, :]).astype(plan.mm_dtype)


def expand_factors_t(x_ref, blocks, plan: Plan, rows=slice(None), lead=()):
    """[E_k^T [tp, R] f32 for k < p]: factor k of every feature of the tile, exactly.

    x_ref[*lead, rows, :] holds the raw rows; the tile is prod_k E_k^T (times row scales).
    """
    out = []
    for k, a in enumerate(blocks):
        start, offset = _window(a, plan)
        xw = x_ref[(*lead, rows, pl.ds(pl.multiple_of(start, plan.window), plan.window))]
        out.append(dot(selection_t(k, offset, plan), xw, plan, trans_b=True))
    return out


def product(xs):
    out = xs[0]
    for x in xs[1:]:
        out = out * x
    return out
