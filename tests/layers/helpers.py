"""Shared by the tests of sympow.layers (and sympow.train): tiny configs, randomized models,
jitted forward / prefill-and-decode, and GPT-2's parameter count from the architecture."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from sympow.layers import GPT, PRESETS, GPTConfig, decode_step
from sympow.layers.fused_decode import decode_weights

VARIANTS = tuple(PRESETS)  # softmax, sympow, sympow_gating, conformal
VOCAB = 48


def tiny(variant: str, **overrides) -> GPTConfig:
    """2 layers, 4 query heads over 2 key/value heads (grouped), head dim 8, the chunked
    algorithm with chunk 4."""
    fields = dict(vocab_size=VOCAB, n_layer=2, n_head=4, n_kv_head=2, d_model=32, chunk_size=4,
                  impl="xla", algorithm="chunked", max_length=32)
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
def forward(graphdef, state, toks):
    return nnx.merge(graphdef, state)(toks)


@functools.partial(jax.jit, static_argnums=(0, 3, 4))
def prefill_and_decode(graphdef, state, toks, prompt_len, fused=False):
    """Prefill then decode each remaining token; fused: the fused step (packed weights;
    True or the products' impl, 'pallas' or 'xla')."""
    model = nnx.merge(graphdef, state)
    weights = decode_weights(model) if fused else None
    if prompt_len:
        logits, cache = model.prefill(toks[:, :prompt_len])
    else:
        cache = model.init_cache(toks.shape[0])
        logits = jnp.zeros((toks.shape[0], 0, model.config.vocab_size), jnp.float32)

    def step(cache, token):
        products = {} if fused in (False, True) else {"products": fused}
        logits, cache = decode_step(model, token, cache, weights=weights, **products)
        return cache, logits

    cache, rest = jax.lax.scan(step, cache, toks[:, prompt_len:].T)  # [T - t, B, V]
    return jnp.concatenate([logits.astype(rest.dtype), jnp.moveaxis(rest, 0, 1)], 1), cache


def full_logits(model: GPT, toks: jax.Array) -> jax.Array:
    return forward(*nnx.split(model), toks)


def decode_logits(model: GPT, toks: jax.Array, prompt_len: int, fused: bool = False
                  ) -> jax.Array:
    """Logits at every position from prefill(toks[:, :prompt_len]) (an empty cache when 0)
    then one decode step per remaining token (fused: the fused step), jit-compiled as used
    in practice."""
    return prefill_and_decode(*nnx.split(model), toks, prompt_len, fused)[0]


def rel_max_err(x, y) -> float:
    x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
    return float(np.max(np.abs(x - y)) / np.max(np.abs(y)))


def gpt2_params(v: int, layers: int, c: int) -> int:
    """GPT-2 with tied head and no position table: derived from the architecture."""
    layer_norm = 2 * c
    attention = 4 * (c * c + c)  # q, k, v, out with biases (n_kv_head = n_head)
    mlp = (c * 4 * c + 4 * c) + (4 * c * c + c)
    return v * c + layer_norm + layers * (2 * layer_norm + attention + mlp) + layer_norm
