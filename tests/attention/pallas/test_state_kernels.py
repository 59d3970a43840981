"""State kernels (state_kernels.py) through the update_state and query_state custom_vjps,
against the pure-JAX primitives; the dtypes of the states between kernels."""

from __future__ import annotations

import functools

import jax.numpy as jnp
import pytest

from sympow.attention import xla
from sympow.attention.chunked import combine
from sympow.attention.pallas import plan as pallas_plan
from sympow.attention.testing import rel_err
from sympow.embedding import sympow_embedding
from tests.attention.pallas.helpers import chunk_inputs, compiled, primitives, tiled, vjp_close


@pytest.mark.parametrize(("p", "d"), [(2, 32), (4, 16)])
def test_update_state_primitive(x64, rng, p, d):
    """Compared in the tile=1 layout: the kernels' states gathered by to_symmetric_layout."""
    _, k, v, g = chunk_inputs(rng, d=d)
    index, scale = tiled(d, p)
    vjp_close(lambda *a: to_symmetric(*primitives(p).update_state(*a, p=p), index, scale),
              lambda *a: xla.update_state(*a, p=p), (k, v, g), rng)


def to_symmetric(s, z, index, scale):
    return s[..., index, :] * scale[:, None], z[..., index] * scale


def tiled_query_state(q, s_in, z_in, g, o, den, m, *, p, tile):
    """xla.query_state with the tiled embedding: the oracle in the kernels' layout."""
    b, hq, n, c, d = q.shape
    hk = s_in.shape[1]
    phi = sympow_embedding(q.reshape(b, hk, hq // hk, n, c, d), p, tile)
    phi = phi * jnp.exp(g)[:, :, None, :, :, None]
    inter_o = jnp.einsum("bhrncf,bhnfe->bhrnce", phi, s_in, precision="highest")
    inter_den = jnp.einsum("bhrncf,bhnf->bhrnc", phi, z_in, precision="highest")
    merge = lambda x: x.reshape(b, hq, *x.shape[3:])  # noqa: E731
    return combine(o, den, m, merge(inter_o), merge(inter_den))


@pytest.mark.parametrize(("p", "d"), [(2, 32), (4, 16)])
def test_query_state_primitive(x64, rng, p, d):
    q, k, v, g = chunk_inputs(rng, d=d)
    prims = primitives(p)

    @compiled
    def setup(q, k, v, g):  # states in the kernels' layout, intra-chunk terms from the oracle
        s_in, z_in, *_ = prims.prefix_sum(*prims.update_state(k, v, g, p=p), g[..., -1])
        return (q, s_in, z_in, g, *xla.attention(q, k, v, g, p=p))

    vjp_close(lambda *a: prims.query_state(*a, p=p),
              functools.partial(tiled_query_state, p=p, tile=pallas_plan.tile_width(d, p)),
              setup(q, k, v, g), rng)


def test_bf16_states_between_kernels(rng):
    """bf16 inputs: per-chunk and prefix states are stored in bf16 (they only feed MMAs), z
    and the final state in float32, all within bf16 rounding of the float32 oracle."""
    _, k, v, g = chunk_inputs(rng, d=32, n=4, dtype=jnp.bfloat16)
    prims = primitives(2)
    s, z = compiled(lambda *a: prims.update_state(*a, p=2))(k, v, g)
    s_in, z_in, s_fin, z_fin = compiled(prims.prefix_sum)(s, z, g[..., -1])
    assert s.dtype == s_in.dtype == jnp.bfloat16
    assert z.dtype == z_in.dtype == s_fin.dtype == z_fin.dtype == jnp.float32
    f32 = lambda x: jnp.asarray(x, jnp.float32)  # noqa: E731
    s_ref, z_ref = xla.update_state(f32(k), f32(v), g, p=2)
    s_in_ref, z_in_ref, s_fin_ref, z_fin_ref = xla.prefix_sum(s_ref, z_ref, g[..., -1])
    index, scale = tiled(32, 2)
    to_sym = lambda x: f32(x)[..., index, :] * scale[:, None]  # noqa: E731
    # bf16 S: each entry rounded once (2^-9) over bf16 MMA operands; z sums in float32.
    for got, want, tol in [(to_sym(s), s_ref, 2 ** -7), (to_sym(s_in), s_in_ref, 2 ** -7),
                           (s_fin, s_fin_ref, 2 ** -7), (z_fin, z_fin_ref, 1e-5),
                           (f32(z_in)[..., index] * scale, z_in_ref, 1e-5)]:
        assert rel_err(got, want) <= tol, (rel_err(got, want), tol)
