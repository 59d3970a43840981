"""Launch helpers (launch.py): the Triton deprecation filter, index arithmetic, dot."""

from __future__ import annotations

import warnings

import jax.numpy as jnp
import numpy as np
import pytest

from sympow.attention.pallas import launch
from sympow.attention.pallas.plan import make_plan

MESSAGE = ("The Pallas Triton backend is deprecated and will be removed in a future JAX "
           "version.")


def test_triton_filter_silences_only_its_warning_and_installs_once():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        launch.ignore_triton_deprecation()
        launch.ignore_triton_deprecation()
        ours = [f for f in warnings.filters if getattr(f[1], "pattern", None)
                == launch.TRITON_DEPRECATION]
        assert len(ours) == 1
        warnings.warn(MESSAGE, DeprecationWarning, stacklevel=1)
        warnings.warn("another deprecation", DeprecationWarning, stacklevel=1)
        warnings.warn(MESSAGE, UserWarning, stacklevel=1)
    assert [(str(w.message), w.category) for w in caught] == [
        ("another deprecation", DeprecationWarning), (MESSAGE, UserWarning)]


def test_index_helpers():
    assert int(launch.idiv(17, 5)) == 3 and int(launch.irem(17, 5)) == 2
    assert tuple(map(int, launch.split_heads(jnp.int32(11), 4))) == (2, 3)


@pytest.mark.parametrize(("trans_a", "trans_b"), [(False, False), (True, False), (False, True)])
def test_dot_transposes_and_accumulates_in_float32(rng, trans_a, trans_b):
    plan = make_plan(2, 16, 16, 16, "bfloat16", True)
    a = rng.normal(size=(8, 4) if trans_a else (4, 8)).astype(np.float32)
    b = rng.normal(size=(6, 8) if trans_b else (8, 6)).astype(np.float32)
    out = launch.dot(jnp.asarray(a), jnp.asarray(b), plan, trans_a=trans_a, trans_b=trans_b)
    assert out.dtype == jnp.float32 and out.shape == (4, 6)
    as_bf16 = lambda x: np.asarray(jnp.asarray(x, jnp.bfloat16), np.float32)  # noqa: E731
    expected = ((as_bf16(a).T if trans_a else as_bf16(a)) @ (as_bf16(b).T if trans_b
                                                             else as_bf16(b)))
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-5)
