"""sympow.layers.decode_linear: the fused product kernel (Pallas interpreter here) against
its jnp reference for every combination of LayerNorm, bias, GELU and residual, rows that
are not a multiple of 16, K read in several blocks; the reference against flax's own
LayerNorm and GELU; its refusals; and its Triton lowering for CUDA."""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from sympow.layers.decode_linear import (
    MAX_ROWS,
    STAGE_BYTES,
    STAGES,
    LayerNormWeights,
    LinearTiles,
    block_k,
    default_tiles,
    linear,
    linear_reference,
    linear_shapes_reason,
)


def _operands(rows, k, n, dtype, seed=0):
    keys = jax.random.split(jax.random.key(seed), 6)
    x = jax.random.normal(keys[0], (rows, k)).astype(dtype)
    wt = (jax.random.normal(keys[1], (n, k)) * k ** -0.5).astype(dtype)
    b = jax.random.normal(keys[2], (n,))
    norm = LayerNormWeights(1 + 0.1 * jax.random.normal(keys[3], (k,)),
                            0.1 * jax.random.normal(keys[4], (k,)), 1e-5)
    residual = jax.random.normal(keys[5], (rows, n)).astype(dtype)
    return x, wt, b, norm, residual


@pytest.mark.parametrize("use_norm, use_bias, gelu, use_residual",
                         list(itertools.product([False, True], repeat=4)))
def test_kernel_matches_reference_fp32(use_norm, use_bias, gelu, use_residual):
    """3 rows (16 computed, 13 masked off), K = 1536 in 3 blocks of 512, 2 column blocks."""
    x, wt, b, norm, residual = _operands(3, 1536, 32, jnp.float32)
    kw = dict(b=b if use_bias else None, norm=norm if use_norm else None, gelu=gelu,
              residual=residual if use_residual else None)
    got = linear(x, wt, **kw)
    want = linear_reference(x, wt, **kw)
    assert got.shape == (3, 32) and got.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rows", [1, 16, 17, MAX_ROWS])
def test_kernel_matches_reference_bf16_rows(rows):
    """bf16 operands, float32 and bf16 results; K = 48 (blocks of 16)."""
    x, wt, b, norm, residual = _operands(rows, 48, 16, jnp.bfloat16, seed=rows)
    for out_dtype in (jnp.float32, jnp.bfloat16):
        got = linear(x, wt, b, norm=norm, gelu=True, residual=residual, out_dtype=out_dtype)
        want = linear_reference(x, wt, b, norm=norm, gelu=True, residual=residual,
                                out_dtype=out_dtype)
        assert got.dtype == out_dtype
        tol = 1e-5 if out_dtype == jnp.float32 else 1e-2
        np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32),
                                   rtol=tol, atol=tol)


def test_reference_is_flax_layer_norm_then_dense_then_gelu():
    """The reference's LayerNorm and GELU are flax's (fast variance) and jax.nn.gelu's."""
    k, n = 32, 16
    x, wt, b, _, residual = _operands(4, k, n, jnp.float32)
    ln = nnx.LayerNorm(k, epsilon=1e-5, rngs=nnx.Rngs(0))
    ln.scale[...] = 1 + 0.1 * jnp.arange(k) / k
    ln.bias[...] = 0.01 * jnp.arange(k)
    norm = LayerNormWeights(ln.scale[...], ln.bias[...], ln.epsilon)
    with jax.default_matmul_precision("highest"):
        want = jax.nn.gelu(ln(x) @ wt.T + b, approximate=True) + residual
    got = linear_reference(x, wt, b, norm=norm, gelu=True, residual=residual)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)


def test_refusals_name_the_argument_and_shapes():
    x, wt, b, norm, residual = _operands(2, 32, 16, jnp.float32)
    with pytest.raises(ValueError, match=r"wt \[N, K\] \(W transposed\)"):
        linear(x, wt.T)
    with pytest.raises(ValueError, match="K = 24 is not a multiple of 16"):
        linear(x[:, :24], wt[:, :24])
    with pytest.raises(ValueError, match="N = 8 is not a multiple of 16"):
        linear(x, wt[:8])
    with pytest.raises(ValueError, match=f"65 rows \\(the kernel takes 1 to {MAX_ROWS}\\)"):
        linear(jnp.zeros((65, 32)), wt)
    with pytest.raises(ValueError, match=r"b must be \[N\] = \[16\]"):
        linear(x, wt, b[:8])
    with pytest.raises(ValueError, match=r"residual must be \[B, N\] = \[2, 16\]"):
        linear(x, wt, residual=residual[:1])
    with pytest.raises(ValueError, match=r"norm scale and bias must be \[K\] = \[32\]"):
        linear(x, wt, norm=LayerNormWeights(norm.scale[:16], norm.bias[:16], 1e-5))
    with pytest.raises(ValueError, match="impl must be one of \\('xla', 'pallas'\\)"):
        linear(x, wt, impl="cuda")
    assert linear_shapes_reason(1, 768, 2336) is None


def test_xla_impl_is_the_reference():
    x, wt, b, norm, residual = _operands(3, 64, 32, jnp.bfloat16)
    kw = dict(norm=norm, gelu=True, residual=residual, out_dtype=jnp.float32)
    np.testing.assert_array_equal(np.asarray(linear(x, wt, b, impl="xla", **kw)),
                                  np.asarray(linear_reference(x, wt, b, **kw)))


