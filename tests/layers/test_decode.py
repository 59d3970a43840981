"""sympow.layers.decode: prefill then recurrent decoding equals the full forward; generation."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from sympow.layers import decode as decode_lib
from sympow.layers import generate
from sympow.layers.decode import PAD_ID
from tests.layers.helpers import (
    VARIANTS,
    VOCAB,
    decode_logits,
    full_logits,
    prefill_and_decode,
    randomized,
    rel_max_err,
    tiny,
    tokens,
)


@pytest.mark.parametrize("variant, overrides", [(v, {}) for v in VARIANTS] + [
    ("softmax", dict(rotary="learned")), ("conformal", dict(gate_bias=None)),
    ("conformal", dict(impl="pallas", d_model=64)),  # kernels (interpreter), fused decode: E = 16
    ("conformal", dict(decode_impl="pallas", d_model=64))])  # chosen prefill, fused decode
def test_prefill_then_decode_matches_forward_fp32(variant, overrides):
    """p = 2 in float32; the prompt (5) and T (13) are not multiples of chunk_size (4)."""
    model = randomized(tiny(variant, **overrides))
    toks = tokens(0)
    full = full_logits(model, toks)
    decoded = decode_logits(model, toks, 5)
    # float32 rounding through 2 layers of O(1) activations: a few ulps of the largest logit.
    assert rel_max_err(decoded, full) < 1e-6


def test_attention_algorithm_trains_and_prefill_streams_the_state():
    """algorithm='attention' (the blocked form) gives the chunked model's logits; its
    prefill streams the state (no chunked algorithm involved) and decoding continues it."""
    chunked = randomized(tiny("conformal"))
    blocked = randomized(tiny("conformal", algorithm="attention"))
    toks = tokens(0)
    full = full_logits(chunked, toks)
    assert rel_max_err(full_logits(blocked, toks), full) < 1e-6
    assert rel_max_err(decode_logits(blocked, toks, 5), full) < 1e-6


@pytest.mark.parametrize("variant", ["softmax", "conformal"])
def test_decode_from_empty_cache_matches_forward(variant):
    model = randomized(tiny(variant))
    toks = tokens(0)
    decoded, cache = prefill_and_decode(*nnx.split(model), toks, 0)
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


def test_generate_unrolled_gives_the_same_tokens():
    model = randomized(tiny("conformal"))
    prompt = tokens(6, (2, 5))
    once = generate(model, prompt, 7, temperature=1.0, rng=jax.random.key(2))
    # 6 decode steps after the first token: unroll 4 leaves a remainder of 2
    unrolled = generate(model, prompt, 7, temperature=1.0, rng=jax.random.key(2), unroll=4)
    np.testing.assert_array_equal(unrolled, once)
    for bad in (0, 1.5, True):
        with pytest.raises(ValueError, match="unroll must be a positive int"):
            generate(model, prompt, 3, unroll=bad)


def test_generate_passes_the_model_as_a_pytree_and_reads_its_current_parameters(
        monkeypatch):
    """flax's Modules are jax pytrees: generate hands the model to jit as one (no nnx.split
    on the host); the split path (for models that are not) gives the same tokens, and a
    parameter changed between calls is the one the next call uses. The model is a clone:
    `randomized` shares its models between tests, and this one changes a parameter."""
    model = nnx.clone(randomized(tiny("conformal")))
    prompt = tokens(6, (2, 5))
    assert decode_lib._is_pytree(model)

    class NotATree(nnx.Module, pytree=False):
        pass

    assert not decode_lib._is_pytree(NotATree())
    sample = dict(temperature=1.0, rng=jax.random.key(3))
    with monkeypatch.context() as patch:  # the pytree path never splits the model
        patch.setattr(decode_lib.nnx, "split", lambda *a, **k: pytest.fail("nnx.split"))
        as_pytree = generate(model, prompt, 6, **sample)
    with monkeypatch.context() as patch:
        patch.setattr(decode_lib, "_is_pytree", lambda model: False)
        split = generate(model, prompt, 6, **sample)
    np.testing.assert_array_equal(as_pytree, split)

    embedding = model.wte.embedding
    embedding[...] = -embedding[...]  # in place: the same Variable, new values
    out = generate(model, prompt, 6)
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



@pytest.mark.parametrize("variant, overrides", [(v, {}) for v in VARIANTS] + [
    ("softmax", dict(rotary="learned")), ("conformal", dict(algorithm="attention"))])
def test_left_padded_prompts_decode_as_each_prompt_alone(variant, overrides):
    """Prompts of lengths 5, 9 and 2 end-aligned in one batch (valid masks the padding):
    the prefill logits of the real positions and three decode steps after them equal the
    full forward over each prompt and its continuation alone."""
    model = randomized(tiny(variant, **overrides))
    lengths, width = [5, 9, 2], 9
    prompts, more = tokens(11, (3, width)), tokens(12, (3, 3))
    aligned, valid = decode_lib._end_aligned(prompts, jnp.asarray(lengths))
    logits, cache = model.prefill(aligned, max_length=width + 3, valid=valid)
    steps = []
    for s in range(3):
        step_logits, cache = model.decode_step(more[:, s], cache)
        steps.append(step_logits)
    for b, n in enumerate(lengths):
        alone = full_logits(model, jnp.concatenate([prompts[b:b + 1, :n], more[b:b + 1]], 1))[0]
        assert rel_max_err(logits[b, width - n:], alone[:n]) < 1e-6, (b, "prefill")
        for s in range(3):
            assert rel_max_err(steps[s][b], alone[n + s]) < 1e-6, (b, s)


@pytest.mark.parametrize("variant", ["softmax", "conformal"])
def test_generate_prompts_of_several_lengths(variant):
    model = randomized(tiny(variant))
    lengths, width, new = [4, 7, 1], 7, 5
    prompts = tokens(13, (3, width))
    out = generate(model, prompts, new, prompt_lengths=lengths)
    assert out.shape == (3, width + new)
    for b, n in enumerate(lengths):
        alone = generate(model, prompts[b:b + 1, :n], new)[0]
        np.testing.assert_array_equal(out[b, :n + new], alone)
        assert np.all(np.asarray(out[b, n + new:]) == PAD_ID)


def test_generate_rejects_bad_prompt_lengths():
    model = randomized(tiny("conformal"))
    prompts = tokens(14, (2, 6))
    for bad, match in (([3], r"ints \[B\] with B = 2"), ([0, 3], r"in \[1, T\] with T = 6"),
                       ([3, 7], r"in \[1, T\]"), ([1.5, 2.0], "dtype")):
        with pytest.raises(ValueError, match=match):
            generate(model, prompts, 2, prompt_lengths=bad)


def test_prefill_rejects_a_valid_mask_of_another_shape():
    model = randomized(tiny("sympow"))
    with pytest.raises(ValueError, match=r"valid must be bool \[B, T\] with T = 13"):
        model.prefill(tokens(0), valid=jnp.ones((2, 12), bool))


@pytest.mark.parametrize("variant", ["softmax", "conformal"])
def test_prefill_last_only_is_the_last_row_of_the_logits(variant):
    model = randomized(tiny(variant))
    toks = tokens(16)
    logits, cache = model.prefill(toks)
    last, last_cache = model.prefill(toks, last_only=True)
    assert last.shape == (toks.shape[0], VOCAB)
    np.testing.assert_allclose(np.asarray(last), np.asarray(logits[:, -1]), rtol=1e-6, atol=1e-6)
    for a, b in zip(jax.tree.leaves(cache), jax.tree.leaves(last_cache), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_generate_top_k_and_vocab_limit():
    model = randomized(tiny("conformal"))
    prompt = tokens(15, (2, 4))
    greedy = generate(model, prompt, 6)
    top1 = generate(model, prompt, 6, temperature=1.0, rng=jax.random.key(3), top_k=1)
    np.testing.assert_array_equal(top1, greedy)  # one candidate: the argmax
    limited = generate(model, prompt, 12, temperature=1.0, rng=jax.random.key(4),
                       vocab_limit=5)
    assert int(limited[:, 4:].max()) < 5
    sampled = generate(model, prompt, 12, temperature=1.0, rng=jax.random.key(4))
    assert int(sampled[:, 4:].max()) >= 5  # without the limit the same key goes beyond it
    for kwargs, match in ((dict(top_k=VOCAB + 1), "top_k must be an int in"),
                          (dict(top_k=-1), "top_k"), (dict(vocab_limit=0), "vocab_limit"),
                          (dict(vocab_limit=VOCAB + 1), "vocab_limit")):
        with pytest.raises(ValueError, match=match):
            generate(model, prompt, 2, **kwargs)


# --- input errors ----------------------------------------------------------------------------


def test_generate_temperature_must_be_a_finite_real_scalar():
    model = randomized(tiny("sympow"))
    prompt = tokens(17, (2, 4))
    for bad in (float("nan"), float("inf"), -0.5, "0.5", True, jnp.ones(2)):
        with pytest.raises(ValueError, match=r"temperature must be a finite real number >= 0 "
                                             r".*got temperature="):
            generate(model, prompt, 2, temperature=bad, rng=jax.random.key(0))
    # NumPy and concrete JAX scalars are taken as the Python float
    want = generate(model, prompt, 3, temperature=0.5, rng=jax.random.key(5))
    for value in (np.float32(0.5), jnp.float32(0.5), jnp.asarray(0.5, jnp.bfloat16)):
        got = generate(model, prompt, 3, temperature=value, rng=jax.random.key(5))
        np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(generate(model, prompt, 3, temperature=jnp.int32(0)),
                                  generate(model, prompt, 3))
    with pytest.raises(ValueError, match=r"rng must be a jax.random key .*got rng=0"):
        generate(model, prompt, 2, temperature=0.5, rng=0)


def test_generate_rejects_prompts_of_bad_ids_or_dtype():
    model = randomized(tiny("sympow"))
    prompt = np.asarray(tokens(18, (2, 4)))
    for bad, match in ((prompt.astype(np.float32), r"prompt must be int \[B, T\] with T >= 1, "
                                                   r"got shape \(2, 4\) and dtype float32"),
                       (prompt[0], r"got shape \(4,\)"), (prompt[:, :0], r"got shape \(2, 0\)"),
                       (np.where(prompt == prompt[0, 0], VOCAB, prompt), r"prompt ids must lie "
                        rf"in \[0, {VOCAB}\) \(the vocabulary\), got ids in \[\d+, {VOCAB}\]"),
                       (prompt - 100, r"prompt ids must lie in \[0, 48\)")):
        with pytest.raises(ValueError, match=match):
            generate(model, bad, 2)
    # Padding after prompt_lengths may hold any ids (PAD_ID included): only real ones count.
    padded = prompt.copy()
    padded[0, 2:] = PAD_ID
    out = generate(model, padded, 2, prompt_lengths=[2, 4])
    np.testing.assert_array_equal(out[0, :4], generate(model, padded[:1, :2], 2)[0])
    with pytest.raises(ValueError, match=r"prompt ids must lie in \[0, 48\)"):
        generate(model, padded, 2, prompt_lengths=[3, 4])


def test_model_calls_reject_tokens_of_bad_shape_or_dtype():
    model = randomized(tiny("conformal"))
    toks = tokens(19, (2, 5))
    for bad, got in ((toks[0], r"shape \(5,\) and dtype int32"),
                     (toks[:, :0], r"shape \(2, 0\) and dtype int32"),
                     (toks.astype(jnp.float32), r"shape \(2, 5\) and dtype float32")):
        for call in (model, model.prefill):
            with pytest.raises(ValueError, match=rf"tokens must be int \[B, T\] with T >= 1 "
                                                 rf"\(ids in \[0, V\)\), got {got}"):
                call(bad)


def test_decode_step_checks_token_and_cache():
    model = randomized(tiny("conformal"))
    _, cache = model.prefill(tokens(20, (2, 5)))
    for bad, got in ((jnp.zeros((3,), jnp.int32), r"shape \(3,\)"),
                     (jnp.zeros((2, 1), jnp.int32), r"shape \(2, 1\)"),
                     (jnp.zeros((2,), jnp.float32), r"shape \(2,\) and dtype float32")):
        with pytest.raises(ValueError, match=r"token must be int \[B\] with B = 2, the cache's "
                                             rf"batch \(ids in \[0, V\)\), got {got}"):
            model.decode_step(bad, cache)
    short = cache._replace(layers=cache.layers[:1])
    with pytest.raises(ValueError, match=r"cache must hold one layer cache per block \(2\), "
                                         r"got 1"):
        model.decode_step(jnp.zeros((2,), jnp.int32), short)
