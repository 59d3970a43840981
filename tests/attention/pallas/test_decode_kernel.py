"""The fused decoding step (pallas/decode_kernel.py) in the interpreter: the state and the
output of `reference.recurrent_step` over several chained steps, every shape the plan takes,
the in-place update, and the logged fallbacks."""

from __future__ import annotations

import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sympow.attention import api, reference, testing
from sympow.attention.pallas import decode_kernel
from sympow.embedding import sympow_embedding


@pytest.mark.parametrize(("b", "hq", "hk", "d", "e", "p"), [
    (2, 4, 2, 16, 16, 2),   # F = 136: rows 8; grouped heads R = 2
    (1, 3, 1, 8, 32, 2),    # R = 3 padded to 4; F = 36
    (2, 2, 2, 8, 16, 4),    # p = 4: F = 330
    (1, 12, 12, 32, 64, 2),  # GPT-2 small's head size: F = 528
])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("gated", [True, False])
def test_fused_step_matches_the_reference_over_chained_steps(rng, b, hq, hk, d, e, p, dtype,
                                                             gated):
    rows = testing.check_decode(rng, "pallas", b=b, hq=hq, hk=hk, d=d, e=e, p=p, dtype=dtype,
                                gated=gated)
    assert [name for name, *_ in rows] == ["s", "z", "y"]
    assert all(ok for *_, ok in rows), rows


def _check_a_wrong_step(rng, monkeypatch, wrong):
    """check_decode's rows for impl='pallas' with the kernel's step replaced by the
    specification's step passed through `wrong(state, y) -> (state, y)`; B = 1, F = 36."""
    def step(state, q, k, v, log_g, p, *, interpret):
        return wrong(*reference.recurrent_step(state, q, k, v, log_g, p))
    monkeypatch.setattr(decode_kernel, "decode_step", step)
    api._decode_step.clear_cache()
    try:
        return testing.check_decode(rng, "pallas", b=1, hq=2, hk=2, d=8, e=16, p=2,
                                    dtype="float32")
    finally:
        api._decode_step.clear_cache()


def test_the_decode_check_fails_a_wrong_step(rng, monkeypatch):
    """check_decode can fail: a step that forgets the gate on z is caught."""
    rows = _check_a_wrong_step(rng, monkeypatch,
                               lambda state, y: (state._replace(z=state.z * 1.001), y))
    assert not dict((name, ok) for name, *_, ok in rows)["z"]


def test_the_decode_check_fails_a_wrong_readout_at_the_float32_tolerance(rng, monkeypatch):
    """check_decode can fail on y alone: a float32 y off by 1e-4 of its size is over
    TOL_DECODE_Y."""
    rows = _check_a_wrong_step(rng, monkeypatch, lambda state, y: (state, y * (1 + 1e-4)))
    name, err, tol, ok = rows[-1]
    assert name == "y" and not ok and err > 5e-5
    assert tol == testing.TOL_DECODE_Y["float32"]


