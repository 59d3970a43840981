"""Recurrent inference for `GPT`: prefill, one-token decode steps and `generate`.

sympow layers carry their recurrent state (S, Z, and mu for learned rotary), O(1) in the
context length; the softmax baseline carries a preallocated KV cache. Both sit in one
pytree, `GPTCache`, so the same jit-compiled loop drives every variant.

    logits, cache = model.prefill(prompt)              # [B, T, V] and the state after it
    logits, cache = model.decode_step(token, cache)    # [B, V]
    tokens = generate(model, prompt, 32, temperature=0.8, rng=jax.random.key(0))

Prompts of several lengths in one batch: `generate(..., prompt_lengths=[B])` (rows of
`prompt` start at column 0, padded after). Inside, each row is moved to end at column T - 1
(left padding, masked by `prefill`'s valid), so every sequence consumes its next token at the
same step; since scores depend on position differences only (rotary and gates alike), the
shift changes no output.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jaxtyping import Array, Bool, Float, Int

from sympow.layers import fused_decode
from sympow.layers.linear import shape_of

__all__ = ["GPTCache", "prefill", "decode_step", "generate", "check_tokens", "PAD_ID"]

PAD_ID = -1  # generate's filler after each row's tokens (prompt_lengths): no token id


class GPTCache(NamedTuple):
    """Decoding state of a GPT.

    layers: one cache per block, `SympowCache` (state S [B, Hk, F, E], Z [B, Hk, F], mu
      [B, Hk] or None) or `KVCache` (k, v [B, L, Hk, D], mu) for softmax.
    position: [] int32, the number of tokens consumed (index of the next token).
    """

    layers: tuple
    position: Array


def check_tokens(tokens, *, name: str = "tokens", batch: int | None = None) -> None:
    """ValueError unless tokens is an integer array [B, T] with T >= 1, or (batch given) [B]
    with B = batch. Shapes and dtype only: the ids may be traced, so ids in [0, V) are the
    caller's to get right (nnx.Embed reads an id outside as NaN)."""
    shape, dtype = getattr(tokens, "shape", None), getattr(tokens, "dtype", None)
    if batch is None:
        ok, want = shape is not None and len(shape) == 2 and shape[1] >= 1, "[B, T] with T >= 1"
    else:
        ok, want = shape == (batch,), f"[B] with B = {batch}, the cache's batch"
    if not ok or not jnp.issubdtype(dtype, jnp.integer):
        raise ValueError(f"{name} must be int {want} (ids in [0, V)), got {shape_of(tokens)}")


def prefill(model, tokens: Int[Array, "B T"], *, max_length: int | None = None,
            valid: Bool[Array, "B T"] | None = None, last_only: bool = False
            ) -> tuple[Float[Array, "B T V"] | Float[Array, "B V"], GPTCache]:
    """Forward over a prompt, returning its logits and the cache (sympow.prefill per layer).

    max_length: softmax KV-cache rows (prompt plus every token to decode; None =
    config.max_length, at least T); ignored by sympow, whose state has a fixed size.
    valid: False on each row's left padding (prompts aligned at their ends; None: all
    valid); the logits of padding positions are meaningless.
    last_only: the logits of the last position only, [B, V]: what decoding needs (the
    [B, T, V] logits of 16 prompts of 65,536 tokens are 105 GB in bf16).
    """
    check_tokens(tokens)
    x, cache = _prefill_hidden(model, tokens, max_length, valid)
    return (model.head(x[:, -1:])[:, 0] if last_only else model.head(x)), cache


def _prefill_hidden(model, tokens, max_length, valid) -> tuple[Float[Array, "B T C"], GPTCache]:
    """`prefill` before the output head: the last block's output and the cache."""
    t = tokens.shape[1]
    if max_length is None:
        max_length = max(model.config.max_length, t)
    x = model.embed(tokens)  # [B, T, C]
    caches = []
    for block in model.blocks:
        x, cache = block.prefill(x, max_length=max_length, valid=valid)
        caches.append(cache)
    return x, GPTCache(tuple(caches), jnp.asarray(t, jnp.int32))


