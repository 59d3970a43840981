"""The chunked algorithm's state primitives on Hopper (p = 2, d = 64): the square layout,
stored in its upper layout.

update_state, prefix_sum and query_state of `ChunkPrimitives`, with states in the square
layout of `state_kernels` (F = d^2 features (i, j), weight 1). Two products carry all the
work, each a `jax.custom_vjp` whose forward and backward are the Mosaic GPU kernels:

* `state_of_rows(x, ls, a)`: S = sum_r phi(u_r) a_r^T, u = x e^ls, and z = sum_r phi(u_r)
  (update_state's states; in the backward of `rows_of_state` the state cotangent);
* `rows_of_state(x, ls, s, z)`: y_r = phi(u_r) S and den_r = phi(u_r) . z (query_state's
  numerator and normalizer; in the backward of `state_of_rows` the cotangent of a).

The normalizer rides on the kernels as a quadratic form (p = 2: phi(u) . z = u^T Z u with Z
the symmetric d x d block of z): `state_to_rows` returns den = e^(2 ls) x^T Z x beside y
and `row_gradients` adds 2 w Z x to the row gradient, Z in three bf16 parts (float32-
accurate products). The gram sums z = sum_r e^(2 ls_r) x_r x_r^T and the query side's z
cotangent are `gram.weighted_gram` (a Triton kernel: float32-accurate from the bf16 rows,
no float32 copy of them); the combine with the intra-chunk (o, den, m) is `chunked.combine`.
The states are stored in the upper layout (STORED_UPPER; `state_walks.upper_shapes`: the
entries (i, j), j >= 16 (i // 16), one array per 16 rows i, 62.5 % of the square bytes; z
alike), or square. The prefix sum is the portable tier's kernel (it sees only F; one launch
over the upper layout's four arrays), in place over N + 1 slots (`prefix_kernels`,
slotted): update_state writes chunk n's state at slot n + 1,
the sum leaves at slot n the state entering chunk n, which query_state reads, and the
backward's cotangents take the same slots, so the state backward holds two state-sized
buffers where an exclusive sum into a buffer of its own held three. The final state leaves
in the tile=1 symmetric layout every tier returns, each feature the mean of (i, j) and its
mirror (j, i): both hold the same sum, and the mean keeps the cotangent that comes back
symmetric.

Symmetry: every state and state cotangent here is symmetric in (i, j) (each is a sum of
u (x) u terms, or a linear map of such sums), so the row gradients use the symmetric form
d(phi(u) . M)/du = 2 M_(i, .) u (one transposed product instead of two). In the upper
layout a stored entry carries the cotangent of the square's entry (i, j), equal to its
mirror's, not their sum: the kernels' backward is then the same on both layouts, the
layout conversions' cotangents are each other's conversion (`stored`, `square`), and the
prefix sum counts an entry right of a diagonal block twice in g_last's cotangent.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from sympow.attention import chunked
from sympow.attention.config import AttentionConfig
from sympow.attention.mosaic_gpu import (
    blocks,
    column_forms,
    gram,
    state_kernels,
    state_references,
    state_sums,
    vjps,
)
from sympow.attention.pallas import vjps as portable
from sympow.attention.pallas.phi import to_symmetric_layout
from sympow.attention.pallas.plan import padded_width, prefix_plan
from sympow.attention.pallas.primitives import pad_to

F32, BF16 = jnp.float32, jnp.bfloat16
P = 2  # the square layout is phi for p = 2
# col's dtype in device memory: the kernels round it to bf16 where the tensor cores take
# it, so bf16 here is the same numbers at half the bytes (float32 until 2026-11-25).
COLUMNS_DTYPE = "bfloat16"
# Whether the kernels form col themselves from x^T and e^(2 ls) (`column_forms.Columns`):
# the same bf16 numbers without the [D, C] arrays XLA writes for them, one for the keys in
# the forward and one for the queries (kept from the forward for the backward); a float32
# COLUMNS_DTYPE is stored whatever this says. Off: on an H200 (T = 65,536, H = 8,
# 2026-11-28) it took XLA's work down 66 us and the peak 1.17 -> 1.11 GiB, but the
# kernels' work up 345 us (rows_to_state 779 -> 1,066 us for its two launches: a step's
# four col vectors formed in float32 triple its CUDA-core operand build), 4.55 -> 4.82 ms.
FORMED_COLUMNS = False
# The dtype of the chunked combine's two partial outputs, the intra-chunk attention's o
# (scaled by e^-m) and the states' y = phi(u) S: each a kernel's float32 sums rounded once
# where it stores them, then summed in float32 by `chunked.combine`. bfloat16 halves the
# bytes the kernels write, the combine reads (forward and backward) and the forward keeps
# live at its peak; float32 until 2026-11-28.
PARTIALS_DTYPE = "bfloat16"
# Whether y = phi(u) S and the update side's da read only the upper blocks of the symmetric
# states (`state_kernels.state_to_rows(upper=True)`: 62.5 % of the products), and with
# their short blocks packed into fewer ring steps (`packed`), each step's blocks in two
# halves whose operands are built while the other half's products run (`pipelined`).
UPPER_BLOCKS = True
PACKED = True
# Whether update_state stores the states in the upper layout (`state_walks.upper_shapes`:
# the rows j >= 16 (i // 16) of each S_i, 62.5 % of the square bytes; z alike), which the
# prefix sums, y and the backward then carry, the cotangents too (module docstring).
STORED_UPPER = True
# The prefix sum's feature block at most: its programs walk the chunks in turn, so fewer
# features a program means more programs walking at once (H200, T = 65,536, H = 8, upper
# layout: 352.9 / 272.1 / 264.8 us forward and backward at 64 / 32 / 16; docs/kernels.md).
PREFIX_FEATURE_BLOCK = 16
# ... and its Triton pipeline depth and warps (`PrefixPlan.stages`, `.warps`): each program
# holds one [bf, E] block of a chunk in flight a stage. 3 or 4 stages, 2 warps or both moved
# the chunked call by at most 0.02 ms, within its runs' spread (H200, 2026-11-28).
PREFIX_STAGES = 2
PREFIX_WARPS = 4


def _upper_options() -> dict[str, bool]:
    """The untransposed state_to_rows' keywords for UPPER_BLOCKS and PACKED, the steps in
    halves with the upper blocks (read at each call, so a test may set either)."""
    return {"upper": UPPER_BLOCKS, "packed": UPPER_BLOCKS and PACKED,
            "pipelined": UPPER_BLOCKS}


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


def kernel_columns(x, ls, xt=None):
    """col as the state kernels take it for rows x [B, H, N, C, d] and ls [B, H, N, C]:
    `column_forms.Columns` (xt = x^T, given or made here, and w = e^(2 ls)) with
    FORMED_COLUMNS and a bf16 COLUMNS_DTYPE, else the stored `columns`."""
    if not FORMED_COLUMNS or jnp.dtype(COLUMNS_DTYPE) != BF16:
        return columns(x, ls)
    return column_forms.Columns(jnp.swapaxes(x, -1, -2) if xt is None else xt,
                                 jnp.exp(P * ls))


def _kernel_width(e: int) -> int:
    return max(min(blocks.WIDTHS), padded_width(e))


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def state_of_rows(x, ls, a, kv_heads: int, upper: bool):
    """(S [B, Hk, N + 1, d^2, E] bf16, z [B, Hk, N + 1, d^2] float32) in slots: chunk n's
    sums over its rows and the group heads of phi(u) a^T and of phi(u) at slot n + 1, u =
    x e^ls, for x [B, Hx, N, C, d] bf16, ls [B, Hx, N, C] f32, a [B, Hx, N, C, E] bf16;
    upper: both in the upper layout instead (`stored`). Slot 0 is left for the prefix
    sum's P_0 (S's unwritten); the cotangents come back in the same slots (slot 0
    unread)."""
    return _state_of_rows_fwd(x, ls, a, kv_heads, upper)[0]


def _state_of_rows_fwd(x, ls, a, kv_heads, upper):
    n, xt = x.shape[2], jnp.swapaxes(x, -1, -2)
    s = state_sums.rows_to_state(xt, kernel_columns(x, ls, xt), a,
                                 kv_heads=kv_heads, slots=n + 1, slot_offset=1, upper=upper)
    z = jnp.pad(_weighted_gram(x, jnp.exp(P * ls), kv_heads), ((0, 0), (0, 0), (1, 0), (0, 0)))
    return (s, stored(z, upper, values=False)), (x, ls, a)


def _state_of_rows_bwd(kv_heads, upper, res, cotangents):
    x, ls, a = res
    ds, dz = cotangents
    ds = _each(lambda y: y.astype(BF16), ds)
    col = kernel_columns(x, ls)
    # da in a's dtype from the kernel: a float32 da (128 MiB at T = 65,536, H = 8) waited
    # for the attention backward's dv, alive at the call's peak
    da = state_kernels.state_to_rows(x, col, ds, transposed=False, slot_offset=1,
                                     out_dtype=a.dtype, **_upper_options())
    # z's cotangent enters the row gradients as the quadratic form's Z (w = e^(2 ls)).
    dz = square(dz, values=False) if upper else dz
    dx, dls = state_kernels.row_gradients(
        a, x, col, ds, slot_offset=1,
        normalizer=state_kernels.Normalizer(z_parts(dz[:, :, 1:]), jnp.exp(P * ls)))
    return dx, dls, da


state_of_rows.defvjp(_state_of_rows_fwd, _state_of_rows_bwd)


@jax.custom_vjp
def rows_of_state(x, ls, s, z):
    """(y [B, Hx, N, C, E] in PARTIALS_DTYPE = phi(u) S, den [B, Hx, N, C] float32 =
    phi(u) . z), u = x e^ls, with S [B, Hk, slots, d^2, E] bf16 and z [B, Hk, slots, d^2]
    float32 of kv head h // (Hx / Hk), or both in the upper layout (`stored`; the
    cotangents then too): chunk n reads slot n (slots >= N: the slotted prefix sum's N + 1,
    the last unread; its cotangent unwritten in S's, zero in z's)."""
    return _rows_of_state_fwd(x, ls, s, z)[0]


def _rows_of_state_fwd(x, ls, s, z):
    parts = z_parts(square(z, values=False) if _is_upper(s) else z)
    out = state_kernels.state_to_rows(
        x, kernel_columns(x, ls), s, transposed=False, **_upper_options(),
        out_dtype=PARTIALS_DTYPE,
        normalizer=state_kernels.Normalizer(parts, jnp.exp(P * ls)))
    return out, (x, ls, s, parts)


def _rows_of_state_bwd(res, cotangents):
    x, ls, s, parts = res
    dy, dden = cotangents
    dy = dy.astype(BF16)
    upper, (_, kv_heads, slots) = _is_upper(s), first_array(s).shape[:3]
    xt = jnp.swapaxes(x, -1, -2)
    col = kernel_columns(x, ls, xt)
    ds = state_sums.rows_to_state(xt, col, dy, kv_heads=kv_heads,
                                  slots=slots, upper=upper)
    weights = dden * jnp.exp(P * ls)  # d(phi(u) . z)/dz = phi(u): z's cotangent a gram sum
    dx, dls = state_kernels.row_gradients(
        dy, x, col, s, normalizer=state_kernels.Normalizer(parts, weights))
    dz = _weighted_gram(x, weights, kv_heads)
    dz = jnp.pad(dz, ((0, 0), (0, 0), (0, slots - dz.shape[2]), (0, 0)))
    return dx, dls, _each(lambda y: y.astype(BF16), ds), stored(dz, upper, values=False)


rows_of_state.defvjp(_rows_of_state_fwd, _rows_of_state_bwd)


def z_parts(z):
    """z [B, Hk, N, d^2] float32 (a symmetric d x d block per chunk) as the three bf16
    parts `state_kernels.Normalizer` takes, stacked [B, Hk, N, 3 d, d], smallest first."""
    blocks_ = z.reshape(*z.shape[:-1], state_kernels.DIM, state_kernels.DIM)
    return jnp.concatenate(blocks.bf16_parts(blocks_), axis=-2)


def _weighted_gram(x, weights, kv_heads: int):
    """[B, Hk, N, d^2] float32: sum over the rows r and the heads of a group of
    w_r x_r x_r^T (= sum_r phi(u_r) for w = e^(2 ls)), from the bf16 rows x [B, Hx, N, C, d]
    (`gram.weighted_gram`)."""
    g = gram.weighted_gram(x, weights, kv_heads=kv_heads)
    return g.reshape(*g.shape[:3], -1)


def update_state(k, v, tail):
    """`ChunkPrimitives.update_state` (p = 2), in N + 1 slots (`state_of_rows`), square or
    (STORED_UPPER) in the upper layout: `prefix_sum` sums them in place, `query_state`
    reads its output."""
    e = v.shape[-1]
    s, z = state_of_rows(k, tail / P, pad_to(v, -1, _kernel_width(e)), k.shape[1],
                         STORED_UPPER)
    return _each(lambda y: y[..., :e], s), z


def holds(s, p: int) -> bool:
    """Whether a state is one `update_state` made: the upper layout's arrays, or F = d^2
    features (no tier's other layout has d^2 features)."""
    return _is_upper(s) or is_square(s.shape[-2], p)


@functools.lru_cache(maxsize=4)
def _final_gather(d: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(rows, mirrors, scale): tile=1 feature alpha = (i, j) is the mean of square rows
    i d + j and j d + i, times scale."""
    rows, scale = to_symmetric_layout(d, P, d)
    mirrors = (rows % d) * d + rows // d
    return rows, mirrors, scale


def prefix_sum(config: AttentionConfig, s, z, g_last):
    """`ChunkPrimitives.prefix_sum` of `update_state`'s states: the portable kernel (in
    place over N + 1 slots; exclusive, into a buffer of its own, for N), in one launch over
    the arrays of the upper layout, each entry weighted in g_last's cotangent by the
    entries it stands for (`state_references.upper_weights`); the final state gathered to the
    tile=1 layout."""
    upper, e = _is_upper(s), first_array(s).shape[-1]
    slotted = first_array(s).shape[2] == g_last.shape[-1] + 1
    s_groups, z_groups = (s, z) if upper else ((s,), (z,))
    # the kernel's [.., F, E] and [.., F] (B, Hk, slots lead)
    flat_s = tuple(pad_to(y.reshape(*y.shape[:3], -1, e), -1, padded_width(e)) for y in s_groups)
    flat_z = tuple(y.reshape(*y.shape[:3], -1) for y in z_groups)
    # an entry's weight in g_last's cotangent: the square entries it stands for, its weight
    # in the upper state_to_rows (1 in a diagonal block, 2 right of one)
    weights = (tuple(y.reshape(-1) for y in state_references.upper_arrays(
        state_references.upper_weights()[:, None])) if upper else None)
    features = math.gcd(PREFIX_FEATURE_BLOCK, *(y.shape[-2] for y in flat_s))  # divides each F
    plan = dataclasses.replace(prefix_plan(features, config.interpret, slotted),
                               stages=PREFIX_STAGES, warps=PREFIX_WARPS)
    s_in, z_in, s_fin, z_fin = portable.prefix_sum(plan, flat_s, flat_z, g_last, weights)
    s_in = tuple(y[..., :e].reshape(x.shape) for y, x in zip(s_in, s_groups, strict=True))
    z_in = tuple(y.reshape(x.shape) for y, x in zip(z_in, z_groups, strict=True))
    s_fin = tuple(y[..., :e].reshape(*y.shape[:2], *x.shape[3:])
                  for y, x in zip(s_fin, s_groups, strict=True))
    z_fin = tuple(y.reshape(*y.shape[:2], *x.shape[3:])
                  for y, x in zip(z_fin, z_groups, strict=True))
    if upper:
        s_fin, z_fin = square(s_fin, values=True), square(z_fin, values=False)
    else:
        s_in, z_in, s_fin, z_fin = s_in[0], z_in[0], s_fin[0], z_fin[0]
    rows, mirrors, scale = _final_gather(state_kernels.DIM)
    s_fin = (s_fin[..., rows, :] + s_fin[..., mirrors, :]) * (0.5 * scale[:, None])
    z_fin = (z_fin[..., rows] + z_fin[..., mirrors]) * (0.5 * scale)
    return s_in, z_in, s_fin, z_fin


def query_state(q, s_in, z_in, g, o, den, m):
    """`ChunkPrimitives.query_state` of `update_state`'s states (p = 2)."""
    hq, hk, e = q.shape[1], g.shape[1], first_array(s_in).shape[-1]
    ls = jnp.repeat(g / P, hq // hk, axis=1)  # per query head
    num, inter_den = rows_of_state(q, ls, _each(lambda y: pad_to(y, -1, _kernel_width(e)), s_in),
                                   z_in)
    return chunked.combine(o, den, m, num[..., :e], inter_den)


def stored(square_state, upper: bool, *, values: bool):
    """A symmetric state of the square layout, S [..., d^2, E] (values) or z [..., d^2],
    as the tier stores it: itself, or (upper) the arrays of the upper layout
    (`state_references.upper_arrays`: [..., 16, d - 16 b(, E)] for b < d / 16). Its
    cotangent is the tier's (`square`)."""
    if not upper:
        return square_state
    if values:
        return _upper_arrays(square_state)
    return tuple(y[..., 0] for y in _upper_arrays(square_state[..., None]))


def square(arrays, *, values: bool):
    """The square layout of a symmetric state stored in the upper layout (`stored`). The
    cotangents of both conversions are the tier's: a stored entry's is that of the
    symmetric square's entry (i, j), equal to its mirror's (not their sum), as every
    state cotangent here is, so each conversion's cotangent is the other conversion of
    its output's (made symmetric)."""
    if values:
        return _square_of_upper(tuple(arrays))
    return _square_of_upper(tuple(y[..., None] for y in arrays))[..., 0]


def _with_cotangent(fn, cotangent_fn):
    """fn (linear, one argument) as a custom_vjp whose cotangent map is cotangent_fn."""
    wrapped = jax.custom_vjp(fn)
    wrapped.defvjp(lambda x: (fn(x), None), lambda _, ct: (cotangent_fn(ct),))
    return wrapped


def _upper_of_symmetric(square_state):
    """The upper arrays of [..., d^2, E] made symmetric (the mean with its mirror)."""
    d = state_kernels.DIM
    blocks_ = square_state.reshape(*square_state.shape[:-2], d, d, square_state.shape[-1])
    mean = 0.5 * (blocks_ + jnp.swapaxes(blocks_, -2, -3))
    return state_references.upper_arrays(mean.reshape(square_state.shape))


_upper_arrays = _with_cotangent(state_references.upper_arrays,
                                state_references.square_of_upper)
_square_of_upper = _with_cotangent(state_references.square_of_upper, _upper_of_symmetric)


def _is_upper(s) -> bool:
    return isinstance(s, (tuple, list))


def first_array(s):
    """The state's first array (its only one in the square layout)."""
    return s[0] if _is_upper(s) else s


def _each(fn, s):
    """fn over a state's arrays (one, or the upper layout's tuple)."""
    return tuple(fn(y) for y in s) if _is_upper(s) else fn(s)
