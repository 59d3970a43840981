"""The blocked attention form (blocked.py): the shared suite for impl='xla',
algorithm='attention', memory that never holds [T, T], and decays whose float32 precision
does not depend on the gates' history."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sympow.attention import blocked
from sympow.attention.reference import attention_form
from sympow.attention.testing import attention_inputs, rel_err
from tests.attention.suite import AttentionSuite


class TestBlocked(AttentionSuite):
    impl = "xla"
    algorithm = "attention"


@pytest.mark.parametrize(("t", "block"), [(1, 8), (37, 8), (64, 16), (50, 64)])
def test_any_length_and_block(rng, t, block):
    q, k, v, log_g = attention_inputs(rng, t=t)
    got = blocked.blocked_attention(q, k, v, log_g, p=2, block=block)
    assert rel_err(got, attention_form(q, k, v, log_g, 2)) < 1e-5


def test_no_intermediate_of_t_by_t(rng):
    """Forward and backward hold [N, K, K] score blocks per head, never [T, T]."""
    t, block = 512, 32
    q, k, v, log_g = attention_inputs(rng, b=1, t=t, hq=1, hk=1, d=8, e=8)

    def loss(q, k, v, log_g):
        return jnp.sum(blocked.blocked_attention(q, k, v, log_g, p=2, block=block))

    largest = 0

    def walk(jaxpr):
        nonlocal largest
        for eqn in jaxpr.eqns:
            for var in eqn.outvars:
                largest = max(largest, int(np.prod(getattr(var.aval, "shape", ()))))
            for sub in jax.extend.core.jaxprs_in_params(eqn.params):
                walk(sub)

    walk(jax.make_jaxpr(jax.grad(loss, argnums=(0, 1, 2, 3)))(q, k, v, log_g).jaxpr)
    assert largest == t * block  # one step's scores: N K^2 = T K
    assert largest < t * t // 8


def precision_cases(rng, t):
    base = np.log(1 / (1 + np.exp(-rng.normal(3.0, 2.0, size=(1, t, 2)))))
    periodic = np.zeros((1, t, 2))
    periodic[:, ::97] = -1e4
    offset = base.copy()
    offset[:, 0] -= 5000.0
    return {"shut every 97": periodic, "offset -5000 at t=0": offset, "gates x200": 200 * base}


@pytest.mark.parametrize("case", ["shut every 97", "offset -5000 at t=0", "gates x200"])
def test_fp32_precision_does_not_depend_on_gate_history(x64, rng, case):
    """Against the float64 reference: strong gates early on cost no digits later. Each
    output is within 1e-5 of float64, or within 3x of the float32 reference's own error
    where the problem is ill-conditioned (dq, dk under gates x200: each row attends almost
    only to itself, and dl = P (dP - delta) cancels)."""
    t = 900
    log_g = precision_cases(rng, t)[case]
    q, k, v = (rng.normal(size=(1, t, 2, 32)) for _ in range(3))
    cotangent = rng.normal(size=(1, t, 2, 32))
    f64 = [jnp.asarray(x, jnp.float64) for x in (q, k, v, log_g)]
    f32 = [jnp.asarray(x, jnp.float32) for x in (q, k, v, log_g)]

    def outputs(f, args):
        y, vjp = jax.vjp(f, *args)
        return (y, *vjp(jnp.asarray(cotangent, y.dtype)))

    reference = functools.partial(attention_form, p=2)
    gold, ref = outputs(reference, f64), outputs(reference, f32)
    test = outputs(functools.partial(blocked.blocked_attention, p=2, block=128), f32)
    for name, g, r, x in zip("y dq dk dv dlog_g".split(), gold, ref, test, strict=True):
        assert rel_err(x, g) <= max(1e-5, 3 * rel_err(r, g)), (name, rel_err(r, g))