def small_step(hq: int, *, interpret: bool = True):
    """(step, its arguments, its plan): the fused step of one token for B = 1, Hk = 2, d = 8
    (F = 36), E = 16, p = 2 and hq query heads."""
    rng = np.random.default_rng(0)
    state = testing.decode_prompt_state(rng, b=1, hk=2, d=8, e=16, p=2)
    token = testing.decode_token(rng, b=1, hq=hq, hk=2, d=8, e=16, dtype=jnp.float32)
    plan = decode_kernel.make_decode_plan(36, hq // 2, 16, interpret=interpret)
    return (lambda *a: decode_kernel.fused_step(plan, *a, p=2)), (state, *token), plan


def test_the_state_is_updated_in_place():
    """The kernel aliases the state's buffers to its outputs (no second [F, E] buffer)."""
    step, args, _ = small_step(2)
    jaxpr = jax.make_jaxpr(step)(*args)
    calls = [eq for eq in jaxpr.eqns if eq.primitive.name == "pallas_call"]
    assert len(calls) == 1
    assert tuple(calls[0].params["input_output_aliases"]) == ((0, 0), (1, 1))


def test_plans():
    plan = decode_kernel.make_decode_plan(2080, 1, 64, interpret=False)  # GPT-2: d = 64, p = 2
    assert (plan.rows, plan.groups) == (32, 1)  # 2080 = 32 * 65
    assert decode_kernel.make_decode_plan(2080, 6, 64, interpret=False).groups == 8
    assert decode_kernel.make_decode_plan(2080, 8, 64, interpret=False).rows == 16  # budget
    assert decode_kernel.make_decode_plan(766480, 1, 64, interpret=False).rows == 16  # p = 4
    assert "E = 24" in decode_kernel.make_decode_plan(36, 1, 24, interpret=False)


def test_shapes_the_kernel_does_not_take_fall_back_with_a_logged_reason(rng, caplog):
    state = testing.decode_prompt_state(rng, b=1, hk=1, d=8, e=24, p=2)
    q, k, v, log_g = testing.decode_token(rng, b=1, hq=1, hk=1, d=8, e=24, dtype=jnp.float32)
    decode_kernel._log_fallback.cache_clear()
    with caplog.at_level(logging.WARNING, logger=decode_kernel.__name__):
        got, y = api.decode_step(state, q, k, v, log_g, impl="pallas")
    assert "value width E = 24" in caplog.text
    want, y_ref = api.decode_step(state, q, k, v, log_g, impl="reference")
    np.testing.assert_array_equal(np.asarray(y), np.asarray(y_ref))
    np.testing.assert_array_equal(np.asarray(got.s), np.asarray(want.s))


def test_a_float64_state_falls_back(x64, rng, caplog):
    state = testing.decode_prompt_state(rng, b=1, hk=1, d=8, e=16, p=2)
    state = jax.tree.map(lambda x: x.astype(jnp.float64), state)
    q, k, v, log_g = testing.decode_token(rng, b=1, hq=1, hk=1, d=8, e=16, dtype=jnp.float64)
    decode_kernel._log_fallback.cache_clear()
    with caplog.at_level(logging.WARNING, logger=decode_kernel.__name__):
        got, _ = api.decode_step(state, q, k, v, log_g, impl="pallas")
    assert "float64 state" in caplog.text and got.s.dtype == jnp.float64


def test_unknown_impl_is_named():
    rng = np.random.default_rng(1)
    state = testing.decode_prompt_state(rng, b=1, hk=1, d=8, e=16, p=2)
    q, k, v, log_g = testing.decode_token(rng, b=1, hq=1, hk=1, d=8, e=16, dtype=jnp.float32)
    with pytest.raises(ValueError, match=r"impl must be one of \('pallas', 'reference'\) or "
                                         r"None, got impl='xla'"):
        api.decode_step(state, q, k, v, log_g, impl="xla")


@pytest.mark.parametrize("backend, want", [("gpu", "pallas"), ("cpu", "reference"),
                                           ("tpu", "reference")])
def test_the_default_decode_impl_is_the_kernel_on_a_gpu_only(monkeypatch, backend, want):
    monkeypatch.setattr(api.jax, "default_backend", lambda: backend)
    assert api.default_decode_impl() == want


def test_impl_none_runs_the_default(rng):
    state = testing.decode_prompt_state(rng, b=1, hk=1, d=8, e=16, p=2)
    q, k, v, log_g = testing.decode_token(rng, b=1, hq=1, hk=1, d=8, e=16, dtype=jnp.float32)
    got, y = api.decode_step(state, q, k, v, log_g)
    want, y_want = api.decode_step(state, q, k, v, log_g, impl=api.default_decode_impl())
    np.testing.assert_array_equal(np.asarray(y), np.asarray(y_want))
    np.testing.assert_array_equal(np.asarray(got.s), np.asarray(want.s))


def test_the_readout_and_its_normalizer_leave_in_one_array_summed_once():
    """The kernel writes each tile's numerators and normalizers side by side ([2 R', E], the
    normalizer repeated along E), so XLA sums the tiles in one reduction (two arrays took
    it two reductions, each a launch of its own in a decoding step), of (sum, rounding
    error) pairs; for a GPU the step lowers to one Triton kernel."""
    step, args, plan = small_step(6)
    jaxpr = jax.make_jaxpr(step)(*args)
    names = [eq.primitive.name for eq in jaxpr.eqns]
    call = jaxpr.eqns[names.index("pallas_call")]
    tiles = 36 // plan.rows
    assert [x.aval.shape for x in call.outvars][2] == (1 * 2, tiles, 2 * plan.groups, 16)
    after = names[names.index("pallas_call"):]
    assert after.count("custom_jvp_call") == 1 and "reduce_sum" not in after
    inner = jaxpr.eqns[names.index("custom_jvp_call")].params["call_jaxpr"].jaxpr
    assert [eq.primitive.name for eq in inner.eqns].count("reduce") == 1  # compensated_sum
    gpu_step, args, _ = small_step(6, interpret=False)
    text = jax.jit(gpu_step).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("stablehlo.custom_call @__gpu$xla.gpu.triton") == 1


def test_the_readout_keeps_what_a_float32_sum_of_the_tiles_loses():
    """Tiles of features whose readout shares cancel: d = 4, p = 2 (F = 10, two features a
    tile), q = 1 (phi(q) = 1 on the squares x_i^2, sqrt 2 elsewhere), a state whose rows
    are 2^27, 8, 7 and -2^27 on the four squares and 0 elsewhere, z = 1 on the squares; k = 0
    leaves the state as it is. Each tile's share is exact, and y = 15 / 4 exactly from the
    kernel, where a float32 sum of the shares loses the 8 and the 7 in any order that does
    not cancel the large ones first."""
    d, e, f = 4, 16, 10
    squares = np.flatnonzero(np.isclose(np.asarray(
        sympow_embedding(jnp.ones((d,), jnp.float32), 2)), 1.0))
    assert squares.size == d
    rows = np.zeros((f,), np.float32)
    rows[squares] = [2.0 ** 27, 8.0, 7.0, -(2.0 ** 27)]
    state = reference.SympowState(
        s=jnp.asarray(np.broadcast_to(rows[:, None], (1, 1, f, e))),
        z=jnp.asarray(np.isin(np.arange(f), squares).astype(np.float32)[None, None]))
    plan = decode_kernel.make_decode_plan(f, 1, e, interpret=True)
    assert not isinstance(plan, str) and f // plan.rows > 1  # several tiles
    _, y = decode_kernel.fused_step(plan, state, jnp.ones((1, 1, d)), jnp.zeros((1, 1, d)),
                                    jnp.zeros((1, 1, e)), None, p=2)
    np.testing.assert_array_equal(np.asarray(y), np.full((1, 1, e), 15.0 / 4.0, np.float32))
