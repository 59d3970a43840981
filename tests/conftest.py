"""Shared fixtures: fresh random inputs and scoped float64 mode."""

from __future__ import annotations

import zlib

import numpy as np
import pytest

from sympow.attention.testing import float64_enabled


@pytest.fixture
def x64():
    """Enable float64 inside one test (exactness checks of the math), then restore."""
    with float64_enabled():
        yield


@pytest.fixture
def rng(request):
    """A numpy Generator seeded from the test's id: each test draws its own inputs, and a
    failure reproduces."""
    seed = zlib.crc32(request.node.nodeid.encode())
    return np.random.default_rng(seed)
