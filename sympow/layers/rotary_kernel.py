"""Learned rotary in one kernel each way: cos and sin made in registers from mu.

Learned rotary ([conformal] §3.2; `sympow.rotary`) rotates pair j of every query and key
of a kv head by mu_i theta_j, mu per token and head. Written in jnp, XLA materializes cos
and sin as two float32 arrays [B, T, Hk, D/2], each as large as the bf16 queries it
rotates, and reads both wherever it rotates or differentiates a rotation: in GPT-2 small's
training step at context 65,536 the rotations took 8.6 ms against fixed rotary's 5.3
(docs/kernels.md). Here a program reads a block of rows of one head and the block's mu
[bt] and makes the angles itself (`rotary._reduced_angles`' turns, so cos and sin stay on
their fast path):

    forward:  x' = x cos + swap(x) sin~              # swap: pairs exchanged, sin~ = (-s, s)
    backward: dx = dy cos - swap(dy) sin~,  dmu = sum over lanes of theta dy u,
              u = d x'/d angle = sigma (cos swap(x) - sin~ x),  sigma = (-1, +1) per pair,
              summed as -sum theta sigma x (cos swap(dy) + sin~ dy): within a pair
              dy . sigma swap(x) = -sigma swap(dy) . x, so the backward's one swap is dy's

An optional bias b [H, D] is added as the rows load (x + b in place of x above; the forward
reads swap(b) beside it, swap(x + b) = swap(x) + swap(b)): the projections' bias of q and k, which
XLA otherwise adds in a pass of its own before a kernel it cannot fuse into (1.68 ms of a
GPT-2 small step at 65,536 tokens on an H100). Its cotangent, the sum of dx over the rows,
is XLA's reduction of dx, as autodiff of the add had it: summed in the backward kernel (a
float32 partial sum per program) it made the kernel 28 % slower, more than the pass it
saved (docs/kernels.md).

The pair swap is a product with a 0/1 permutation matrix (exact: one term per output; the
tensor cores move lanes the vector units would shuffle). Each kv head's mu cotangent is the
sum over its query heads' (XLA adds the group). cos and sin are the GPU's approximate ones
(absolute error <= 2^-20.5 on the reduced angle, far below bf16's rounding of x').

Where the result goes matters as much as the rotation: XLA had fused its own rotation into
the copies of q and k to the chunked algorithm's chunk layout, so `layout='heads'` writes x'
head-major ([B, H, T, D], that layout after a reshape) and reads the backward's dy the same
way; XLA then folds those copies into the kernels' index maps. GPT-2 small at 65,536 tokens
on an H100: 2.89x -> 2.95x softmax's training tokens/s with it (docs/benchmarks.md).

`rotate(x, mu, base=...)` is the function; `sympow.rotary.apply_rotary` with
`learned_rotary_angles`' angles is its specification (`rotate_reference`). On GPU the
kernels lower through Triton; elsewhere they run in the Pallas interpreter (CPU tests).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jaxtyping import Array, Float

from sympow.attention.pallas.launch import LaunchPlan, idiv, launch
from sympow.rotary import _reduced_angles, apply_rotary, rotary_rates

__all__ = ["BLOCK_ROWS", "LAYOUTS", "rotate", "rotate_reference", "unsupported"]

F32 = jnp.float32
BLOCK_ROWS = 64  # rows of one head a program rotates (H200 sweep: docs/kernels.md)
WARPS = 8
STAGES = 2  # Triton's pipelining depth


def unsupported(x: Array, mu: Array) -> str | None:
    """Why `rotate` cannot take x [B, T, H, D] and mu [B, T, Hk], or None."""
    if x.ndim != 4 or mu.ndim != 3 or x.shape[:2] != mu.shape[:2]:
        return f"x [B, T, H, D] and mu [B, T, Hk] needed, got x {x.shape}, mu {mu.shape}"
    d, h, hk = x.shape[3], x.shape[2], mu.shape[2]
    if d < 16 or d & (d - 1):
        return f"head dim D={d} (supported: a power of two >= 16, the kernels' lanes)"
    if h % hk:
        return f"H={h} heads of x not a multiple of mu's Hk={hk}"
    if x.dtype not in (jnp.bfloat16, jnp.float32):
        return f"x dtype {x.dtype} (supported: bfloat16, float32)"
    return None


def rotate_reference(x: Float[Array, "B T H D"], mu: Float[Array, "B T Hk"], *,
                     base: float, bias: Float[Array, "H D"] | None = None
                     ) -> Float[Array, "B T H D"]:
    """The specification: `apply_rotary` by mu theta (reduced) of x (+ bias, added in
    float32), query head n of kv head n // (H / Hk); x's dtype."""
    b, t, h, d = x.shape
    hk = mu.shape[2]
    angles = _reduced_angles(mu.astype(F32), rotary_rates(d, base))  # [B, T, Hk, D/2]
    shifted = x if bias is None else x.astype(F32) + bias.astype(F32)
    rotated = apply_rotary(shifted.reshape(b, t, hk, h // hk, d), angles[:, :, :, None])
    return rotated.reshape(x.shape).astype(x.dtype)


LAYOUTS = ("tokens", "heads")


def rotate(x: Float[Array, "B T H D"], mu: Float[Array, "B T Hk"], *, base: float,
           bias: Float[Array, "H D"] | None = None, interpret: bool | None = None,
           block_rows: int = BLOCK_ROWS, layout: str = "tokens") -> Float[Array, "B T H D"]:
    """x (+ bias) with pair (2j, 2j+1) of head n rotated by mu[..., n // (H / Hk)] theta_j,
    theta = `rotary_rates(D, base)`; x's dtype (rotated in float32). Differentiable in x,
    mu and bias.

    x: [B, T, H, D] bfloat16 or float32, D a power of two >= 16; mu: [B, T, Hk] (used in
    float32), H a multiple of Hk; bias: None or [H, D], any float dtype (added in float32
    as the rows load; its cotangent, the sum of dx over rows, in its dtype). interpret:
    None = the Pallas interpreter unless the default backend is a GPU. block_rows: rows of
    one head a program rotates (a power of two >= 16). layout: how the rotated array lies
    in memory, and how the backward reads its cotangent: 'tokens' ([B, T, H, D], as x) or
    'heads' ([B, H, T, D], returned through a transpose to [B, T, H, D]): the chunked
    algorithm's chunk layout after a free reshape, so that XLA need not copy the result
    there (it folds the transpose into the consumer). The same numbers either way.
    ValueError for shapes `unsupported` names, and for a bias not [H, D].
    """
    if block_rows < 16 or block_rows & (block_rows - 1):
        raise ValueError(f"block_rows must be a power of two >= 16, got {block_rows}")
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got layout={layout!r}")
    reason = unsupported(x, mu)
    if reason is not None:
        raise ValueError(f"rotate: {reason}")
    if bias is not None and (getattr(bias, "shape", None) != x.shape[2:]
                             or not jnp.issubdtype(bias.dtype, jnp.floating)):
        raise ValueError(f"rotate: bias must be a float [H, D] = {list(x.shape[2:])} array, "
                         f"got {getattr(bias, 'dtype', type(bias))} {getattr(bias, 'shape', '')}")
    if interpret is None:
        interpret = jax.default_backend() != "gpu"
    setup = (float(base), bool(interpret), int(block_rows), layout == "heads")
    return _rotate(setup, x, mu.astype(F32), bias)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _rotate(setup, x, mu, bias):
    return _call(setup, "forward", x, mu, bias=bias)[0]


def _rotate_fwd(setup, x, mu, bias):
    return _rotate(setup, x, mu, bias), (x, mu, bias)


def _rotate_bwd(setup, res, dy):
    x, mu, bias = res
    dx, dmu = _call(setup, "backward", x, mu, dy.astype(x.dtype), bias=bias)
    b, t, h, _ = x.shape
    dmu = dmu.reshape(b, t, mu.shape[2], -1).sum(axis=-1)  # summed over a kv head's group
    if bias is None:
        return dx, dmu, None
    dbias = jnp.sum(dx.astype(F32), axis=(0, 1))  # [H, D]: d(x + b) summed over rows
    return dx, dmu, dbias.astype(bias.dtype)


_rotate.defvjp(_rotate_fwd, _rotate_bwd)


def _rates(d: int, base: float) -> tuple[Array, Array]:
    """(turns, theta) [1, D] per lane, pair j on lanes 2j and 2j + 1: theta = rotary_rates
    and turns = theta / 2 pi, computed as `rotary._reduced_angles` computes them."""
    theta = rotary_rates(d, base)
    return jnp.repeat(theta / (2 * jnp.pi), 2)[None], jnp.repeat(theta, 2)[None]


@functools.lru_cache(maxsize=8)
def _swap(d: int) -> np.ndarray:
    """[D, D] 0/1: the permutation exchanging the lanes of each pair ([i, j]: j = i ^ 1)."""
    lanes = np.arange(d)
    return (lanes[:, None] == (lanes ^ 1)[None, :]).astype(np.float32)


def _call(setup: tuple[float, bool, int, bool], direction: str, x, mu, dy=None, bias=None):
    """Launch the forward ((x',)) or backward ((dx, dmu per head of x)) kernel over a grid
    (B, row blocks, H), x shifted by bias [H, D] if given; setup = (base, interpret,
    block_rows, heads: x' and dy head-major). x, x' and dy are [B, T, H, D] to the caller;
    T is padded to whole blocks."""
    base, interpret, bt, heads = setup
    b, t, h, d = x.shape
    hk = mu.shape[2]
    padded = -(-t // bt) * bt

    def pad(a, axis=1):  # T (at axis) padded to whole blocks
        return jnp.pad(a, [(0, padded - t) if i == axis else (0, 0) for i in range(a.ndim)])

    turns, theta = _rates(d, base)
    group = h // hk
    in_tokens = pl.BlockSpec((None, bt, None, d), lambda j, i, n: (j, i, n, 0))
    in_heads = pl.BlockSpec((None, None, bt, d), lambda j, i, n: (j, n, i, 0))
    per_row = pl.BlockSpec((None, bt, None), lambda j, i, n: (j, i, idiv(n, group)))
    whole = lambda a: pl.BlockSpec(a.shape, lambda j, i, n: (0, 0))  # noqa: E731
    swap = jnp.asarray(_swap(d), x.dtype)  # 0/1: exact in either dtype
    in_specs = [in_tokens, per_row, whole(turns), whole(theta), whole(swap)]
    args = [pad(x), pad(mu), turns, theta, swap]
    if bias is not None:  # b (and for the forward swap(b)), one row per head of x
        per_head = pl.BlockSpec((None, d), lambda j, i, n: (n, 0))
        shift = bias.astype(F32)
        in_specs.append(per_head)
        args.append(shift)
        if direction == "forward":
            in_specs.append(per_head)
            args.append(shift.reshape(h, d // 2, 2)[..., ::-1].reshape(h, d))
    tokens_shape = jax.ShapeDtypeStruct((b, padded, h, d), x.dtype)
    heads_shape = jax.ShapeDtypeStruct((b, h, padded, d), x.dtype)
    if direction == "forward":
        out_specs = [in_heads if heads else in_tokens]
        out_shape = [heads_shape if heads else tokens_shape]
        kernel = _forward_kernel
    else:
        dy = jnp.swapaxes(dy, 1, 2) if heads else dy  # XLA writes it head-major
        in_specs = [in_heads if heads else in_tokens, *in_specs]
        args = [pad(dy, axis=2 if heads else 1), *args]
        out_specs = [in_tokens, pl.BlockSpec((None, bt, None), lambda j, i, n: (j, i, n))]
        out_shape = [tokens_shape, jax.ShapeDtypeStruct((b, padded, h), F32)]
        kernel = _backward_kernel
    kernel = functools.partial(kernel, approx=not interpret, shifted=bias is not None)
    outs = launch(kernel, plan=LaunchPlan(interpret, STAGES),
                  name=f"sympow_rotary_{direction}", grid=(b, padded // bt, h),
                  in_specs=in_specs, out_specs=out_specs, out_shape=out_shape,
                  warps=WARPS)(*args)
    if direction == "forward" and heads:
        return [jnp.swapaxes(outs[0][:, :, :t], 1, 2)]
    return [out[:, :t] for out in outs]


def _angles(mu, turns_per_mu, approx: bool):
    """(cos, sin~, first) [bt, D] of rows mu [bt]: sin~ = -sin on a pair's first lane (where
    `first`), +sin on its second; the angle reduced to [-pi, pi] as `rotary._reduced_angles`
    does. approx: the GPU's cos.approx and sin.approx (absolute error <= 2^-20.5 on
    [-pi, pi]); libdevice's exact cosf and sinf keep a slow path for huge arguments whose
    local memory made the kernels 2-50x slower than XLA's rotation (docs/kernels.md)."""
    turns = mu[:, None] * turns_per_mu  # [bt, D]
    angle = (2 * math.pi) * (turns - jnp.floor(turns + 0.5))
    lane = jax.lax.broadcasted_iota(jnp.int32, angle.shape, 1)
    first = jax.lax.rem(lane, 2) == 0
    if approx:
        cos, sin = (_approx(f"{name}.approx.f32 $0, $1;", angle) for name in ("cos", "sin"))
    else:
        cos, sin = jnp.cos(angle), jnp.sin(angle)
    return cos, jnp.where(first, -sin, sin), first


def _approx(asm: str, x):
    from jax.experimental.pallas import triton as plt

    return plt.elementwise_inline_asm(asm, args=[x], constraints="=f,f", pack=1,
                                      result_shape_dtypes=[jax.ShapeDtypeStruct(x.shape, F32)])[0]


def _swapped(x, swap):
    """x [bt, D] with the lanes of each pair exchanged, float32 (a product with the 0/1
    permutation: one term per output, exact; float32 operands at full precision)."""
    precision = jax.lax.Precision.HIGHEST if x.dtype == F32 else None
    return jax.lax.dot(x, swap, precision=precision, preferred_element_type=F32)


def _forward_kernel(x_ref, mu_ref, turns_ref, theta_ref, swap_ref, *refs, approx, shifted):
    del theta_ref  # the backward's
    x = x_ref[...]  # [bt, D]
    x32, swapped = x.astype(F32), _swapped(x, swap_ref[...])
    if shifted:  # x + b and swap(x) + swap(b)
        bias_ref, swapped_bias_ref, out_ref = refs
        x32, swapped = x32 + bias_ref[...][None], swapped + swapped_bias_ref[...][None]
    else:
        (out_ref,) = refs
    cos, signed_sin, _ = _angles(mu_ref[...], turns_ref[...], approx)
    out_ref[...] = (x32 * cos + swapped * signed_sin).astype(out_ref.dtype)


def _backward_kernel(dy_ref, x_ref, mu_ref, turns_ref, theta_ref, swap_ref, *refs, approx,
                     shifted):
    *bias_ref, dx_ref, dmu_ref = refs  # the bias if shifted
    cos, signed_sin, first = _angles(mu_ref[...], turns_ref[...], approx)
    dy = dy_ref[...]  # [bt, D]
    dy32, swapped_dy = dy.astype(F32), _swapped(dy, swap_ref[...])
    dx_ref[...] = (dy32 * cos - swapped_dy * signed_sin).astype(dx_ref.dtype)
    x = x_ref[...].astype(F32)
    if shifted:
        x = x + bias_ref[0][...][None]
    # dmu = sum theta dy . d x'/d angle with d x'/d angle = sigma (cos swap(x) - sin~ x),
    # sigma = (-1, +1) on a pair's lanes; dy . sigma swap(x) = -sigma swap(dy) . x per pair
    sigma_x = jnp.where(first, -x, x)
    along = cos * swapped_dy + signed_sin * dy32
    dmu_ref[...] = -jnp.sum(sigma_x * along * theta_ref[...], axis=1)
