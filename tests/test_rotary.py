"""Seed 002 propositions: relative rotary, learned rotary, gating as state decay."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import sympow
from sympow.attention.reference import attention_form, init_state, recurrent_step


def test_rates():
    theta = np.asarray(sympow.rotary_rates(8, base=100.0))
    np.testing.assert_allclose(theta, 2 * np.pi / 100.0 ** (np.arange(4) * 2 / 8), rtol=1e-6)


def scores(q_rot, k_rot):
    return np.einsum("id,jd->ij", np.asarray(q_rot, np.float64), np.asarray(k_rot, np.float64))


def test_fixed_rotary_scores_depend_only_on_offset(rng):
    """The same q and k at every position: (R^i q) . (R^j k) must be a function of i - j."""
    t, d = 12, 8
    theta = sympow.rotary_rates(d, base=50.0)
    q = jnp.asarray(np.broadcast_to(rng.normal(size=d), (t, d)), jnp.float32)
    k = jnp.asarray(np.broadcast_to(rng.normal(size=d), (t, d)), jnp.float32)
    angles = sympow.fixed_rotary_angles(jnp.arange(t), theta)
    s = scores(sympow.apply_rotary(q, angles), sympow.apply_rotary(k, angles))
    for offset in range(-t + 1, t):
        diagonal = np.diagonal(s, offset)
        np.testing.assert_allclose(diagonal, diagonal[0], atol=1e-4)
    assert np.ptp(np.diagonal(s, 0)) < 1e-4 and np.ptp(s) > 1e-2  # not trivially constant


def test_learned_rotary_scores_depend_on_summed_betas(rng):
    """(R(mu_i) q) . (R(mu_j) k) = (R(c_ij theta) q) . k with c_ij = mu_i - mu_j, which for
    i >= j is sum_{k=j+1..i} beta_k."""
    t, d = 9, 6
    theta = sympow.rotary_rates(d, base=20.0)
    beta = jnp.asarray(1 + np.tanh(rng.normal(size=(1, t, 1))), jnp.float32)
    angles, mu = sympow.learned_rotary_angles(beta, theta)
    np.testing.assert_allclose(mu[0, :, 0], np.cumsum(beta[0, :, 0]), rtol=1e-6)
    q, k = rng.normal(size=(2, t, d))
    s = scores(sympow.apply_rotary(jnp.asarray(q, jnp.float32), angles[0, :, 0]),
               sympow.apply_rotary(jnp.asarray(k, jnp.float32), angles[0, :, 0]))
    for i in range(t):
        for j in range(t):
            c_ij = float(np.sum(beta[0, j + 1:i + 1, 0])) if i >= j else -float(
                np.sum(beta[0, i + 1:j + 1, 0]))
            q_rel = sympow.apply_rotary(jnp.asarray(q[i], jnp.float32), c_ij * theta)
            assert abs(s[i, j] - float(np.asarray(q_rel) @ k[j])) < 1e-4


def test_learned_rotary_continues_from_mu0(rng):
    theta = sympow.rotary_rates(4)
    beta = jnp.asarray(rng.uniform(0, 2, size=(2, 10, 3)), jnp.float32)
    full, mu = sympow.learned_rotary_angles(beta, theta)
    head, mu_head = sympow.learned_rotary_angles(beta[:, :6], theta)
    tail, _ = sympow.learned_rotary_angles(beta[:, 6:], theta, mu0=mu_head[:, -1])
    np.testing.assert_allclose(np.concatenate([head, tail], 1), full, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="mu0 must be"):
        sympow.learned_rotary_angles(beta, theta, mu0=jnp.zeros((2, 4)))


def test_angles_are_reduced_and_exact_for_whole_turns():
    """Angles come reduced to [-pi, pi] with derivative theta in mu; theta_0 = 2 pi's turns
    are mu itself, so at mu = 65,536.25 the angle is pi / 2 to float32 precision, where the
    unreduced product mu * 2 pi in float32 is off by ~0.03 rad."""
    theta = sympow.rotary_rates(8)
    mu = jnp.asarray([[65536.25, 100_003.5, 3.0]], jnp.float32)  # [1, T]
    angles = sympow.fixed_rotary_angles(mu[0], theta)  # [T, 4]
    assert float(jnp.max(jnp.abs(angles))) <= np.pi + 1e-6
    assert abs(float(angles[0, 0]) - np.pi / 2) < 1e-6
    assert abs(float(jnp.float32(mu[0, 0]) * theta[0]) % (2 * np.pi) - np.pi / 2) > 1e-3
    exact = np.asarray(mu[0], np.float64)[:, None] * np.asarray(theta, np.float64)
    for f in (np.cos, np.sin):  # within float32's hold on mu theta (~ulp of 7e5 rad)
        np.testing.assert_allclose(f(np.asarray(angles, np.float64)), f(exact), atol=0.1)
    beta = jnp.full((1, 3, 1), 0.75, jnp.float32)
    dmu = jax.grad(lambda b: sympow.learned_rotary_angles(b, theta)[0][0, -1, 0].sum())(beta)
    np.testing.assert_allclose(dmu[0, :, 0], np.full(3, float(jnp.sum(theta))), rtol=1e-6)


def test_rotation_preserves_norms_and_validates(rng):
    x = jnp.asarray(rng.normal(size=(3, 5, 8)), jnp.float32)
    angles = jnp.asarray(rng.normal(size=(3, 5, 4)), jnp.float32)
    np.testing.assert_allclose(jnp.linalg.norm(sympow.apply_rotary(x, angles), axis=-1),
                               jnp.linalg.norm(x, axis=-1), rtol=1e-5)
    with pytest.raises(ValueError, match="angles must end in D/2 = 4"):
        sympow.apply_rotary(x, angles[..., :3])
    with pytest.raises(ValueError, match="d must be a positive even int"):
        sympow.rotary_rates(7)


def naive_gated_attention(q, k, v, gamma, p):
    """Seed 002 section 3.1 literally: B_ij = prod_{k=j+1..i} gamma_k (q_i . k_j)^p."""
    t = q.shape[0]
    y = np.zeros((t, v.shape[-1]))
    for i in range(t):
        b = np.array([np.prod(gamma[j + 1:i + 1]) * (q[i] @ k[j]) ** p for j in range(i + 1)])
        y[i] = b @ v[:i + 1] / b.sum()
    return y


def test_gating_is_per_step_decay_of_the_state(x64, rng):
    """Proposition 1: the gated attention form equals the recurrence S <- gamma S + v phi(k)^T,
    checked against a literal loop over products of gates."""
    t, d, e, p = 11, 4, 3, 2
    q, k = rng.normal(size=(2, t, d))
    v = rng.normal(size=(t, e))
    gamma = rng.uniform(0.3, 1.0, size=t)
    expected = naive_gated_attention(q, k, v, gamma, p)
    as_batch = lambda x: jnp.asarray(x)[None, :, None]  # noqa: E731  [1, T, 1, ...]
    log_g = jnp.log(as_batch(gamma))
    got = attention_form(as_batch(q), as_batch(k), as_batch(v), log_g, p)[0, :, 0]
    np.testing.assert_allclose(got, expected, rtol=1e-10)
    state = init_state(1, 1, d, e, p, dtype=jnp.float64)
    for i in range(t):
        state, y_i = recurrent_step(state, as_batch(q)[:, i], as_batch(k)[:, i],
                                    as_batch(v)[:, i], log_g[:, i], p)
        np.testing.assert_allclose(y_i[0, 0], expected[i], rtol=1e-8)


def test_rotary_and_gating_commute_with_the_kernels(rng):
    """Rotating q and k by R(mu_i) before sympow_attention equals rotating by relative
    angles inside the scores (what conformal-sympow's attention form writes)."""
    t, d, p = 10, 4, 2
    theta = sympow.rotary_rates(d, base=30.0)
    beta = jnp.asarray(rng.uniform(0, 2, size=(1, t, 1)), jnp.float32)
    angles, _ = sympow.learned_rotary_angles(beta, theta)
    q, k = (jnp.asarray(rng.normal(size=(1, t, 1, d)), jnp.float32) for _ in range(2))
    v = jnp.asarray(rng.normal(size=(1, t, 1, 3)), jnp.float32)
    y = sympow.sympow_attention(sympow.apply_rotary(q, angles), sympow.apply_rotary(k, angles), v,
                                p=p, impl="xla", algorithm="chunked", chunk_size=4)
    mu = np.cumsum(np.asarray(beta[0, :, 0]))
    for i in range(t):
        rel = [np.asarray(sympow.apply_rotary(q[0, i, 0], (mu[i] - mu[j]) * theta)) for j in
               range(i + 1)]
        b = np.array([(r @ np.asarray(k[0, j, 0])) ** p for j, r in enumerate(rel)])
        np.testing.assert_allclose(y[0, i, 0], b @ np.asarray(v[0, :i + 1, 0]) / b.sum(),
                                   rtol=2e-4, atol=2e-5)
    assert jax.numpy.all(jnp.isfinite(y))


@pytest.mark.parametrize(("call", "match"), [
    (lambda: sympow.learned_rotary_angles(jnp.ones((1, 4, 2)), jnp.ones((2, 8))),
     r"theta must be \[D/2\], got shape \(2, 8\)"),
    (lambda: sympow.fixed_rotary_angles(jnp.arange(4), jnp.ones((1, 4))),
     r"theta must be \[D/2\], got shape \(1, 4\)"),
    (lambda: sympow.apply_rotary(jnp.arange(8), jnp.zeros(4)),
     r"x must be floating point, got dtype int32"),
    (lambda: sympow.apply_rotary(jnp.float32(1.0), jnp.zeros(())),
     r"x must be \[\.\.\., D\], got shape \(\)"),
    (lambda: sympow.apply_rotary(jnp.zeros((2, 5, 4, 8)), jnp.zeros((2, 6, 4, 4))),
     r"angles of shape \(2, 6, 4, 4\) must broadcast to x's \(2, 5, 4\) \+ \(4,\)"),
    (lambda: sympow.apply_rotary(jnp.zeros((2, 5, 4, 8)), jnp.zeros((2, 5, 2, 4))),
     r"angles of shape \(2, 5, 2, 4\) must broadcast .* x of shape \(2, 5, 4, 8\)"),
    (lambda: sympow.apply_rotary(jnp.zeros(8), jnp.zeros((5, 4))),
     r"angles of shape \(5, 4\) must broadcast to x's \(\) \+ \(4,\)"),
])
def test_rotary_shapes_and_dtypes_are_validated(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_apply_rotary_checks_under_jit_and_takes_lists():
    angles = jnp.zeros((3, 4))
    with pytest.raises(ValueError, match=r"angles of shape \(3, 4\) must broadcast"):
        jax.jit(sympow.apply_rotary)(jnp.zeros((2, 8)), angles)
    np.testing.assert_array_equal(sympow.apply_rotary([[1.0, 2.0]], [0.0]), [[1.0, 2.0]])
    assert jax.jit(sympow.apply_rotary)(jnp.zeros((2, 3, 8)), angles[None]).shape == (2, 3, 8)


@pytest.mark.parametrize(("d", "base", "match"), [
    (16, "x", r"base must be a finite number > 1, got base='x'"),
    (16, float("inf"), r"base must be a finite number > 1, got base=inf"),
    (16, float("nan"), r"base must be a finite number > 1, got base=nan"),
    (16, 1.0, r"base must be a finite number > 1, got base=1\.0"),
    (True, 100.0, r"d must be a positive even int, got d=True"),
    (8.0, 100.0, r"d must be a positive even int, got d=8\.0"),
])
def test_invalid_rates(d, base, match):
    with pytest.raises(ValueError, match=match):
        sympow.rotary_rates(d, base)


def test_rates_take_numpy_ints():
    np.testing.assert_array_equal(sympow.rotary_rates(np.int64(8), np.float32(100.0)),
                                  sympow.rotary_rates(8, 100.0))
