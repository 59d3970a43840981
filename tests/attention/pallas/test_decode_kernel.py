"""The fused decoding step (pallas/decode_kernel.py) in the interpreter: the state and the
output of `reference.recurrent_step` over several chained steps, every shape the plan takes,
the in-place update, and the logged fallbacks."""

from __future__ import annotations

import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sympow.attention import api, reference
from sympow.attention.pallas import decode_kernel


def history_state(rng, b, hk, d, e, p, length=12):
    """The state after `length` random tokens (a prompt): its denominators are sums of many
    non-negative terms, so the readout is well conditioned, as after a real prefill."""
    q = jnp.asarray(rng.normal(size=(b, length, hk, d)), jnp.float32)
    k = jnp.asarray(rng.normal(size=(b, length, hk, d)) / np.sqrt(d), jnp.float32)
    v = jnp.asarray(rng.normal(size=(b, length, hk, e)), jnp.float32)
    log_g = jnp.asarray(np.log(rng.uniform(0.8, 1.0, size=(b, length, hk))), jnp.float32)
    _, state = reference.recurrent_form(q, k, v, log_g, p)
    return state


def token(rng, b, hq, hk, d, e, dtype, gated=True):
    q = jnp.asarray(rng.normal(size=(b, hq, d)), dtype)
    k = jnp.asarray(rng.normal(size=(b, hk, d)) / np.sqrt(d), dtype)
    v = jnp.asarray(rng.normal(size=(b, hk, e)), dtype)
    log_g = jnp.asarray(np.log(rng.uniform(0.8, 1.0, size=(b, hk))), jnp.float32)
    return q, k, v, log_g if gated else None


@pytest.mark.parametrize(("b", "hq", "hk", "d", "e", "p"), [
    (2, 4, 2, 16, 16, 2),   # F = 136: rows 8; grouped heads R = 2
    (1, 3, 1, 8, 32, 2),    # R = 3 padded to 4; F = 36
    (2, 2, 2, 8, 16, 4),    # p = 4: F = 330
    (1, 12, 12, 32, 64, 2),  # GPT-2 small's head size: F = 528
])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("gated", [True, False])
def test_fused_step_matches_the_reference_over_chained_steps(rng, b, hq, hk, d, e, p, dtype,
                                                             gated):
    fused = expected = history_state(rng, b, hk, d, e, p)
    for _ in range(3):
        q, k, v, log_g = token(rng, b, hq, hk, d, e, dtype, gated)
        fused, y = api.decode_step(fused, q, k, v, log_g, p=p, impl="pallas")
        expected, y_ref = api.decode_step(expected, q, k, v, log_g, p=p, impl="reference")
        assert y.shape == (b, hq, e) and y.dtype == dtype
        for got, want in ((fused.s, expected.s), (fused.z, expected.z)):
            # entries near zero are cancellations of larger terms: tolerance per the largest
            np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=0,
                                       atol=2e-6 * float(jnp.max(jnp.abs(want))))
        tol = 1e-5 if dtype == jnp.float32 else 1e-2  # bf16: the output's own rounding
        np.testing.assert_allclose(np.asarray(y, np.float32), np.asarray(y_ref, np.float32),
                                   rtol=tol, atol=tol * float(jnp.max(jnp.abs(y_ref))))


def test_the_state_is_updated_in_place():
    """The kernel aliases the state's buffers to its outputs (no second [F, E] buffer)."""
    rng = np.random.default_rng(0)
    state = history_state(rng, 1, 2, 8, 16, 2)
    q, k, v, log_g = token(rng, 1, 2, 2, 8, 16, jnp.float32)
    plan = decode_kernel.make_decode_plan(36, 1, 16, interpret=True)
    jaxpr = jax.make_jaxpr(lambda *a: decode_kernel.fused_step(plan, *a, p=2))(
        state, q, k, v, log_g)
    calls = [eq for eq in jaxpr.eqns if eq.primitive.name == "pallas_call"]
    assert len(calls) == 1
    assert tuple(calls[0].params["input_output_aliases"]) == ((0, 0), (1, 1))


def test_plans():
    plan = decode_kernel.make_decode_plan(2080, 1, 64, interpret=False)  # GPT-2: d = 64, p = 2
    assert (plan.rows, plan.groups) == (32, 1)  # 2080 = 32 * 65
    assert decode_kernel.make_decode_plan(2080, 6, 64, interpret=False).groups == 8
    assert decode_kernel.make_decode_plan(2080, 8, 64, interpret=False).rows == 16  # budget
    assert decode_kernel.make_decode_plan(766480, 1, 64, interpret=False).rows == 16  # p = 4
    assert "E = 24" in decode_kernel.make_decode_plan(36, 1, 24, interpret=False)


def test_shapes_the_kernel_does_not_take_fall_back_with_a_logged_reason(rng, caplog):
    state = history_state(rng, 1, 1, 8, 24, 2)
    q, k, v, log_g = token(rng, 1, 1, 1, 8, 24, jnp.float32)
    decode_kernel._log_fallback.cache_clear()
    with caplog.at_level(logging.WARNING, logger=decode_kernel.__name__):
        got, y = api.decode_step(state, q, k, v, log_g, impl="pallas")
    assert "value width E = 24" in caplog.text
    want, y_ref = api.decode_step(state, q, k, v, log_g, impl="reference")
    np.testing.assert_array_equal(np.asarray(y), np.asarray(y_ref))
    np.testing.assert_array_equal(np.asarray(got.s), np.asarray(want.s))


def test_a_float64_state_falls_back(x64, rng, caplog):
    state = jax.tree.map(lambda x: x.astype(jnp.float64), history_state(rng, 1, 1, 8, 16, 2))
    q, k, v, log_g = token(rng, 1, 1, 1, 8, 16, jnp.float64)
    decode_kernel._log_fallback.cache_clear()
    with caplog.at_level(logging.WARNING, logger=decode_kernel.__name__):
        got, _ = api.decode_step(state, q, k, v, log_g, impl="pallas")
    assert "float64 state" in caplog.text and got.s.dtype == jnp.float64


def test_unknown_impl_is_named():
    rng = np.random.default_rng(1)
    state = history_state(rng, 1, 1, 8, 16, 2)
    q, k, v, log_g = token(rng, 1, 1, 1, 8, 16, jnp.float32)
    with pytest.raises(ValueError, match=r"impl must be one of \('pallas', 'reference'\) or "
                                         r"None, got impl='xla'"):
        api.decode_step(state, q, k, v, log_g, impl="xla")