def test_lowers_for_cuda_through_triton():
    """GPT-2 small's widest products, every option on: the Triton lowering (pow2 loads,
    masked rows, the transposed dot) accepts them."""
    x = jnp.zeros((1, 3072), jnp.bfloat16)
    wt = jnp.zeros((768, 3072), jnp.bfloat16)
    norm = LayerNormWeights(jnp.ones(3072), jnp.zeros(3072), 1e-5)

    for unroll, fma in itertools.product((False, True), repeat=2):
        def fused(x, wt, b, residual, unroll=unroll, fma=fma):
            return linear(x, wt, b, norm=norm, gelu=True, residual=residual,
                          tiles=LinearTiles(block_n=8 if fma else 16, unroll=unroll, fma=fma),
                          interpret=False)

        text = jax.jit(fused).trace(x, wt, jnp.zeros(768), jnp.zeros((1, 768), jnp.bfloat16)
                                    ).lower(lowering_platforms=("cuda",)).as_text()
        assert "sympow_decode_linear" in text


def test_block_k_fits_the_shared_memory_of_three_stages():
    """GPT-2 small's products: K in the widest blocks whose stage fits STAGE_BYTES (64 float32
    rows at K = 768 asked for 228 KiB of shared memory at 512 on the H100)."""
    assert block_k(16, 768, 2) == 256 and block_k(16, 3072, 2) == 512
    assert block_k(64, 768, 4) == 128 and block_k(64, 3072, 2) == 256
    for rows, k, itemsize in itertools.product((16, 32, 64), (768, 3072, 48), (2, 4)):
        bk = block_k(rows, k, itemsize)
        assert k % bk == 0 and bk & (bk - 1) == 0
        assert bk == 16 or (rows + 16) * bk * itemsize * STAGES <= 3 * STAGE_BYTES


@pytest.mark.parametrize("tiles", [LinearTiles(block_n=32, warps=2, stages=2),
                                   LinearTiles(block_n=64, warps=8, max_block_k=16),
                                   LinearTiles(max_block_k=16, unroll=True)])
def test_other_launch_shapes_give_the_same_result(tiles):
    """N = 48 is not a multiple of 32 or 64: those run at 16 columns a program; N = 64 runs
    at the asked width."""
    for n in (48, 64):
        x, wt, b, norm, residual = _operands(5, 64, n, jnp.float32, seed=n)
        got = linear(x, wt, b, norm=norm, gelu=True, residual=residual, tiles=tiles)
        want = linear_reference(x, wt, b, norm=norm, gelu=True, residual=residual)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("block_n, unroll, dtype", [
    (4, False, jnp.float32), (8, True, jnp.float32), (32, False, jnp.float32),
    (8, False, jnp.bfloat16), (16, True, jnp.bfloat16)])
def test_one_row_on_the_cuda_cores_matches_reference(block_n, unroll, dtype):
    """fma: one row's product as weight tiles times x summed over K after the loop (K = 1536
    in 3 blocks of 512); N = 48 runs at block_n where it divides N, else at 16 columns."""
    tiles = LinearTiles(block_n=block_n, unroll=unroll, fma=True)
    x, wt, b, norm, residual = _operands(1, 1536, 48, dtype, seed=block_n)
    for kw in (dict(norm=norm, gelu=True), dict(residual=residual), {}):
        got = linear(x, wt, b, tiles=tiles, out_dtype=jnp.float32, **kw)
        want = linear_reference(x, wt, b, out_dtype=jnp.float32, **kw)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)


def test_fma_at_several_rows_runs_the_tensor_core_product():
    """fma is a one-row shape: 5 rows run the 16-row product at 16 columns a program."""
    x, wt, b, norm, residual = _operands(5, 64, 48, jnp.float32, seed=3)
    got = linear(x, wt, b, norm=norm, residual=residual,
                 tiles=LinearTiles(block_n=4, fma=True))
    want = linear_reference(x, wt, b, norm=norm, residual=residual)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)


def test_launch_shapes_are_checked():
    with pytest.raises(ValueError, match="block_n must be a power of two >= 16, got 24"):
        LinearTiles(block_n=24)
    with pytest.raises(ValueError, match="block_n must be a power of two >= 16, got 8"):
        LinearTiles(block_n=8)
    with pytest.raises(ValueError, match="block_n must be a power of two >= 4, got 2"):
        LinearTiles(block_n=2, fma=True)
    assert LinearTiles(block_n=4, fma=True).block_n == 4
    with pytest.raises(ValueError, match="warps must be 1, 2, 4 or 8"):
        LinearTiles(warps=3)


def test_default_tiles_follow_the_shape_of_the_product():
    one_row = dict(block_n=4, max_block_k=1024, unroll=True, fma=True)
    assert default_tiles(768, 3072, rows=1) == LinearTiles(warps=2, **one_row)
    assert default_tiles(768, 768, rows=1) == LinearTiles(warps=2, **one_row)
    assert default_tiles(3072, 768, rows=1) == LinearTiles(warps=4, **one_row)
    assert default_tiles(768, 3072, rows=16) == LinearTiles(block_n=32, warps=4)
    assert default_tiles(768, 2336, rows=16) == LinearTiles(block_n=32, warps=4)
    assert default_tiles(3072, 768, rows=16) == LinearTiles(block_n=16, warps=2)
    assert default_tiles(768, 768, rows=16) == LinearTiles(block_n=16, warps=1)
