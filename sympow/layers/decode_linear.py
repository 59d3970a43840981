"""The linear layers of a decoding step as one kernel each: LayerNorm, product, bias,
GELU and residual in a single launch.

At a few rows (one token for each of B <= 64 sequences) a GPT block's products read their
weights once and do little else, so the step's time is the number of kernels and how close
each comes to the memory's bandwidth. XLA runs such a product as a reduction (2.7-9.5 us
for GPT-2 small's, 3-6x its weight-reading time, docs/benchmarks.md) and the LayerNorm, bias,
GELU and residual around it as separate launches. Here one program per block of block_n
output columns streams their weights once:

    out = act(LN(x) @ W + b) + residual      # x [B, K], W [K, N] -> [B, N]

with LN, b, act (tanh GELU) and residual each optional. W comes transposed, wt [N, K], so a
program's slab (block_n outputs' weights) is one contiguous stretch of memory; it is read in
[block_n, block_k] tiles (block_k a power of two dividing K, at most max_block_k: Triton
loads powers of two) through a pipeline of STAGES stages of at most STAGE_BYTES each.
Several rows run on the tensor cores, loaded and stored masked to the next multiple of
ROW_BLOCK (16, their smallest row block), so callers keep [B, C] as it is; block_n is then
16 or 32 columns. One row (B = 1 decoding) runs on the CUDA cores (`LinearTiles.fma`):
each weight tile times x, summed over K once after the loop, 4 columns a program, so a
768-column product has 192 programs and every SM streams weights; all its loads are
issued before the LayerNorm's reductions. Launch shapes: `default_tiles`, from sweeps on
an H100 and an H200 (docs/benchmarks.md). A one-row product takes ~2.2-3.2 us on the
H200 (1.5 TB/s for 3072 -> 768), still above XLA's bare dot of the same shape (1.5-2.2
us) but without the separate launches for what XLA would not fuse into it.

`linear_reference` is the specification (the same formula in jnp, float32 accumulation).
On GPU the kernel lowers through Triton; elsewhere it runs in the Pallas interpreter.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt
from jaxtyping import Array, Float

from sympow.attention.pallas.launch import launch

__all__ = ["LINEAR_IMPLS", "MAX_ROWS", "LayerNormWeights", "LinearTiles", "block_k",
           "default_tiles", "linear", "linear_reference", "linear_shapes_reason"]

ROW_BLOCK = 16  # the smallest row block of a tensor-core product
MAX_ROWS = 64
MAX_BLOCK_K = 512
BLOCK_N = 16
FMA_BLOCK_N = 4  # the narrowest column block of the one-row product on the CUDA cores
STAGES = 3
LINEAR_IMPLS = ("xla", "pallas")
STAGE_BYTES = 48 * 1024  # x and wt tiles of one pipeline stage (3 fit the 227 KiB of an SM)


class LayerNormWeights:
    """LayerNorm before the product: scale and bias [K], epsilon (flax's fast variance)."""

    def __init__(self, scale: Float[Array, " K"], bias: Float[Array, " K"], eps: float):
        self.scale, self.bias, self.eps = scale, bias, float(eps)


jax.tree_util.register_pytree_node(
    LayerNormWeights, lambda n: ((n.scale, n.bias), n.eps),
    lambda eps, leaves: LayerNormWeights(*leaves, eps))


@dataclasses.dataclass(frozen=True)
class LinearTiles:
    """The kernel's launch shape: block_n outputs a program (a power of two >= BLOCK_N, or
    >= FMA_BLOCK_N with fma; N not a multiple of it runs at BLOCK_N), `warps` warps, `stages`
    pipeline stages, K tiles of at most max_block_k; unroll: the loops over K written out,
    every load issued before the first reduction or product, instead of a device loop.
    fma: at one row, the product on the CUDA cores (each weight tile times x, summed over K
    once at the end) instead of a 16-row tensor-core product of which 15 rows are padding;
    block_n may then be any power of two >= FMA_BLOCK_N (more programs for the same
    columns). More rows ignore it."""

    block_n: int = BLOCK_N
    warps: int = 4
    stages: int = STAGES
    max_block_k: int = MAX_BLOCK_K
    unroll: bool = False
    fma: bool = False

    def __post_init__(self):
        smallest = {"block_n": FMA_BLOCK_N if self.fma else BLOCK_N, "max_block_k": BLOCK_N}
        for name, least in smallest.items():
            value = getattr(self, name)
            if value < least or value & (value - 1):
                raise ValueError(f"{name} must be a power of two >= {least}, got {value}")
        if self.warps not in (1, 2, 4, 8) or self.stages < 1:
            raise ValueError(f"warps must be 1, 2, 4 or 8 and stages >= 1, got warps = "
                             f"{self.warps}, stages = {self.stages}")


def default_tiles(k: int, n: int, rows: int) -> LinearTiles:
    """The launch shape for a [K, N] product at `rows` rows, from sweeps of GPT-2 small's
    four (docs/benchmarks.md, `experiments/tune_decode_linear.py`) and their time inside
    the decoding step. One row, on the CUDA cores (fma): 4 columns a program, loops written
    out, K tiles up to 1024, 2 warps, 4 where the inputs are at least twice the outputs
    (3072 -> 768). More rows, on the tensor cores: outputs at least twice the inputs (768 ->
    2336, 768 -> 3072) 32 columns a program, 4 warps; inputs at least twice the outputs 16
    columns, 2 warps; square (768 -> 768) 16 columns, 1 warp; 3 stages, K tiles up to 512."""
    if rows == 1:
        return LinearTiles(block_n=FMA_BLOCK_N, warps=4 if k >= 2 * n else 2,
                           max_block_k=1024, unroll=True, fma=True)
    if n >= 2 * k:
        return LinearTiles(block_n=32, warps=4)
    return LinearTiles(block_n=BLOCK_N, warps=2 if k >= 2 * n else 1)


@dataclasses.dataclass(frozen=True)
class _Plan:
    rows: int  # the rows the kernel computes: x's, padded to a multiple of ROW_BLOCK (1: fma)
    block_n: int
    block_k: int
    warps: int
    stages: int
    unroll: bool
    interpret: bool
    fma: bool = False


def padded_rows(rows: int) -> int:
    """Rows the kernel runs at: the next multiple of ROW_BLOCK."""
    return -(-rows // ROW_BLOCK) * ROW_BLOCK


def block_k(rows: int, k: int, itemsize: int, block_n: int = BLOCK_N,
            max_block_k: int = MAX_BLOCK_K) -> int:
    """The widest power of two <= max_block_k dividing K whose stage, an x tile of `rows`
    and a wt tile of block_n rows, fits STAGE_BYTES (at least 16: K is a multiple of it)."""
    bk = min(max_block_k, k & -k)
    while bk > ROW_BLOCK and (rows + block_n) * bk * itemsize > STAGE_BYTES:
        bk //= 2
    return bk


def linear_shapes_reason(rows: int, k: int, n: int) -> str | None:
    """Why x [rows, K] @ W [K, N] cannot run in the kernel, or None when it can."""
    if not 1 <= rows <= MAX_ROWS:
        return f"{rows} rows (the kernel takes 1 to {MAX_ROWS})"
    if k % ROW_BLOCK:
        return f"K = {k} is not a multiple of {ROW_BLOCK}"
    if n % BLOCK_N:
        return f"N = {n} is not a multiple of {BLOCK_N}"
    return None


def _gelu(x):
    # GPT-2's tanh GELU, jax.nn.gelu(approximate=True) written out (lowers through Triton).
    return 0.5 * x * (1.0 + jnp.tanh(0.7978845608028654 * (x + 0.044715 * x * x * x)))


def _normalize(x, mean, rstd, scale, shift):
    return (x.astype(jnp.float32) - mean) * rstd * scale + shift


def linear_reference(x: Float[Array, "B K"], wt: Float[Array, "N K"],
                     b: Float[Array, " N"] | None = None, *,
                     norm: LayerNormWeights | None = None, gelu: bool = False,
                     residual: Float[Array, "B N"] | None = None, out_dtype=None
                     ) -> Float[Array, "B N"]:
    """act(LN(x) @ wt^T + b) + residual in jnp: the product of LN(x) cast to wt's dtype,
    in float32, everything after it in float32, cast to out_dtype (None: x's dtype)."""
    out_dtype = x.dtype if out_dtype is None else out_dtype
    if norm is not None:
        xf = x.astype(jnp.float32)
        mean = jnp.mean(xf, axis=-1, keepdims=True)
        var = jnp.maximum(jnp.mean(xf * xf, axis=-1, keepdims=True) - mean * mean, 0.0)
        x = _normalize(x, mean, jax.lax.rsqrt(var + norm.eps),
                       norm.scale.astype(jnp.float32), norm.bias.astype(jnp.float32))
    exact = wt.dtype == jnp.float32  # as the kernel: float32 weights never round to TF32
    y = jnp.dot(x.astype(wt.dtype), wt.T, preferred_element_type=jnp.float32,
                precision=jax.lax.Precision.HIGHEST if exact else None)
    if b is not None:
        y = y + b.astype(jnp.float32)
    if gelu:
        y = _gelu(y)
    if residual is not None:
        y = y + residual.astype(jnp.float32)
    return y.astype(out_dtype)


def _linear_kernel(*refs, plan: _Plan, has_norm: bool, has_bias: bool, gelu: bool,
                   has_residual: bool, eps: float):
    x_ref, wt_ref, *rest = refs
    scale_ref, shift_ref = (rest.pop(0), rest.pop(0)) if has_norm else (None, None)
    b_ref = rest.pop(0) if has_bias else None
    res_ref = rest.pop(0) if has_residual else None
    (o_ref,) = rest
    b, k = x_ref.shape
    bk, steps, rows = plan.block_k, k // plan.block_k, plan.rows

    def block(i):
        return pl.ds(i * bk if plan.unroll else pl.multiple_of(i * bk, bk), bk)

    def loop(body, init):  # over the K tiles: written out, or a device loop
        if not plan.unroll:
            return jax.lax.fori_loop(0, steps, body, init)
        for i in range(steps):
            init = body(i, init)
        return init

    valid = jnp.arange(rows)[:, None] < b  # [rows, 1]: the rows past x's are zeros

    def tiles(load):  # tile i of an operand; written out, all its loads issued here
        if not plan.unroll:
            return load
        return [load(i) for i in range(steps)].__getitem__

    # Written out, every load is issued up front, weights first: the LayerNorm's reductions,
    # the normalization and the epilogue then share one wait on memory instead of each
    # waiting a round trip of its own after the one before.
    weight = tiles(lambda i: wt_ref[:, block(i)])  # [block_n, bk]
    x_block = tiles(lambda i: plt.load(x_ref.at[pl.ds(0, rows), block(i)], mask=valid,
                                       other=0))  # [rows, bk]
    if has_norm:
        scale = tiles(lambda i: scale_ref[block(i)][None, :])  # [1, bk]
        shift = tiles(lambda i: shift_ref[block(i)][None, :])
    bias = b_ref[...] if has_bias else None  # [1, block_n]
    residual = (plt.load(res_ref.at[pl.ds(0, rows), :], mask=valid, other=0)
                if has_residual else None)  # [rows, block_n]

    mean = rstd = None
    if has_norm:
        def stats(i, carry):
            xb = x_block(i).astype(jnp.float32)
            return (carry[0] + jnp.sum(xb, axis=1, keepdims=True),
                    carry[1] + jnp.sum(xb * xb, axis=1, keepdims=True))

        zero = jnp.zeros((rows, 1), jnp.float32)
        total, squares = loop(stats, (zero, zero))
        mean = total / k  # [rows, 1]
        rstd = jax.lax.rsqrt(jnp.maximum(squares / k - mean * mean, 0.0) + eps)

    def product(i, acc):
        xb = x_block(i)
        if has_norm:
            xb = _normalize(xb, mean, rstd, scale(i).astype(jnp.float32),
                            shift(i).astype(jnp.float32))
        wb = weight(i)  # [block_n, bk]
        if plan.fma:  # one row: products on the CUDA cores, summed over K after the loop
            return acc + wb.astype(jnp.float32) * xb.astype(wb.dtype).astype(jnp.float32)
        exact = wb.dtype == jnp.float32  # float32 weights: no TF32 rounding on the GPU
        return acc + jax.lax.dot_general(
            xb.astype(wb.dtype), wb, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32,
            precision=jax.lax.Precision.HIGHEST if exact else None)

    if plan.fma:  # [block_n, bk] products, then their sums as the output row [1, block_n]
        acc = jnp.sum(loop(product, jnp.zeros((plan.block_n, bk), jnp.float32)), axis=1)[None]
    else:
        acc = loop(product, jnp.zeros((rows, plan.block_n), jnp.float32))
    if has_bias:
        acc = acc + bias.astype(jnp.float32)
    if gelu:
        acc = _gelu(acc)
    if has_residual:
        acc = acc + residual.astype(jnp.float32)
    plt.store(o_ref.at[pl.ds(0, rows), :], acc.astype(o_ref.dtype), mask=valid)


def linear(x: Float[Array, "B K"], wt: Float[Array, "N K"], b: Float[Array, " N"] | None = None,
           *, norm: LayerNormWeights | None = None, gelu: bool = False,
           residual: Float[Array, "B N"] | None = None, out_dtype=None,
           tiles: LinearTiles | None = None, impl: str = "pallas",
           interpret: bool | None = None) -> Float[Array, "B N"]:
    """act(LN(x) @ wt^T + b) + residual in one kernel (see the module docstring).

    x: [B, K], 1 <= B <= MAX_ROWS; wt: [N, K], W transposed, in the product's dtype (x,
    after the LayerNorm, is cast to it); b: [N]; norm: LayerNorm of x's rows first; gelu:
    GPT-2's tanh GELU after the bias; residual: [B, N] added last. K and N multiples of 16.
    Sums in float32; the result in out_dtype (None: x's dtype). tiles: the launch shape
    (None: `default_tiles(K, N, B)`). impl: 'pallas' (the kernel) or 'xla'
    (`linear_reference`, which XLA compiles into its own product with what it fuses around
    it). interpret: None = the Pallas interpreter unless the default backend is a GPU.
    """
    if impl not in LINEAR_IMPLS:
        raise ValueError(f"impl must be one of {LINEAR_IMPLS}, got impl={impl!r}")
    if x.ndim != 2 or wt.ndim != 2 or wt.shape[1] != x.shape[1]:
        raise ValueError(f"x must be [B, K] and wt [N, K] (W transposed), got x.shape = "
                         f"{x.shape} and wt.shape = {wt.shape}")
    rows, k = x.shape
    n = wt.shape[0]
    reason = linear_shapes_reason(rows, k, n)
    if reason:
        raise ValueError(f"x [B, K] = {x.shape} times wt [N, K] = {wt.shape}: {reason}")
    if b is not None and b.shape != (n,):
        raise ValueError(f"b must be [N] = [{n}], got b.shape = {b.shape}")
    if residual is not None and residual.shape != (rows, n):
        raise ValueError(f"residual must be [B, N] = [{rows}, {n}], got {residual.shape}")
    if norm is not None and (norm.scale.shape != (k,) or norm.bias.shape != (k,)):
        raise ValueError(f"norm scale and bias must be [K] = [{k}], got "
                         f"{norm.scale.shape} and {norm.bias.shape}")
    if impl == "xla":
        return linear_reference(x, wt, b, norm=norm, gelu=gelu, residual=residual,
                                out_dtype=out_dtype)
    if interpret is None:
        interpret = jax.default_backend() != "gpu"
    tiles = default_tiles(k, n, rows) if tiles is None else tiles
    fma = tiles.fma and rows == 1
    block_n = tiles.block_n if n % tiles.block_n == 0 else BLOCK_N
    if not fma:
        block_n = max(block_n, BLOCK_N)
    itemsize = max(jnp.dtype(x.dtype).itemsize, jnp.dtype(wt.dtype).itemsize)
    kernel_rows = 1 if fma else padded_rows(rows)
    plan = _Plan(rows=kernel_rows, block_n=block_n, warps=tiles.warps, fma=fma,
                 stages=tiles.stages, unroll=tiles.unroll, interpret=interpret,
                 block_k=block_k(kernel_rows, k, itemsize, block_n, tiles.max_block_k))
    return _launch(plan, norm is not None, b is not None, gelu, residual is not None,
                   None if norm is None else norm.eps,
                   jnp.dtype(x.dtype if out_dtype is None else out_dtype),
                   x, wt, *(() if norm is None else (norm.scale, norm.bias)),
                   *(() if b is None else (b.reshape(1, n),)),
                   *(() if residual is None else (residual,)))


@functools.partial(jax.jit, static_argnums=(0, 1, 2, 3, 4, 5, 6))
def _launch(plan, has_norm, has_bias, gelu, has_residual, eps, out_dtype, x, wt, *operands):
    rows, k = x.shape
    n = wt.shape[0]
    bn = plan.block_n
    columns = lambda r: pl.BlockSpec((r, bn), lambda j: (0, j))  # noqa: E731
    whole = lambda *shape: pl.BlockSpec(shape, lambda j: (0,) * len(shape))  # noqa: E731
    in_specs = [whole(rows, k), pl.BlockSpec((bn, k), lambda j: (j, 0))]
    in_specs += [whole(k), whole(k)] if has_norm else []
    in_specs += [columns(1)] if has_bias else []
    in_specs += [columns(rows)] if has_residual else []
    kernel = functools.partial(_linear_kernel, plan=plan, has_norm=has_norm,
                               has_bias=has_bias, gelu=gelu, has_residual=has_residual,
                               eps=eps)
    return launch(kernel, plan=plan, name="sympow_decode_linear", grid=(n // bn,),
                  in_specs=in_specs, out_specs=columns(rows),
                  out_shape=jax.ShapeDtypeStruct((rows, n), out_dtype), warps=plan.warps,
                  stages=plan.stages)(x, wt, *operands)
