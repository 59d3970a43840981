"""Rotary position embeddings: fixed (RoPE) and data-dependent ([conformal] §3.2;
docs/references.md).

Pairs (2j, 2j+1) of a query or key are rotated by the angle mu_i * theta_j with rates
theta_j = 2 pi / N^(2j/D), j = 0 .. D/2 - 1. Fixed rotary uses mu_i = i; learned rotary
uses mu_i = mu_{i-1} + beta_i with beta_i = 1 + tanh(W_beta X_i) in (0, 2) per head, so the
score of (i, j) depends only on c_ij = mu_i - mu_j = sum_{k=j+1..i} beta_k. Rotation is
applied to Q and K before the attention; the kernels never see it.

Angles are float32, returned reduced to [-pi, pi]: mu_i theta_j / (2 pi) in turns less its
nearest integer, times 2 pi. For very long contexts mu_i * theta_j grows to ~1e5 rad and
float32 keeps ~1e-2 rad of it either way (the relative property then holds to that
precision); the reduction costs nothing in accuracy (exact for theta_0 = 2 pi, whose turns
are mu_i itself) and keeps cos and sin on their fast path: on a GPU, arguments beyond ~1e5
take a slow exact reduction, which made the cosines 4x slower at context 65,536 than at
4,096 in GPT-2 small's training step (docs/benchmarks.md).
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float

from sympow.numerics import compute_dtype, is_finite_number, is_int

__all__ = ["rotary_rates", "fixed_rotary_angles", "learned_rotary_angles", "apply_rotary"]


def rotary_rates(d: int, base: float = 65536.0) -> Float[Array, " D/2"]:
    """Rotation rates theta_j = 2 pi / base^(2j/d), j = 0 .. d/2 - 1, as float32 [d/2].

    `base` is N of [conformal] (the maximum document size; 65536 for LongCrawl64), a finite
    number > 1: base 1 rotates every pair by whole turns, base inf all but the first not at all.
    """
    if not is_int(d) or d < 2 or d % 2:
        raise ValueError(f"d must be a positive even int, got d={d!r}")
    if not is_finite_number(base) or base <= 1:
        raise ValueError(f"base must be a finite number > 1, got base={base!r}")
    j = jnp.arange(d // 2, dtype=jnp.float32)
    return 2 * jnp.pi / jnp.asarray(base, jnp.float32) ** (2 * j / d)


def fixed_rotary_angles(
    positions: Float[Array, "... T"], theta: Float[Array, " D/2"]
) -> Float[Array, "... T D/2"]:
    """Angles mu_i * theta (mod 2 pi) for fixed rotary with mu_i = positions[i] (usually
    arange(T))."""
    return _reduced_angles(jnp.asarray(positions, jnp.float32), theta)


def _reduced_angles(mu: Float[Array, "..."], theta: Float[Array, " D/2"]
                    ) -> Float[Array, "... D/2"]:
    """mu theta reduced to [-pi, pi] (see the module docstring); its derivative in mu is
    theta (the nearest integer is locally constant)."""
    theta = jnp.asarray(theta)
    if theta.ndim != 1:  # else it would broadcast against mu's trailing dims into nonsense
        raise ValueError(f"theta must be [D/2], got shape {theta.shape}")
    turns = mu[..., None] * (theta / (2 * jnp.pi))
    return (2 * jnp.pi) * (turns - jnp.round(turns))


def learned_rotary_angles(
    beta: Float[Array, "B T H"],
    theta: Float[Array, " D/2"],
    mu0: Float[Array, "B H"] | None = None,
) -> tuple[Float[Array, "B T H D/2"], Float[Array, "B T H"]]:
    """Data-dependent angles of [conformal] §3.2: mu_i = mu_{i-1} + beta_i, angle = mu_i * theta
    (mod 2 pi).

    Args:
      beta: [B, T, H] rate multipliers (1 + tanh(W_beta x) in the layers), per head.
      theta: [D/2] base rates from `rotary_rates`.
      mu0: [B, H] the accumulated mu before the first token (recurrent decoding); 0 if None.

    Returns:
      (angles [B, T, H, D/2], mu [B, T, H]) where mu[:, -1] continues a later call.
    """
    beta = jnp.asarray(beta, jnp.float32)
    if beta.ndim != 3:
        raise ValueError(f"beta must be [B, T, H], got shape {beta.shape}")
    mu = jnp.cumsum(beta, axis=1)
    if mu0 is not None:
        mu0 = jnp.asarray(mu0, jnp.float32)
        if mu0.shape != (beta.shape[0], beta.shape[2]):
            raise ValueError(f"mu0 must be [B, H] = {(beta.shape[0], beta.shape[2])}, "
                             f"got shape {mu0.shape} (beta shape {beta.shape})")
        mu = mu + mu0[:, None, :]
    return _reduced_angles(mu, theta), mu


def apply_rotary(
    x: Float[Array, "... D"], angles: Float[Array, "... D/2"]
) -> Float[Array, "... D"]:
    """Rotate pairs (2j, 2j+1) of x [..., D] by angles [..., D/2] (broadcast to x[..., :D/2]).

    x is floating point, of at least one dimension; angles' leading dims broadcast to x's (not
    beyond them). For queries x [B, T, H, D] with H a multiple of the Hk heads of angles
    [B, T, Hk, D/2], repeat the angles over each query group
    (`jnp.repeat(angles, H // Hk, axis=2)`) or rotate x.reshape(B, T, Hk, H // Hk, D) by
    angles[:, :, :, None].

    Computed in float32 (float64 for float64 x) and returned in x's dtype. Norms are preserved and
    apply_rotary(q, a) . apply_rotary(k, b) depends only on a - b.
    """
    x, angles = jnp.asarray(x), jnp.asarray(angles)
    if x.ndim < 1:
        raise ValueError(f"x must be [..., D], got shape {x.shape}")
    if not jnp.issubdtype(x.dtype, jnp.floating):  # else cast back to x's dtype truncates
        raise ValueError(f"x must be floating point, got dtype {x.dtype}")
    if x.shape[-1] % 2:
        raise ValueError(f"the last dim of x must be even, got shape {x.shape}")
    if angles.shape[-1:] != (x.shape[-1] // 2,):
        raise ValueError(f"angles must end in D/2 = {x.shape[-1] // 2}, got shape "
                         f"{angles.shape} for x of shape {x.shape}")
    if not _broadcasts_to(angles.shape[:-1], x.shape[:-1]):
        raise ValueError(f"angles of shape {angles.shape} must broadcast to x's "
                         f"{x.shape[:-1]} + {(x.shape[-1] // 2,)}, got x of shape {x.shape}")
    ct = compute_dtype(x)
    pairs = x.astype(ct).reshape(*x.shape[:-1], -1, 2)
    cos, sin = jnp.cos(angles).astype(ct), jnp.sin(angles).astype(ct)
    even, odd = pairs[..., 0], pairs[..., 1]
    rotated = jnp.stack([cos * even - sin * odd, sin * even + cos * odd], axis=-1)
    return rotated.reshape(x.shape).astype(x.dtype)


def _broadcasts_to(shape: tuple[int, ...], target: tuple[int, ...]) -> bool:
    """Whether `shape` broadcasts to exactly `target` (static shapes: fine under jit)."""
    try:
        return np.broadcast_shapes(shape, target) == target
    except ValueError:
        return False
