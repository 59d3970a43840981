"""The tier as a whole (primitives.py): the shared suite for impl='pallas' in the
interpreter, the gold/ref/test bf16 method at larger sizes, the kernels present in the
compiled program, lowering to Triton, the logged fallback, and the state prefill returns."""

from __future__ import annotations

import functools
import logging

import jax
import jax.numpy as jnp
import pytest

import sympow
from sympow.attention import testing
from sympow.attention.chunked import chunked_attention
from sympow.attention.config import AttentionConfig
from sympow.attention.pallas import primitives as pallas_primitives
from sympow.attention.testing import attention_inputs, rel_err
from sympow.embedding import expanded_dim
from tests.attention.pallas.helpers import ROW_DOTS
from tests.attention.suite import AttentionSuite

CHUNKED = dict(impl="pallas", algorithm="chunked")
CHUNKED_ROW = ("pallas", "chunked")  # (backend, algorithm) for sympow.attention.testing
FORWARD_KERNELS = {"sympow_attention_fwd", "sympow_update_state", "sympow_prefix_sum",
                   "sympow_query_state"}
BACKWARD_KERNELS = {"sympow_attention_dq", "sympow_attention_dkv", "sympow_update_state_dk",
                    "sympow_update_state_dv",
                    "sympow_prefix_sum_bwd", "sympow_query_state_dq", "sympow_query_state_ds"}


class TestPallas(AttentionSuite):
    impl = "pallas"
    algorithm = "chunked"


# ---------------------------------------------------------------------------------------
# End to end at sizes beyond the shared suite: several chunks, wider heads.

E2E = [testing.Case(t=70, p=2, d=32, e=32, hq=4, hk=2, chunk=32),
       testing.Case(t=45, p=4, d=16, e=16, hq=2, hk=1, gating=False)]


@pytest.mark.parametrize("case", E2E, ids=lambda c: c.name)
def test_bf16_gold_ref_test(rng, case):
    args = testing.inputs(case, rng)
    for name, err_test, err_ref, bound, ok in testing.check_bf16(case, args, CHUNKED_ROW):
        assert ok, f"{name}: |gold-test| {err_test:.3e} > bound {bound:.3e} (ref {err_ref:.3e})"


@pytest.mark.parametrize("case", E2E, ids=lambda c: c.name)
def test_fp32_matches_reference(rng, case):
    for name, err, tol, ok in testing.check_fp32(case, testing.inputs(case, rng), CHUNKED_ROW):
        assert ok, f"{name}: relative error {err:.3e} > {tol:.0e}"


def loss(q, k, v, log_g, *, p, chunk):
    return jnp.sum(sympow.sympow_attention(q, k, v, log_g, p=p, chunk_size=chunk, **CHUNKED))


@pytest.mark.parametrize(("p", "d", "e", "chunk"), [(2, 16, 8, 16), (4, 16, 16, 24)])
def test_forward_and_backward_run_the_named_kernels(rng, p, d, e, chunk):
    q, k, v, log_g = attention_inputs(rng, t=40, d=d, e=e)
    fwd = functools.partial(loss, p=p, chunk=chunk)
    assert set(testing.pallas_call_names(fwd, q, k, v, log_g)) == FORWARD_KERNELS
    names = testing.pallas_call_names(jax.grad(fwd, argnums=(0, 1, 2, 3)), q, k, v, log_g)
    assert set(names) == FORWARD_KERNELS | BACKWARD_KERNELS | ROW_DOTS


@pytest.mark.parametrize(("p", "d", "e", "chunk", "dtype"), [
    (2, 64, 48, 24, jnp.bfloat16), (4, 32, 64, 64, jnp.float32), (2, 128, 128, 16, jnp.float32)])
def test_triton_lowering(p, d, e, chunk, dtype):
    """fwd+bwd lower to Triton IR (for CUDA, from this CPU): every load and store is a
    power-of-two block and every primitive has a Triton rule. Compiling it needs a GPU
    (experiments/gpu_check.py)."""
    prims = pallas_primitives.primitives(AttentionConfig(p=p, algorithm="chunked",
                                                         backend="pallas", chunk_size=chunk))

    def fwd_bwd(q, k, v, log_g, dy):
        y, vjp = jax.vjp(lambda *a: chunked_attention(*a, p=p, chunk_size=chunk,
                                                      primitives=prims)[0], q, k, v, log_g)
        return vjp(dy)

    t, hq, hk = 100, 4, 2
    spec = jax.ShapeDtypeStruct
    args = (spec((1, t, hq, d), dtype), spec((1, t, hk, d), dtype), spec((1, t, hk, e), dtype),
            spec((1, t, hk), jnp.float32), spec((1, t, hq, e), jnp.float32))
    text = jax.jit(fwd_bwd).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    row_dots = ROW_DOTS if dtype == jnp.float32 else set()
    assert text.count("__gpu$xla.gpu.triton") == len(FORWARD_KERNELS | BACKWARD_KERNELS
                                                     | row_dots)


def test_unsupported_shapes_fall_back_with_a_logged_reason(rng, caplog):
    q, k, v, log_g = attention_inputs(rng, t=20, d=8, e=8)
    fwd = functools.partial(loss, p=2, chunk=16)
    with caplog.at_level(logging.WARNING, logger="sympow.attention.pallas.primitives"):
        pallas_primitives._log_fallback.cache_clear()
        assert testing.pallas_call_names(fwd, q, k, v, log_g) == []
    assert "falls back to 'xla' for d=8 with p=2" in caplog.text
    expected = sympow.sympow_attention(q, k, v, log_g, p=2, impl="reference")
    assert rel_err(sympow.sympow_attention(q, k, v, log_g, p=2, **CHUNKED), expected) < 1e-5


def test_prefill_state_matches_xla_and_decoding_continues(rng):
    p, t = 2, 40
    q, k, v, log_g = attention_inputs(rng, t=t + 2, d=16, e=8, scale=3.0)
    expected = sympow.sympow_attention(q, k, v, log_g, p=p, impl="reference")
    y, state = sympow.prefill(q[:, :t], k[:, :t], v[:, :t], log_g[:, :t], p=p, chunk_size=16,
                              impl="pallas")
    _, state_xla = sympow.prefill(q[:, :t], k[:, :t], v[:, :t], log_g[:, :t], p=p,
                                  chunk_size=16, impl="xla")
    assert state.s.shape == state_xla.s.shape == (2, 2, expanded_dim(16, p), 8)
    assert rel_err(state.s, state_xla.s) < 1e-5 and rel_err(state.z, state_xla.z) < 1e-5
    assert rel_err(y, expected[:, :t]) < 1e-5
    for i in range(t, t + 2):
        state, y_i = sympow.decode_step(state, q[:, i], k[:, i], v[:, i], log_g[:, i], p=p)
        assert rel_err(y_i, expected[:, i]) < 5e-5
