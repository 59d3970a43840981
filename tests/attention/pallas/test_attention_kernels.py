"""Intra-chunk attention kernels (attention_kernels.py) through their custom_vjp, against
the pure-JAX primitive: forward (o, den, m) and vjp."""

from __future__ import annotations

import pytest

from sympow.attention import xla
from tests.attention.pallas.helpers import chunk_inputs, primitives, vjp_close


@pytest.mark.parametrize("p", [2, 4])
def test_attention_primitive(x64, rng, p):
    q, k, v, g = chunk_inputs(rng)
    prims = primitives(p)
    # (o, den, m); m is a stop_gradient'ed row max in both, so its cotangent is ignored.
    vjp_close(lambda *a: prims.attention(*a, p=p), lambda *a: xla.attention(*a, p=p),
              (q, k, v, g), rng)
