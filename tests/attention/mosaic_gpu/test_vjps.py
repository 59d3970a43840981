"""The Hopper tier's attention primitive off a Hopper GPU: why it cannot run a problem, its
logged fallback to the portable tier, and the custom_vjp it shares with that tier (the
backward takes its residuals; checked with the portable forward kernel in place of the
Mosaic one, whose numbers only a Hopper GPU can check)."""

from __future__ import annotations

import dataclasses
import logging
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sympow.attention.config import AttentionConfig
from sympow.attention.mosaic_gpu import attention_kernels, vjps
from sympow.attention.mosaic_gpu import primitives as hopper
from sympow.attention.pallas import attention_form as portable_form
from sympow.attention.pallas import attention_kernels as portable_kernels
from sympow.attention.pallas import vjps as portable
from sympow.attention.pallas.plan import make_form_plan
from tests.attention.pallas.helpers import chunk_inputs, compiled, out_and_vjp


def gpu_plan(**changes):
    """A plan the Mosaic forward takes, as a Hopper GPU would see it (interpret off)."""
    plan = make_form_plan(2, 64, 64, 256, "bfloat16", False)
    return dataclasses.replace(plan, **changes)


@pytest.mark.parametrize(("changes", "reason"), [
    ({"interpret": True}, "the interpreter"),
    ({"dtype": "float32", "mm": "float32"}, "dtype float32 with matmul dtype float32"),
    ({"d": 32}, r"d=32, e=64 \(supported: \(64, 128\)\)"),
    ({"e": 256}, r"d=64, e=256"),
    ({"c": 64}, r"chunk 64 with blocks of 64 \(supported: multiples of 128 rows"),
    ({"attn_bq": 32, "attn_bk": 32}, "chunk 256 with blocks of 32"),
])
def test_unsupported_names_the_reason(changes, reason):
    assert re.search(reason, vjps.unsupported(gpu_plan(**changes)) or "")


def test_a_gpu_that_is_not_hopper_is_named(monkeypatch):
    monkeypatch.setattr(vjps, "_compute_capability", lambda: "8.0")
    assert vjps.unsupported(gpu_plan()) == "GPU compute capability 8.0 (supported: 9.0)"
    monkeypatch.setattr(vjps, "_compute_capability", lambda: vjps.HOPPER)
    assert vjps.unsupported(gpu_plan()) is None


def test_off_a_hopper_gpu_it_is_the_portable_primitive_and_says_why(rng, caplog):
    q, k, v, g = chunk_inputs(rng, c=32)
    a = jnp.diff(g, axis=-1, prepend=0.0)
    plan = make_form_plan(2, 16, 16, 32, "float32", True)
    vjps._log_fallback.cache_clear()
    with caplog.at_level(logging.WARNING):
        got = compiled(lambda *x: vjps.attention(plan, *x))(q, k, v, a)
    want = compiled(lambda *x: portable.attention(plan, *x))(q, k, v, a)
    for x, y in zip(got, want, strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    assert "the attention forward runs the portable tier's kernel for the interpreter" in \
        caplog.text


def test_the_hopper_custom_vjp_feeds_the_portable_backward(rng, monkeypatch):
    """With the portable forward kernel in the Mosaic kernel's place, the Hopper primitive's
    outputs and gradients are the portable primitive's: the residuals and the shared
    backward are wired as that tier's."""
    def portable_forward(q, k, v, a, head, tail, *, p):
        return portable_kernels.attention_fwd(q, k, v, a, head, tail, dataclasses.replace(
            plan, p=p))

    monkeypatch.setattr(attention_kernels, "attention_fwd", portable_forward)
    q, k, v, g = chunk_inputs(rng, c=32)
    a = jnp.diff(g, axis=-1, prepend=0.0)
    plan = make_form_plan(2, 16, 16, 32, "float32", True)
    ct = tuple(jnp.asarray(rng.normal(size=x.shape), jnp.float32)
               for x in jax.eval_shape(lambda: portable.attention(plan, q, k, v, a)))
    ct = (ct[0], ct[1], jnp.zeros_like(ct[2]))  # m: a row max, no cotangent
    got = out_and_vjp(lambda *x: vjps._hopper_attention(plan, *x), (q, k, v, a), ct)
    want = out_and_vjp(lambda *x: portable.attention(plan, *x), (q, k, v, a), ct)
    jax.tree.map(lambda x, y: np.testing.assert_array_equal(np.asarray(x), np.asarray(y)),
                 got, want)


def test_the_tier_on_cpu_is_the_portable_tier(rng):
    """impl='mosaic_gpu' is a GPU row; its wrappers in the interpreter (as on any GPU that
    is not a Hopper) give the portable tier's result."""
    config = AttentionConfig(p=2, algorithm="attention", backend="mosaic_gpu", interpret=True)
    portable_config = dataclasses.replace(config, backend="pallas")
    b, t, h, d = 1, 40, 2, 16
    q, k, v = (jnp.asarray(rng.normal(size=(b, t, h, d)), jnp.float32) for _ in range(3))
    log_g = jnp.asarray(np.log(rng.uniform(0.8, 1.0, size=(b, t, h))), jnp.float32)
    got = compiled(lambda *x: hopper.attention_form(config, *x))(q, k, v, log_g)
    want = compiled(lambda *x: portable_form.attention_form(portable_config, *x))(
        q, k, v, log_g)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-6, atol=2e-7)
