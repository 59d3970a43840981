"""vjps.py helpers: the two-level reverse cumulative sum that turns dG into dlog_g."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from sympow.attention.pallas.vjps import _reverse_cumsum


@pytest.mark.parametrize(("length", "block"), [(256, 16), (64, 64), (128, 32)])
def test_reverse_cumsum_matches_numpy(x64, rng, length, block):
    x = rng.normal(size=(2, 3, 1, length))
    want = np.flip(np.cumsum(np.flip(x, -1), -1), -1)
    got = _reverse_cumsum(jnp.asarray(x), block)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-12, atol=1e-12)
