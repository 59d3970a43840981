"""The chunked algorithm's state primitives on Hopper (p = 2, d = 64): the square layout.

update_state, prefix_sum and query_state of `ChunkPrimitives`, with states in the square
layout of `state_kernels` (F = d^2 features (i, j), weight 1). Two products carry all the
work, each a `jax.custom_vjp` whose forward and backward are the Mosaic GPU kernels:

* `state_of_rows(x, ls, a)`: S = sum_r phi(u_r) a_r^T, u = x e^ls (update_state's S, and in
  the backward of `rows_of_state` the state cotangent);
* `rows_of_state(x, ls, s)`: y_r = phi(u_r) S (query_state's numerator, and in the backward
  of `state_of_rows` the cotangent of a).

The normalizer states z [B, Hk, N, d^2] and the normalizer phi(u) . z are float32 XLA
(a [C, d] x [d, d] product per chunk, on the tensor cores as bf16 parts:
`NORMALIZER_ALGORITHM`), differentiated by XLA; the combine with the
intra-chunk (o, den, m) is `chunked.combine`. The prefix sum is the portable tier's kernel
(it sees only F). The final state leaves in the tile=1 symmetric layout every tier returns,
each feature the mean of (i, j) and its mirror (j, i): both hold the same sum, and the mean
keeps the cotangent that comes back symmetric.

Symmetry: every state and state cotangent here is symmetric in (i, j) (each is a sum of
u (x) u terms, or a linear map of such sums), so the row gradients use the symmetric form
d(phi(u) . M)/du = 2 M_(i, .) u (one transposed product instead of two).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from sympow.attention import chunked
from sympow.attention.config import AttentionConfig
from sympow.attention.mosaic_gpu import blocks, state_kernels, vjps
from sympow.attention.pallas import vjps as portable
from sympow.attention.pallas.phi import to_symmetric_layout
from sympow.attention.pallas.plan import padded_width, prefix_plan
from sympow.attention.pallas.primitives import pad_to

F32, BF16 = jnp.float32, jnp.bfloat16
P = 2  # the square layout is phi for p = 2
# The normalizer products' algorithm (a `lax.DotAlgorithmPreset` name, or a
# `lax.Precision` one): each float32 operand as three bf16 parts, six tensor-core products,
# float32-accurate. XLA runs Precision.HIGHEST as float32 SIMT GEMMs: 0.88 ms of the 8.2
# busy ms of the T = 65,536, H = 8 call on an H100 (docs/kernels.md).
NORMALIZER_ALGORITHM = "BF16_BF16_F32_X6"
# col's dtype in device memory: the kernels round it to bf16 where the tensor cores take
# it, so bf16 here is the same numbers at half the bytes (float32 until 2026-11-25).
COLUMNS_DTYPE = "bfloat16"


def unsupported(config: AttentionConfig, d: int, e: int, c: int, dtype) -> str | None:
    """Why the Hopper state kernels cannot run a chunked problem, or None."""
    if config.interpret:
        return "the interpreter (the Mosaic GPU kernels run on a Hopper GPU only)"
    if config.p != P:
        return f"p={config.p} (the square layout is p = {P})"
    if jnp.dtype(dtype) != BF16:
        return f"dtype {jnp.dtype(dtype).name} (supported: bfloat16)"
    if d != state_kernels.DIM or e > max(blocks.WIDTHS):
        return f"d={d}, e={e} (supported: d = {state_kernels.DIM}, e <= {max(blocks.WIDTHS)})"
    if c % blocks.TILE_ROWS:
        return f"chunk {c} (supported: multiples of {blocks.TILE_ROWS})"
    return vjps.not_hopper()


def square_layout(p: int, d: int) -> bool:
    """Whether the tier's state kernels (the square layout) are made for power p and key
    width d (they still need `unsupported` to find nothing against the call)."""
    return (p, d) == (P, state_kernels.DIM)


def is_square(f: int, p: int) -> bool:
    """Whether F features are the square layout (no tier's other layout has d^2 features)."""
    return square_layout(p, state_kernels.DIM) and f == state_kernels.DIM ** 2


def columns(x, ls):
    """col = x^T e^(2 ls) [B, H, N, d, C] in COLUMNS_DTYPE: u_ri u_rj = col_ir x_rj."""
    col = jnp.swapaxes(x.astype(F32) * jnp.exp(P * ls)[..., None], -1, -2)
    return col.astype(COLUMNS_DTYPE)


def normalizer_precision():
    """NORMALIZER_ALGORITHM as the `precision` of an einsum."""
    preset = getattr(lax.DotAlgorithmPreset, NORMALIZER_ALGORITHM, None)
    return preset if preset is not None else lax.Precision[NORMALIZER_ALGORITHM]


def _kernel_width(e: int) -> int:
    return max(min(blocks.WIDTHS), padded_width(e))


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def state_of_rows(x, ls, a, kv_heads: int):
    """S [B, Hk, N, d^2, E] bf16 = sum over rows and group heads of phi(x e^ls) a^T, for
    x [B, Hx, N, C, d] bf16, ls [B, Hx, N, C] f32, a [B, Hx, N, C, E] bf16."""
    return _state_of_rows_fwd(x, ls, a, kv_heads)[0]


def _state_of_rows_fwd(x, ls, a, kv_heads):
    s = state_kernels.rows_to_state(jnp.swapaxes(x, -1, -2), columns(x, ls), a,
                                    kv_heads=kv_heads)
    return s, (x, ls, a)


def _row_gradients(x, ls, rows, s):
    """(dx, dls) of sum_r phi(u_r) . (S rows_r): dx = 2 sum_j col_jr rows_r S_j^T."""
    return state_kernels.row_gradients(rows, x, columns(x, ls), s)


def _state_of_rows_bwd(kv_heads, res, ds):
    x, ls, a = res
    ds = ds.astype(BF16)
    da = state_kernels.state_to_rows(x, columns(x, ls), ds, transposed=False)
    return (*_row_gradients(x, ls, a, ds), da.astype(a.dtype))


state_of_rows.defvjp(_state_of_rows_fwd, _state_of_rows_bwd)


@jax.custom_vjp
def rows_of_state(x, ls, s):
    """y [B, Hx, N, C, E] float32 = phi(x e^ls) S, S of kv head h // (Hx / Hk)."""
    return _rows_of_state_fwd(x, ls, s)[0]


def _rows_of_state_fwd(x, ls, s):
    return state_kernels.state_to_rows(x, columns(x, ls), s, transposed=False), (x, ls, s)


def _rows_of_state_bwd(res, dy):
    x, ls, s = res
    dy = dy.astype(BF16)
    ds = state_kernels.rows_to_state(jnp.swapaxes(x, -1, -2), columns(x, ls), dy,
                                     kv_heads=s.shape[1])
    return (*_row_gradients(x, ls, dy, s), ds.astype(s.dtype))


rows_of_state.defvjp(_rows_of_state_fwd, _rows_of_state_bwd)


# The normalizer products take the bf16 rows themselves (exact in float32) with the scale
# e^(2 ls) outside the product, not u = x e^ls: XLA then reads bf16 rows already in device
# memory (on an H100 the x^T that rows_to_state reads), where it wrote a float32 u beside
# col, in col's transposed layout, and ran every product and gradient sum on that copy.

def _normalizer_state(k, ls):
    """z [B, Hk, N, d^2] float32 = sum_r phi(k_r e^ls_r) = sum_r e^(2 ls_r) k_r k_r^T."""
    x = k.astype(F32)
    z = jnp.einsum("bhnci,bhncj->bhnij", x * jnp.exp(P * ls)[..., None], x,
                   precision=normalizer_precision())
    return z.reshape(*z.shape[:3], -1)


def update_state(k, v, tail):
    """`ChunkPrimitives.update_state` in the square layout (p = 2)."""
    e = v.shape[-1]
    ls = tail / P
    s = state_of_rows(k, ls, pad_to(v, -1, _kernel_width(e)), k.shape[1])
    return s[..., :e], _normalizer_state(k, ls)


@functools.lru_cache(maxsize=4)
def _final_gather(d: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(rows, mirrors, scale): tile=1 feature alpha = (i, j) is the mean of square rows
    i d + j and j d + i, times scale."""
    rows, scale = to_symmetric_layout(d, P, d)
    mirrors = (rows % d) * d + rows // d
    return rows, mirrors, scale


def prefix_sum(config: AttentionConfig, s, z, g_last):
    """`ChunkPrimitives.prefix_sum` in the square layout: the portable kernel, the final
    state gathered to the tile=1 layout."""
    f, e = s.shape[-2:]
    s_in, z_in, s_fin, z_fin = portable.prefix_sum(
        prefix_plan(f, config.interpret), pad_to(s, -1, padded_width(e)), z, g_last)
    rows, mirrors, scale = _final_gather(state_kernels.DIM)
    s_fin = (s_fin[..., rows, :e] + s_fin[..., mirrors, :e]) * (0.5 * scale[:, None])
    z_fin = (z_fin[..., rows] + z_fin[..., mirrors]) * (0.5 * scale)
    return s_in[..., :e], z_in, s_fin, z_fin


def query_state(q, s_in, z_in, g, o, den, m):
    """`ChunkPrimitives.query_state` in the square layout (p = 2)."""
    b, hq, n, c, d = q.shape
    hk, e = g.shape[1], s_in.shape[-1]
    per_query_head = lambda x: jnp.repeat(x, hq // hk, axis=1)  # noqa: E731
    ls = per_query_head(g / P)
    num = rows_of_state(q, ls, pad_to(s_in, -1, _kernel_width(e)))[..., :e]
    x = q.astype(F32)
    xz = jnp.einsum("bhnci,bhnij->bhncj", x, per_query_head(z_in.reshape(b, hk, n, d, d)),
                    precision=normalizer_precision())  # phi(u) . z = e^(2 ls) x^T z x
    return chunked.combine(o, den, m, num, jnp.exp(P * ls) * jnp.sum(xz * x, axis=-1))
