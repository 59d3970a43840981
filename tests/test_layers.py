"""Tests for sympow.layers: shapes, recurrent decoding == full forward, learning, counts."""

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
from sympow.layers import (
    GPT,
    PRESETS,
    GPTConfig,
    SoftmaxAttention,
    SympowAttention,
    generate,
    model_report,
)

VARIANTS = tuple(PRESETS)  # softmax, sympow, sympow_gating, conformal
VOCAB = 48


def tiny(variant: str, **overrides) -> GPTConfig:
    """2 layers, 4 query heads over 2 key/value heads (grouped), head dim 8, chunk 4."""
    fields = dict(vocab_size=VOCAB, n_layer=2, n_head=4, n_kv_head=2, d_model=32, chunk_size=4,
                  impl="xla", max_length=32)
    return GPTConfig.preset(variant, size="tiny", **{**fields, **overrides})


@functools.cache
def randomized(config: GPTConfig, seed: int = 0) -> GPT:
    """A model whose gates and rotary rates are far from their init (gamma in (0.5, 0.95),
    beta spread over (0, 2)), every parameter perturbed, so decoding checks see real
    gating and learned rotary rather than gamma ~ 1, beta = 1. Cached: do not mutate."""
    model = GPT(config, rngs=nnx.Rngs(seed))
    keys = iter(jax.random.split(jax.random.key(seed + 1), 1000))

    def perturb(path, x):
        names = "/".join(str(p) for p in path)
        noise = jax.random.normal(next(keys), x.shape, jnp.float32)
        if "gate_proj" in names and names.endswith("bias"):
            return jax.random.uniform(next(keys), x.shape, minval=0.0, maxval=3.0).astype(x.dtype)
        if "beta_proj" in names or "gate_proj" in names:
            return (0.3 * noise).astype(x.dtype)
        return (x + 0.05 * noise).astype(x.dtype)

    params = nnx.state(model, nnx.Param)
    nnx.update(model, jax.tree_util.tree_map_with_path(perturb, params))
    return model


def tokens(seed: int, shape=(2, 13)) -> jax.Array:
    return jnp.asarray(np.random.default_rng(seed).integers(0, VOCAB, shape), jnp.int32)


# Module-level jitted helpers keyed on the (hashable) graphdef: models of one config share
# one compilation across tests.
@functools.partial(jax.jit, static_argnums=0)
def _forward(graphdef, state, toks):
    return nnx.merge(graphdef, state)(toks)


@functools.partial(jax.jit, static_argnums=(0, 3))
def _prefill_and_decode(graphdef, state, toks, prompt_len):
    model = nnx.merge(graphdef, state)
    if prompt_len:
        logits, cache = model.prefill(toks[:, :prompt_len])
    else:
        cache = model.init_cache(toks.shape[0])
        logits = jnp.zeros((toks.shape[0], 0, model.config.vocab_size), jnp.float32)

    def step(cache, token):
        logits, cache = model.decode_step(token, cache)
        return cache, logits

    cache, rest = jax.lax.scan(step, cache, toks[:, prompt_len:].T)  # [T - t, B, V]
    return jnp.concatenate([logits.astype(rest.dtype), jnp.moveaxis(rest, 0, 1)], 1), cache


def full_logits(model: GPT, toks: jax.Array) -> jax.Array:
    return _forward(*nnx.split(model), toks)


def decode_logits(model: GPT, toks: jax.Array, prompt_len: int) -> jax.Array:
    """Logits at every position from prefill(toks[:, :prompt_len]) (an empty cache when 0)
    then one decode step per remaining token, jit-compiled as used in practice."""
    return _prefill_and_decode(*nnx.split(model), toks, prompt_len)[0]


def rel_max_err(x, y) -> float:
    x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
    return float(np.max(np.abs(x - y)) / np.max(np.abs(y)))


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


# --- recurrent decoding equals the full forward ----------------------------------------------


@pytest.mark.parametrize("variant, overrides", [(v, {}) for v in VARIANTS] + [
    ("softmax", dict(rotary="learned"))])
def test_prefill_then_decode_matches_forward_fp32(variant, overrides):
    """p = 2 in float32; the prompt (5) and T (13) are not multiples of chunk_size (4)."""
    model = randomized(tiny(variant, **overrides))
    toks = tokens(0)
    full = full_logits(model, toks)
    decoded = decode_logits(model, toks, 5)
    # float32 rounding through 2 layers of O(1) activations: a few ulps of the largest logit.
    assert rel_max_err(decoded, full) < 1e-6


@pytest.mark.parametrize("variant", ["softmax", "conformal"])
def test_decode_from_empty_cache_matches_forward(variant):
    model = randomized(tiny(variant))
    toks = tokens(0)
    decoded, cache = _prefill_and_decode(*nnx.split(model), toks, 0)
    assert int(cache.position) == toks.shape[1]
    assert rel_max_err(decoded, full_logits(model, toks)) < 1e-6


