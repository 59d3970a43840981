"""sympow.layers.fused_decode: the fused decoding step (packed weights, one kernel per
product, run by the Pallas interpreter here) gives the blocks' own decoding step's logits,
cache and tokens, for every variant; its refusals name the reason."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from sympow.layers import GPT, decode_step, generate
from sympow.layers.decode_linear import linear
from sympow.layers.fused_decode import (
    MAX_BATCH,
    decode_weights,
    fused_blocks,
    fused_decode_reason,
    split_outputs,
)
from tests.layers.helpers import (
    VARIANTS,
    decode_logits,
    full_logits,
    prefill_and_decode,
    randomized,
    rel_max_err,
    tiny,
    tokens,
)


@pytest.mark.parametrize("variant, products", [(v, "pallas") for v in VARIANTS] + [
    ("conformal", "xla"), ("softmax", "xla")])
def test_fused_step_matches_blocks_fp32(variant, products):
    """Every variant (softmax's KV cache, sympow's state, gates, learned rotary), float32,
    the products by the kernel or by XLA: the same logits at every decoded position as the
    blocks' decode and the forward."""
    model = randomized(tiny(variant))
    toks = tokens(0)
    fused = decode_logits(model, toks, 5, fused=products)
    assert rel_max_err(fused, decode_logits(model, toks, 5)) < 1e-6
    assert rel_max_err(fused, full_logits(model, toks)) < 1e-6


def test_fused_step_from_an_empty_cache_and_grouped_heads_odd_batch():
    """Decoding from position 0 with 3 sequences (16 rows inside the kernels). On these
    inputs the blocks' own step is 1.3e-6 from the forward at position 0 (float32 rounding
    of a one-token state): the fused step must be as close as that, and to the blocks'."""
    model = randomized(tiny("conformal"))
    toks = tokens(1, shape=(3, 9))
    fused, cache = prefill_and_decode(*nnx.split(model), toks, 0, True)
    blocks, reference = prefill_and_decode(*nnx.split(model), toks, 0, False)
    assert rel_max_err(fused, full_logits(model, toks)) < 2e-6
    assert rel_max_err(fused, blocks) < 2e-6
    # the states: sums over 9 tokens of squared-key features, float32 rounding (3.6e-6)
    for got, want in zip(jax.tree.leaves(cache), jax.tree.leaves(reference), strict=True):
        assert rel_max_err(got, want) < 1e-5


def test_bf16_compute_decodes_within_bf16_rounding():
    """bf16 compute, float32 parameters: within bf16 rounding of the blocks' step (the two
    round the residual stream at different points: the fused one after adding in float32)."""
    model = randomized(tiny("conformal", dtype="bfloat16"))
    toks = tokens(2)
    fused, fused_cache = prefill_and_decode(*nnx.split(model), toks, 4, True)
    blocks, blocks_cache = prefill_and_decode(*nnx.split(model), toks, 4, False)
    assert rel_max_err(fused, blocks) < 3e-2
    for got, want in zip(fused_cache.layers, blocks_cache.layers, strict=True):
        assert rel_max_err(got.mu, want.mu) < 3e-3


def test_packed_gate_and_rotary_columns_keep_parameter_precision():
    """W_gamma and W_beta (float32 parameters, bf16 compute) enter the packed product as
    their bf16 part plus the remainder: their outputs equal the float32 product of the same
    bf16 input to float32 rounding; the bf16 part alone is ~100x further."""
    model = randomized(tiny("conformal", dtype="bfloat16"))
    attn, packed = model.blocks[0].attn, decode_weights(model)[0]
    x = jax.random.normal(jax.random.key(0), (16, 32), jnp.bfloat16)
    z = linear(x, packed.w_in, packed.b_in, out_dtype=jnp.float32)
    gate, beta = (part[:, 0] for part in split_outputs(z, attn)[3:])
    xf = x.astype(jnp.float32)
    exact_gate = xf @ attn.gate_proj.kernel[...] + attn.gate_proj.bias[...]
    exact_beta = xf @ attn.rotary.beta_proj.kernel[...]
    assert rel_max_err(gate, exact_gate) < 1e-5
    assert rel_max_err(beta, exact_beta) < 1e-5
    rounded_beta = xf @ attn.rotary.beta_proj.kernel[...].astype(jnp.bfloat16).astype(
        jnp.float32)
    assert rel_max_err(rounded_beta, exact_beta) > 1e-4


def test_generate_fused_gives_the_same_tokens():
    model = randomized(tiny("conformal"))
    prompt = tokens(3, shape=(2, 6))
    fused = generate(model, prompt, 5, fused=True)
    assert fused.shape == (2, 11)
    np.testing.assert_array_equal(np.asarray(fused), np.asarray(generate(model, prompt, 5,
                                                                         fused=False)))


def test_generate_fused_true_refuses_a_batch_over_the_limit():
    model = GPT(tiny("sympow"), rngs=nnx.Rngs(0))
    prompt = jnp.zeros((MAX_BATCH + 1, 2), jnp.int32)
    with pytest.raises(ValueError, match=f"batch {MAX_BATCH + 1} > {MAX_BATCH}"):
        generate(model, prompt, 1, fused=True)


def test_reason_names_the_product_that_does_not_fit():
    model = GPT(tiny("sympow", d_model=40, n_head=4, n_kv_head=2), rngs=nnx.Rngs(0))
    reason = fused_decode_reason(model, 1)
    assert "[40, 40] product" in reason and "K = 40 is not a multiple of 16" in reason
    assert fused_decode_reason(GPT(tiny("sympow"), rngs=nnx.Rngs(0)), 2) is None


def test_weights_of_another_depth_are_refused():
    model = GPT(tiny("sympow"), rngs=nnx.Rngs(0))
    cache = model.init_cache(1)
    weights = decode_weights(model)[:1]
    with pytest.raises(ValueError, match="one BlockWeights per block \\(2\\), got 1"):
        fused_blocks(model, weights, jnp.zeros((1, 32)), cache.layers, cache.position)
    with pytest.raises(ValueError, match="cannot run this model"):
        decode_step(GPT(tiny("sympow", d_model=40, n_head=4, n_kv_head=2),
                        rngs=nnx.Rngs(0)), jnp.zeros((1,), jnp.int32),
                    GPT(tiny("sympow", d_model=40, n_head=4, n_kv_head=2),
                        rngs=nnx.Rngs(0)).init_cache(1), weights=weights)
