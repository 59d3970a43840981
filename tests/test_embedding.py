"""phi^p identities, feature dimensions and the state tables of [sympow]."""

from __future__ import annotations

import itertools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import sympow
from sympow.embedding import embedding_tables


def naive_symmetric_power(x: np.ndarray, p: int) -> np.ndarray:
    """Seed 000's loop: sqrt(multinomial) * prod x[alpha] over non-decreasing alpha."""
    out = []
    for alpha in itertools.combinations_with_replacement(range(len(x)), p):
        counts = [alpha.count(i) for i in set(alpha)]
        multinomial = math.factorial(p) // math.prod(math.factorial(c) for c in counts)
        out.append(math.sqrt(multinomial) * math.prod(x[a] for a in alpha))
    return np.array(out)


@pytest.mark.parametrize("p", [2, 4, 6, 8])
@pytest.mark.parametrize("tile", [1, 2, 4, 8])
def test_inner_product_is_power(x64, rng, p, tile):
    d = 8
    q, k = rng.normal(size=(2, 5, d))
    phi_q = sympow.sympow_embedding(jnp.asarray(q), p, tile)
    phi_k = sympow.sympow_embedding(jnp.asarray(k), p, tile)
    assert phi_q.shape == (5, sympow.expanded_dim(d, p, tile))
    # The feature sum cancels terms of size (|q| |k|)^p down to (q . k)^p: bound the error
    # against that scale (float64 rounding times a few thousand terms).
    scale = (np.linalg.norm(q, axis=-1) * np.linalg.norm(k, axis=-1)) ** p
    error = np.abs((phi_q * phi_k).sum(-1) - np.sum(q * k, -1) ** p)
    assert np.all(error <= 1e-12 * scale), error / scale


@pytest.mark.parametrize("p", [2, 3, 4])
def test_symmetric_power_matches_the_articles_loop(x64, rng, p):
    x = rng.normal(size=6)
    np.testing.assert_allclose(sympow.sympow_embedding(jnp.asarray(x), p),
                               naive_symmetric_power(x, p), rtol=1e-12)


def test_tensor_power_is_flattened_outer_product(x64, rng):
    x = rng.normal(size=4)
    expected = np.einsum("i,j,k->ijk", x, x, x).reshape(-1)
    got = sympow.sympow_embedding(jnp.asarray(x), 3, tile=4)
    np.testing.assert_allclose(np.sort(got), np.sort(expected), rtol=1e-12)


@pytest.mark.parametrize(("d", "p", "tile", "expected"), [
    (64, 2, 1, 2080), (64, 4, 1, 766480), (64, 2, 64, 4096), (64, 4, 64, 64**4),
    (64, 2, 16, 10 * 256), (8, 3, 2, math.comb(6, 3) * 8), (5, 1, 1, 5),
])
def test_expanded_dim(d, p, tile, expected):
    assert sympow.expanded_dim(d, p, tile) == expected


def test_tables_are_cached_and_readonly():
    index, weight = embedding_tables(6, 2, 3)
    assert embedding_tables(6, 2, 3)[0] is index
    assert not index.flags.writeable and not weight.flags.writeable


# Seed 000 tables: GPT-2 small, 12 layers x 12 heads, d = e = 64, 2 bytes per number.
@pytest.mark.parametrize(("p", "tile", "unit", "printed"), [
    (2, 1, 1e6, 39), (4, 1, 1e9, 14), (6, 1, 1e12, 2.2), (8, 1, 1e12, 199),
    (2, 64, 1e6, 77), (4, 64, 1e9, 314), (6, 64, 1e15, 1.3), (8, 64, 1e18, 5.3),
])
def test_state_tables_of_the_sympow_article(p, tile, unit, printed):
    size = sympow.state_bytes(64, p, layers=12, heads=12, tile=tile) / unit
    digits = 1 if printed < 10 else 0
    assert round(size, digits) == printed


def test_state_bytes_formula():
    f = sympow.expanded_dim(32, 2)
    assert sympow.state_bytes(32, 2, e=16, layers=3, heads=5, bytes_per_number=4) == \
        3 * 5 * f * 17 * 4


