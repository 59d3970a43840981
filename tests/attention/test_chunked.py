"""The chunked algorithm (chunked.py, here over the pure-JAX primitives) equals the
attention form: outputs, gradients, and the state prefill hands to decode_step."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import sympow
from sympow.attention import reference, xla
from sympow.attention.chunked import (
    chunked_attention,
    combine,
    combine_weights,
    gates_or_zeros,
    norm_bound,
    normalize_queries_and_keys,
)
from sympow.attention.testing import attention_inputs, max_err, rel_err
from tests.attention.helpers import CASES, rotate

attention_form = jax.jit(reference.attention_form, static_argnums=4)
recurrent_form = jax.jit(reference.recurrent_form, static_argnums=4)


@functools.partial(jax.jit, static_argnums=(4, 5))
def chunked(q, k, v, log_g, p, chunk):
    return chunked_attention(q, k, v, log_g, p=p, chunk_size=chunk, primitives=xla.PRIMITIVES)


@pytest.mark.parametrize(("t", "chunk", "p", "heads", "gating", "rotary"), CASES)
def test_chunked_equals_attention_form_fp32(rng, t, chunk, p, heads, gating, rotary):
    q, k, v, log_g = attention_inputs(rng, b=2, t=t, hq=heads[0], hk=heads[1], gating=gating)
    q, k = rotate(q, k, rotary, rng)
    expected = attention_form(q, k, v, log_g, p)
    got, _ = chunked(q, k, v, log_g, p, chunk)
    assert got.shape == expected.shape == (2, t, heads[0], v.shape[-1])
    assert max_err(got, expected) < 2e-5


@pytest.mark.parametrize(("t", "chunk", "p", "heads", "gating"), [
    (7, 8, 2, (4, 2), True),
    (37, 8, 2, (2, 2), True),
    (37, 16, 4, (4, 2), True),
    (40, 8, 4, (2, 1), False),
])
def test_chunked_gradients_equal_attention_form(rng, t, chunk, p, heads, gating):
    q, k, v, log_g = attention_inputs(rng, t=t, hq=heads[0], hk=heads[1], gating=gating)
    cotangent = jnp.asarray(rng.normal(size=(2, t, heads[0], v.shape[-1])), jnp.float32)
    args = (q, k, v, log_g) if gating else (q, k, v)

    def loss(impl, *args):
        y = sympow.sympow_attention(*args, p=p, chunk_size=chunk, impl=impl,
                                    algorithm=None if impl == "reference" else "chunked")
        return jnp.sum(y * cotangent)

    argnums = tuple(range(len(args)))
    expected = jax.jit(jax.grad(functools.partial(loss, "reference"), argnums))(*args)
    got = jax.jit(jax.grad(functools.partial(loss, "xla"), argnums))(*args)
    for name, g_got, g_expected in zip("q k v log_g".split(), got, expected, strict=False):
        assert rel_err(g_got, g_expected) < 2e-5, name


def test_prefill_then_decode_continues_attention(rng):
    p, t = 2, 21
    q, k, v, log_g = attention_inputs(rng, t=t + 3)
    expected = attention_form(q, k, v, log_g, p)
    y, state = sympow.prefill(q[:, :t], k[:, :t], v[:, :t], log_g[:, :t], p=p, chunk_size=8)
    assert max_err(y, expected[:, :t]) < 2e-5
    for i in range(t, t + 3):
        state, y_i = sympow.decode_step(state, q[:, i], k[:, i], v[:, i], log_g[:, i], p=p)
        assert max_err(y_i, expected[:, i]) < 5e-5


def test_prefill_state_is_in_true_units(x64, rng):
    """The chunked driver normalizes keys; the state it returns must not be."""
    q, k, v, log_g = attention_inputs(rng, t=30, dtype=jnp.float64, scale=7.0)
    _, expected = recurrent_form(q, k, v, log_g, 4)
    _, state = sympow.prefill(q, k, v, log_g, p=4, chunk_size=8)
    assert rel_err(state.s, expected.s) < 1e-12 and rel_err(state.z, expected.z) < 1e-12


@pytest.mark.parametrize(("impl", "algorithm"), [("xla", "chunked"), ("xla", "attention"),
                                                 ("pallas", "chunked"), ("pallas", "attention")])
def test_ungated_zeros_are_not_constants_xla_can_fold(impl, algorithm):
    """An ungated call's zero gates pass an optimization barrier in every tier and form: XLA's
    GPU compiler constant-folded the gate sums of plain zeros for minutes (H100, jax 0.11.2)."""
    q = k = v = jnp.ones((1, 40, 2, 8), jnp.float32)

    def barriers(log_g):  # remat lowers through barriers too: count, gated vs not
        loss = lambda q, k, v: jnp.sum(sympow.sympow_attention(  # noqa: E731
            q, k, v, log_g, p=2, chunk_size=16, impl=impl, algorithm=algorithm))
        hlo = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(q, k, v).as_text()
        return hlo.count("optimization_barrier")

    assert barriers(None) > barriers(jnp.zeros((1, 40, 2), jnp.float32))


def test_gates_or_zeros_casts_given_gates_and_fills_zeros():
    k = jnp.ones((2, 5, 3, 4), jnp.bfloat16)
    log_g = -jnp.arange(30, dtype=jnp.bfloat16).reshape(2, 5, 3)
    given = gates_or_zeros(log_g, k, jnp.float32)
    assert given.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(given), np.asarray(log_g, np.float32))
    zeros = gates_or_zeros(None, k, jnp.float32)
    assert zeros.shape == (2, 5, 3) and zeros.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(zeros), 0.0)


@pytest.mark.parametrize("scale", [2.0**-100, 2.0**-66, 1.0, 2.0**66, 2.0**100])
def test_the_scales_bound_every_norm_across_float32s_range(rng, scale):
    """q per row and k per (batch, head) divided by powers of two: each unit row's norm in
    (1 / (2 sqrt(D)), 1] at every scale (the norm's own sum of squares overflows from ~1.8e19
    and underflows below ~1e-19), key_scale the keys' power of two, zero rows unchanged."""
    q, k, _, _ = attention_inputs(rng, b=2, t=9, hq=4, hk=2, d=16)
    q, k = (q * scale).at[0, 3].set(0.0), k * scale
    q_unit, k_unit, key_scale = normalize_queries_and_keys(q, k)
    norms = np.linalg.norm(np.asarray(q_unit, np.float64), axis=-1)
    assert np.all(norms[0, 3] == 0)
    nonzero = np.delete(norms, 3, axis=1)
    assert np.all(nonzero <= 1) and np.all(nonzero > 1 / (2 * 4))
    head_max = np.linalg.norm(np.asarray(k_unit, np.float64), axis=-1).max(axis=1)
    assert np.all(head_max <= 1) and np.all(head_max > 1 / (2 * 4))
    assert key_scale.shape == (2, 2)
    log2 = np.log2(np.asarray(key_scale, np.float64))
    np.testing.assert_array_equal(log2, np.round(log2))  # exact powers of two
    np.testing.assert_array_equal(np.asarray(k_unit) * np.asarray(key_scale)[:, None, :, None],
                                  np.asarray(k))


