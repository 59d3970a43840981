"""sympow.layers.model: shapes and dtypes, gradients and learning, configuration errors and
presets, parameter counts and state sizes."""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import sympow
from sympow.layers import GPT, PRESETS, SIZES, GPTConfig, model_report, state_bytes
from sympow.layers.model import preset_name, tied_logits
from tests.layers.helpers import (
    VARIANTS,
    VOCAB,
    decode_logits,
    full_logits,
    gpt2_params,
    randomized,
    rel_max_err,
    tiny,
    tokens,
)

# --- shapes and dtypes --------------------------------------------------------------------


@pytest.mark.parametrize("variant", VARIANTS)
def test_shapes_and_dtypes(variant):
    logits = full_logits(randomized(tiny(variant)), tokens(0))
    assert logits.shape == (2, 13, VOCAB) and logits.dtype == jnp.float32
    assert np.isfinite(np.asarray(logits)).all()


@pytest.mark.parametrize("variant", VARIANTS)
def test_bf16_compute_with_fp32_params(variant):
    model = randomized(tiny(variant, dtype="bfloat16", param_dtype="float32"))
    params = jax.tree.leaves(nnx.state(model, nnx.Param))
    assert {p.dtype for p in params} == {jnp.dtype(jnp.float32)}
    toks = tokens(1)
    logits = full_logits(model, toks)
    assert logits.dtype == jnp.float32 and np.isfinite(np.asarray(logits)).all()
    reference = full_logits(randomized(tiny(variant)), toks)  # fp32 compute, same weights
    assert rel_max_err(logits, reference) < 0.05
    if variant in ("softmax", "conformal"):  # bf16 decoding runs and stays close
        decoded = decode_logits(model, toks, 5)
        assert np.isfinite(np.asarray(decoded)).all()
        assert rel_max_err(decoded, reference) < 0.05



# --- gradients and learning ------------------------------------------------------------------


