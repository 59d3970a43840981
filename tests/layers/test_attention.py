"""sympow.layers.attention: the layers standalone (shapes, gate init and gate bias, rotary,
softmax implementation choice)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from sympow.layers import Rotary, SoftmaxAttention, SympowAttention


def test_attention_layers_standalone():
    x = jnp.asarray(np.random.default_rng(0).normal(size=(2, 9, 32)), jnp.float32)
    for layer in (SympowAttention(32, 4, 2, p=4, gating=True, rotary="learned", chunk_size=4,
                                  rngs=nnx.Rngs(0)),
                  SoftmaxAttention(32, 4, 1, rngs=nnx.Rngs(0))):
        y = nnx.jit(lambda layer, x: layer(x))(layer, x)
        assert y.shape == x.shape and y.dtype == jnp.float32
        assert np.isfinite(np.asarray(y)).all()
    # log_g <= 0 and the gate starts near 1 (bias +5).
    layer = SympowAttention(32, 4, gating=True, rngs=nnx.Rngs(0))
    _, _, _, log_g, _ = layer.project(x)
    assert log_g.shape == (2, 9, 4) and float(log_g.max()) <= 0 and float(log_g.min()) > -0.05


def test_softmax_implementation_choice():
    layer = SoftmaxAttention(32, 4, dtype="bfloat16", rngs=nnx.Rngs(0))
    assert layer._implementation() == ("cudnn" if jax.default_backend() == "gpu" else "xla")
    assert SoftmaxAttention(32, 4, rngs=nnx.Rngs(0))._implementation() == "xla"  # float32



def test_fresh_learned_rotary_scores_equal_fixed_rotary():
    """W_beta starts at zero, so beta = 1 and mu_i = i + 1: fixed rotary (mu_i = i) shifted by
    one, hence the same scores q_i . k_j (they depend on mu_i - mu_j only), with mu = T after
    the last token. A rotation keeps the norm of every (2j, 2j + 1) pair; fixed rotary leaves
    position 0 unchanged (angle 0)."""
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(2, 7, 32)), jnp.float32)
    q = jnp.asarray(rng.normal(size=(2, 7, 4, 8)), jnp.float32)
    k = jnp.asarray(rng.normal(size=(2, 7, 2, 8)), jnp.float32)
    q_l, k_l, mu = Rotary(32, 2, 8, "learned", rngs=nnx.Rngs(0))(x, q, k)
    q_f, k_f, none = Rotary(32, 2, 8, "fixed", rngs=nnx.Rngs(0))(x, q, k)
    assert none is None
    np.testing.assert_array_equal(mu, np.full((2, 2), 7.0))

    def scores(q, k):  # [B, Hq, T, T]; query head n reads key/value head n // 2
        return np.einsum("bind,bjnd->bnij", np.asarray(q), np.repeat(np.asarray(k), 2, axis=2))

    np.testing.assert_allclose(scores(q_l, k_l), scores(q_f, k_f), rtol=1e-5, atol=1e-5)
    assert np.abs(scores(q_f, k_f) - scores(q, k)).max() > 1e-2  # rotary did something
    np.testing.assert_array_equal(q_f[:, 0], q[:, 0])

    def pair_norms(a):
        return np.hypot(np.asarray(a)[..., 0::2], np.asarray(a)[..., 1::2])

    for rotated, original in ((q_f, q), (k_f, k), (q_l, q), (k_l, k)):
        np.testing.assert_allclose(pair_norms(rotated), pair_norms(original), rtol=1e-5)


def _gate_params(layer) -> dict[str, np.ndarray]:
    return {"/".join(map(str, path)): np.asarray(value[...])
            for path, value in nnx.to_flat_state(nnx.state(layer.gate_proj, nnx.Param))}


def test_gate_bias_is_configurable():
    """gate_bias is b_gamma's initial value (default +5); None drops the bias: the papers'
    gamma = sigmoid(W_gamma x), which starts near 0.5."""
    x = jnp.asarray(np.random.default_rng(1).normal(size=(2, 9, 32)), jnp.float32)
    default = _gate_params(SympowAttention(32, 4, 2, gating=True, rngs=nnx.Rngs(0)))
    assert set(default) == {"kernel", "bias"}
    np.testing.assert_array_equal(default["bias"], np.full(2, 5.0, np.float32))
    low = _gate_params(SympowAttention(32, 4, 2, gating=True, gate_bias=-1.0, rngs=nnx.Rngs(0)))
    np.testing.assert_array_equal(low["bias"], np.full(2, -1.0, np.float32))
    layer = SympowAttention(32, 4, 2, gating=True, gate_bias=None, rngs=nnx.Rngs(0))
    params = _gate_params(layer)
    assert set(params) == {"kernel"} and layer.gate_proj.bias is None
    _, _, _, log_g, _ = layer.project(x)
    expected = 1 / (1 + np.exp(-np.einsum("btc,ch->bth", np.asarray(x), params["kernel"])))
    np.testing.assert_allclose(np.exp(np.asarray(log_g)), expected, rtol=1e-5, atol=1e-6)
    assert abs(float(np.exp(log_g).mean()) - 0.5) < 0.1  # W_gamma x is small at init


def test_invalid_gate_bias_raises():
    for value in ("5", True, float("inf"), float("nan")):
        with pytest.raises(ValueError, match=r"gate_bias must be None .* got gate_bias="):
            SympowAttention(32, 4, gating=True, gate_bias=value, rngs=nnx.Rngs(0))


@pytest.mark.parametrize("impl, decode_impl, want", [
    (None, None, None),  # decode_step's default (the kernel on a GPU)
    ("pallas", None, "pallas"), ("xla", None, "reference"), ("reference", None, "reference"),
    (None, "pallas", "pallas"), ("pallas", "reference", "reference")])
def test_decode_impl_follows_impl_unless_given(impl, decode_impl, want):
    layer = SympowAttention(32, 4, impl=impl, decode_impl=decode_impl, rngs=nnx.Rngs(0))
    assert layer.decode_impl == want


def test_invalid_decode_impl_raises():
    with pytest.raises(ValueError, match=r"decode_impl must be one of \('pallas', 'reference'\) "
                                         r"or None, got decode_impl='xla'"):
        SympowAttention(32, 4, decode_impl="xla", rngs=nnx.Rngs(0))


# --- input errors ----------------------------------------------------------------------------


def _layers():
    return (SympowAttention(32, 4, 2, chunk_size=4, rngs=nnx.Rngs(0)),
            SoftmaxAttention(32, 4, 2, rngs=nnx.Rngs(0)))


def test_gating_must_be_a_bool():
    """bool('no') is True: a flag that is not a bool is an error, not a guess."""
    for value in ("no", 1):
        with pytest.raises(ValueError, match=rf"gating must be a bool .*got gating={value!r}"):
            SympowAttention(32, 4, gating=value, rngs=nnx.Rngs(0))
        with pytest.raises(ValueError, match=r"softmax baseline takes gating=False, got "
                                             rf"gating={value!r}"):
            SoftmaxAttention(32, 4, gating=value, rngs=nnx.Rngs(0))


@pytest.mark.parametrize("shape", [(2, 5, 16), (2, 32), (2, 5, 1, 32), (2, 0, 32)])
def test_inputs_of_another_shape_raise(shape):
    x = jnp.zeros(shape, jnp.float32)
    for layer in _layers():
        for call in (layer, functools.partial(layer.prefill, max_length=8)):
            with pytest.raises(ValueError, match=r"x must be \[B, T, C\] with C = d_model = "
                                                 rf"32 and T >= 1, got shape \({shape[0]}, "):
                call(x)


def test_decode_takes_one_token():
    x = jnp.zeros((1, 2, 32), jnp.float32)
    for layer in _layers():
        cache = layer.init_cache(1, 8)
        with pytest.raises(ValueError, match=r"x must be \[B, 1, C\] with C = d_model = 32 "
                                             r"\(one token\), got shape \(1, 2, 32\)"):
            layer.decode(x, cache, jnp.int32(0))


def test_prefill_valid_must_be_a_bool_mask_like_x():
    x = jnp.zeros((2, 5, 32), jnp.float32)
    for layer in _layers():
        for valid, got in ((jnp.ones((3, 5), bool), r"shape \(3, 5\) and dtype bool"),
                           ([[True] * 5] * 2, "of type list"),
                           (jnp.ones((2, 5), jnp.int32), r"shape \(2, 5\) and dtype int32")):
            with pytest.raises(ValueError, match=r"valid must be bool \[B, T\] with T = 5 and "
                                                 rf"B = 2 \(the prompt\), got {got}"):
                layer.prefill(x, max_length=8, valid=valid)


def test_softmax_prefill_needs_an_int_max_length():
    layer = SoftmaxAttention(32, 4, rngs=nnx.Rngs(0))
    for bad in (None, 4, 6.0):
        with pytest.raises(ValueError, match=r"max_length must be an int >= the prompt length "
                                             rf"5, got max_length={bad!r}"):
            layer.prefill(jnp.zeros((1, 5, 32)), max_length=bad)


def test_input_checks_hold_under_jit():
    """The checks read static shapes only: a jitted call runs, and a bad shape still raises."""
    layer = _layers()[0]
    run = nnx.jit(lambda layer, x: layer(x))
    assert run(layer, jnp.zeros((1, 4, 32))).shape == (1, 4, 32)
    with pytest.raises(ValueError, match="x must be"):
        run(layer, jnp.zeros((1, 4, 16)))


@pytest.mark.parametrize("base", [1.0, float("inf"), float("nan"), "65536"])
def test_rotary_base_must_be_a_finite_number_above_one(base):
    """inf would pass `base > 1` and rotate every pair but the first by nothing."""
    with pytest.raises(ValueError, match=r"rotary_base must be a finite number > 1, got "
                                         r"rotary_base="):
        SympowAttention(32, 2, rotary="learned", rotary_base=base, rngs=nnx.Rngs(0))
