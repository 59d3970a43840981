"""Learned rotary in one kernel each way: cos and sin made in registers from mu.

Learned rotary ([conformal] §3.2; `sympow.rotary`) rotates pair j of every query and key
of a kv head by mu_i theta_j, mu per token and head. Written in jnp, XLA materializes cos
and sin as two float32 arrays [B, T, Hk, D/2], each as large as the bf16 queries it
rotates, and reads both wherever it rotates or differentiates a rotation: in GPT-2 small's
training step at context 65,536 the rotations took 8.6 ms against fixed rotary's 5.3
(docs/kernels.md). Here a program reads a block of rows of its heads and the block's mu
[bt] and makes the angles itself (`rotary._reduced_angles`' turns, so cos and sin stay on
their fast path). A pair (x_1, x_2) is lanes (2j, 2j + 1): a head's rows load whole and
split into two halves [bt, D/2] (Triton's split of a [bt, D/2, 2] view; join to store),
so the rotation is elementwise on the halves and every access is of contiguous rows:

    forward:  x'_1 = x_1 cos - x_2 sin,   x'_2 = x_2 cos + x_1 sin
    backward: dx_1 = dy_1 cos + dy_2 sin,  dx_2 = dy_2 cos - dy_1 sin    (the transpose)
              dmu = sum over pairs of theta (dy_2 x'_1 - dy_1 x'_2)  # d x'/d angle = (-x'_2, x'_1)

An optional bias b [H, D] is added as the rows load (x + b in place of x above): the
projections' bias of q and k, which XLA otherwise adds in a pass of its own before a kernel
it cannot fuse into (1.68 ms of a GPT-2 small step at 65,536 tokens on an H100). Its
cotangent, the sum of dx over the rows, comes from the backward kernel: each program's
float32 sum of its rows' dx per head, before dx is rounded to x's dtype ([B, row blocks,
H, D]; XLA adds those). XLA's reduction of the returned dx, which this replaces, read dx
once more and summed its bf16 rounding: on GPT-2 small's q and k at 4k on an H100 the
kernels' vjp call took 377.2 -> 325.7 us with the sums in the kernel (docs/kernels.md).

The halves replaced a product with a 0/1 lane-swap matrix on the tensor cores (Triton has
no cheap lane shuffle; the product's operands went through shared memory), first as two
strided loads and stores of every other lane: on GPT-2 small's q and k at 4k on an H100
the kernels' vjp call took 493.5 -> 381.6 us, the forward 207.6 -> 189.2 us (one run);
whole rows split in registers then took the vjp call 325.7 -> 273.8 us and the forward
183.4 -> 159.2 us (docs/kernels.md). cos and sin are the GPU's approximate ones (absolute
error <= 2^-20.5 on the reduced angle, far below bf16's rounding of x').

A layer's q and k share mu, so `rotate_together((q, k), mu)` rotates both in one kernel each
way: a program makes a block's angles for its kv heads once and rotates every array's heads
of those kv heads with them, and the backward sums mu's cotangent over all of them (a kv
head's query heads and its key head) in the kernel. Several kv heads a program measured
slower than one (docs/kernels.md).

Where the result goes matters as much as the rotation: XLA had fused its own rotation into
the copies of q and k to the chunked algorithm's chunk layout, so `layout='heads'` writes x'
head-major ([B, H, T, D], that layout after a reshape) and reads the backward's dy the same
way; XLA then folds those copies into the kernels' index maps. GPT-2 small at 65,536 tokens
on an H100: 2.89x -> 2.95x softmax's training tokens/s with it (docs/benchmarks.md).

`rotate(x, mu, base=...)` and `rotate_together` are the functions; `sympow.rotary.
apply_rotary` with `learned_rotary_angles`' angles is their specification
(`rotate_reference`). On GPU the kernels lower through Triton; elsewhere they run in the
Pallas interpreter (CPU tests).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jaxtyping import Array, Float

from sympow.attention.pallas.launch import LaunchPlan, launch
from sympow.rotary import _reduced_angles, apply_rotary, rotary_rates

__all__ = ["BLOCK_ROWS", "KV_HEADS", "LAYOUTS", "rotate", "rotate_reference",
           "rotate_together", "unsupported"]

F32 = jnp.float32
BLOCK_ROWS = 64  # rows of one head a program rotates at a time (H200 sweep: docs/kernels.md)
KV_HEADS = 1  # at most this many kv heads a program (their angles made once for all arrays)
WARPS = 4  # H100 sweeps with q and k together (docs/kernels.md)
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
           block_rows: int = BLOCK_ROWS, layout: str = "tokens",
           kv_heads: int | None = None) -> Float[Array, "B T H D"]:
    """x (+ bias) with pair (2j, 2j+1) of head n rotated by mu[..., n // (H / Hk)] theta_j,
    theta = `rotary_rates(D, base)`; x's dtype (rotated in float32). Differentiable in x,
    mu and bias.

    x: [B, T, H, D] bfloat16 or float32, D a power of two >= 16; mu: [B, T, Hk] (used in
    float32), H a multiple of Hk; bias: None or [H, D], any float dtype (added in float32
    as the rows load; its cotangent, the sum of dx over rows, in its dtype). interpret:
    None = the Pallas interpreter unless the default backend is a GPU. block_rows: rows of
    one head a program rotates at a time (a power of two >= 16). layout: how the rotated
    array lies in memory, and how the backward reads its cotangent: 'tokens' ([B, T, H, D],
    as x) or 'heads' ([B, H, T, D], returned through a transpose to [B, T, H, D]): the
    chunked algorithm's chunk layout after a free reshape, so that XLA need not copy the
    result there (it folds the transpose into the consumer). The same numbers either way.
    kv_heads: kv heads a program takes (a divisor of Hk; None: the largest <= KV_HEADS).
    ValueError for shapes `unsupported` names, and for a bias not [H, D].
    """
    return rotate_together((x,), mu, base=base, biases=None if bias is None else (bias,),
                           interpret=interpret, block_rows=block_rows, layout=layout,
                           kv_heads=kv_heads)[0]


def rotate_together(xs: tuple[Float[Array, "B T H D"], ...], mu: Float[Array, "B T Hk"], *,
                    base: float, biases: tuple[Float[Array, "H D"] | None, ...] | None = None,
                    interpret: bool | None = None, block_rows: int = BLOCK_ROWS,
                    layout: str = "tokens", kv_heads: int | None = None
                    ) -> tuple[Float[Array, "B T H D"], ...]:
    """`rotate` of every array of xs by the one mu (a layer's q and k), in one kernel each
    way: a program makes the angles of a block of rows of its kv heads once and rotates
    each array's heads of those kv heads with them; the backward sums mu's cotangent over
    all of them in the kernel. xs: arrays [B, T, H_a, D] of one dtype and D, each H_a a
    multiple of Hk; biases: None or one entry per array (None or [H_a, D]). Returns the
    rotated arrays in order; the other arguments as `rotate`'s.
    """
    if block_rows < 16 or block_rows & (block_rows - 1):
        raise ValueError(f"block_rows must be a power of two >= 16, got {block_rows}")
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got layout={layout!r}")
    xs = tuple(xs)
    if not xs:
        raise ValueError("rotate_together: xs must hold at least one array")
    for x in xs:
        reason = unsupported(x, mu)
        if reason is not None:
            raise ValueError(f"rotate: {reason}")
    if len({(x.dtype, x.shape[3]) for x in xs}) > 1:
        raise ValueError("rotate_together: xs must share dtype and D, got "
                         f"{[(str(x.dtype), x.shape) for x in xs]}")
    biases = (None,) * len(xs) if biases is None else tuple(biases)
    if len(biases) != len(xs):
        raise ValueError(f"biases must have one entry per array of xs ({len(xs)}), "
                         f"got {len(biases)}")
    for x, bias in zip(xs, biases, strict=True):
        if bias is not None and (getattr(bias, "shape", None) != x.shape[2:]
                                 or not jnp.issubdtype(bias.dtype, jnp.floating)):
            raise ValueError(
                f"rotate: bias must be a float [H, D] = {list(x.shape[2:])} array, got "
                f"{getattr(bias, 'dtype', type(bias))} {getattr(bias, 'shape', '')}")
    hk = mu.shape[2]
    if kv_heads is None:
        kv_heads = max(n for n in range(1, min(KV_HEADS, hk) + 1) if hk % n == 0)
    if kv_heads < 1 or hk % kv_heads:
        raise ValueError(f"kv_heads must divide mu's Hk={hk}, got kv_heads={kv_heads}")
    if interpret is None:
        interpret = jax.default_backend() != "gpu"
    setup = _Setup(float(base), bool(interpret), int(block_rows), layout == "heads",
                   int(kv_heads))
    return _rotate(setup, xs, mu.astype(F32), biases)


@dataclasses.dataclass(frozen=True)
class _Setup:
    """The static arguments of a rotation: how the kernels run, not what they compute."""

    base: float
    interpret: bool
    block_rows: int
    heads_major: bool  # x' and dy [B, H, T, D]
    kv_heads: int  # a program's


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _rotate(setup, xs, mu, biases):
    return tuple(_call(setup, "forward", xs, mu, biases=biases))


def _rotate_fwd(setup, xs, mu, biases):
    return _rotate(setup, xs, mu, biases), (xs, mu, biases)


def _rotate_bwd(setup, res, dys):
    xs, mu, biases = res
    outs = _call(setup, "backward", xs, mu,
                 tuple(dy.astype(x.dtype) for dy, x in zip(dys, xs, strict=True)),
                 biases=biases)
    dxs, dmu, sums = outs[:len(xs)], outs[len(xs)], iter(outs[len(xs) + 1:])
    # d(x + b) summed over rows: the kernel's float32 sums of each block of rows [B, blocks,
    # H, D], summed here
    dbiases = tuple(None if bias is None
                    else jnp.sum(next(sums), axis=(0, 1)).astype(bias.dtype) for bias in biases)
    return tuple(dxs), dmu, dbiases


_rotate.defvjp(_rotate_fwd, _rotate_bwd)


def _rates(d: int, base: float) -> tuple[Array, Array]:
    """(turns, theta) [1, D/2] per pair: theta = rotary_rates and turns = theta / 2 pi,
    computed as `rotary._reduced_angles` computes them."""
    theta = rotary_rates(d, base)
    return (theta / (2 * jnp.pi))[None], theta[None]


def _call(setup: _Setup, direction: str, xs, mu, dys=None, biases=None) -> list[Array]:
    """Launch the forward ([x'_a]) or backward ([dx_a..., dmu]) kernel over a grid
    (B, row blocks, Hk / kv_heads), each x_a shifted by its bias [H_a, D] if given. x, x'
    and dy are [B, T, H_a, D] to the caller; T is padded to whole blocks."""
    bt, kb = setup.block_rows, setup.kv_heads
    b, t, _, d = xs[0].shape
    hk = mu.shape[2]
    padded = -(-t // bt) * bt

    def pad(a, axis=1):  # T (at axis) padded to whole blocks
        return jnp.pad(a, [(0, padded - t) if i == axis else (0, 0) for i in range(a.ndim)])

    def rows(heads):  # a block of rows of a program's heads: token-major, head-major
        return (pl.BlockSpec((None, bt, heads, d), lambda j, i, n: (j, i, n, 0)),
                pl.BlockSpec((None, heads, bt, d), lambda j, i, n: (j, n, i, 0)))

    groups = tuple(x.shape[2] // hk for x in xs)
    blocks = [rows(kb * group) for group in groups]  # (tokens, heads) per array
    rates = _rates(d, setup.base)[:1 if direction == "forward" else 2]  # turns (, theta)
    whole = lambda a: pl.BlockSpec(a.shape, lambda j, i, n: (0, 0))  # noqa: E731
    in_specs = [tokens for tokens, _ in blocks]
    in_specs += [pl.BlockSpec((None, bt, kb), lambda j, i, n: (j, i, n)),
                 *(whole(rate) for rate in rates)]
    args = [*(pad(x) for x in xs), pad(mu), *rates]
    shifted = tuple(bias is not None for bias in biases)
    for group, bias in zip(groups, biases, strict=True):  # b per head, in float32
        if bias is not None:
            in_specs.append(pl.BlockSpec((kb * group, d), lambda j, i, n: (n, 0)))
            args.append(bias.astype(F32))
    major = 1 if setup.heads_major else 0
    if direction == "forward":
        out_specs = [block[major] for block in blocks]
        out_shape = [jax.ShapeDtypeStruct((b, x.shape[2], padded, d) if major
                                          else (b, padded, x.shape[2], d), x.dtype) for x in xs]
        kernel = _forward_kernel
    else:
        # XLA writes each dy head-major for 'heads'
        dys = [pad(jnp.swapaxes(dy, 1, 2), axis=2) if major else pad(dy) for dy in dys]
        in_specs = [block[major] for block in blocks] + in_specs
        args = dys + args
        out_specs = [tokens for tokens, _ in blocks]
        out_specs.append(pl.BlockSpec((None, bt, kb), lambda j, i, n: (j, i, n)))
        out_shape = [jax.ShapeDtypeStruct((b, padded, *x.shape[2:]), x.dtype) for x in xs]
        out_shape.append(jax.ShapeDtypeStruct((b, padded, hk), F32))
        for x, group, has in zip(xs, groups, shifted, strict=True):  # the bias sums
            if has:  # [B, row blocks, H_a, D]: a program's rows summed per head
                out_specs.append(pl.BlockSpec((None, None, kb * group, d),
                                              lambda j, i, n: (j, i, n, 0)))
                out_shape.append(jax.ShapeDtypeStruct((b, padded // bt, x.shape[2], d), F32))
        kernel = _backward_kernel
    kernel = functools.partial(kernel, groups=groups, kv_heads=kb, shifted=shifted,
                               heads_major=setup.heads_major, approx=not setup.interpret)
    outs = launch(kernel, plan=LaunchPlan(setup.interpret, STAGES),
                  name=f"sympow_rotary_{direction}", grid=(b, padded // bt, hk // kb),
                  in_specs=in_specs, out_specs=out_specs, out_shape=out_shape,
                  warps=WARPS)(*args)
    if direction == "forward" and setup.heads_major:
        return [jnp.swapaxes(out[:, :, :t], 1, 2) for out in outs]
    return [out[:, :t] for out in outs]


def _angles(mu, turns_per_mu, approx: bool):
    """(cos, sin) [bt, D/2] of rows mu [bt] and each pair's turns [1, D/2], the angle reduced
    to [-pi, pi] as `rotary._reduced_angles` does. approx: the GPU's cos.approx and
    sin.approx (absolute error <= 2^-20.5 on [-pi, pi]); libdevice's exact cosf and sinf
    keep a slow path for huge arguments whose local memory made the kernels 2-50x slower
    than XLA's rotation (docs/kernels.md)."""
    turns = mu[:, None] * turns_per_mu
    angle = (2 * math.pi) * (turns - jnp.floor(turns + 0.5))
    if approx:
        return tuple(_approx(f"{name}.approx.f32 $0, $1;", angle) for name in ("cos", "sin"))
    return jnp.cos(angle), jnp.sin(angle)


def _approx(asm: str, x):
    from jax.experimental.pallas import triton as plt

    return plt.elementwise_inline_asm(asm, args=[x], constraints="=f,f", pack=1,
                                      result_shape_dtypes=[jax.ShapeDtypeStruct(x.shape, F32)])[0]


def _heads(groups, kv_head: int):
    """(array, head) of every head of x a program's kv head `kv_head` turns, in order."""
    return [(a, kv_head * group + m) for a, group in enumerate(groups) for m in range(group)]


def _take_biases(refs, shifted):
    """One ref per shifted array (None for the others), and the refs left."""
    taken, at = [], 0
    for has in shifted:
        taken.append(refs[at] if has else None)
        at += has
    return taken, refs[at:]


# A pair's two lanes (2j, 2j + 1) split out of a row loaded whole: [bt, D] -> [bt, D/2, 2]
# -> two [bt, D/2] halves (Triton's split; join to store), so the rotation is elementwise on
# the halves and every load and store is of whole contiguous rows.
def _split(rows):
    """(first, second) [.., D/2] lanes of each pair of rows [.., D], float32."""
    first, second = jnp.unstack(rows.reshape(*rows.shape[:-1], -1, 2).astype(F32), axis=-1)
    return first, second


def _join(first, second):
    """`_split`'s inverse: rows [.., D] with first and second as each pair's lanes."""
    return jnp.stack([first, second], axis=-1).reshape(*first.shape[:-1], -1)


def _index(head: int, heads_major: bool):
    """The indexer of one head's rows [bt, D] in a block of several heads' rows."""
    return (head, slice(None), slice(None)) if heads_major else (slice(None), head, slice(None))


def _rows(ref, head: int, heads_major: bool = False):
    """One head's rows [bt, D] from a block of several heads' rows."""
    return ref[_index(head, heads_major)]


def _store(ref, head: int, first, second, heads_major: bool = False):
    """The pairs (first, second) [bt, D/2] as one head's rows of ref (`_rows`' inverse), in
    ref's dtype."""
    ref[_index(head, heads_major)] = _join(first, second).astype(ref.dtype)


def _pair(x_ref, bias_ref, head: int):
    """(x_1, x_2) [bt, D/2] of one head's rows, shifted by its bias row if given."""
    rows = _rows(x_ref, head).astype(F32)
    if bias_ref is not None:
        rows = rows + bias_ref[head, :][None]
    return _split(rows)


def _forward_kernel(*refs, groups, kv_heads, shifted, heads_major, approx):
    n = len(groups)
    x_refs, mu_ref, turns_ref = refs[:n], refs[n], refs[n + 1]
    bias_refs, out_refs = _take_biases(refs[n + 2:], shifted)
    for j in range(kv_heads):
        cos, sin = _angles(mu_ref[:, j], turns_ref[...], approx)  # [bt, D/2], once for all
        for a, head in _heads(groups, j):
            x1, x2 = _pair(x_refs[a], bias_refs[a], head)
            _store(out_refs[a], head, x1 * cos - x2 * sin, x2 * cos + x1 * sin, heads_major)


# A row's sum as a fixed tree of pairwise adds (the lane-pair split again), not a reduce:
# the order is then the kernel's, not the compiler's (XLA on the CPU orders a reduce by the
# layout it picks, which differed with the number of heads in a block: an ulp in dmu).
def _tree_sum(v):
    """v [.., P] summed over its last axis (P a power of two) by pairwise adds: [..]."""
    while v.shape[-1] > 1:
        first, second = jnp.unstack(v.reshape(*v.shape[:-1], -1, 2), axis=-1)
        v = first + second
    return v.reshape(v.shape[:-1])


def _backward_kernel(*refs, groups, kv_heads, shifted, heads_major, approx):
    n = len(groups)
    dy_refs, x_refs = refs[:n], refs[n:2 * n]
    mu_ref, turns_ref, theta_ref = refs[2 * n:2 * n + 3]
    bias_refs, out_refs = _take_biases(refs[2 * n + 3:], shifted)
    dx_refs, dmu_ref = out_refs[:n], out_refs[n]
    sum_refs, _ = _take_biases(out_refs[n + 1:], shifted)  # [H_a, D] each
    theta = theta_ref[...]  # [1, D/2]
    for j in range(kv_heads):
        cos, sin = _angles(mu_ref[:, j], turns_ref[...], approx)
        dmu = None
        for a, head in _heads(groups, j):
            dy1, dy2 = _split(_rows(dy_refs[a], head, heads_major))
            dx1, dx2 = dy1 * cos + dy2 * sin, dy2 * cos - dy1 * sin  # the transpose
            _store(dx_refs[a], head, dx1, dx2)
            if sum_refs[a] is not None:  # the bias's share: dx over the rows
                sum_refs[a][pl.ds(head, 1), :] = _join(
                    jnp.sum(dx1, axis=0, keepdims=True), jnp.sum(dx2, axis=0, keepdims=True))
            x1, x2 = _pair(x_refs[a], bias_refs[a], head)
            y1, y2 = x1 * cos - x2 * sin, x2 * cos + x1 * sin  # d x'/d angle = (-y2, y1)
            head_dmu = _tree_sum(theta * (dy2 * y1 - dy1 * y2))  # [bt]
            dmu = head_dmu if dmu is None else dmu + head_dmu
        dmu_ref[:, j] = dmu
