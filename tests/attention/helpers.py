"""Helpers of the formulation tests: rotary applied as the layers do, and shared cases."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from sympow.rotary import apply_rotary, fixed_rotary_angles, learned_rotary_angles, rotary_rates


def rotate(q, k, rotary, rng):
    """Apply no / fixed / learned rotary to q and k, as the layers do."""
    if rotary == "none":
        return q, k
    b, t, hk, d = k.shape
    theta = rotary_rates(d, base=1000.0)
    if rotary == "fixed":
        angles = fixed_rotary_angles(jnp.arange(t), theta)[None, :, None]  # [1,T,1,D/2]
        return apply_rotary(q, angles), apply_rotary(k, angles)
    beta = jnp.asarray(1 + np.tanh(rng.normal(size=(b, t, hk))), jnp.float32)
    angles, _ = learned_rotary_angles(beta, theta)  # [B, T, Hk, D/2]
    groups = q.shape[2] // hk
    q_angles = jnp.repeat(angles, groups, axis=2)
    return apply_rotary(q, q_angles), apply_rotary(k, angles)


CASES = [  # (t, chunk, p, heads (hq, hk), gating, rotary)
    (1, 8, 2, (2, 2), True, "none"),
    (7, 8, 2, (4, 2), True, "fixed"),
    (7, 3, 4, (2, 1), False, "learned"),
    (64, 16, 2, (2, 2), False, "none"),
    (64, 16, 4, (4, 2), True, "learned"),
    (64, 64, 2, (4, 1), True, "fixed"),
    (200, 64, 2, (4, 2), True, "learned"),
    (200, 48, 4, (2, 2), True, "fixed"),
    (200, 200, 2, (2, 1), False, "none"),
]