def test_norm_bound_of_zeros_is_one():
    bound = norm_bound(jnp.zeros((2, 3, 4)), axis=(-1,))
    assert bound.shape == (2, 3, 1)
    np.testing.assert_array_equal(bound, 1.0)


def test_combine_without_a_state_takes_a_row_max_below_float32s_exponent():
    """A row max m < -88 (every score below ~1e-19 at p = 2) with nothing from the state:
    e^-M overflowed float32 and 0 * inf made y NaN (the Pallas tier) or 0; now w_inter = 0
    there and y = o / den."""
    o = jnp.asarray([[1.0, 2.0], [3.0, 4.0]])
    den, m = jnp.asarray([2.0, 4.0]), jnp.asarray([-100.0, -300.0])
    zeros = jnp.zeros(2)
    w_intra, w_inter = combine_weights(den, m, zeros)
    np.testing.assert_array_equal(w_intra, 1.0)
    np.testing.assert_array_equal(w_inter, 0.0)
    np.testing.assert_allclose(combine(o, den, m, jnp.zeros_like(o), zeros), o / den[:, None])


@pytest.mark.parametrize("impl", ["xla", "pallas"])
def test_scores_below_1e_19_within_one_chunk(rng, impl):
    """Every q . k ~ 1e-20 of |q| |k| (queries and keys on disjoint coordinates but one):
    the intra-chunk attention is in log space and matches the specification, forward and
    gradients, where the combine made NaN or zeros. (Across chunks the states hold
    (q . k)^2 ~ 1e-40 on float32's linear scale, which underflows: docs/design.md §4.)"""
    q = np.zeros((1, 40, 2, 16), np.float32)
    k = np.zeros((1, 40, 2, 16), np.float32)
    q[..., :8], k[..., 8:] = rng.normal(size=(1, 40, 2, 8)), rng.normal(size=(1, 40, 2, 8))
    q[..., 8] = 1e-20 * rng.normal(size=(1, 40, 2))
    q, k = jnp.asarray(q), jnp.asarray(k)
    v = jnp.asarray(rng.normal(size=(1, 40, 2, 8)), jnp.float32)
    log_g = jnp.asarray(np.log(rng.uniform(0.8, 1.0, size=(1, 40, 2))), jnp.float32)
    cot = jnp.asarray(rng.normal(size=(1, 40, 2, 8)), jnp.float32)

    def loss(impl, q, k, v, log_g):
        y = sympow.sympow_attention(q, k, v, log_g, p=2, impl=impl, algorithm=(
            None if impl == "reference" else "chunked"), chunk_size=64)
        return jnp.sum(y * cot), y

    (_, y), grads = jax.value_and_grad(functools.partial(loss, impl), argnums=(0, 1, 2, 3),
                                       has_aux=True)(q, k, v, log_g)
    (_, want), want_grads = jax.value_and_grad(functools.partial(loss, "reference"),
                                               argnums=(0, 1, 2, 3), has_aux=True)(q, k, v, log_g)
    assert rel_err(y, want) < 1e-5
    for got, expected in zip(grads, want_grads, strict=True):
        assert np.all(np.isfinite(np.asarray(got)))
        assert rel_err(got, expected) < 1e-4
