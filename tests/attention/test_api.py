"""Public API (api.py): argument validation, output dtypes, prefill and decode_step."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

import sympow
from sympow.attention import reference
from sympow.attention.testing import attention_inputs, rel_err


def test_output_dtype_follows_v(rng):
    q, k, v, log_g = attention_inputs(rng, t=5, dtype=jnp.bfloat16)
    assert sympow.sympow_attention(q, k, v, log_g.astype(jnp.float32)).dtype == jnp.bfloat16


@pytest.mark.parametrize(("change", "match"), [
    (lambda a: {**a, "p": 3}, r"p must be a positive even int, got p=3"),
    (lambda a: {**a, "p": 0}, r"p must be a positive even int, got p=0"),
    (lambda a: {**a, "p": -2}, r"p must be a positive even int"),
    (lambda a: {**a, "p": 2.0}, r"p must be a positive even int"),
    (lambda a: {**a, "q": a["q"][0]}, r"q must be rank 4 \[B, T, H, D\]; got q \(5, 4, 8\)"),
    (lambda a: {**a, "k": a["k"][..., :4]},
     r"k must be \[B, T, Hk, D\] = \[2, 5, Hk, 8\].*k \(2, 5, 2, 4\)"),
    (lambda a: {**a, "v": a["v"][:, :4]},
     r"v must be \[B, T, Hk, E\] = \[2, 5, 2, E\].*v \(2, 4, 2, 6\)"),
    (lambda a: {**a, "q": a["q"][:, :, :3]},
     r"q must be \[B, T, Hq, D\] with Hq a multiple of Hk = 2.*q \(2, 5, 3, 8\)"),
    (lambda a: {**a, "log_g": a["log_g"][..., :1]},
     r"log_g must be \[B, T, Hk\] = \[2, 5, 2\].*log_g \(2, 5, 1\)"),
    (lambda a: {**a, "log_g": a["log_g"].astype(jnp.int32)}, r"log_g must be floating point"),
    (lambda a: {**a, "v": a["v"].astype(jnp.bfloat16)}, r"q, k and v must share one dtype"),
    (lambda a: {**a, "chunk_size": 0},
     r"chunk_size must be a positive int or None, got chunk_size=0"),
    (lambda a: {**a, "chunk_size": 2.5}, r"chunk_size must be a positive int"),
    (lambda a: {**a, "impl": "cuda"}, r"impl must be one of .* got impl='cuda'"),
    (lambda a: {**a, "algorithm": "flash"}, r"algorithm must be one of .* got algorithm='flash'"),
    (lambda a: {**a, "impl": "reference", "algorithm": "chunked"},
     r"impl='reference' with algorithm='chunked' is not available"),
])
def test_invalid_arguments_raise(rng, change, match):
    q, k, v, log_g = attention_inputs(rng, b=2, t=5, hq=4, hk=2, d=8, e=6)
    args = change({"q": q, "k": k, "v": v, "log_g": log_g, "p": 2})
    with pytest.raises(ValueError, match=match):
        sympow.sympow_attention(**args)


@pytest.mark.parametrize(("impl", "algorithm"), [("xla", "chunked"), ("xla", "attention"),
                                                ("reference", None)])
def test_a_gradient_runs_the_forward_once(rng, monkeypatch, impl, algorithm):
    """The custom_vjp keeps the forward's residuals (jax.vjp's function) instead of running
    the implementation again in the backward: a jitted gradient executes the forward once
    (a callback inside it counts; twice when the backward recomputed it), and the gradients
    are those of differentiating the implementation directly."""
    from sympow.attention import api

    q, k, v, log_g = attention_inputs(rng, b=1, t=40, hq=2, hk=2, d=8, e=8)
    forward, executions = api._forward, []

    def counted_forward(config, *x):
        jax.debug.callback(lambda: executions.append(config))
        return forward(config, *x)

    monkeypatch.setattr(api, "_forward", counted_forward)
    settings = dict(p=2, impl=impl, algorithm=algorithm, chunk_size=16 if impl == "xla" else None)
    loss = lambda *x: (sympow.sympow_attention(*x, **settings) ** 2).sum()  # noqa: E731
    grads = jax.block_until_ready(jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))(q, k, v, log_g))
    assert len(executions) == 1, executions
    direct = jax.grad(lambda *x: (forward(executions[0], *x) ** 2).sum(), argnums=(0, 1, 2, 3))(
        q, k, v, log_g)
    for got, want in zip(grads, direct, strict=True):
        assert rel_err(got, want) < 1e-6


def test_integer_inputs_raise(rng):
    q, k, v, _ = attention_inputs(rng, t=3)
    with pytest.raises(ValueError, match="floating point"):
        sympow.sympow_attention(*(x.astype(jnp.int32) for x in (q, k, v)))


def test_unavailable_impl_names_backend(rng, monkeypatch):
    """The Pallas tier runs on GPU and (interpreted) on CPU; on any other platform asking
    for it names the platform and what is available there."""
    q, k, v, _ = attention_inputs(rng, t=3)
    monkeypatch.setattr(jax, "default_backend", lambda: "tpu")
    with pytest.raises(ValueError, match=r"impl='pallas' is not available on backend 'tpu'; "
                                         r"available \(algorithm, impl\): \[\('chunked', 'xla'\)"):
        sympow.sympow_attention(q, k, v, impl="pallas")


def test_prefill_reference_runs_the_recurrent_form(rng):
    """impl='reference' has two specification forms; prefill takes the one with a state."""
    q, k, v, log_g = attention_inputs(rng, t=9)
    y, state = sympow.prefill(q, k, v, log_g, p=2, impl="reference")
    y_chunked, state_chunked = sympow.prefill(q, k, v, log_g, p=2, impl="xla", chunk_size=4)
    expected = sympow.sympow_attention(q, k, v, log_g, p=2, impl="reference")
    assert rel_err(y, expected) < 1e-5 and rel_err(y_chunked, expected) < 1e-5
    assert rel_err(state.s, state_chunked.s) < 1e-5 and rel_err(state.z, state_chunked.z) < 1e-5


def test_decode_step_validates_state(rng):
    q, k, v, log_g = attention_inputs(rng, t=4)
    _, state = sympow.prefill(q, k, v, log_g, p=2)
    with pytest.raises(ValueError, match=r"state.s must be \[B, Hk, F, E\]"):
        sympow.decode_step(state, q[:, 0], k[:, 0], v[:, 0, :, :3], log_g[:, 0], p=2)


@pytest.mark.parametrize("impl", ["reference", "pallas"])
@pytest.mark.parametrize(("p", "log2_scale"), [(2, 70), (2, -75), (4, 35), (4, -38)])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_decode_step_takes_queries_at_any_scale(rng, impl, p, log2_scale, dtype):
    """The readout phi(q)^T S / phi(q)^T Z is invariant to q's scale, so q x 2^n gives the
    unscaled q's row though |q|^p is past float32 (overflow: inf / inf; underflow: 0 / 0)."""
    q, k, v, log_g = attention_inputs(rng, b=2, t=5, hq=4, hk=2, d=8, e=16, dtype=dtype)
    _, state = sympow.prefill(q[:, :4], k[:, :4], v[:, :4], log_g[:, :4], p=p, impl="xla",
                              chunk_size=2)
    args = (k[:, 4], v[:, 4], log_g[:, 4])
    _, expected = reference.recurrent_step(state, q[:, 4], *args, p)
    scaled = (q[:, 4].astype(jnp.float32) * 2.0 ** log2_scale).astype(dtype)  # exact
    _, y = sympow.decode_step(state, scaled, *args, p=p, impl=impl)
    assert jnp.all(jnp.isfinite(y.astype(jnp.float32)))
    tol = 1e-5 if dtype == jnp.float32 else 1e-2  # y leaves in v's dtype
    assert rel_err(y, expected) < tol
