"""phi tiles (phi.py) outside the kernels: the tile tables and tile products reproduce the
tiled embedding of sympow.embedding, their backward is autodiff's, and the gather to the
tile=1 layout gives the symmetric power embedding."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sympow.attention.pallas import phi
from sympow.embedding import sympow_embedding

SHAPES = [(16, 2, 16), (32, 2, 16), (16, 4, 4), (32, 4, 4)]  # (d, p, tile) the tier uses


def factors_of(x, blocks, tile):
    return [x[:, a * tile:(a + 1) * tile] for a in blocks]


@pytest.mark.parametrize(("d", "p", "tile"), SHAPES)
def test_tiles_from_tables_are_the_tiled_embedding(rng, d, p, tile):
    x = jnp.asarray(rng.normal(size=(5, d)), jnp.float32)
    expected = np.asarray(sympow_embedding(x, p, tile))  # [5, F]
    blocks, weights = phi.tile_tables(d, p, tile)
    tp = tile ** p
    assert blocks.shape == (expected.shape[1] // tp, p)
    for f, (sequence, weight) in enumerate(zip(blocks, weights, strict=True)):
        tile_values = phi.tile_products(factors_of(x, sequence, tile))[-1] * weight
        np.testing.assert_allclose(tile_values, expected[:, f * tp:(f + 1) * tp], rtol=1e-6)


@pytest.mark.parametrize(("d", "p", "tile"), SHAPES)
def test_gather_to_symmetric_layout(x64, rng, d, p, tile):
    x = jnp.asarray(rng.normal(size=(4, d)), jnp.float64)
    rows, scale = phi.to_symmetric_layout(d, p, tile)
    tiled = np.asarray(sympow_embedding(x, p, tile))
    np.testing.assert_allclose(tiled[:, rows] * scale, sympow_embedding(x, p, 1), rtol=1e-6)


@pytest.mark.parametrize("p", [2, 4])
def test_tile_factor_grads_are_the_vjp_of_tile_products(rng, p):
    factors = [jnp.asarray(rng.normal(size=(3, 4)), jnp.float32) for _ in range(p)]
    dtile = jnp.asarray(rng.normal(size=(3, 4 ** p)), jnp.float32)
    _, vjp = jax.vjp(lambda *fs: phi.tile_products(list(fs))[-1], *factors)
    got = phi.tile_factor_grads(dtile, factors, phi.tile_products(factors))
    for g, want in zip(got, vjp(dtile), strict=True):
        np.testing.assert_allclose(g, want, rtol=1e-5, atol=1e-6)


def test_scatter_blocks_adds_each_gradient_at_its_block():
    acc = jnp.zeros((2, 3, 4))
    grads = [jnp.full((2, 4), 1.0), jnp.full((2, 4), 10.0), jnp.full((2, 4), 100.0)]
    out = np.asarray(phi.scatter_blocks(acc, grads, [jnp.int32(0), jnp.int32(2), jnp.int32(2)]))
    np.testing.assert_array_equal(out[:, 0], 1.0)
    np.testing.assert_array_equal(out[:, 1], 0.0)
    np.testing.assert_array_equal(out[:, 2], 110.0)
