"""A GPT's decoding step in few kernels per block, for batches of up to MAX_BATCH sequences.

Profiled on an H100 (docs/benchmarks.md), GPT-2 small's step at B = 1 ran ~290 kernels:
XLA computes each one-row product as a reduction at 3-6x its weight-reading time and runs
the LayerNorms, biases, GELU, residual adds and every small projection as kernels of their
own. Here every product of a block is one `decode_linear.linear` kernel with what
surrounds it fused in:

    z = linear(x, [W_q | W_k | W_v | W_gamma | W_beta], b, norm=ln1)  # every projection
    q, k, v, log_g, mu = attn.heads(split(z))      # heads, rotary, gate (XLA)
    y, cache = attn.decode_heads(q, k, v, ...)     # the state kernel, or the KV cache
    x = linear(y, W_out, b_out, residual=x)
    x = linear(linear(x, W_fc, b_fc, norm=ln2, gelu=True), W_proj, b_proj, residual=x)

Same model, same cache, the same outputs up to rounding (tested against the layers'
`decode`). The weights are packed once per `generate` (`decode_weights`), in the compute
dtype; W_gamma and W_beta, whose outputs add up over the context (the gate's product, the
learned rotary's mu), enter as two columns each, the compute-dtype part and the
remainder, so their products keep the parameters' precision. On the H100 the step runs 175
kernels instead of 306 and takes 0.87 ms a token instead of 1.17 (docs/benchmarks.md).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Float

from sympow.layers import decode_linear
from sympow.layers.decode_linear import (
    BLOCK_N,
    MAX_ROWS,
    LayerNormWeights,
    linear_shapes_reason,
)

__all__ = ["MAX_BATCH", "BlockWeights", "block_weights", "decode_weights", "fused_blocks",
           "fused_decode_reason", "split_outputs"]

MAX_BATCH = MAX_ROWS  # sequences a fused step takes (rows of its products)
PRODUCTS = "pallas"  # decode_linear.linear's impl for the products


class BlockWeights(NamedTuple):
    """One block's weights for the fused step, in the compute dtype (biases float32),
    each kernel transposed ([outputs, inputs]: what `decode_linear.linear` streams).

    w_in [N_in, C]: the projections' kernels stacked (`_Attention.projections` order;
    W_gamma and W_beta as a compute-dtype part and a remainder), N_in padded with zero
    rows to a multiple of BLOCK_N; w_out [C, C]; w_fc [4C, C]; w_proj [C, 4C].
    """

    ln1: LayerNormWeights
    w_in: Array
    b_in: Array
    w_out: Array
    b_out: Array
    ln2: LayerNormWeights
    w_fc: Array
    b_fc: Array
    w_proj: Array
    b_proj: Array


def _layer_norm(norm: nnx.LayerNorm) -> LayerNormWeights:
    return LayerNormWeights(norm.scale[...].astype(jnp.float32),
                            norm.bias[...].astype(jnp.float32), norm.epsilon)


def _bias(layer: nnx.Linear) -> Array:
    n = layer.kernel.shape[1]
    return (jnp.zeros((n,), jnp.float32) if layer.bias is None
            else layer.bias[...].astype(jnp.float32))


def _input_columns(attn, dtype) -> tuple[Array, Array]:
    """w_in and b_in of `BlockWeights` (before padding): q, k, v; then each scalar-per-head
    projection's compute-dtype part, then the remainders."""
    linears = attn.projections()
    dense, scalar = linears[:3], linears[3:]
    kernels = [layer.kernel[...].astype(dtype) for layer in dense]
    exact = [layer.kernel[...].astype(jnp.float32) for layer in scalar]
    rounded = [w.astype(dtype) for w in exact]
    kernels += rounded + [(w - r.astype(jnp.float32)).astype(dtype)
                          for w, r in zip(exact, rounded, strict=True)]
    biases = [_bias(layer) for layer in linears]
    biases += [jnp.zeros_like(b) for b in biases[3:]]
    return jnp.concatenate(kernels, axis=1), jnp.concatenate(biases)


