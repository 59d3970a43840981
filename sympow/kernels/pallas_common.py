"""Shared pieces of the portable Pallas tier: the static plan, the launcher, dots, phi tiles.

Every kernel of `pallas_attention` and `pallas_state` is launched through `launch`, which
selects the Triton lowering on GPU (`interpret=True` elsewhere) and silences exactly the
Triton deprecation warning of jax 0.11+. The phi helpers build one tile of the tiled
symmetric power embedding (DESIGN.md section 2) from p block slices of a row block, either
by outer products in registers (`tile_products`, the state -> rows kernels) or by exact
products against 0/1 selections (`expand_factors_t`, the rows -> state kernel): a tile of
width t holds the t^p products x[a_1 t + u_1] ... x[a_p t + u_p] for a
fixed non-decreasing block sequence (a_1 <= ... <= a_p), in the feature order of
`sympow.embedding.embedding_tables(d, p, t)`, so the kernel layout of F is that table's.
"""

from __future__ import annotations

import dataclasses
import functools
import warnings

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from sympow.embedding import embedding_tables, expanded_dim

# The one warning we silence: jax >= 0.11 emits it (DeprecationWarning) each time a
# pallas_call is lowered through Triton. Lowering happens when the caller's jit compiles,
# after our functions returned, so a filter around our call site cannot see it: the filter
# is process-wide, matching only this message and category, and (re)installed by each
# launch of a Triton kernel (a caller's warnings.catch_warnings may have dropped it).
TRITON_DEPRECATION = (r"The Pallas Triton backend is deprecated and will be removed in"
                      r" a future JAX version")


def ignore_triton_deprecation() -> None:
    for action, message, category, *_ in warnings.filters:
        if (action == "ignore" and category is DeprecationWarning
                and getattr(message, "pattern", None) == TRITON_DEPRECATION):
            return
    warnings.filterwarnings("ignore", message=TRITON_DEPRECATION, category=DeprecationWarning)


@dataclasses.dataclass(frozen=True)
class Plan:
    """Static, hashable settings of one problem shape (built by `pallas.make_plan`).

    p, d, e, c: power, key dim, value dim, chunk. dtype: input dtype name ('bfloat16' or
    'float32'). tile: width t of the tiled embedding (F = n_tiles * t^p).
    attn_bq / attn_bk: query / key block of the intra-chunk attention kernels.
    state_br / state_be: row block and value-column block of the rows -> state kernel;
    query_br / query_split: row block of the phi(x) S kernels (query_state forward, the
    update_state backward's dV), and the number of parts their phi tiles are built in (the
    first factor's slice split: [query_br, tp / split]).
    grad_br: row block of the kernels back through phi (dQ, dK).
    warps_*: Triton num_warps per kernel family; stages: num_stages of the rows -> state
    kernel; attn_stages / rows_stages: of the attention and state -> rows kernels.
    interpret: run in the Pallas interpreter (off GPU).
    """

    p: int
    d: int
    e: int
    c: int
    dtype: str
    tile: int
    attn_bq: int
    attn_bk: int
    state_br: int
    query_br: int
    query_split: int
    grad_br: int
    state_be: int
    warps_attn: int
    warps_state: int
    stages: int
    attn_stages: int
    rows_stages: int
    interpret: bool

    @property
    def tile_features(self) -> int:
        return self.tile ** self.p

    @property
    def n_tiles(self) -> int:
        return expanded_dim(self.d, self.p, self.tile) // self.tile_features

    @property
    def features(self) -> int:
        return expanded_dim(self.d, self.p, self.tile)

    @property
    def window(self) -> int:
        """Width of the x slice one factor of a tile is selected from (an MMA's K >= 16)."""
        return max(self.tile, 16)

    @property
    def mm_dtype(self):
        """Operand dtype of the matrix products (accumulation is always float32)."""
        return jnp.dtype(self.dtype)

    @property
    def precision(self):
        # float32 operands: ask for true fp32 products (Triton's default would be tf32).
        return jax.lax.Precision.HIGHEST if self.dtype == "float32" else None


@dataclasses.dataclass(frozen=True)
class PrefixPlan:
    """Static settings of the prefix-sum kernels: feature block bf, warps, stages, interpret."""

    bf: int
    warps: int
    stages: int
    interpret: bool


def launch(kernel, *, plan, name: str, grid, in_specs, out_specs, out_shape, warps: int,
           stages: int | None = None):
    """pl.pallas_call with the tier's conventions (Triton on GPU, interpreter elsewhere).

    plan: any object with `interpret` and `stages` (a Plan or a PrefixPlan); `stages`
    overrides plan.stages.
    """
    interpret, params = plan.interpret, None
    if not interpret:
        from jax.experimental.pallas import triton as plt

        ignore_triton_deprecation()
        params = plt.CompilerParams(num_warps=warps, num_stages=stages or plan.stages)
    return pl.pallas_call(kernel, out_shape=out_shape, grid=grid, in_specs=in_specs,
                          out_specs=out_specs, interpret=interpret, name=name,
                          compiler_params=params)


def idiv(a, b):
    """a // b for non-negative traced ints (lax.div: jnp's floor division does not lower)."""
    a = jnp.asarray(a)
    return jax.lax.div(a, jnp.asarray(b, a.dtype))


def irem(a, b):
    """a % b for non-negative traced ints."""
    a = jnp.asarray(a)
    return jax.lax.rem(a, jnp.asarray(b, a.dtype))


def split_heads(bh, heads: int):
    """(batch, head) of a grid index over batch * heads."""
    return idiv(bh, heads), irem(bh, heads)


def dot(a, b, plan: Plan, *, trans_a: bool = False, trans_b: bool = False):
    """a @ b in float32 with operands cast to the plan's matmul dtype; optional transposes."""
    dims = (((0 if trans_a else 1,), (1 if trans_b else 0,)), ((), ()))
    return jax.lax.dot_general(a.astype(plan.mm_dtype), b.astype(plan.mm_dtype), dims,
                               precision=plan.precision, preferred_element_type=jnp.float32)


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