def decode_step(model, token: Int[Array, " B"], cache: GPTCache, *, weights=None,
                products: str = fused_decode.PRODUCTS) -> tuple[Float[Array, "B V"], GPTCache]:
    """Consume one token per sequence at index cache.position; returns its logits [B, V].

    Time and memory per step are independent of the context length for sympow (the state
    has a fixed size); softmax reads its KV cache (O(max_length)).
    weights: None runs each block's `decode`; `fused_decode.decode_weights(model)` runs the
    blocks' products as fused kernels instead (B <= fused_decode.MAX_BATCH; the same
    outputs up to rounding, several times fewer kernels a step); products: how it computes
    them (`decode_linear.LINEAR_IMPLS`).
    """
    if len(cache.layers) != len(model.blocks):
        raise ValueError(f"cache must hold one layer cache per block ({len(model.blocks)}), "
                         f"got {len(cache.layers)}: make it with model.prefill or init_cache")
    # every leaf of a layer cache is [B, ...]
    check_tokens(token, name="token", batch=jax.tree.leaves(cache.layers[0])[0].shape[0])
    x = model.embed(token[:, None])  # [B, 1, C]
    if weights is not None:
        x, caches = fused_decode.fused_blocks(model, weights, x[:, 0], cache.layers,
                                              cache.position, products)
        x = x[:, None]
    else:
        caches = []
        for block, layer_cache in zip(model.blocks, cache.layers, strict=True):
            x, layer_cache = block.decode(x, layer_cache, cache.position)
            caches.append(layer_cache)
    return model.head(x)[:, 0], GPTCache(tuple(caches), cache.position + 1)


def _next_token(logits: Float[Array, "B V"], key, temperature, greedy: bool, top_k: int,
                vocab_limit: int | None) -> Array:
    """Greedy argmax, or a sample of softmax(logits / temperature) among the top_k most
    likely (0: all); ids >= vocab_limit never (None: no limit)."""
    logits = logits.astype(jnp.float32)
    if vocab_limit is not None and vocab_limit < logits.shape[-1]:
        logits = jnp.where(jnp.arange(logits.shape[-1]) < vocab_limit, logits, -jnp.inf)
    if greedy:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    if top_k:
        kth = jax.lax.top_k(logits, top_k)[0][:, -1:]  # [B, 1]
        logits = jnp.where(logits < kth, -jnp.inf, logits)
    return jax.random.categorical(key, logits / temperature, axis=-1).astype(jnp.int32)


def _end_aligned(prompt: Int[Array, "B T"], lengths: Int[Array, " B"]):
    """Rows moved to end at column T - 1 (the valid tokens of each row first in `prompt`),
    and the mask of the valid ones."""
    t = prompt.shape[1]
    shift = t - lengths  # [B] left padding
    source = jnp.arange(t)[None, :] - shift[:, None]  # [B, T]
    valid = source >= 0
    return jnp.take_along_axis(prompt, jnp.maximum(source, 0), axis=1), valid


_STATIC = ("max_new_tokens", "greedy", "max_length", "top_k", "vocab_limit", "unroll", "fused")


@functools.partial(jax.jit, static_argnames=_STATIC)
def _generate_pytree(model, prompt, lengths, key, temperature, **static):
    """`_generate` for a model that is a jax pytree (flax's default for Modules): jit
    flattens it itself, without nnx.split's graph walk on the host (docs/benchmarks.md)."""
    return _generate(model, prompt, lengths, key, temperature, **static)


@functools.partial(jax.jit, static_argnames=("graphdef", *_STATIC))
def _generate_split(graphdef, state, prompt, lengths, key, temperature, **static):
    """`_generate` for any model, passed as nnx.split's (graphdef, state)."""
    return _generate(nnx.merge(graphdef, state), prompt, lengths, key, temperature, **static)


def _is_pytree(model) -> bool:
    """Whether jax flattens `model` into its arrays (flax's `flax_pytree_module`, on by
    default) rather than holding it as one leaf."""
    # one level deep (every child counts as a leaf): jit flattens the whole model anyway
    leaves = jax.tree.leaves(model, is_leaf=lambda node: node is not model)
    return not (len(leaves) == 1 and leaves[0] is model)


