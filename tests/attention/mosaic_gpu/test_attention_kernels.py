"""The Hopper attention kernels where a CPU can check them: each traces and lowers, through
Pallas' Mosaic GPU lowering, to one Mosaic GPU kernel for CUDA (jax lowers across platforms
without a GPU). Their numbers need a Hopper GPU: `experiments/gpu_check.py --only=primitives`
compares them with the portable kernels there (the Mosaic GPU interpreter cannot run a
wgmma whose A operand is in registers)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from sympow.attention.mosaic_gpu import attention_kernels, blocks

SHAPES = [
    (1, 2, 2, 1, 128, 64, 64, 2),  # one program: both warpgroups' diagonals
    (2, 6, 2, 3, 512, 64, 64, 2),  # grouped query heads, several chunks
    (1, 2, 1, 1, 1024, 128, 64, 4),  # wide keys, p = 4
    (1, 2, 2, 1, 256, 64, 128, 2),  # wide values
]


def lowered(fn, *shapes):
    args = [jax.ShapeDtypeStruct(shape, dtype) for shape, dtype in shapes]
    return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def operands(b, hq, hk, n, c, d, e):
    bf16, f32 = jnp.bfloat16, jnp.float32
    return [((b, hq, n, c, d), bf16), ((b, hk, n, c, d), bf16), ((b, hk, n, c, e), bf16),
            ((b, hk, n, c), f32), ((b, hk, n, c), f32), ((b, hk, n, c), f32)]


@pytest.mark.parametrize(("b", "hq", "hk", "n", "c", "d", "e", "p"), SHAPES)
def test_the_forward_lowers_to_one_mosaic_gpu_kernel(b, hq, hk, n, c, d, e, p):
    text = lowered(lambda *x: attention_kernels.attention_fwd(*x, p=p),
                   *operands(b, hq, hk, n, c, d, e))
    assert text.count("stablehlo.custom_call @mosaic_gpu") == 1
    # the outputs: o [B, Hq, N, C, E], den, m and the row scales c [B, Hq, N, C], float32
    rows = f"tensor<{b}x{hq}x{n}x{c}xf32>"
    assert f"tensor<{b}x{hq}x{n}x{c}x{e}xf32>, {rows}, {rows}, {rows}" in text


@pytest.mark.parametrize(("b", "hq", "hk", "n", "c", "d", "e", "p"), SHAPES)
def test_the_backward_lowers_to_two_mosaic_gpu_kernels(b, hq, hk, n, c, d, e, p):
    f32 = jnp.float32
    text = lowered(lambda *x: attention_kernels.attention_bwd(*x, p=p),
                   *operands(b, hq, hk, n, c, d, e), ((b, hq, n, c), f32), ((b, hq, n, c), f32),
                   ((b, hq, n, c, e), jnp.bfloat16), ((b, hq, n, c), f32))
    assert text.count("stablehlo.custom_call @mosaic_gpu") == 2
    blocks_ = c // blocks.ROWS
    slots = -(-blocks_ // blocks.ROWS) * blocks.ROWS
    rows = f"tensor<{b}x{hq}x{n}x{c}xf32>"
    # dq, dhead, the diagonal straddle sums and the block-pair totals
    assert (f"tensor<{b}x{hq}x{n}x{c}x{d}xbf16>, {rows}, {rows}, "
            f"tensor<{b}x{hq}x{n}x{blocks_}x{slots}xf32>") in text
    assert f"tensor<{b}x{hk}x{n}x{c}x{d}xbf16>, tensor<{b}x{hk}x{n}x{c}x{e}xbf16>, " \
           f"tensor<{b}x{hk}x{n}x{c}xf32>" in text  # dk, dv, dtail


def test_the_shapes_they_take_are_whole_programs():
    assert blocks.TILE_ROWS == blocks.COMPUTE_WGS * blocks.ROWS
    assert blocks.ROWS == 64  # one wgmma M per warpgroup
    assert blocks.WIDTHS == (64, 128)
