"""Public API: argument validation, dispatch, dtypes; the shared suite for impl='xla'."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

import sympow
from tests.attention_suite import AttentionSuite
from tests.helpers import attention_inputs


class TestXla(AttentionSuite):
    impl = "xla"


class TestReference(AttentionSuite):
    impl = "reference"
    chunk = None


def test_default_impl_on_cpu_is_xla():
    assert sympow.available_impls()[0] == "xla" or jax.default_backend() == "gpu"


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
    (lambda a: {**a, "chunk_size": 0}, r"chunk_size must be a positive int or None, got 0"),
    (lambda a: {**a, "chunk_size": 2.5}, r"chunk_size must be a positive int"),
    (lambda a: {**a, "impl": "cuda"}, r"impl must be one of .* got impl='cuda'"),
])
def test_invalid_arguments_raise(rng, change, match):
    q, k, v, log_g = attention_inputs(rng, b=2, t=5, hq=4, hk=2, d=8, e=6)
    args = change({"q": q, "k": k, "v": v, "log_g": log_g, "p": 2})
    with pytest.raises(ValueError, match=match):
        sympow.sympow_attention(**args)


def test_integer_inputs_raise(rng):
    q, k, v, _ = attention_inputs(rng, t=3)
    with pytest.raises(ValueError, match="floating point"):
        sympow.sympow_attention(*(x.astype(jnp.int32) for x in (q, k, v)))


def test_unavailable_impl_names_backend(rng):
    q, k, v, _ = attention_inputs(rng, t=3)
    if "mosaic_gpu" in sympow.available_impls():
        pytest.skip("mosaic_gpu is available on this backend")
    with pytest.raises(ValueError, match="impl='mosaic_gpu' is not available on backend"):
        sympow.sympow_attention(q, k, v, impl="mosaic_gpu")


def test_decode_step_validates_state(rng):
    q, k, v, log_g = attention_inputs(rng, t=4)
    _, state = sympow.prefill(q, k, v, log_g, p=2)
    with pytest.raises(ValueError, match=r"state.s must be \[B, Hk, F, E\]"):
        sympow.decode_step(state, q[:, 0], k[:, 0], v[:, 0, :, :3], log_g[:, 0], p=2)