def _generate(model, prompt, lengths, key, temperature, *, max_new_tokens: int,
              greedy: bool, max_length: int, top_k: int, vocab_limit: int | None,
              unroll: int, fused: bool):
    weights = fused_decode.decode_weights(model) if fused else None  # packed once
    pick = functools.partial(_next_token, temperature=temperature, greedy=greedy, top_k=top_k,
                             vocab_limit=vocab_limit)
    aligned, valid = (prompt, None) if lengths is None else _end_aligned(prompt, lengths)
    logits, cache = prefill(model, aligned, max_length=max_length, valid=valid, last_only=True)
    keys = jax.random.split(key, max_new_tokens)
    first = pick(logits, keys[0])  # [B]

    def step(carry, step_key):
        token, cache = carry
        logits, cache = decode_step(model, token, cache, weights=weights)
        next_token = pick(logits, step_key)
        return (next_token, cache), next_token

    _, rest = jax.lax.scan(step, (first, cache), keys[1:], unroll=unroll)  # [N - 1, B]
    new = jnp.concatenate([first[:, None], rest.T.astype(prompt.dtype)], axis=1)  # [B, N]
    if lengths is None:
        return jnp.concatenate([prompt, new], axis=1)
    # Row b: its prompt, its N new tokens, then PAD_ID to the common width T + N.
    t, n = prompt.shape[1], max_new_tokens
    columns = jnp.arange(t + n)[None, :]  # [1, T + N]
    from_new = jnp.take_along_axis(new, jnp.clip(columns - lengths[:, None], 0, n - 1), axis=1)
    out = jnp.where(columns < lengths[:, None], jnp.pad(prompt, ((0, 0), (0, n))), from_new)
    return jnp.where(columns < (lengths + n)[:, None], out, PAD_ID)


def generate(model, prompt: Int[Array, "B T"], max_new_tokens: int, *,
             temperature: float = 0.0, rng: jax.Array | None = None,
             prompt_lengths: Int[Array, " B"] | None = None, top_k: int = 0,
             vocab_limit: int | None = None, unroll: int = 1,
             fused: bool | None = None) -> Int[Array, "B T+N"]:
    """Continue `prompt` by max_new_tokens tokens: prefill, then a jit-compiled lax.scan of
    decode steps. temperature 0 = greedy (argmax); > 0 samples softmax(logits / temperature)
    with `rng` (a jax.random key). Returns int32 [B, T + max_new_tokens], prompt first.
    prompt: integer ids in [0, vocab_size) (checked unless traced).

    top_k: sample among the top_k most likely tokens only (0: all; ignored when greedy).
    vocab_limit: never produce ids >= vocab_limit (e.g. GPT-2's 50,257 tokens under a
    vocabulary padded to 50,304); None: any id of the model's vocabulary.

    prompt_lengths: [B] ints in [1, T], the number of tokens of each row (the rest of the
    row is padding, any ids): a batch of prompts of several lengths. Row b of the result is
    then its prompt, its max_new_tokens new tokens, and PAD_ID (-1) after them. Each row
    gets the tokens it would get alone (up to the batch's floating-point reordering).

    unroll: decode steps per iteration of the device loop (lax.scan's unroll): fewer loop
    iterations, each with its own control overhead, for a longer compilation.

    fused: decode with the blocks' products as fused kernels (`fused_decode`: packed
    weights, a few kernels per block) or each block's `decode` (False). None: fused on a
    GPU when the model and batch allow it (B <= fused_decode.MAX_BATCH), else not (the
    kernels run in the slow Pallas interpreter off GPU). True where it cannot run:
    ValueError with the reason.

    One compilation serves every call with the same shapes, settings and model structure:
    the model goes into the jitted loop as the jax pytree flax makes of a Module (its
    arrays the leaves), or, where flax is set not to (`flax_pytree_module` off), as
    nnx.split's (graphdef, state), which cost the GPU machine's host 6-18 ms a call.
    """
    if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be a positive int, got {max_new_tokens!r}")
    temperature = _check_temperature(temperature)
    vocab = model.config.vocab_size
    if not isinstance(top_k, int) or isinstance(top_k, bool) or not 0 <= top_k <= vocab:
        raise ValueError(f"top_k must be an int in [0, {vocab}] (the vocabulary), got "
                         f"top_k={top_k!r}")
    if vocab_limit is not None and (not isinstance(vocab_limit, int)
                                    or not 1 <= vocab_limit <= vocab):
        raise ValueError(f"vocab_limit must be None or an int in [1, {vocab}], got "
                         f"vocab_limit={vocab_limit!r}")
    if not isinstance(unroll, int) or isinstance(unroll, bool) or unroll < 1:
        raise ValueError(f"unroll must be a positive int, got unroll={unroll!r}")
    greedy = temperature == 0
    if not greedy and rng is None:
        raise ValueError("rng (a jax.random key) is required when temperature > 0")
    if rng is not None and not hasattr(rng, "dtype"):  # an int seed is not a key
        raise ValueError(f"rng must be a jax.random key (jax.random.key(seed)), got rng={rng!r}")
    prompt, prompt_lengths = _check_prompt(prompt, prompt_lengths, vocab)
    reason = fused_decode.fused_decode_reason(model, prompt.shape[0])
    if fused is None:
        fused = jax.default_backend() == "gpu" and reason is None
    elif fused and reason:
        raise ValueError(f"fused=True: the fused decoding step cannot run: {reason}")
    key = jax.random.key(0) if rng is None else rng
    args = (prompt, prompt_lengths, key, jnp.float32(temperature or 1.0))
    static = dict(max_new_tokens=max_new_tokens, greedy=greedy,
                  max_length=prompt.shape[1] + max_new_tokens, top_k=top_k,
                  vocab_limit=vocab_limit, unroll=unroll, fused=bool(fused))
    if _is_pytree(model):
        return _generate_pytree(model, *args, **static)
    return _generate_split(*nnx.split(model), *args, **static)


