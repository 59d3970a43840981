"""The attention form on the tier's attention kernels (attention_form.py): the shared suite
for impl='pallas', algorithm='attention' in the interpreter, any even p, padded widths, the
kernels in the program, lowering to Triton and the logged fallback."""

from __future__ import annotations

import dataclasses
import functools
import logging

import jax
import jax.numpy as jnp
import pytest

import sympow
from sympow.attention import testing
from sympow.attention.api import make_config
from sympow.attention.pallas import attention_form
from sympow.attention.testing import attention_inputs, rel_err
from tests.attention.pallas.helpers import ROW_DOTS
from tests.attention.suite import AttentionSuite

FORM = dict(impl="pallas", algorithm="attention")
KERNELS = {"sympow_attention_fwd"}
BACKWARD_KERNELS = {"sympow_attention_dq", "sympow_attention_dkv"}


class TestPallasAttentionForm(AttentionSuite):
    impl = "pallas"
    algorithm = "attention"
    chunk = None


@pytest.mark.parametrize(("p", "t", "d", "e", "heads"), [
    (6, 37, 16, 8, (4, 2)), (8, 20, 16, 16, (2, 1)), (2, 70, 24, 6, (2, 2))])
def test_any_even_p_and_padded_widths_match_the_reference(rng, p, t, d, e, heads):
    q, k, v, log_g = attention_inputs(rng, t=t, d=d, e=e, hq=heads[0], hk=heads[1])
    cotangent = jnp.asarray(rng.normal(size=(2, t, heads[0], e)), jnp.float32)

    def value_and_grads(**kw):
        def loss(*args):
            return jnp.sum(sympow.sympow_attention(*args, p=p, **kw) * cotangent)
        return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3)))(q, k, v, log_g)

    (_, want), (_, got) = value_and_grads(impl="reference"), value_and_grads(**FORM)
    assert rel_err(sympow.sympow_attention(q, k, v, log_g, p=p, **FORM),
                   sympow.sympow_attention(q, k, v, log_g, p=p, impl="reference")) < 1e-5
    for name, x, y in zip("dq dk dv dlog_g".split(), got, want, strict=True):
        assert rel_err(x, y) < 2e-5, name


def loss(q, k, v, log_g, *, p):
    return jnp.sum(sympow.sympow_attention(q, k, v, log_g, p=p, **FORM))


def test_forward_and_backward_run_the_attention_kernels_only(rng):
    q, k, v, log_g = attention_inputs(rng, t=40, d=16, e=8)
    fwd = functools.partial(loss, p=4)
    assert set(testing.pallas_call_names(fwd, q, k, v, log_g)) == KERNELS
    names = testing.pallas_call_names(jax.grad(fwd, argnums=(0, 1, 2, 3)), q, k, v, log_g)
    assert set(names) == KERNELS | BACKWARD_KERNELS | ROW_DOTS


@pytest.mark.parametrize(("p", "t", "d", "dtype"), [(4, 100, 64, jnp.bfloat16),
                                                    (2, 1000, 128, jnp.float32)])
def test_triton_lowering(p, t, d, dtype):
    """fwd+bwd lower to Triton IR for CUDA from this CPU (compiling needs a GPU:
    experiments/gpu_check.py)."""
    config = dataclasses.replace(make_config(t, p, None, "pallas", "attention"), interpret=False)

    def fwd_bwd(q, k, v, log_g, dy):
        _, vjp = jax.vjp(lambda *a: attention_form.attention_form(config, *a), q, k, v, log_g)
        return vjp(dy)

    spec = jax.ShapeDtypeStruct
    args = (spec((1, t, 4, d), dtype), spec((1, t, 2, d), dtype), spec((1, t, 2, d), dtype),
            spec((1, t, 2), jnp.float32), spec((1, t, 4, d), jnp.float32))
    text = jax.jit(fwd_bwd).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    row_dots = ROW_DOTS if dtype == jnp.float32 else set()
    assert text.count("__gpu$xla.gpu.triton") == len(KERNELS | BACKWARD_KERNELS | row_dots)


def test_too_wide_heads_fall_back_with_a_logged_reason(rng, caplog):
    q, k, v, log_g = attention_inputs(rng, t=9, d=512, e=8)
    with caplog.at_level(logging.WARNING, logger="sympow.attention.pallas.attention_form"):
        attention_form._log_fallback.cache_clear()
        assert testing.pallas_call_names(functools.partial(loss, p=2), q, k, v, log_g) == []
    assert "falls back to 'xla' for d=512, e=16 (supported: up to 256)" in caplog.text
    got = sympow.sympow_attention(q, k, v, log_g, p=2, **FORM)
    assert rel_err(got, sympow.sympow_attention(q, k, v, log_g, p=2, impl="reference")) < 1e-5


@pytest.mark.parametrize("kind", ["random", "zero_keys", "huge_norms", "large_scales",
                                  "small_scales", "full_decay"])
@pytest.mark.parametrize("block", [16, 32])
def test_blocks_below_the_diagonal_skip_the_mask(rng, monkeypatch, fresh_traces, kind, block):
    """Several key blocks per query block: those wholly below the diagonal run without the
    causal mask and the zero-score select (log|0| = -inf), with decays head + mid + tail
    summed as the loop walks back. Zero keys put s = 0 off the diagonal; q and k at scales
    whose norms' squares over- or underflow float32 are divided back; gates of -1e4
    everywhere make every mid and tail huge; grouped heads exercise the dK/dV loop over the
    group. The shared fp32 and bf16 checks, forward and all four gradients, T = 100 (up to
    8 blocks after padding to 128)."""
    base = attention_form.make_form_plan

    def small_blocks(*args):
        return dataclasses.replace(base(*args), attn_bq=block, attn_bk=block)

    monkeypatch.setattr(attention_form, "make_form_plan", small_blocks)
    case = testing.Case(t=100, p=4, d=16, e=8, hq=4, hk=2)
    args = testing.inputs(case, rng, kind=kind)
    impl = ("pallas", "attention")
    # under full decay each row attends to itself only (y = v, dq = dk = 0 exactly) and the
    # float32 specification's dq and dk are rounding noise amplified by p / s, ~1e-4 of the
    # problem's scale: there the gold is the float64 oracle (the kernels' measure ~1e-13);
    # also at scales where the float32 specification's logits p log|s| round by ~1e-5
    float64_gold = kind in ("full_decay", "large_scales", "small_scales")
    rows = testing.check_fp32(case, args, impl, gold_impl=None if float64_gold else "reference")
    for name, err, tol, ok in rows:
        assert ok, f"fp32 {name}: {err:.2e} > {tol:.0e}"
    for name, err_test, err_ref, bound, ok in testing.check_bf16(case, args, impl):
        assert ok, f"bf16 {name}: {err_test:.2e} (ref {err_ref:.2e}, bound {bound:.2e})"


def test_unequal_blocks_are_refused(rng, monkeypatch, fresh_traces):
    """The diagonal block's in-kernel decays assume one block size for queries and keys."""
    base = attention_form.make_form_plan
    monkeypatch.setattr(attention_form, "make_form_plan", lambda *args: dataclasses.replace(
        base(*args), attn_bq=32, attn_bk=16))
    q, k, v, log_g = attention_inputs(rng, t=40, d=16, e=8)
    with pytest.raises(ValueError, match=r"attention kernels need attn_bq == attn_bk, got "
                                         r"32 x 16"):
        sympow.sympow_attention(q, k, v, log_g, p=2, **FORM)
