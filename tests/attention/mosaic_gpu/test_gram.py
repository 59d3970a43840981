"""The square layout's normalizer sums (`gram.weighted_gram`): in the Pallas interpreter
against float64, float32-accurate where one bf16 product is not; lowered for CUDA, one
Triton kernel reading the bf16 rows (no float32 copy of them); its argument checks."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sympow.attention.mosaic_gpu import gram
from tests.attention.mosaic_gpu.test_attention_kernels import lowered


def _products64(a, x, kv_heads):
    """sum over the rows and the heads of a group of a_r x_r^T, in float64: [B, Hk, N, D, D]."""
    g = np.einsum("bhnci,bhncj->bhnij", np.asarray(a, np.float64), np.asarray(x, np.float64))
    b, hx, n, d = g.shape[0], g.shape[1], g.shape[2], g.shape[-1]
    return g.reshape(b, kv_heads, hx // kv_heads, n, d, d).sum(axis=2)


@pytest.mark.parametrize(("b", "hx", "hk", "n", "c", "d"), [
    (1, 2, 2, 2, 128, 64),  # one head a group, two steps a chunk
    (2, 4, 2, 3, 64, 16),  # two query heads a kv group, one step a chunk
])
@pytest.mark.parametrize("signed", [False, True], ids=["e2ls", "dden_e2ls"])
def test_the_gram_is_float32_accurate_where_a_bf16_product_is_not(rng, b, hx, hk, n, c, d,
                                                                   signed):
    x = jnp.asarray(rng.normal(size=(b, hx, n, c, d)), jnp.bfloat16)
    # weights over many binades, as e^(2 ls) of decayed rows (times a signed dden)
    w = np.exp(rng.uniform(-12.0, 2.0, size=(b, hx, n, c)))
    if signed:
        w = w * rng.normal(size=w.shape)
    w = jnp.asarray(w, jnp.float32)
    g = gram.weighted_gram(x, w, kv_heads=hk, interpret=True)
    assert g.shape == (b, hk, n, d, d) and g.dtype == jnp.float32
    x64, w64 = np.asarray(x, np.float64), np.asarray(w, np.float64)[..., None]
    want = _products64(w64 * x64, x64, hk)
    scale = _products64(np.abs(w64 * x64), np.abs(x64), hk)
    assert np.all(np.abs(np.asarray(g, np.float64) - want) <= 1e-6 * scale)
    # one bf16 product of w x would miss that bound: the split is what the test sees
    one_part = _products64((x.astype(jnp.float32) * w[..., None]).astype(jnp.bfloat16), x, hk)
    assert np.max(np.abs(one_part - want) / scale) > 1e-4


@pytest.mark.parametrize(("hx", "hk"), [(2, 2), (4, 2)])
def test_it_lowers_to_one_triton_kernel_reading_the_bf16_rows(hx, hk):
    b, n, c, d = 1, 4, 256, 64
    text = lowered(lambda x, w: gram.weighted_gram(x, w, kv_heads=hk),
                   ((b, hx, n, c, d), jnp.bfloat16), ((b, hx, n, c), jnp.float32))
    assert text.count("stablehlo.custom_call @__gpu$xla.gpu.triton") == 1
    assert "tensor<" + "x".join(map(str, (b, hx, n, c, d))) + "xf32>" not in text
    assert f"tensor<{b}x{hk}x{n}x{d}x{d}xf32>" in text


def test_bad_arguments_are_named():
    x = jnp.zeros((1, 4, 2, 128, 16), jnp.bfloat16)
    w = jnp.zeros((1, 4, 2, 128), jnp.float32)
    with pytest.raises(ValueError, match=r"x must be bfloat16"):
        gram.weighted_gram(x.astype(jnp.float32), w, kv_heads=2, interpret=True)
    with pytest.raises(ValueError, match=r"weights must have shape \(1, 4, 2, 128\)"):
        gram.weighted_gram(x, w[..., :64], kv_heads=2, interpret=True)
    with pytest.raises(ValueError, match=r"kv_heads=3 must divide x's 4 heads"):
        gram.weighted_gram(x, w, kv_heads=3, interpret=True)
    with pytest.raises(ValueError, match=r"chunk of 96 rows .* multiple of 64"):
        gram.weighted_gram(x[..., :96, :], w[..., :96], kv_heads=2, interpret=True)


def test_it_is_jit_compatible_and_linear_in_the_weights(rng):
    x = jnp.asarray(rng.normal(size=(1, 2, 1, 64, 16)), jnp.bfloat16)
    w = jnp.asarray(rng.uniform(size=(1, 2, 1, 64)), jnp.float32)
    fn = jax.jit(lambda x, w: gram.weighted_gram(x, w, kv_heads=1, interpret=True))
    g1, g2 = fn(x, w), fn(x, 2 * w)  # doubling is exact in every part
    np.testing.assert_array_equal(np.asarray(g2), 2 * np.asarray(g1))
