"""Input makers and comparisons shared by the attention test suites."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np


def attention_inputs(rng, *, b=2, t=37, hq=4, hk=2, d=8, e=6, gating=True, dtype=jnp.float32,
                     scale=1.0):
    """Fresh random q [B,T,Hq,D], k [B,T,Hk,D], v [B,T,Hk,E], log_g [B,T,Hk] (or None)."""
    q = jnp.asarray(scale * rng.normal(size=(b, t, hq, d)), dtype)
    k = jnp.asarray(scale * rng.normal(size=(b, t, hk, d)), dtype)
    v = jnp.asarray(rng.normal(size=(b, t, hk, e)), dtype)
    log_g = jnp.asarray(np.log(rng.uniform(0.5, 1.0, size=(b, t, hk))), dtype) if gating else None
    return q, k, v, log_g


def rel_err(x, y) -> float:
    """||x - y|| / ||y|| in float64."""
    x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
    return float(np.linalg.norm(x - y) / max(np.linalg.norm(y), 1e-30))


def max_err(x, y) -> float:
    return float(np.max(np.abs(np.asarray(x, np.float64) - np.asarray(y, np.float64))))