def _check_temperature(temperature) -> float:
    """temperature as a Python float: it chooses greedy or sampling (two compilations), so
    it must be a real scalar known on the host (Python, NumPy or concrete JAX), finite, >= 0."""
    value = None
    if not isinstance(temperature, bool):
        try:  # a traced value cannot become a Python float: the same error as a string's
            dtype = np.asarray(temperature).dtype
            if np.ndim(temperature) == 0 and (jnp.issubdtype(dtype, jnp.integer)
                                              or jnp.issubdtype(dtype, jnp.floating)):
                value = float(temperature)
        except (TypeError, jax.errors.TracerArrayConversionError):
            pass
    if value is None or not math.isfinite(value) or value < 0:
        raise ValueError("temperature must be a finite real number >= 0 (a Python float, or "
                         f"a NumPy or concrete JAX scalar), got temperature={temperature!r}")
    return value


def _host_values(x):
    """x as a NumPy array, or None where it is traced (its values are not known yet)."""
    try:
        return np.asarray(x)
    except jax.errors.TracerArrayConversionError:
        return None


def _check_prompt(prompt, lengths, vocab: int) -> tuple[Array, Array | None]:
    """(prompt as int32 [B, T], prompt_lengths as `_check_lengths`'s or None); ValueError
    unless prompt is integer [B, T] with T >= 1 and, where known on the host (not traced),
    its ids (those of each row's first prompt_lengths tokens) lie in [0, vocab)."""
    host = _host_values(prompt)
    values = prompt if host is None else host
    if values.ndim != 2 or values.shape[1] < 1 or not jnp.issubdtype(values.dtype, jnp.integer):
        raise ValueError(f"prompt must be int [B, T] with T >= 1, got shape {values.shape} "
                         f"and dtype {values.dtype}")
    if lengths is not None:
        lengths = _check_lengths(lengths, values.shape)
    lengths_host = None if lengths is None else _host_values(lengths)
    if host is not None and (lengths is None or lengths_host is not None):
        # the padding after a row's length may hold any ids
        real = host if lengths is None else host[
            np.arange(host.shape[1]) < lengths_host[:, None]]
        if real.size and (real.min() < 0 or real.max() >= vocab):
            raise ValueError(f"prompt ids must lie in [0, {vocab}) (the vocabulary), got ids "
                             f"in [{int(real.min())}, {int(real.max())}]")
    return jnp.asarray(prompt, jnp.int32), lengths


def _check_lengths(lengths, shape) -> Array:
    """prompt_lengths as int32 [B]; ValueError unless every entry is in [1, T]."""
    b, t = shape
    values = np.asarray(lengths)
    if values.shape != (b,) or not np.issubdtype(values.dtype, np.integer):
        raise ValueError(f"prompt_lengths must be ints [B] with B = {b}, got shape "
                         f"{values.shape} and dtype {values.dtype}")
    if values.min() < 1 or values.max() > t:
        raise ValueError(f"prompt_lengths must lie in [1, T] with T = {t} (the prompt's "
                         f"width), got {values.tolist()}")
    return jnp.asarray(values, jnp.int32)
