"""Prefix-sum kernels (prefix_kernels.py) through their custom_vjp, against the pure-JAX
prefix sum; the final state comes back in the tile=1 layout."""

from __future__ import annotations

import pytest

from sympow.attention import xla
from tests.attention.pallas.helpers import chunk_inputs, compiled, primitives, tiled, vjp_close


@pytest.mark.parametrize(("p", "d"), [(2, 32), (4, 16)])
def test_prefix_sum_primitive(x64, rng, p, d):
    """States in the kernels' layout from update_state; the prefix sum is layout-agnostic
    except for the final state it returns in tile=1."""
    _, k, v, g = chunk_inputs(rng, d=d)
    prims = primitives(p)
    index, scale = tiled(d, p)
    s, z = compiled(lambda *a: prims.update_state(*a, p=p))(k, v, g)

    def oracle(s, z, g_last):
        s_in, z_in, s_fin, z_fin = xla.prefix_sum(s, z, g_last)
        return s_in, z_in, s_fin[..., index, :] * scale[:, None], z_fin[..., index] * scale

    vjp_close(prims.prefix_sum, oracle, (s, z, g[..., -1]), rng)
