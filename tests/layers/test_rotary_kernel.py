"""sympow.layers.rotary_kernel: the learned-rotary kernels (Pallas interpreter here) against
their specification (`sympow.rotary.apply_rotary`), forward and every cotangent, in float32
and bf16, with and without a bias added as the rows load, with grouped heads, rows not a
multiple of the block and mu large enough that the angles need their reduction; the
refusals; the Triton lowering for CUDA (with the GPU's approximate cos and sin); and
`Rotary`'s choice between the kernels and XLA, with the attention layer's biases."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from sympow.attention.testing import pallas_call_names, pallas_calls, rel_err
from sympow.layers import rotary_kernel
from sympow.layers.attention import Rotary
from sympow.layers.rotary_kernel import rotate, rotate_reference

BASE = 65536.0


def _inputs(rng, b, t, h, hk, d, dtype):
    x = jnp.asarray(rng.standard_normal((b, t, h, d)), dtype)
    # mu as the layers make it (beta in (0, 2) summed over tokens), offset to ~3e4: the
    # angles of the fast pairs are then ~2e5 rad, reduced through their turns.
    mu = 3e4 + np.cumsum(rng.uniform(0, 2, (b, t, hk)), axis=1)
    dy = jnp.asarray(rng.standard_normal((b, t, h, d)), dtype)
    return x, jnp.asarray(mu, jnp.float32), dy


def _forward_and_cotangents(fn, x, mu, dy, bias=None, **kw):
    if bias is None:
        y, vjp = jax.vjp(lambda x, mu: fn(x, mu, base=BASE, **kw), x, mu)
    else:
        y, vjp = jax.vjp(lambda x, mu, bias: fn(x, mu, base=BASE, bias=bias, **kw), x, mu,
                         bias)
    return (y, *vjp(dy))


@pytest.mark.parametrize("biased", [False, True])
@pytest.mark.parametrize("layout", ["tokens", "heads"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("shape", [(3, 45, 4, 2, 16), (1, 70, 3, 3, 32), (2, 16, 2, 1, 64)])
def test_matches_the_specification(rng, dtype, shape, layout, biased):
    """x', dx, dmu (and dbias) against autodiff of apply_rotary of x (+ bias), x' written in
    either layout; 45 and 70 tokens are not multiples of the 16-row blocks used here (the
    padded rows must add nothing to dbias), grouped heads sum their mu cotangents."""
    x, mu, dy = _inputs(rng, *shape, dtype)
    bias = jnp.asarray(rng.standard_normal(shape[2:3] + shape[4:]), jnp.float32) if biased \
        else None
    got = _forward_and_cotangents(rotate, x, mu, dy, bias, block_rows=16, layout=layout)
    want = _forward_and_cotangents(rotate_reference, x, mu, dy, bias)
    assert got[0].dtype == got[1].dtype == jnp.dtype(dtype) and got[2].dtype == jnp.float32
    assert got[2].shape == mu.shape
    # The same float32 arithmetic up to the order of sums: bf16 outputs round alike.
    tols = (1e-6, 1e-6, 1e-5) if dtype == "float32" else (2e-3, 2e-3, 1e-5)
    for name, a, b, tol in zip(("y", "dx", "dmu"), got[:3], want[:3], tols, strict=True):
        assert rel_err(a, b) <= tol, (name, rel_err(a, b))
    if biased:
        assert got[3].shape == bias.shape and got[3].dtype == jnp.float32
        assert rel_err(got[0], rotate(x, mu, base=BASE, block_rows=16)) > 0.1  # it was added
        # dbias is the kernel's float32 sum of dx before dx is rounded to x's dtype: the
        # specification's sum up to the order of the sums, in bf16 too
        assert rel_err(got[3], want[3]) <= 1e-6


def _together_and_cotangents(fn, xs, mu, dys, biases):
    """(rotated xs, their cotangents, mu's, the biases') of fn(xs, mu, biases)."""
    outs, vjp = jax.vjp(fn, xs, mu, biases)
    return outs, *vjp(tuple(dys))


def _separately(xs, mu, biases):
    return tuple(rotate_reference(x, mu, base=BASE, bias=bias)
                 for x, bias in zip(xs, biases, strict=True))


@pytest.mark.parametrize("layout", ["tokens", "heads"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize(("heads", "hk", "kv_heads"), [
    ((4, 2), 2, 2),      # q [.., 4, D] of kv heads 2 (groups of 2), k [.., 2, D]: one program
    ((6, 3), 3, 1),      # three programs across the heads, one kv head each
    ((3, 3, 6), 3, 3),   # three arrays, one of them grouped
])
def test_rotate_together_matches_the_specification_array_by_array(rng, dtype, heads, hk,
                                                                  kv_heads, layout):
    """Arrays sharing mu (q and k) rotated in one kernel each way, a program taking
    kv_heads kv heads of every array: each output and each cotangent against the
    specification array by array (mu's cotangent summed over the arrays, as autodiff of
    the separate rotations sums it), 37 tokens (not a multiple of the 16-row block), the
    first array shifted by a bias and the others not."""
    b, t, d = 2, 37, 16
    xs, dys = [], []
    for h in heads:
        x, mu, dy = _inputs(rng, b, t, h, hk, d, dtype)
        xs.append(x)
        dys.append(dy)
    biases = (jnp.asarray(rng.standard_normal((heads[0], d)), jnp.float32),
              *(None,) * (len(heads) - 1))
    got = _together_and_cotangents(
        lambda xs, mu, biases: rotary_kernel.rotate_together(
            xs, mu, base=BASE, biases=biases, block_rows=16, layout=layout,
            kv_heads=kv_heads), tuple(xs), mu, dys, biases)
    want = _together_and_cotangents(_separately, tuple(xs), mu, dys, biases)
    tol = 1e-6 if dtype == "float32" else 2e-3  # the same float32 arithmetic, rounded once
    for name, a, c in zip(("y", "dx"), got[:2], want[:2], strict=True):
        for i, (u, v) in enumerate(zip(a, c, strict=True)):
            assert u.dtype == jnp.dtype(dtype) and u.shape == v.shape
            assert rel_err(u, v) <= tol, (name, i, rel_err(u, v))
    assert got[2].shape == mu.shape and rel_err(got[2], want[2]) <= 1e-5  # dmu
    assert got[3][1:] == (None,) * (len(heads) - 1)
    assert rel_err(got[3][0], want[3][0]) <= 1e-6  # float32 sums of the unrounded dx


def test_rotate_together_is_one_kernel_each_way_over_kv_head_blocks(rng):
    """q [.., 4, D] and k [.., 2, D] in one forward and one backward kernel; kv_heads=2
    puts both kv heads in a program (grid (B, row blocks, 1)), and the block of kv heads
    is a schedule: kv_heads 1 and 2 give identical bits (rows and heads are independent;
    mu's cotangent sums the heads of a kv head in the same order either way)."""
    x, mu, dy = _inputs(rng, 2, 40, 4, 2, 16, "bfloat16")
    k, _, dk = _inputs(rng, 2, 40, 2, 2, 16, "bfloat16")

    def run(kv_heads):
        return _together_and_cotangents(
            lambda xs, mu, biases: rotary_kernel.rotate_together(
                xs, mu, base=BASE, block_rows=16, kv_heads=kv_heads), (x, k), mu, (dy, dk),
            (None, None))

    calls = pallas_calls(lambda x, k, mu: jax.vjp(
        lambda x, k: rotary_kernel.rotate_together((x, k), mu, base=BASE, block_rows=16,
                                                   kv_heads=2), x, k)[1]((x, k)), x, k, mu)
    assert [call.params["grid_mapping"].grid for call in calls] == [(2, 3, 1), (2, 3, 1)]
    assert [tuple(v.aval.shape) for v in calls[1].outvars] == [
        (2, 48, 4, 16), (2, 48, 2, 16), (2, 48, 2)]  # dq, dk, dmu per kv head
    for u, v in zip(jax.tree.leaves(run(1)), jax.tree.leaves(run(2)), strict=True):
        np.testing.assert_array_equal(u, v)


def test_rotate_together_refuses_what_it_cannot_take():
    x, mu = jnp.zeros((1, 8, 4, 16)), jnp.zeros((1, 8, 2))
    with pytest.raises(ValueError, match="kv_heads must divide mu's Hk=2, got kv_heads=3"):
        rotary_kernel.rotate_together((x,), mu, base=BASE, kv_heads=3)
    with pytest.raises(ValueError, match="xs must share dtype and D"):
        rotary_kernel.rotate_together((x, x.astype(jnp.bfloat16)), mu, base=BASE)
    with pytest.raises(ValueError, match="xs must share dtype and D"):
        rotary_kernel.rotate_together((x, jnp.zeros((1, 8, 2, 32))), mu, base=BASE)
    with pytest.raises(ValueError, match=r"biases must have one entry per array of xs \(2\)"):
        rotary_kernel.rotate_together((x, x), mu, base=BASE, biases=(None,))
    with pytest.raises(ValueError, match="xs must hold at least one array"):
        rotary_kernel.rotate_together((), mu, base=BASE)
    with pytest.raises(ValueError, match="H=3 heads"):
        rotary_kernel.rotate_together((x, jnp.zeros((1, 8, 3, 16))), mu, base=BASE)


def test_rotates_each_query_head_by_its_kv_heads_mu(rng):
    """Query head n turns by mu[..., n // (H / Hk)]: with mu of head 1 zero, heads 2 and 3
    are unchanged and heads 0 and 1 are not."""
    x, mu, _ = _inputs(rng, 1, 20, 4, 2, 16, "float32")
    mu = mu.at[:, :, 1].set(0.0)
    y = rotate(x, mu, base=BASE, block_rows=16)
    np.testing.assert_array_equal(y[:, :, 2:], x[:, :, 2:])
    assert np.all(np.abs(np.asarray(y[:, :, :2] - x[:, :, :2])).max(axis=(0, 2, 3)) > 1e-3)


def test_one_block_size_gives_the_same_numbers_as_another(rng):
    """The block is a schedule: rows are independent, so 16 and 64 give identical bits."""
    x, mu, dy = _inputs(rng, 2, 100, 2, 2, 16, "bfloat16")
    a = _forward_and_cotangents(rotate, x, mu, dy, block_rows=16)
    b = _forward_and_cotangents(rotate, x, mu, dy, block_rows=64)
    for u, v in zip(a, b, strict=True):
        np.testing.assert_array_equal(u, v)


@pytest.mark.parametrize("x_shape, mu_shape, dtype, match", [
    ((1, 8, 2, 24), (1, 8, 2), "float32", "head dim D=24"),
    ((1, 8, 3, 16), (1, 8, 2), "float32", "H=3 heads"),
    ((1, 8, 2, 16), (1, 9, 2), "float32", r"x \[B, T, H, D\] and mu"),
    ((1, 8, 2, 16), (1, 8, 2), "float16", "dtype float16"),
])
def test_refuses_what_it_cannot_take(x_shape, mu_shape, dtype, match):
    x, mu = jnp.zeros(x_shape, dtype), jnp.zeros(mu_shape)
    assert rotary_kernel.unsupported(x, mu) is not None
    with pytest.raises(ValueError, match=match):
        rotate(x, mu, base=BASE)


def test_refuses_a_bias_of_the_wrong_shape_or_dtype():
    x, mu = jnp.zeros((1, 8, 2, 16)), jnp.zeros((1, 8, 2))
    for bias in (jnp.zeros((2, 8)), jnp.zeros((16,)), jnp.zeros((2, 16), jnp.int32)):
        with pytest.raises(ValueError, match=r"bias must be a float \[H, D\] = \[2, 16\]"):
            rotate(x, mu, base=BASE, bias=bias)


def test_refuses_a_block_that_is_not_a_power_of_two_and_an_unknown_layout():
    x, mu = jnp.zeros((1, 8, 2, 16)), jnp.zeros((1, 8, 2))
    with pytest.raises(ValueError, match="block_rows must be a power of two"):
        rotate(x, mu, base=BASE, block_rows=24)
    with pytest.raises(ValueError, match="layout must be one of"):
        rotate(x, mu, base=BASE, layout="chunks")


def _kernel_outputs(fn, *args) -> list[tuple]:
    """Shapes of the outputs of every pallas_call in fn's jaxpr, in order."""
    return [tuple(tuple(v.aval.shape) for v in eqn.outvars) for eqn in pallas_calls(fn, *args)]


def test_the_heads_layout_writes_and_reads_head_major_arrays():
    """layout='heads': the forward kernel writes [B, H, T, D] (T padded to the block) and the
    result is its transpose; the backward reads dy head-major and writes dx as x lies."""
    x, mu = jnp.zeros((2, 20, 3, 16)), jnp.zeros((2, 20, 3))

    def forward(x, mu, layout):
        return rotate(x, mu, base=BASE, block_rows=16, layout=layout)

    assert _kernel_outputs(lambda x, mu: forward(x, mu, "heads"), x, mu) == [((2, 3, 32, 16),)]
    assert _kernel_outputs(lambda x, mu: forward(x, mu, "tokens"), x, mu) == [((2, 32, 3, 16),)]
    calls = pallas_calls(
        lambda x, mu: jax.vjp(lambda x: forward(x, mu, "heads"), x)[1](x), x, mu)
    assert tuple(calls[-1].invars[0].aval.shape) == (2, 3, 32, 16)  # dy
    assert tuple(calls[-1].outvars[0].aval.shape) == (2, 32, 3, 16)  # dx


def test_a_bias_enters_the_kernels_as_rows_per_head():
    """With a bias both kernels read b [H, D] after the rows' turns (and the backward's
    theta), one [D/2] pair-rate row each (no pass of XLA's adds b to x; no swap product: a
    pair's lanes come as strided halves); both write what they write without one, and the
    backward also each block's float32 sum of dx per head [B, row blocks, H, D] (dbias)."""
    x, mu, bias = jnp.zeros((2, 20, 3, 16)), jnp.zeros((2, 20, 3)), jnp.zeros((3, 16))

    def grads(x, mu, bias):
        return jax.grad(lambda x, bias: jnp.sum(
            rotate(x, mu, base=BASE, bias=bias, block_rows=16)), argnums=(0, 1))(x, bias)

    forward, backward = pallas_calls(grads, x, mu, bias)
    assert [tuple(v.aval.shape) for v in forward.invars[-2:]] == [(1, 8), (3, 16)]
    assert [tuple(v.aval.shape) for v in backward.invars[-3:]] == [(1, 8), (1, 8), (3, 16)]
    assert [tuple(v.aval.shape) for v in backward.outvars] == [(2, 32, 3, 16), (2, 32, 3),
                                                               (2, 2, 3, 16)]
    for call in (forward, backward):
        assert "dot_general" not in str(call.params["jaxpr"])
    assert _kernel_outputs(lambda x, mu: rotate(x, mu, base=BASE, block_rows=16), x, mu) == [
        ((2, 32, 3, 16),)]  # without a bias, the kernels of before


def test_lowers_for_cuda_through_triton():
    """GPT-2 small's queries: both kernels lower through Triton with the GPU's cos.approx
    and sin.approx (inline PTX, which the interpreter cannot run)."""
    x = jnp.zeros((1, 4096, 12, 64), jnp.bfloat16)
    mu = jnp.zeros((1, 4096, 12), jnp.float32)

    def step(x, mu):
        y, vjp = jax.vjp(lambda x, mu: rotate(x, mu, base=BASE, interpret=False), x, mu)
        return vjp(y)

    text = jax.jit(step).trace(x, mu).lower(lowering_platforms=("cuda",)).as_text()
    assert "sympow_rotary_forward" in text and "sympow_rotary_backward" in text


@pytest.mark.parametrize("layout", ["tokens", "heads"])
def test_rotate_together_lowers_for_cuda_through_triton(layout):
    """GPT-2 small's q and k with biases, 4 kv heads a program: the heads' rows loaded and
    stored one head at a time from blocks of several heads, in either layout."""
    q = jnp.zeros((1, 4096, 12, 64), jnp.bfloat16)
    mu = jnp.zeros((1, 4096, 12), jnp.float32)
    bias = jnp.zeros((12, 64), jnp.float32)

    def step(q, k, mu):
        ys, vjp = jax.vjp(lambda q, k, mu, biases: rotary_kernel.rotate_together(
            (q, k), mu, base=BASE, biases=biases, interpret=False, kv_heads=4,
            layout=layout), q, k, mu, (bias, bias))
        return vjp(ys)

    text = jax.jit(step).trace(q, q, mu).lower(lowering_platforms=("cuda",)).as_text()
    assert "sympow_rotary_forward" in text and "sympow_rotary_backward" in text


def _rotary(impl):
    return Rotary(32, 2, 16, "learned", impl=impl, rngs=nnx.Rngs(0))


def test_the_layer_rotates_alike_with_the_kernels_and_xla(rng):
    """Rotary(impl='pallas') against impl='xla' (same weights): q', k', mu and the gradient
    of a loss of q' and k' with respect to W_beta, x, q and k."""
    b, t = 2, 40
    x = jnp.asarray(rng.standard_normal((b, t, 32)), jnp.float32)
    q = jnp.asarray(rng.standard_normal((b, t, 4, 16)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((b, t, 2, 16)), jnp.float32)
    w_beta = jnp.asarray(rng.standard_normal((32, 2)) * 0.3, jnp.float32)
    results = []
    for impl in ("pallas", "xla"):
        layer = _rotary(impl)
        layer.beta_proj.kernel[...] = w_beta

        def loss(layer, x, q, k):
            q2, k2, mu = layer(x, q, k)
            return jnp.sum(q2 * jnp.cos(q)) + jnp.sum(k2 ** 2 * jnp.sin(k)) + jnp.sum(mu)

        value, grads = nnx.value_and_grad(loss, argnums=(0, 1, 2, 3))(layer, x, q, k)
        results.append((layer(x, q, k), value, jax.tree.leaves(grads)))
    (out_p, value_p, grads_p), (out_x, value_x, grads_x) = results
    for a, c in zip(out_p, out_x, strict=True):
        assert rel_err(a, c) <= 1e-6
    assert abs(float(value_p - value_x)) <= 1e-5 * abs(float(value_x))
    for a, c in zip(grads_p, grads_x, strict=True):
        assert rel_err(a, c) <= 1e-5


@pytest.mark.parametrize("algorithm, layout", [("chunked", "heads"), ("attention", "tokens")])
def test_the_attention_layer_asks_for_the_layout_its_algorithm_reads(algorithm, layout):
    """SympowAttention rotates into 'heads' where the chunked algorithm runs (it reads q and k
    in chunk layout) and 'tokens' for the attention form; `chosen_algorithm` says which."""
    from sympow.attention import chosen_algorithm
    from sympow.layers.attention import SympowAttention

    layer = SympowAttention(32, 2, gating=True, rotary="learned", algorithm=algorithm,
                            impl="xla", rngs=nnx.Rngs(0))
    assert chosen_algorithm(300, 16, 16, 2, impl="xla", algorithm=algorithm) == algorithm
    assert layer._rotary_layout(300) == layout


def test_chosen_algorithm_follows_the_cost_model():
    """impl=None: the attention form for short T at p = 2, d = 64, the chunked algorithm for
    long ones (docs/design.md §5.1), as sympow_attention would run them."""
    from sympow.attention import chosen_algorithm

    assert chosen_algorithm(256, 64, 64, 2, impl="xla") == "attention"
    assert chosen_algorithm(65536, 64, 64, 2, impl="xla") == "chunked"


def _biased_layer(dtype=jnp.float32):
    """A conformal SympowAttention layer with nonzero q and k biases and W_beta."""
    from sympow.layers.attention import SympowAttention

    layer = SympowAttention(32, 2, gating=True, rotary="learned", impl="xla", dtype=dtype,
                            rngs=nnx.Rngs(0))
    for seed, linear in enumerate((layer.q_proj, layer.k_proj)):
        linear.bias[...] = jnp.asarray(
            np.random.default_rng(seed).standard_normal(linear.bias.shape), jnp.float32)
    layer.rotary.beta_proj.kernel[...] = jnp.full(layer.rotary.beta_proj.kernel.shape, 0.1)
    return layer


def test_the_attention_layer_gives_its_q_and_k_biases_to_the_kernels(rng):
    """Learned rotary: SympowAttention's q and k products leave without their biases and
    the rotary kernels add them (impl='pallas') or XLA does (impl='xla'): the layer's output
    and every gradient, the biases' included, agree."""
    x = jnp.asarray(rng.standard_normal((2, 40, 32)), jnp.float32)
    results = []
    for impl in ("pallas", "xla"):
        layer = _biased_layer()
        layer.rotary.impl = impl
        results.append(nnx.value_and_grad(lambda layer, x: jnp.sum(jnp.sin(layer(x))))(
            layer, x))
    (value_p, grads_p), (value_x, grads_x) = results
    assert abs(float(value_p - value_x)) <= 1e-5 * abs(float(value_x))
    assert float(jnp.abs(grads_p.q_proj.bias[...]).max()) > 0
    for a, c in zip(jax.tree.leaves(grads_p), jax.tree.leaves(grads_x), strict=True):
        assert rel_err(a, c) <= 1e-5


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_the_xla_path_adds_the_biases_as_the_projections_did(rng, dtype):
    """Off the kernels, `project` (q and k products without bias, the biases added by
    Rotary) gives the bits of the projections' own outputs (`nnx.Linear` with its bias)."""
    layer = _biased_layer(dtype)
    x = jnp.asarray(rng.standard_normal((2, 40, 32)), jnp.float32)
    got = layer.project(x)
    want = layer.heads([linear(x) for linear in layer.projections()])
    for a, b in zip(got, want, strict=True):
        np.testing.assert_array_equal(a, b)


def test_the_layer_picks_xla_off_a_gpu_and_for_a_few_tokens(monkeypatch):
    """impl=None: the kernels on a GPU for at least BLOCK_ROWS tokens (training, prefill;
    q and k in one), XLA for decoding's few and on a CPU; 'pallas' with a shape it cannot
    take: ValueError."""
    x = jnp.zeros((1, 64, 32))
    q, k = jnp.zeros((1, 64, 4, 16)), jnp.zeros((1, 64, 2, 16))

    def kernels(layer, t):
        return pallas_call_names(lambda x, q, k: layer(x, q, k), x[:, :t], q[:, :t], k[:, :t])

    assert kernels(_rotary(None), 64) == []
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(rotary_kernel, "BLOCK_ROWS", 64)
    assert kernels(_rotary(None), 64) == ["sympow_rotary_forward"]  # q and k in one
    assert kernels(_rotary(None), 1) == []
    assert kernels(_rotary("xla"), 64) == []
    wide = Rotary(48, 2, 24, "learned", impl="pallas", rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="rotary impl='pallas': head dim D=24"):
        wide(jnp.zeros((1, 8, 48)), jnp.zeros((1, 8, 2, 24)), jnp.zeros((1, 8, 2, 24)))
    with pytest.raises(ValueError, match="rotary impl must be one of"):
        Rotary(32, 2, 16, "learned", impl="triton", rngs=nnx.Rngs(0))
