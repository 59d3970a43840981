"""Public API (api.py): argument validation, output dtypes, prefill and decode_step."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
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
    (lambda a: {**a, "q": a["q"].tolist()}, r"q must be rank 4 .*; got q of type list"),
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


def _step_inputs(rng):
    """A state after 4 tokens and the 5th token: B = 2, Hq = 4, Hk = 2, D = 8, E = 6, p = 2
    (F = expanded_dim(8, 2) = 36)."""
    q, k, v, log_g = attention_inputs(rng, b=2, t=5, hq=4, hk=2, d=8, e=6)
    _, state = sympow.prefill(q[:, :4], k[:, :4], v[:, :4], log_g[:, :4], p=2)
    return state, {"q": q[:, 4], "k": k[:, 4], "v": v[:, 4], "log_g": log_g[:, 4]}


@pytest.mark.parametrize(("change", "match"), [
    (lambda st, a: (st, {**a, "v": a["v"][..., :3]}),
     r"state.s must be \[B, Hk, F, E\] = \[2, 2, 36, 3\] \(F = expanded_dim\(D=8, p=2\) = 36"),
    (lambda st, a: (sympow.init_state(2, 2, 8, 6, p=4), a),  # a p = 4 state, a p = 2 call
     r"state.s must be \[B, Hk, F, E\] = \[2, 2, 36, 6\].*state.s \(2, 2, 330, 6\)"),
    (lambda st, a: (st._replace(z=st.z[:1]), a),
     r"state.z must be \[B, Hk, F\] = \[2, 2, 36\].*state.z \(1, 2, 36\)"),
    (lambda st, a: (st._replace(z=st.z[..., :10]), a), r"state.z must be \[B, Hk, F\]"),
    (lambda st, a: (tuple(st), a), r"state must be a SympowState\(s, z\).*got tuple"),
    (lambda st, a: (None, a), r"state must be a SympowState.*got NoneType"),
    (lambda st, a: (sympow.SympowState(st.s.astype(jnp.int32), st.z), a),
     r"state.s and state.z must be floating point"),
    (lambda st, a: (st, {**a, "log_g": a["log_g"][0, 0]}),
     r"log_g must be rank 2 \[B, Hk\] \(one token\); got .*log_g \(\)"),
    (lambda st, a: (st, {**a, "q": a["q"][:, None]}),
     r"q must be rank 3 \[B, Hq, D\] \(one token\); got q \(2, 1, 4, 8\)"),
    (lambda st, a: (st, {**a, "q": a["q"].tolist()}), r"q must be rank 3.*got q of type list"),
])
def test_decode_step_validates_its_token_and_state(rng, change, match):
    """A state of another p, D or shape, or a token of the wrong rank, is a ValueError naming
    the argument and the shapes (before: a broadcast, a TypeError from deep inside, or a
    message blaming state.s for z)."""
    state, token = change(*_step_inputs(rng))
    with pytest.raises(ValueError, match=match):
        sympow.decode_step(state, **token, p=2)


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


@pytest.mark.parametrize("impl", ["reference", "pallas"])
def test_decode_step_gives_nan_rows_for_a_nan_query_not_zeros(rng, impl):
    """A NaN in query head 0's token gives that head a NaN row (a `den > 0` test once made it
    the zeros of a row without weight); the other heads and batch rows stay finite."""
    q, k, v, log_g = attention_inputs(rng, b=2, t=5, hq=4, hk=2, d=8, e=16)
    _, state = sympow.prefill(q[:, :4], k[:, :4], v[:, :4], log_g[:, :4], p=2)
    _, y = sympow.decode_step(state, q[:, 4].at[0, 0, 3].set(jnp.nan), k[:, 4], v[:, 4],
                              log_g[:, 4], p=2, impl=impl)
    y = np.asarray(y)
    assert np.isnan(y[0, 0]).all()
    assert np.isfinite(y[0, 1:]).all() and np.isfinite(y[1]).all()


@pytest.mark.parametrize(("args", "match"), [
    ((0, 2, 8, 6), r"batch must be a positive int, got batch=0"),
    ((1.0, 2, 8, 6), r"batch must be a positive int, got batch=1.0"),
    ((1, -1, 8, 6), r"kv_heads must be a positive int, got kv_heads=-1"),
    ((1, 2, 8, 0), r"e must be a positive int, got e=0"),
    ((1, np.int64(2), 8, 6.0), r"e must be a positive int, got e=6.0"),  # numpy ints are ints
    ((1, 2, True, 6), r"d must be a positive int, got d=True"),
])
def test_init_state_names_a_bad_size(args, match):
    with pytest.raises(ValueError, match=match):
        sympow.init_state(*args, p=2)


def test_init_state_takes_even_p_and_a_floating_dtype():
    with pytest.raises(ValueError, match=r"p must be a positive even int, got p=3"):
        sympow.init_state(1, 2, 8, 6, p=3)
    with pytest.raises(ValueError, match=r"dtype must be floating point, got dtype=int32"):
        sympow.init_state(1, 2, 8, 6, p=2, dtype=jnp.int32)
    state = sympow.init_state(1, 2, 8, 6, p=2, dtype=jnp.bfloat16)
    assert state.s.shape == (1, 2, 36, 6) and state.z.shape == (1, 2, 36)
    assert state.s.dtype == state.z.dtype == jnp.bfloat16
