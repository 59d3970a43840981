"""Shared fixtures: fresh random inputs, scoped float64 mode and fresh traces; the scripts'
compilation cache in a temporary directory."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
import zlib

import jax
import numpy as np
import pytest

from sympow.attention.testing import float64_enabled
from sympow.train.compilation import ENV_VAR

# The command-line tools cache compiled programs in ~/.cache by default: the scripts the tests
# launch use a directory of this session instead, removed at exit.
os.environ[ENV_VAR] = tempfile.mkdtemp(prefix="sympow-test-compilation-cache-")
atexit.register(shutil.rmtree, os.environ[ENV_VAR], ignore_errors=True)


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


@pytest.fixture
def fresh_traces():
    """For a test that monkeypatches a function called while tracing: jax's caches cleared
    before it (a jit traced by an earlier test of the same shapes would skip the patch) and
    after it (none keeps the patched trace for a later test)."""
    jax.clear_caches()
    yield
    jax.clear_caches()
