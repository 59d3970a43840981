"""The specification forms (reference.py): the shared suite for impl='reference' (the
attention form), and the recurrent form against the attention form."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from sympow.attention import reference
from sympow.attention.testing import attention_inputs, max_err
from tests.attention.helpers import CASES, rotate
from tests.attention.suite import AttentionSuite

attention_form = jax.jit(reference.attention_form, static_argnums=4)
recurrent_form = jax.jit(reference.recurrent_form, static_argnums=4)


class TestReference(AttentionSuite):
    impl = "reference"
    chunk = None


@pytest.mark.parametrize(("t", "p", "heads", "gating", "rotary"),
                         [(t, p, h, g, r) for t, _, p, h, g, r in CASES if t < 200])
def test_recurrent_equals_attention_form(x64, rng, t, p, heads, gating, rotary):
    """In float64: the recurrence evaluates phi(Q).S, which cancels terms of size
    (|Q||K|)^p down to (Q.K)^p, so for p = 4 on random inputs float32 keeps too few digits for a
    tight comparison (see test_recurrent_fp32_p2 for the float32 case)."""
    q, k, v, log_g = attention_inputs(rng, b=2, t=t, hq=heads[0], hk=heads[1], gating=gating,
                                      dtype=jnp.float64)
    q, k = rotate(q, k, rotary, rng)
    expected = attention_form(q, k, v, log_g, p)
    got, _ = recurrent_form(q, k, v, log_g, p)
    assert got.dtype == jnp.float64
    assert max_err(got, expected) < 1e-8


@pytest.mark.parametrize("gating", [False, True])
def test_recurrent_fp32_p2(rng, gating):
    q, k, v, log_g = attention_inputs(rng, t=50, gating=gating)
    expected = attention_form(q, k, v, log_g, 2)
    got, _ = recurrent_form(q, k, v, log_g, 2)
    assert max_err(got, expected) < 5e-5