def loss_fn(model: GPT, batch: jax.Array) -> jax.Array:
    logits = model(batch[:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch[:, 1:]).mean()


@pytest.mark.parametrize("variant, overrides", [(v, {}) for v in VARIANTS] + [
    ("sympow_gating", dict(gate_bias=None))])
def test_train_step_gradients_learning_and_single_compile(variant, overrides):
    """Gradients reach every parameter (W_gamma, W_beta, all projections) on a randomized
    model; 40 adam steps on a period-5 pattern bring the loss far below ln(V); the jitted
    step traces once. Also for the papers' bias-free gate (gate_bias=None)."""
    model = randomized(tiny(variant, **overrides))
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    optimizer = optax.adam(1e-2)
    opt_state = optimizer.init(params)
    traces = []

    @jax.jit
    def train_step(params, opt_state, batch):
        traces.append(1)  # Python side effect: runs once per trace

        def loss(params):
            return loss_fn(nnx.merge(graphdef, params, rest), batch)

        value, grads = jax.value_and_grad(loss)(params)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value, grads

    pattern = np.random.default_rng(9).permutation(VOCAB)[:5]
    starts = np.arange(4)[:, None]
    batch = jnp.asarray(pattern[(starts + np.arange(17)[None]) % 5], jnp.int32)  # [4, 17]
    losses = []
    for i in range(40):
        params, opt_state, value, grads = train_step(params, opt_state, batch)
        losses.append(float(value))
        if i == 0:
            flat = {"/".join(map(str, path)): np.asarray(g[...])
                    for path, g in nnx.to_flat_state(grads)}
    expected = {"q_proj", "k_proj", "v_proj", "out_proj"}
    expected |= {"gate_proj"} if PRESETS[variant]["gating"] else set()
    expected |= {"beta_proj"} if PRESETS[variant]["rotary"] == "learned" else set()
    for name in expected:
        assert any(name in path for path in flat), name
    for path, g in flat.items():
        assert np.isfinite(g).all(), path
        assert np.abs(g).max() > 0, f"zero gradient for {path}"
    assert len(traces) == 1
    assert losses[0] > 0.8 * math.log(VOCAB)
    assert losses[-1] < 0.5, losses[::5]


def _head_operands(dtype):
    kx, kt, kg = jax.random.split(jax.random.PRNGKey(7), 3)
    x = jax.random.normal(kx, (2, 5, 16), jnp.float32).astype(dtype)
    table = (0.3 * jax.random.normal(kt, (37, 16), jnp.float32)).astype(dtype)
    dlogits = jax.random.normal(kg, (2, 5, 37), jnp.float32)
    return x, table, dlogits


def test_tied_logits_float32_is_autodiff():
    x, table, dlogits = _head_operands(jnp.float32)
    logits, vjp = jax.vjp(tied_logits, x, table)
    plain, plain_vjp = jax.vjp(lambda a, b: jnp.einsum("btc,vc->btv", a, b), x, table)
    np.testing.assert_allclose(logits, plain, rtol=1e-6, atol=1e-6)
    for ours, theirs in zip(vjp(dlogits), plain_vjp(dlogits), strict=True):
        np.testing.assert_allclose(ours, theirs, rtol=1e-5, atol=1e-5)


def test_tied_logits_bf16_backward_runs_bf16_products_on_the_rounded_cotangent():
    """bf16 x: float32 logits; the backward's products take bf16 operands only (autodiff's
    take the float32 cotangent) and equal float32 products of the cotangent rounded to bf16."""
    x, table, dlogits = _head_operands(jnp.bfloat16)
    logits, vjp = jax.vjp(tied_logits, x, table)
    assert logits.dtype == jnp.float32
    wide = jnp.einsum("btc,vc->btv", x.astype(jnp.float32), table.astype(jnp.float32))
    np.testing.assert_allclose(logits, wide, rtol=1e-5, atol=1e-5)
    dx, dtable = vjp(dlogits)
    assert dx.dtype == dtable.dtype == jnp.bfloat16
    rounded = dlogits.astype(jnp.bfloat16).astype(jnp.float32)
    dx_ref = jnp.einsum("btv,vc->btc", rounded, table.astype(jnp.float32))
    dtable_ref = jnp.einsum("btv,btc->vc", rounded, x.astype(jnp.float32))
    for ours, ref in ((dx, dx_ref), (dtable, dtable_ref)):  # one bf16 rounding of the sum
        np.testing.assert_allclose(ours.astype(jnp.float32), ref, rtol=2 ** -8, atol=1e-6)

    def dot_operand_dtypes(f, *args):
        eqns = jax.make_jaxpr(f)(*args).eqns
        return {(str(e.invars[0].aval.dtype), str(e.invars[1].aval.dtype))
                for e in eqns if e.primitive.name == "dot_general"}

    ours = dot_operand_dtypes(lambda g: jax.vjp(tied_logits, x, table)[1](g), dlogits)
    plain = dot_operand_dtypes(lambda g: jax.vjp(
        lambda a, b: jnp.einsum("btc,vc->btv", a, b, preferred_element_type=jnp.float32),
        x, table)[1](g), dlogits)
    assert ours == {("bfloat16", "bfloat16")}
    assert ("float32", "bfloat16") in plain or ("bfloat16", "float32") in plain


# --- configuration errors --------------------------------------------------------------------


@pytest.mark.parametrize("overrides, match", [
    (dict(p=3), "p must be a positive even int"),
    (dict(p=0), "p must be a positive even int"),
    (dict(n_head=4, n_kv_head=3), "n_head must be a multiple of n_kv_head"),
    (dict(d_model=30, n_head=4, n_kv_head=2), "d_model must be divisible by n_head"),
    (dict(d_model=12, n_head=4, n_kv_head=2), "needs an even head dim"),
    (dict(rotary="alibi"), "rotary must be one of"),
    (dict(attention="linear"), "attention must be one of"),
    (dict(impl="cuda"), "impl must be one of"),
    (dict(algorithm="flash"), "algorithm must be one of"),
    (dict(chunk_size=0), "chunk_size must be a positive int"),
    (dict(attention="softmax", gating=True), "softmax baseline takes gating=False"),
    (dict(vocab_size=0), "vocab_size must be a positive int"),
    (dict(layer_norm_eps=0.0), r"layer_norm_eps must be a finite number > 0, got "
                               r"layer_norm_eps=0.0"),
    (dict(layer_norm_eps=math.nan), "layer_norm_eps must be a finite number > 0"),
    (dict(init_std=math.nan), r"init_std must be a finite number > 0, got init_std=nan"),
    (dict(init_std=-0.02), "init_std must be a finite number > 0"),
    (dict(init_std=0), "init_std must be a finite number > 0"),
    # the sympow fields are checked whatever the attention
    (dict(attention="softmax", gating=False, p=3), "p must be a positive even int"),
    (dict(attention="softmax", gating=False, chunk_size=0), "chunk_size must be a positive int"),
    (dict(attention="softmax", gating=False, decode_impl="xla"), "decode_impl must be one of"),
])
def test_invalid_configs_raise(overrides, match):
    with pytest.raises(ValueError, match=match):
        GPT(tiny("conformal", **overrides), rngs=nnx.Rngs(0))


@pytest.mark.parametrize("value", ["5.0", True, math.inf, math.nan])
def test_invalid_gate_bias_raises(value):
    with pytest.raises(ValueError, match=r"gate_bias must be None") as error:
        GPTConfig(gate_bias=value)
    assert f"gate_bias={value!r}" in str(error.value)


def _gate_biases(model: GPT) -> list:
    return [block.attn.gate_proj.bias for block in model.blocks]


def test_gate_bias_setting():
    """gate_bias: b_gamma's initial value in every layer (default +5); None = no bias
    parameter and gamma = sigmoid(W_gamma x) at init, the papers' gate."""
    assert GPTConfig().gate_bias == 5.0 and GPTConfig(gate_bias=-1).gate_bias == -1.0
    for overrides, want in (({}, 5.0), (dict(gate_bias=-1.0), -1.0)):
        biases = _gate_biases(GPT(tiny("sympow_gating", **overrides), rngs=nnx.Rngs(0)))
        assert len(biases) == 2
        for bias in biases:
            np.testing.assert_array_equal(bias[...], np.full(2, want, np.float32))
    model = GPT(tiny("conformal", gate_bias=None), rngs=nnx.Rngs(0))
    assert _gate_biases(model) == [None, None]
    names = ["/".join(map(str, path)) for path, _ in nnx.to_flat_state(nnx.state(model))]
    assert [n for n in names if "gate_proj" in n] == [f"blocks/{i}/attn/gate_proj/kernel"
                                                      for i in range(2)]
    attn = model.blocks[0].attn
    x = model.blocks[0].ln1(model.embed(tokens(2)))  # the first layer's attention input
    log_g = attn.project(x)[3]  # [B, T, Hk]
    w = np.asarray(attn.gate_proj.kernel[...], np.float64)  # [C, Hk]
    expected = 1 / (1 + np.exp(-np.einsum("btc,ch->bth", np.asarray(x, np.float64), w)))
    np.testing.assert_allclose(np.exp(np.asarray(log_g)), expected, rtol=1e-5, atol=1e-6)
    # Without b_gamma the gating group is W_gamma alone: C x Hk per layer.
    small = model_report(GPTConfig.preset("sympow_gating", size="small", gate_bias=None))
    assert small.groups["gating"] == 12 * 768 * 12


def test_unknown_preset_and_odd_head_dim_without_rotary():
    with pytest.raises(ValueError, match="variant must be one of"):
        GPTConfig.preset("mamba")
    with pytest.raises(ValueError, match="size must be one of"):
        GPTConfig.preset("sympow", size="huge")
    # Without rotary an odd head dim is fine.
    GPT(tiny("sympow", rotary="none", d_model=12, n_head=4), rngs=nnx.Rngs(0))



def test_preset_aliases_and_sizes():
    """The words users type name the presets; sizes are the GPT-2 shapes (micro: runlocal)."""
    assert preset_name("gating") == preset_name("sympow+gating") == "sympow_gating"
    assert preset_name("conformal-sympow") == "conformal" and preset_name("softmax") == "softmax"
    assert GPTConfig.preset("gating", "tiny") == GPTConfig.preset("sympow_gating", "tiny")
    with pytest.raises(ValueError, match="variant must be one of"):
        preset_name("mamba")
    shapes = {name: (s["n_layer"], s["n_head"], s["d_model"]) for name, s in SIZES.items()}
    assert shapes == {"micro": (2, 2, 64), "tiny": (2, 4, 128), "small": (12, 12, 768),
                      "medium": (24, 16, 1024)}
    config = GPTConfig.preset("conformal", "micro", p=4)
    assert (config.attention, config.gating, config.rotary, config.p) == (
        "sympow", True, "learned", 4)
    assert config.kv_heads == 2 and config.head_dim == 32


# --- parameter counts and state sizes --------------------------------------------------------




def test_gpt2_small_parameter_count_and_overheads():
    reports = {v: model_report(GPTConfig.preset(v, size="small")) for v in VARIANTS}
    expected = gpt2_params(50304, 12, 768)
    assert expected == 123_691_008  # ~124M
    assert reports["softmax"].params == reports["sympow"].params == expected
    gating = reports["sympow_gating"].params - expected
    conformal = reports["conformal"].params - expected
    assert gating == 12 * (768 * 12 + 12)  # W_gamma and b_gamma per layer and head
    assert conformal - gating == 12 * 768 * 12  # W_beta, no bias
    # [conformal] §A.5 (docs/references.md): +0.09% (gating) and +0.18% (gating and learned rotary).
    assert round(100 * gating / expected, 2) == 0.09
    assert round(100 * conformal / expected, 2) == 0.18
    assert reports["conformal"].groups["gating"] == gating
    assert reports["conformal"].groups["rotary"] == conformal - gating


def test_state_bytes_consistent_with_sympow_and_cache():
    small = GPTConfig.preset("sympow", size="small", p=2)
    paper_table = sympow.state_bytes(64, 2, layers=12, heads=12)  # 2 bytes per number
    assert round(paper_table / 1e6) == 39  # [sympow] §4's state-size table: 39 MB
    abstract = nnx.eval_shape(lambda: GPT(small, rngs=nnx.Rngs(0)))
    assert abstract.state_bytes(bytes_per_number=2) == paper_table
    assert model_report(GPTConfig.preset("conformal", p=4)).state_bytes == (
        sympow.state_bytes(64, 4, layers=12, heads=12, bytes_per_number=4))  # float32
    # The caches prefill builds hold exactly the reported bytes (S and Z; K and V).
    for variant in ("conformal", "softmax"):
        model = randomized(tiny(variant))
        prefill = functools.partial(model.prefill, max_length=20)
        cache = jax.eval_shape(prefill, tokens(10, (3, 6)))[1]
        held = [(layer.k, layer.v) if variant == "softmax" else (layer.state.s, layer.state.z)
                for layer in cache.layers]
        held = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(held))
        assert model.state_bytes(batch=3, context=20) == held


def test_invalid_configs_raise_at_construction():
    """A config is checked when made (state_bytes and model_report read it without a model)."""
    with pytest.raises(ValueError, match=r"d_model must be divisible by n_head, got "
                                         r"d_model=32, n_head=3"):
        GPTConfig(n_head=3, d_model=32)
    with pytest.raises(ValueError, match=r"p must be a positive even int"):
        GPTConfig(attention="softmax", p=3)


@pytest.mark.parametrize("kwargs, match", [
    (dict(batch=-3), r"batch must be a positive int, got batch=-3"),
    (dict(batch=0), r"batch must be a positive int, got batch=0"),
    (dict(context=-5), r"context must be None or a positive int, got context=-5"),
    (dict(bytes_per_number=0), r"bytes_per_number must be None or a positive int, got "
                               r"bytes_per_number=0"),
    (dict(bytes_per_number=2.5), r"bytes_per_number must be None or a positive int"),
])
@pytest.mark.parametrize("variant", ["sympow", "softmax"])
def test_state_bytes_rejects_bad_arguments(variant, kwargs, match):
    with pytest.raises(ValueError, match=match):
        state_bytes(tiny(variant), **kwargs)