def block_weights(block) -> BlockWeights:
    """The packed weights of one `Block` (see `BlockWeights`)."""
    dtype = jnp.dtype(block.attn.dtype)
    w_in, b_in = _input_columns(block.attn, dtype)
    pad = -w_in.shape[1] % BLOCK_N
    transposed = lambda layer: layer.kernel[...].astype(dtype).T  # noqa: E731
    return BlockWeights(
        _layer_norm(block.ln1), jnp.pad(w_in, ((0, 0), (0, pad))).T, jnp.pad(b_in, (0, pad)),
        transposed(block.attn.out_proj), _bias(block.attn.out_proj), _layer_norm(block.ln2),
        transposed(block.fc), _bias(block.fc), transposed(block.proj), _bias(block.proj))


def decode_weights(model) -> tuple[BlockWeights, ...]:
    """Every block's packed weights: build once, pass to each
    `decode.decode_step(..., weights=...)`."""
    return tuple(block_weights(block) for block in model.blocks)


def fused_decode_reason(model, batch: int) -> str | None:
    """Why `fused_blocks` cannot run `model` at `batch` sequences, or None."""
    if batch > MAX_BATCH:
        return f"batch {batch} > {MAX_BATCH} (MAX_BATCH)"
    c = model.config.d_model
    hidden = model.config.mlp_ratio * c
    for k, n in ((c, c), (c, hidden), (hidden, c)):
        reason = linear_shapes_reason(batch, k, n)
        if reason:
            return f"a [{k}, {n}] product of the block: {reason}"
    return None


def split_outputs(z: Float[Array, "B N"], attn) -> list[Array]:
    """The projections' outputs [B, 1, n_i] from the packed product z [B, N_in], in each
    projection's output dtype; the scalar-per-head ones summed from their two parts."""
    linears = attn.projections()
    widths = [layer.kernel.shape[1] for layer in linears]
    widths += widths[3:]
    parts, start = [], 0
    for width in widths:
        parts.append(z[:, None, start:start + width])
        start += width
    scalar = len(linears) - 3
    parts = parts[:3] + [hi + lo for hi, lo in zip(parts[3:3 + scalar], parts[3 + scalar:],
                                                   strict=True)]
    return [part.astype(layer.dtype or z.dtype) for part, layer in zip(parts, linears,
                                                                        strict=True)]


def _block_step(block, weights: BlockWeights, x: Float[Array, "B C"], cache, position,
                products: str):
    attn = block.attn
    linear = functools.partial(decode_linear.linear, impl=products)
    z = linear(x, weights.w_in, weights.b_in, norm=weights.ln1, out_dtype=jnp.float32)
    q, k, v, log_g, mu = attn.heads(split_outputs(z, attn), position=position, mu0=cache.mu)
    y, cache = attn.decode_heads(q, k, v, log_g, mu, cache, position)  # [B, 1, Hq, E]
    x = linear(y.reshape(x.shape[0], -1).astype(x.dtype), weights.w_out, weights.b_out,
               residual=x)
    hidden = linear(x, weights.w_fc, weights.b_fc, norm=weights.ln2, gelu=True)
    return linear(hidden, weights.w_proj, weights.b_proj, residual=x), cache


def fused_blocks(model, weights: tuple[BlockWeights, ...], x: Float[Array, "B C"],
                 layers: tuple, position: Array, products: str = PRODUCTS
                 ) -> tuple[Float[Array, "B C"], tuple]:
    """The blocks of `decode.decode_step` with their products as fused kernels (module
    docstring): x [B, C] (the embedded tokens, B <= MAX_BATCH), layers and position of a
    `GPTCache`, weights = `decode_weights(model)`; products: `decode_linear.linear`'s impl.
    Returns (x after the last block, the layer caches after the token)."""
    batch = x.shape[0]
    reason = fused_decode_reason(model, batch)
    if reason:
        raise ValueError(f"the fused decoding step cannot run this model: {reason}")
    if len(weights) != len(model.blocks):
        raise ValueError(f"weights must hold one BlockWeights per block ({len(model.blocks)}),"
                         f" got {len(weights)}: build them with decode_weights(model)")
    caches = []
    for block, packed, layer_cache in zip(model.blocks, weights, layers, strict=True):
        x, layer_cache = _block_step(block, packed, x, layer_cache, position, products)
        caches.append(layer_cache)
    return x, tuple(caches)
