"""Recurrent inference for `GPT`: prefill, one-token decode steps and `generate`.

sympow layers carry their recurrent state (S, Z, and mu for learned rotary), O(1) in the
context length; the softmax baseline carries a preallocated KV cache. Both sit in one
pytree, `GPTCache`, so the same jit-compiled loop drives every variant.

    logits, cache = model.prefill(prompt)              # [B, T, V] and the state after it
    logits, cache = model.decode_step(token, cache)    # [B, V]
    tokens = generate(model, prompt, 32, temperature=0.8, rng=jax.random.key(0))
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Float, Int

__all__ = ["GPTCache", "prefill", "decode_step", "generate"]


class GPTCache(NamedTuple):
    """Decoding state of a GPT.

    layers: one cache per block, `SympowCache` (state S [B, Hk, F, E], Z [B, Hk, F], mu
      [B, Hk] or None) or `KVCache` (k, v [B, L, Hk, D], mu) for softmax.
    position: [] int32, the number of tokens consumed (index of the next token).
    """

    layers: tuple
    position: Array


def prefill(model, tokens: Int[Array, "B T"], *, max_length: int | None = None
            ) -> tuple[Float[Array, "B T V"], GPTCache]:
    """Forward over a prompt, returning its logits and the cache (sympow.prefill per layer).

    max_length: softmax KV-cache rows (prompt plus every token to decode; None =
    config.max_length, at least T); ignored by sympow, whose state has a fixed size.
    """
    t = tokens.shape[1]
    if max_length is None:
        max_length = max(model.config.max_length, t)
    x = model.embed(tokens)  # [B, T, C]
    caches = []
    for block in model.blocks:
        x, cache = block.prefill(x, max_length=max_length)
        caches.append(cache)
    return model.head(x), GPTCache(tuple(caches), jnp.asarray(t, jnp.int32))


def decode_step(model, token: Int[Array, " B"], cache: GPTCache
                ) -> tuple[Float[Array, "B V"], GPTCache]:
    """Consume one token per sequence at index cache.position; returns its logits [B, V].

    Time and memory per step are independent of the context length for sympow (the state
    has a fixed size); softmax reads its KV cache (O(max_length)).
    """
    x = model.embed(token[:, None])  # [B, 1, C]
    caches = []
    for block, layer_cache in zip(model.blocks, cache.layers, strict=True):
        x, layer_cache = block.decode(x, layer_cache, cache.position)
        caches.append(layer_cache)
    return model.head(x)[:, 0], GPTCache(tuple(caches), cache.position + 1)


def _next_token(logits: Float[Array, "B V"], key, temperature, greedy: bool) -> Array:
    if greedy:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    return jax.random.categorical(key, logits / temperature, axis=-1).astype(jnp.int32)


@functools.partial(jax.jit, static_argnames=("graphdef", "max_new_tokens", "greedy",
                                             "max_length"))
def _generate(graphdef, state, prompt, key, temperature, *, max_new_tokens: int, greedy: bool,
              max_length: int):
    model = nnx.merge(graphdef, state)
    logits, cache = prefill(model, prompt, max_length=max_length)
    keys = jax.random.split(key, max_new_tokens)
    first = _next_token(logits[:, -1], keys[0], temperature, greedy)  # [B]

    def step(carry, step_key):
        token, cache = carry
        logits, cache = decode_step(model, token, cache)
        next_token = _next_token(logits, step_key, temperature, greedy)
        return (next_token, cache), next_token

    _, rest = jax.lax.scan(step, (first, cache), keys[1:])  # [N - 1, B]
    return jnp.concatenate([prompt, first[:, None], rest.T.astype(prompt.dtype)], axis=1)


def generate(model, prompt: Int[Array, "B T"], max_new_tokens: int, *,
             temperature: float = 0.0, rng: jax.Array | None = None) -> Int[Array, "B T+N"]:
    """Continue `prompt` by max_new_tokens tokens: prefill, then a jit-compiled lax.scan of
    decode steps. temperature 0 = greedy (argmax); > 0 samples softmax(logits / temperature)
    with `rng` (a jax.random key). Returns int32 [B, T + max_new_tokens], prompt first.

    The model is split into (graphdef, state) with nnx.split, so one compilation serves
    every call with the same shapes, settings and model structure.
    """
    if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be a positive int, got {max_new_tokens!r}")
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got temperature={temperature!r}")
    greedy = temperature == 0
    if not greedy and rng is None:
        raise ValueError("rng (a jax.random key) is required when temperature > 0")
    prompt = jnp.asarray(prompt, jnp.int32)
    if prompt.ndim != 2 or prompt.shape[1] < 1:
        raise ValueError(f"prompt must be int [B, T] with T >= 1, got shape {prompt.shape}")
    key = jax.random.key(0) if rng is None else rng
    graphdef, state = nnx.split(model)
    return _generate(graphdef, state, prompt, key, jnp.float32(temperature or 1.0),
                     max_new_tokens=max_new_tokens, greedy=greedy,
                     max_length=prompt.shape[1] + max_new_tokens)
