"""The residual add and the LayerNorm after it, in one kernel each way.

A pre-LN block adds each sublayer's output to the residual stream and normalizes the sum for
the next sublayer. XLA makes that three passes over the [N, C] rows forward (the add, the
statistics, the normalization) and two backward (row sums, then dx with the scale's and
shift's column sums): 10.7 ms of a GPT-2 small step at 65,536 tokens on an H100, for 24
LayerNorms, while the rows are read and written once by bandwidth (docs/kernels.md). Here a
program holds its rows in registers:

    forward:   s = x + delta + bias              float32 sum, rounded once to x's dtype
               y = (s - mean) (rstd scale) + shift    mean = E[s], var = max(E[s^2] - mean^2,
                                                  0), rstd = rsqrt(var + eps): nnx.LayerNorm
    backward:  xhat = (s - mean) rstd,  g = dy scale
               ds' = ds + rstd (g - E[g] - xhat E[g xhat])     (ds: s's own cotangent)
               dx = ddelta = ds',  dbias = sum ds',  dscale = sum dy xhat,  dshift = sum dy

delta is a sublayer's product without its bias (`linear.product`) and bias that linear's: the
sum nnx.Linear and the block did in two bf16 roundings is one float32 sum here. The backward
recomputes mean and rstd from s, which it reads anyway; the three column sums leave as one
float32 row per program, which XLA adds. Columns go through the kernel in tiles of the widest
power of two <= 256 dividing C (Triton's tensors are powers of two; C = 768 is 3 x 256).

`add_layer_norm(...)` is the function; `add_layer_norm_reference` is its specification (and
the path off a GPU, or for shapes the kernel does not take). On GPU the kernels lower through
Triton; elsewhere they run in the Pallas interpreter (CPU tests).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jaxtyping import Array, Float

from sympow.attention.pallas.launch import launch
from sympow.numerics import compute_dtype

__all__ = ["IMPLS", "TILES", "Tiles", "add_layer_norm", "add_layer_norm_reference", "residual_sum",
           "unsupported"]

F32 = jnp.float32
IMPLS = (None, "xla", "pallas")
MAX_TILE = 256


class Tiles(NamedTuple):
    """Launch shape: a program normalizes `rows` rows at a time (in registers), `chunks`
    times (the backward's column sums accumulate across them), with `warps` warps."""

    rows: int = 16
    chunks: int = 1
    warps: int = 8


TILES = Tiles()


class _Plan:
    """What `launch` reads: the interpreter or Triton, and the pipeline depth."""

    def __init__(self, interpret: bool):
        self.interpret, self.stages = interpret, 1


def unsupported(x: Array, delta: Array) -> str | None:
    """Why the kernels cannot take rows x [..., C] and delta, or None."""
    c = x.shape[-1]
    if c % 16:
        return f"C = {c} is not a multiple of 16 (the kernels' column tiles)"
    for name, a in (("x", x), ("delta", delta)):
        if a.dtype not in (jnp.bfloat16, jnp.float32):
            return f"{name} dtype {a.dtype} (supported: bfloat16, float32)"
    return None


def residual_sum(x: Float[Array, "... C"], delta: Float[Array, "... C"],
                 bias: Float[Array, " C"]) -> Float[Array, "... C"]:
    """x + delta + bias summed in at least float32, rounded once to x's dtype: the residual
    stream after a sublayer whose output is delta + bias."""
    ct = compute_dtype(x)
    return (x.astype(ct) + delta.astype(ct) + bias.astype(ct)).astype(x.dtype)


def add_layer_norm_reference(x: Float[Array, "... C"], delta: Float[Array, "... C"],
                             bias: Float[Array, " C"], scale: Float[Array, " C"],
                             shift: Float[Array, " C"], *, eps: float
                             ) -> tuple[Float[Array, "... C"], Float[Array, "... C"]]:
    """The specification: (s, y) with s = x + delta + bias summed in at least float32 and
    rounded once to x's dtype, y = nnx.LayerNorm(s) (statistics in at least float32, fast
    variance clipped at 0) in x's dtype."""
    ct = compute_dtype(x)
    s = residual_sum(x, delta, bias)
    sf = s.astype(ct)
    mean = jnp.mean(sf, axis=-1, keepdims=True)
    var = jnp.maximum(0.0, jnp.mean(sf * sf, axis=-1, keepdims=True) - mean * mean)
    y = (sf - mean) * (jax.lax.rsqrt(var + eps) * scale.astype(ct)) + shift.astype(ct)
    return s, y.astype(x.dtype)


def add_layer_norm(x: Float[Array, "... C"], delta: Float[Array, "... C"],
                   bias: Float[Array, " C"], scale: Float[Array, " C"],
                   shift: Float[Array, " C"], *, eps: float, impl: str | None = None,
                   interpret: bool | None = None, tiles: Tiles = TILES
                   ) -> tuple[Float[Array, "... C"], Float[Array, "... C"]]:
    """(s, y): the residual stream after adding delta + bias to x, and its LayerNorm
    (`add_layer_norm_reference`'s numbers). Differentiable in every array.

    x: [..., C] the residual stream, bfloat16 or float32 for the kernels; delta: x's shape
    (any float dtype; its cotangent in it); bias, scale, shift: [C] (the linear's bias and the
    LayerNorm's; float32 in the kernels, cotangents in their dtypes). impl: 'pallas' (the
    kernels; ValueError for shapes `unsupported` names), 'xla' (the specification, which XLA
    fuses as it can) or None: 'pallas' on a GPU where the shapes allow, else 'xla'.
    interpret: None = the Pallas interpreter unless the default backend is a GPU. tiles: the
    kernels' launch shape (rows a power of two >= 1).
    """
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got impl={impl!r}")
    c = x.shape[-1]
    if delta.shape != x.shape:
        raise ValueError(f"delta must have x's shape {x.shape}, got {delta.shape}")
    for name, value in (("bias", bias), ("scale", scale), ("shift", shift)):
        if value.shape != (c,):
            raise ValueError(f"{name} must be [C] = [{c}], got {name}.shape = {value.shape}")
    reason = unsupported(x, delta)
    if impl == "pallas" and reason is not None:
        raise ValueError(f"add_layer_norm impl='pallas': {reason}")
    if impl is None:
        impl = "pallas" if reason is None and jax.default_backend() == "gpu" else "xla"
    if impl == "xla":
        return add_layer_norm_reference(x, delta, bias, scale, shift, eps=eps)
    if interpret is None:
        interpret = jax.default_backend() != "gpu"
    # the cotangents' dtypes travel with the setup (a custom_vjp residual must be an array)
    setup = (float(eps), bool(interpret), Tiles(*tiles), delta.dtype, bias.dtype, shift.dtype)
    s, y = _add_layer_norm(setup, x.reshape(-1, c), delta.reshape(-1, c), bias, scale, shift)
    return s.reshape(x.shape), y.reshape(x.shape)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _add_layer_norm(setup, x, delta, bias, scale, shift):
    return _forward(setup, x, delta, bias, scale, shift)


def _add_layer_norm_fwd(setup, x, delta, bias, scale, shift):
    s, y = _forward(setup, x, delta, bias, scale, shift)
    return (s, y), (s, scale)


def _add_layer_norm_bwd(setup, res, cotangents):
    s, scale = res
    delta_dtype, bias_dtype, shift_dtype = setup[3:]
    ds, dy = cotangents
    dsum, dscale, dshift, dbias = _backward(setup, s, dy.astype(s.dtype), ds.astype(s.dtype),
                                            scale)
    return (dsum, dsum.astype(delta_dtype), dbias.astype(bias_dtype),
            dscale.astype(scale.dtype), dshift.astype(shift_dtype))


_add_layer_norm.defvjp(_add_layer_norm_fwd, _add_layer_norm_bwd)


def _tile(c: int) -> int:
    return min(MAX_TILE, c & -c)


def _padded(a, rows: int):
    return jnp.pad(a, ((0, rows - a.shape[0]), (0, 0))) if rows != a.shape[0] else a


def _grid(n: int, tiles: Tiles) -> tuple[int, int]:
    """(programs, padded rows): each program takes chunks x rows rows."""
    block = tiles.chunks * tiles.rows
    programs = -(-n // block)
    return programs, programs * block


def _specs(c: int, tiles: Tiles):
    block = tiles.chunks * tiles.rows
    rows = pl.BlockSpec((block, c), lambda i: (i, 0))
    vector = pl.BlockSpec((1, c), lambda i: (0, 0))
    return rows, vector


def _forward(setup, x, delta, bias, scale, shift):
    eps, interpret, tiles = setup[:3]
    n, c = x.shape
    programs, padded = _grid(n, tiles)
    rows, vector = _specs(c, tiles)
    kernel = functools.partial(_forward_kernel, eps=eps, width=_tile(c), tiles=tiles)
    shape = jax.ShapeDtypeStruct((padded, c), x.dtype)
    s, y = launch(kernel, plan=_Plan(interpret), name="sympow_add_layer_norm_forward",
                  grid=(programs,), in_specs=[rows, rows, vector, vector, vector],
                  out_specs=[rows, rows], out_shape=[shape, shape], warps=tiles.warps)(
        _padded(x, padded), _padded(delta, padded),
        *(v.astype(F32).reshape(1, c) for v in (bias, scale, shift)))
    return s[:n], y[:n]


def _backward(setup, s, dy, ds, scale):
    eps, interpret, tiles = setup[:3]
    n, c = s.shape
    programs, padded = _grid(n, tiles)
    rows, vector = _specs(c, tiles)
    kernel = functools.partial(_backward_kernel, eps=eps, width=_tile(c), tiles=tiles)
    sums = pl.BlockSpec((None, 3, c), lambda i: (i, 0, 0))
    dsum, partial = launch(
        kernel, plan=_Plan(interpret), name="sympow_add_layer_norm_backward",
        grid=(programs,), in_specs=[rows, rows, rows, vector], out_specs=[rows, sums],
        out_shape=[jax.ShapeDtypeStruct((padded, c), s.dtype),
                   jax.ShapeDtypeStruct((programs, 3, c), F32)], warps=tiles.warps)(
        *(_padded(a, padded) for a in (s, dy, ds)), scale.astype(F32).reshape(1, c))
    dscale, dshift, dbias = jnp.sum(partial, axis=0)  # [C] each
    return dsum[:n], dscale, dshift, dbias


def _row_stats(tiles, c: int, eps: float):
    """(mean, rstd) [R, 1] of rows given as float32 column tiles [R, w]."""
    total = sum(jnp.sum(t, axis=1, keepdims=True) for t in tiles)
    squares = sum(jnp.sum(t * t, axis=1, keepdims=True) for t in tiles)
    mean = total / c
    return mean, jax.lax.rsqrt(jnp.maximum(squares / c - mean * mean, 0.0) + eps)


def _chunks(body, init, tiles: Tiles):
    if tiles.chunks == 1:
        return body(0, init)
    return jax.lax.fori_loop(0, tiles.chunks, body, init)


def _chunk_rows(i, tiles: Tiles):
    if tiles.chunks == 1:
        return pl.ds(0, tiles.rows)
    return pl.ds(pl.multiple_of(i * tiles.rows, tiles.rows), tiles.rows)


def _forward_kernel(x_ref, d_ref, b_ref, scale_ref, shift_ref, s_ref, y_ref, *, eps, width,
                    tiles):
    c = x_ref.shape[1]
    columns = [pl.ds(j * width, width) for j in range(c // width)]

    def chunk(i, carry):
        r = _chunk_rows(i, tiles)
        sums = []
        for cols in columns:  # s = x + delta + bias in float32, rounded once
            s = (x_ref[r, cols].astype(F32) + d_ref[r, cols].astype(F32)
                 + b_ref[:, cols]).astype(s_ref.dtype)
            s_ref[r, cols] = s
            sums.append(s.astype(F32))
        mean, rstd = _row_stats(sums, c, eps)
        for cols, s in zip(columns, sums, strict=True):
            y = (s - mean) * (rstd * scale_ref[:, cols]) + shift_ref[:, cols]
            y_ref[r, cols] = y.astype(y_ref.dtype)
        return carry

    _chunks(chunk, 0, tiles)


def _backward_kernel(s_ref, dy_ref, ds_ref, scale_ref, dsum_ref, sums_ref, *, eps, width,
                     tiles):
    c = s_ref.shape[1]
    columns = [pl.ds(j * width, width) for j in range(c // width)]

    def chunk(i, sums):
        r = _chunk_rows(i, tiles)
        s = [s_ref[r, cols].astype(F32) for cols in columns]
        mean, rstd = _row_stats(s, c, eps)
        xhat = [(t - mean) * rstd for t in s]
        dy = [dy_ref[r, cols].astype(F32) for cols in columns]
        g = [t * scale_ref[:, cols] for t, cols in zip(dy, columns, strict=True)]
        g_mean = sum(jnp.sum(t, axis=1, keepdims=True) for t in g) / c  # [R, 1]
        gx_mean = sum(jnp.sum(a * b, axis=1, keepdims=True)
                      for a, b in zip(g, xhat, strict=True)) / c
        new = []
        for j, cols in enumerate(columns):
            dsum = ds_ref[r, cols].astype(F32) + rstd * (g[j] - g_mean - xhat[j] * gx_mean)
            dsum = dsum.astype(dsum_ref.dtype)
            dsum_ref[r, cols] = dsum
            dscale, dshift, dbias = sums[j]
            new.append((dscale + jnp.sum(dy[j] * xhat[j], axis=0),
                        dshift + jnp.sum(dy[j], axis=0),
                        dbias + jnp.sum(dsum.astype(F32), axis=0)))
        return tuple(new)

    zero = jnp.zeros((width,), F32)
    sums = _chunks(chunk, tuple((zero, zero, zero) for _ in columns), tiles)
    for cols, column_sums in zip(columns, sums, strict=True):
        for k, total in enumerate(column_sums):
            sums_ref[k, cols] = total