def test_prefill_then_decode_matches_forward_p4_float64(x64):
    """p = 4 needs float64: phi(q).S cancels terms of size |q|^4 |k|^4 down to (q.k)^4, so
    in float32 rows with small scores lose digits (seen: 2e-6 of the largest logit). The
    conformal variant exercises everything (gating, learned rotary, grouped heads)."""
    model = randomized(tiny("conformal", p=4, dtype="float64", param_dtype="float64"))
    toks = tokens(3)
    full = full_logits(model, toks)
    assert full.dtype == jnp.float64
    assert rel_max_err(decode_logits(model, toks, 7), full) < 1e-12


def test_sympow_state_size_is_constant_in_context():
    model = randomized(tiny("conformal"))
    shapes = [jax.eval_shape(lambda t: model.prefill(t)[1].layers, tokens(5, (2, n)))
              for n in (3, 11, 40)]
    assert shapes[0] == shapes[1] == shapes[2]


@pytest.mark.parametrize("variant", ["softmax", "conformal"])
def test_generate_greedy_matches_full_forward_argmax(variant):
    model = randomized(tiny(variant))
    prompt = tokens(6, (2, 5))
    out = generate(model, prompt, 8)
    assert out.shape == (2, 13) and out.dtype == jnp.int32
    np.testing.assert_array_equal(out[:, :5], prompt)
    # Causal: the forward's logits at i - 1 are those of the prefix out[:, :i], so every new
    # token is the argmax of the forward over its prefix.
    expected = jnp.argmax(full_logits(model, out)[:, 4:-1], axis=-1)
    np.testing.assert_array_equal(out[:, 5:], expected)


def test_generate_sampling_is_reproducible():
    model = randomized(tiny("sympow_gating"))
    prompt = tokens(7, (3, 4))
    a = generate(model, prompt, 5, temperature=1.0, rng=jax.random.key(1))
    b = generate(model, prompt, 5, temperature=1.0, rng=jax.random.key(1))
    np.testing.assert_array_equal(a, b)
    assert a.shape == (3, 9) and int(a.min()) >= 0 and int(a.max()) < VOCAB
    with pytest.raises(ValueError, match="rng"):
        generate(model, prompt, 5, temperature=1.0)


# --- gradients and learning ------------------------------------------------------------------


def loss_fn(model: GPT, batch: jax.Array) -> jax.Array:
    logits = model(batch[:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch[:, 1:]).mean()


@pytest.mark.parametrize("variant", VARIANTS)
def test_train_step_gradients_learning_and_single_compile(variant):
    """Gradients reach every parameter (W_gamma, W_beta, all projections) on a randomized
    model; 40 adam steps on a period-5 pattern bring the loss far below ln(V); the jitted
    step traces once."""
    model = randomized(tiny(variant))
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
    (dict(chunk_size=0), "chunk_size must be a positive int"),
    (dict(attention="softmax", gating=True), "gating=True is only defined for sympow"),
    (dict(vocab_size=0), "vocab_size must be a positive int"),
])
def test_invalid_configs_raise(overrides, match):
    with pytest.raises(ValueError, match=match):
        GPT(tiny("conformal", **overrides), rngs=nnx.Rngs(0))


def test_unknown_preset_and_odd_head_dim_without_rotary():
    with pytest.raises(ValueError, match="variant must be one of"):
        GPTConfig.preset("mamba")
    with pytest.raises(ValueError, match="size must be one of"):
        GPTConfig.preset("sympow", size="huge")
    # Without rotary an odd head dim is fine.
    GPT(tiny("sympow", rotary="none", d_model=12, n_head=4), rngs=nnx.Rngs(0))


# --- parameter counts and state sizes --------------------------------------------------------


def gpt2_params(v: int, layers: int, c: int) -> int:
    """GPT-2 with tied head and no position table: derived from the architecture."""
    layer_norm = 2 * c
    attention = 4 * (c * c + c)  # q, k, v, out with biases (n_kv_head = n_head)
    mlp = (c * 4 * c + 4 * c) + (4 * c * c + c)
    return v * c + layer_norm + layers * (2 * layer_norm + attention + mlp) + layer_norm


def test_gpt2_small_parameter_count_and_overheads():
    reports = {v: model_report(GPTConfig.preset(v, size="small")) for v in VARIANTS}
    expected = gpt2_params(50304, 12, 768)
    assert expected == 123_691_008  # ~124M
    assert reports["softmax"].params == reports["sympow"].params == expected
    gating = reports["sympow_gating"].params - expected
    conformal = reports["conformal"].params - expected
    assert gating == 12 * (768 * 12 + 12)  # W_gamma and b_gamma per layer and head
    assert conformal - gating == 12 * 768 * 12  # W_beta, no bias
    # Seed 002 A.5: +0.09% (gating) and +0.18% (gating and learned rotary).
    assert round(100 * gating / expected, 2) == 0.09
    assert round(100 * conformal / expected, 2) == 0.18
    assert reports["conformal"].groups["gating"] == gating
    assert reports["conformal"].groups["rotary"] == conformal - gating


def test_state_bytes_consistent_with_sympow_and_cache():
    small = GPTConfig.preset("sympow", size="small", p=2)
    seed_table = sympow.state_bytes(64, 2, layers=12, heads=12)  # 2 bytes per number
    assert round(seed_table / 1e6) == 39  # seed table: 39 MB
    abstract = nnx.eval_shape(lambda: GPT(small, rngs=nnx.Rngs(0)))
    assert abstract.state_bytes(bytes_per_number=2) == seed_table
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