def test_batch_shapes_jit_and_grad(rng):
    x = jnp.asarray(rng.normal(size=(2, 3, 4, 8)), jnp.float32)
    y = jnp.asarray(rng.normal(size=(8,)), jnp.float32)
    phi = jax.jit(sympow.sympow_embedding, static_argnums=(1, 2))(x, 4, 2)
    assert phi.shape == (2, 3, 4, sympow.expanded_dim(8, 4, 2))
    assert phi.dtype == jnp.float32

    def via_phi(x):
        return (sympow.sympow_embedding(x, 4) @ sympow.sympow_embedding(y, 4)).sum()

    def direct(x):
        return ((x @ y) ** 4).sum()

    np.testing.assert_allclose(jax.grad(via_phi)(x), jax.grad(direct)(x), rtol=2e-4, atol=1e-3)


def test_rotation_preserves_inner_products(x64, rng):
    """Seed 002 Proposition 2: phi(Pk) = Pbar phi(k) with Pbar orthogonal, so a rotation of
    the inputs preserves every phi inner product (and phi norms)."""
    d, p = 6, 4
    rotation, _ = np.linalg.qr(rng.normal(size=(d, d)))
    x = rng.normal(size=(10, d))
    phi = np.asarray(sympow.sympow_embedding(jnp.asarray(x), p))
    phi_rot = np.asarray(sympow.sympow_embedding(jnp.asarray(x @ rotation.T), p))
    np.testing.assert_allclose(phi_rot @ phi_rot.T, phi @ phi.T, rtol=1e-9, atol=1e-9)
    # Pbar solves phi_rot = phi Pbar^T; with F <= 10 samples not enough to pin it, check its
    # defining consequence on fresh points instead: Gram matrices of any set agree.
    z = rng.normal(size=(3, d))
    a = np.asarray(sympow.sympow_embedding(jnp.asarray(z), p))
    b = np.asarray(sympow.sympow_embedding(jnp.asarray(z @ rotation.T), p))
    np.testing.assert_allclose(b @ phi_rot.T, a @ phi.T, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"d": 8, "p": 0}, "p must be a positive int"),
    ({"d": 8, "p": 2, "tile": 3}, "tile must be a positive divisor of d=8"),
    ({"d": 0, "p": 2}, "d must be a positive int"),
    ({"d": True, "p": 2}, r"d must be a positive int, got d=True"),
    ({"d": 8, "p": True}, r"p must be a positive int, got p=True"),
    ({"d": 8, "p": 2, "tile": True}, r"tile must be a positive divisor of d=8, got tile=True"),
])
def test_invalid_dims(kwargs, match):
    with pytest.raises(ValueError, match=match):
        sympow.expanded_dim(**kwargs)


def test_invalid_state_bytes_and_embedding_inputs():
    with pytest.raises(ValueError, match="layers must be a positive int"):
        sympow.state_bytes(64, 2, layers=0)
    with pytest.raises(ValueError, match="x must be floating point"):
        sympow.sympow_embedding(jnp.arange(4), 2)


def test_numpy_ints_count_as_ints():
    assert sympow.expanded_dim(np.int64(64), np.int32(2), np.int64(1)) == 2080
    size = sympow.state_bytes(np.int64(64), 8, layers=np.int64(12), heads=12, tile=64)
    assert type(size) is int and size == 12 * 12 * 64**8 * 65 * 2  # no int64 wrap-around


@pytest.mark.parametrize(("args", "kwargs", "match"), [
    ((-64, 2), {}, r"d must be a positive int, got d=-64"),
    ((64, 2), {"e": -1}, r"e must be a positive int, got e=-1"),
    ((64, 2), {"heads": True}, r"heads must be a positive int, got heads=True"),
    ((64, 2), {"bytes_per_number": float("nan")},
     r"bytes_per_number must be a finite number > 0, got bytes_per_number=nan"),
    ((64, 2), {"bytes_per_number": float("inf")},
     r"bytes_per_number must be a finite number > 0, got bytes_per_number=inf"),
    ((64, 2), {"bytes_per_number": "2"},
     r"bytes_per_number must be a finite number > 0, got bytes_per_number='2'"),
    ((64, 2), {"bytes_per_number": 0}, r"bytes_per_number must be a finite number > 0"),
    ((64, 2), {"bytes_per_number": True}, r"got bytes_per_number=True"),
])
def test_invalid_state_bytes_names_the_argument(args, kwargs, match):
    with pytest.raises(ValueError, match=match):
        sympow.state_bytes(*args, **kwargs)
