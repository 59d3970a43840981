"""The Hopper attention forward where a CPU can check it: it traces and lowers, through
Pallas' Mosaic GPU lowering, to one Mosaic GPU kernel for CUDA (jax lowers across platforms
without a GPU). Its numbers need a Hopper GPU: `experiments/gpu_check.py --only=primitives`
compares it with the portable kernel there (the Mosaic GPU interpreter cannot run a wgmma
whose A operand is in registers)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from sympow.attention.mosaic_gpu import attention_kernels


def lowered_text(b, hq, hk, n, c, d, e, p):
    bf16, f32 = jnp.bfloat16, jnp.float32
    args = [jax.ShapeDtypeStruct(shape, dtype) for shape, dtype in (
        ((b, hq, n, c, d), bf16), ((b, hk, n, c, d), bf16), ((b, hk, n, c, e), bf16),
        ((b, hk, n, c), f32), ((b, hk, n, c), f32), ((b, hk, n, c), f32))]
    fn = jax.jit(lambda *x: attention_kernels.attention_fwd(*x, p=p))
    return fn.trace(*args).lower(lowering_platforms=("cuda",)).as_text()


@pytest.mark.parametrize(("b", "hq", "hk", "n", "c", "d", "e", "p"), [
    (1, 2, 2, 1, 128, 64, 64, 2),  # one program: both warpgroups' diagonals
    (2, 6, 2, 3, 512, 64, 64, 2),  # grouped query heads, several chunks
    (1, 2, 1, 1, 1024, 128, 64, 4),  # wide keys, p = 4
    (1, 2, 2, 1, 256, 64, 128, 2),  # wide values
])
def test_the_forward_lowers_to_one_mosaic_gpu_kernel(b, hq, hk, n, c, d, e, p):
    text = lowered_text(b, hq, hk, n, c, d, e, p)
    assert text.count("stablehlo.custom_call @mosaic_gpu") == 1
    # the three outputs: o [B, Hq, N, C, E], den and m [B, Hq, N, C], float32
    assert f"tensor<{b}x{hq}x{n}x{c}x{e}xf32>, tensor<{b}x{hq}x{n}x{c}xf32>, " \
           f"tensor<{b}x{hq}x{n}x{c}xf32>" in text


def test_the_shapes_it_takes_are_whole_programs():
    assert attention_kernels.TILE_ROWS == attention_kernels.COMPUTE_WGS * attention_kernels.ROWS
    assert attention_kernels.ROWS == 64  # one wgmma M per warpgroup
    assert attention_kernels.WIDTHS == (64, 128)
