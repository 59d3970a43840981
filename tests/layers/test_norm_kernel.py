"""sympow.layers.norm_kernel: the residual add + LayerNorm kernels (Pallas interpreter)
against their specification, the specification against nnx.LayerNorm, dispatch and errors;
the model's blocks with the kernels against the XLA path."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from sympow.layers import GPT, GPTConfig, norm_kernel
from sympow.layers.model import add_norm
from tests.layers.helpers import VOCAB, tokens

F32 = jnp.float32


def _inputs(n, c, dtype, seed=0):
    keys = jax.random.split(jax.random.key(seed), 7)
    x = (3.0 * jax.random.normal(keys[0], (n, c))).astype(dtype)  # a residual stream
    delta = (0.5 * jax.random.normal(keys[1], (n, c))).astype(dtype)
    bias, scale, shift = (jax.random.normal(k, (c,)) for k in keys[2:5])
    ds = jax.random.normal(keys[5], (n, c)).astype(dtype)
    dy = jax.random.normal(keys[6], (n, c)).astype(dtype)
    return (x, delta, bias, scale, shift), (ds, dy)


def _run(impl, args, cotangents):
    (s, y), vjp = jax.vjp(
        lambda *a: norm_kernel.add_layer_norm(*a, eps=1e-5, impl=impl), *args)
    return (s, y, *vjp(cotangents))


def _rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


# (rows, C): a row count off the kernels' 128-row blocks, GPT-2 small's width (three
# column tiles), one tile, and fewer rows than one block.
@pytest.mark.parametrize("n,c", [(300, 768), (130, 64), (45, 128)])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_kernels_match_the_specification_values_and_gradients(n, c, dtype):
    args, cotangents = _inputs(n, c, dtype, seed=n + c)
    got = _run("pallas", args, cotangents)
    want = _run("xla", args, cotangents)
    names = ("s", "y", "dx", "ddelta", "dbias", "dscale", "dshift")
    for name, a, b in zip(names, got, want, strict=True):
        assert a.shape == b.shape and a.dtype == b.dtype, name
        assert np.all(np.isfinite(np.asarray(a, np.float32))), name
    bf16 = dtype == jnp.bfloat16
    # s: the same float32 sum rounded once: exact
    np.testing.assert_array_equal(got[0], want[0])
    # y and dx: float32 row sums in another order; in bf16 the results round (y once, dx
    # once here and twice in autodiff of the specification: its cotangent of s meets ds in
    # bf16)
    assert _rel(got[1], want[1]) < (4e-3 if bf16 else 1e-6)
    assert _rel(got[2], want[2]) < (4e-3 if bf16 else 1e-5)
    np.testing.assert_array_equal(got[2], got[3])  # dx and ddelta: one cotangent
    # dbias sums the rows of dx, each within 2^-7 |dx| (bf16) of autodiff's
    unit = 2.0 ** -7 if bf16 else 1e-5
    bound = unit * np.abs(np.asarray(want[2], np.float64)).sum(axis=0) + 1e-6
    assert np.all(np.abs(np.asarray(got[4], np.float64) - np.asarray(want[4])) <= bound)
    # dscale and dshift: float32 sums of the same terms in another order
    assert _rel(got[5], want[5]) < 1e-4 and _rel(got[6], want[6]) < 1e-5


def test_specification_is_the_blocks_sum_then_nnx_layer_norm():
    args, _ = _inputs(40, 32, F32, seed=3)
    x, delta, bias, scale, shift = args
    ln = nnx.LayerNorm(32, epsilon=1e-5, rngs=nnx.Rngs(0))
    ln.scale[...], ln.bias[...] = scale, shift
    s, y = norm_kernel.add_layer_norm_reference(*args, eps=1e-5)
    np.testing.assert_allclose(s, x + (delta + bias), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(y, ln(s), rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(s, norm_kernel.residual_sum(x, delta, bias))


def test_bf16_sum_rounds_once():
    # x = 2^-9, delta = 1 + 2^-7, bias = 2^-9 (bf16's step at 1 is 2^-7): rounded twice
    # (nnx.Linear's bias add, then the residual add) the sum is 1 + 2^-7; the one float32
    # sum 1 + 1.5 2^-7 rounds once, to even: 1 + 2^-6
    x = jnp.full((1, 16), 2.0 ** -9, jnp.bfloat16)
    delta = jnp.full((1, 16), 1 + 2.0 ** -7, jnp.bfloat16)
    bias = jnp.full((16,), 2.0 ** -9, F32)
    s = norm_kernel.residual_sum(x, delta, bias)
    assert float(s[0, 0]) == 1 + 2.0 ** -6
    assert float(x[0, 0] + (delta[0, 0] + bias[0].astype(jnp.bfloat16))) == 1 + 2.0 ** -7
    s_kernel, _ = norm_kernel.add_layer_norm(x, delta, bias, jnp.ones(16), jnp.zeros(16),
                                             eps=1e-5, impl="pallas")
    np.testing.assert_array_equal(s_kernel, s)


def test_dispatch_and_errors():
    args, _ = _inputs(8, 24, F32)  # C = 24: not a multiple of 16
    assert "multiple of 16" in norm_kernel.unsupported(args[0], args[1])
    with pytest.raises(ValueError, match="impl='pallas': C = 24"):
        norm_kernel.add_layer_norm(*args, eps=1e-5, impl="pallas")
    s, _ = norm_kernel.add_layer_norm(*args, eps=1e-5)  # off a GPU: the specification
    np.testing.assert_array_equal(s, norm_kernel.residual_sum(*args[:3]))
    x64 = jnp.ones((4, 16), jnp.float16)
    assert "x dtype float16" in norm_kernel.unsupported(x64, x64)
    x, delta, bias, scale, shift = _inputs(8, 32, F32)[0]
    with pytest.raises(ValueError, match="impl must be one of"):
        norm_kernel.add_layer_norm(x, delta, bias, scale, shift, eps=1e-5, impl="cuda")
    with pytest.raises(ValueError, match="delta must have x's shape"):
        norm_kernel.add_layer_norm(x, delta[:4], bias, scale, shift, eps=1e-5)
    with pytest.raises(ValueError, match=r"scale must be \[C\] = \[32\]"):
        norm_kernel.add_layer_norm(x, delta, bias, scale[:8], shift, eps=1e-5)


def test_add_norm_without_pending_is_the_layer_norm():
    ln = nnx.LayerNorm(32, rngs=nnx.Rngs(0))
    x = _inputs(6, 32, F32)[0][0]
    same, y = add_norm(ln, x, None)
    assert same is x
    np.testing.assert_array_equal(y, ln(x))


def _tiny(norm_impl, dtype="float32"):
    config = GPTConfig.preset("conformal", size="tiny", vocab_size=VOCAB, norm_impl=norm_impl,
                              dtype=dtype, chunk_size=16)
    return GPT(config, rngs=nnx.Rngs(1))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_model_with_the_kernels_matches_the_xla_path(dtype):
    kernels, xla = _tiny("pallas", dtype), _tiny("xla", dtype)
    ids = tokens(0)

    def loss(model):
        return jnp.mean(model(ids).astype(F32) ** 2)

    got_loss, got = nnx.value_and_grad(loss)(kernels)
    want_loss, want = nnx.value_and_grad(loss)(xla)
    tol = 2e-2 if dtype == "bfloat16" else 1e-5
    assert abs(float(got_loss) - float(want_loss)) <= tol * abs(float(want_loss))
    for a, b in zip(jax.tree.leaves(nnx.state(got)), jax.tree.leaves(nnx.state(want)),
                    strict=True):
        assert _rel(a, b) < (5e-2 if dtype == "bfloat16" else 1e-4)


def test_block_call_is_its_residual_step_plus_the_pending_output():
    model = _tiny(None)
    x = jax.random.normal(jax.random.key(4), (2, 13, model.config.d_model))
    block = model.blocks[0]
    stream, (delta, bias) = block.residual_step(x, None)
    np.testing.assert_array_equal(block(x), norm_kernel.residual_sum(stream, delta, bias))
    # and the unfused sublayers: x + attn(ln1(x)), then x + mlp(ln2(x))
    mid = x + block.attn(block.ln1(x))
    np.testing.assert_allclose(block(x), mid + block.mlp(block.ln2(mid)), rtol=1e-5,
                               atol=1e-5)


def test_config_checks_norm_impl():
    with pytest.raises(ValueError, match="norm_impl must be one of"):
        GPTConfig.preset("conformal", size="tiny", norm_impl="triton")
