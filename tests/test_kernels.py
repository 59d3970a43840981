"""The Pallas tier (impl='pallas') in the Pallas interpreter: the shared attention suite,
each primitive against its pure-JAX oracle in sympow.attention.xla (forward and vjp), the
gold/ref/test bf16 method at larger sizes, the kernels present in the compiled program,
and the tile=1 state that prefill hands to decode_step."""

from __future__ import annotations

import functools
import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import sympow
from sympow.attention import xla
from sympow.attention.chunked import chunked_attention, combine
from sympow.attention.config import AttentionConfig
from sympow.embedding import expanded_dim, sympow_embedding
from sympow.kernels import pallas
from sympow.kernels.pallas_common import to_symmetric_layout
from tests import kernel_cases as kc
from tests.attention_suite import AttentionSuite
from tests.helpers import attention_inputs, rel_err

FORWARD_KERNELS = {"sympow_attention_fwd", "sympow_update_state", "sympow_prefix_sum",
                   "sympow_query_state"}
BACKWARD_KERNELS = {"sympow_attention_dq", "sympow_attention_dkv", "sympow_update_state_dk",
                    "sympow_update_state_dv",
                    "sympow_prefix_sum_bwd", "sympow_query_state_dq", "sympow_query_state_ds"}


class TestPallas(AttentionSuite):
    impl = "pallas"


# ---------------------------------------------------------------------------------------
# Each primitive against the oracle. Chunk-layout inputs normalized as the driver does.


def chunk_inputs(rng, *, b=2, hq=4, hk=2, n=3, c=16, d=16, e=16, dtype=jnp.float32):
    unit = lambda x: x / np.linalg.norm(x, axis=-1, keepdims=True)  # noqa: E731
    q = unit(rng.normal(size=(b, hq, n, c, d)))
    k = rng.normal(size=(b, hk, n, c, d))
    k = k / np.linalg.norm(k, axis=-1).max()
    v = rng.normal(size=(b, hk, n, c, e))
    g = np.cumsum(np.log(rng.uniform(0.7, 1.0, size=(b, hk, n, c))), axis=-1)
    cast = lambda x, t=dtype: jnp.asarray(x, t)  # noqa: E731
    return cast(q), cast(k), cast(v), cast(g, jnp.float32)


def primitives(p, c=16):
    return pallas.primitives_factory(AttentionConfig(p=p, chunk_size=c, impl="pallas",
                                                     interpret=True))


def compiled(f):
    """jax.jit at the interpreter-friendly optimization level of the shared cases."""
    return jax.jit(f, compiler_options=kc.CPU_OPTIONS)


def out_and_vjp(f, args, ct):
    """f(*args) and its vjp at cotangent ct, as one compiled program."""
    def both(args, ct):
        out, vjp = jax.vjp(f, *args)
        return out, vjp(ct)
    return compiled(both)(args, ct)


def vjp_close(f_test, f_ref, args, rng, k=3.0, atol=1e-6):
    """Outputs and vjp (random cotangent) of f_test agree with the oracle f_ref.

    gold/ref/test in float32 (run under the x64 fixture): gold = f_ref on float64 inputs,
    ref = f_ref on float32, test = f_test on float32; ||gold - test|| <= k ||gold - ref||
    + atol ||gold|| per output (the p log|s| gradients are ill-conditioned where |Q.K| is
    small, so a fixed float32 tolerance would be either loose or flaky).
    """
    f64 = lambda t: jax.tree.map(lambda x: x.astype(jnp.float64), t)  # noqa: E731
    ct = jax.tree.map(lambda y: jnp.asarray(rng.normal(size=y.shape), y.dtype),
                      jax.eval_shape(f_ref, *args))
    test, ref, gold = (out_and_vjp(f_test, args, ct), out_and_vjp(f_ref, args, ct),
                       out_and_vjp(f_ref, f64(args), f64(ct)))
    for x, y, z in zip(*map(jax.tree.leaves, (test, ref, gold)), strict=True):
        assert x.dtype == jnp.float32
        x, y, z = (np.asarray(a, np.float64) for a in (x, y, z))
        bound = k * np.linalg.norm(z - y) + atol * np.linalg.norm(z)
        assert np.linalg.norm(z - x) <= bound, (np.linalg.norm(z - x), bound)


@pytest.mark.parametrize("p", [2, 4])
def test_attention_primitive(x64, rng, p):
    q, k, v, g = chunk_inputs(rng)
    prims = primitives(p)
    # (o, den, m); m is a stop_gradient'ed row max in both, so its cotangent is ignored.
    vjp_close(lambda *a: prims.attention(*a, p=p), lambda *a: xla.attention(*a, p=p),
              (q, k, v, g), rng)


def tiled(d, p):
    """Feature map tiled -> tile=1: x[..., index, :] * scale[:, None]."""
    return to_symmetric_layout(d, p, pallas.tile_width(d, p))


@pytest.mark.parametrize(("p", "d"), [(2, 32), (4, 16)])
def test_update_state_and_prefix_sum_primitives(x64, rng, p, d):
    q, k, v, g = chunk_inputs(rng, d=d)
    prims = primitives(p)
    index, scale = tiled(d, p)
    to_sym = lambda s, z: (s[..., index, :] * scale[:, None], z[..., index] * scale)  # noqa

    # update_state compared in the tile=1 layout: the kernels' states gathered by to_sym.
    vjp_close(lambda *a: to_sym(*prims.update_state(*a, p=p)),
              lambda *a: xla.update_state(*a, p=p), (k, v, g), rng)
    s, z = compiled(lambda *a: prims.update_state(*a, p=p))(k, v, g)
    # The prefix sum is layout-agnostic except for the final state it returns in tile=1.
    vjp_close(prims.prefix_sum, lambda *a: (lambda o: (*o[:2], *to_sym(*o[2:])))(
        xla.prefix_sum(*a)), (s, z, g[..., -1]), rng)


def tiled_query_state(q, s_in, z_in, g, o, den, m, *, p, tile):
    """xla.query_state with the tiled embedding: the oracle in the kernels' layout."""
    b, hq, n, c, d = q.shape
    hk = s_in.shape[1]
    phi = sympow_embedding(q.reshape(b, hk, hq // hk, n, c, d), p, tile)
    phi = phi * jnp.exp(g)[:, :, None, :, :, None]
    inter_o = jnp.einsum("bhrncf,bhnfe->bhrnce", phi, s_in, precision="highest")
    inter_den = jnp.einsum("bhrncf,bhnf->bhrnc", phi, z_in, precision="highest")
    merge = lambda x: x.reshape(b, hq, *x.shape[3:])  # noqa: E731
    return combine(o, den, m, merge(inter_o), merge(inter_den))


@pytest.mark.parametrize(("p", "d"), [(2, 32), (4, 16)])
def test_query_state_primitive(x64, rng, p, d):
    q, k, v, g = chunk_inputs(rng, d=d)
    prims = primitives(p)

    @compiled
    def setup(q, k, v, g):  # states in the kernels' layout, intra-chunk terms from the oracle
        s_in, z_in, *_ = prims.prefix_sum(*prims.update_state(k, v, g, p=p), g[..., -1])
        return (q, s_in, z_in, g, *xla.attention(q, k, v, g, p=p))

    vjp_close(lambda *a: prims.query_state(*a, p=p),
              functools.partial(tiled_query_state, p=p, tile=pallas.tile_width(d, p)),
              setup(q, k, v, g), rng)


# ---------------------------------------------------------------------------------------
# End to end at sizes beyond the shared suite: several chunks, wider heads.

E2E = [kc.Case(t=70, p=2, d=32, e=32, hq=4, hk=2, chunk=32),
       kc.Case(t=45, p=4, d=16, e=16, hq=2, hk=1, gating=False)]


@pytest.mark.parametrize("case", E2E, ids=lambda c: c.name)
def test_bf16_gold_ref_test(rng, case):
    for name, err_test, err_ref, bound, ok in kc.check_bf16(case, kc.inputs(case, rng)):
        assert ok, f"{name}: |gold-test| {err_test:.3e} > bound {bound:.3e} (ref {err_ref:.3e})"


@pytest.mark.parametrize("case", E2E, ids=lambda c: c.name)
def test_fp32_matches_reference(rng, case):
    for name, err, tol, ok in kc.check_fp32(case, kc.inputs(case, rng)):
        assert ok, f"{name}: relative error {err:.3e} > {tol:.0e}"


# ---------------------------------------------------------------------------------------
# Structure: the compiled program runs the kernels, and no silent fallback.


def loss(q, k, v, log_g, *, p, chunk):
    return jnp.sum(sympow.sympow_attention(q, k, v, log_g, p=p, chunk_size=chunk, impl="pallas"))


@pytest.mark.parametrize(("p", "d", "e", "chunk"), [(2, 16, 8, 16), (4, 16, 16, 24)])
def test_forward_and_backward_run_the_named_kernels(rng, p, d, e, chunk):
    q, k, v, log_g = attention_inputs(rng, t=40, d=d, e=e)
    fwd = functools.partial(loss, p=p, chunk=chunk)
    assert set(kc.pallas_call_names(fwd, q, k, v, log_g)) == FORWARD_KERNELS
    names = kc.pallas_call_names(jax.grad(fwd, argnums=(0, 1, 2, 3)), q, k, v, log_g)
    assert set(names) == FORWARD_KERNELS | BACKWARD_KERNELS


@pytest.mark.parametrize(("p", "d", "e", "chunk", "dtype"), [
    (2, 64, 48, 24, jnp.bfloat16), (4, 32, 64, 64, jnp.float32), (2, 128, 128, 16, jnp.float32)])
def test_triton_lowering(p, d, e, chunk, dtype):
    """fwd+bwd lower to Triton IR (for CUDA, from this CPU): every load and store is a
    power-of-two block and every primitive has a Triton rule. Compiling it needs a GPU
    (experiments/gpu_check.py)."""
    prims = pallas.primitives_factory(AttentionConfig(p=p, chunk_size=chunk, impl="pallas"))

    def fwd_bwd(q, k, v, log_g, dy):
        y, vjp = jax.vjp(lambda *a: chunked_attention(*a, p=p, chunk_size=chunk,
                                                      primitives=prims)[0], q, k, v, log_g)
        return vjp(dy)

    t, hq, hk = 100, 4, 2
    spec = jax.ShapeDtypeStruct
    args = (spec((1, t, hq, d), dtype), spec((1, t, hk, d), dtype), spec((1, t, hk, e), dtype),
            spec((1, t, hk), jnp.float32), spec((1, t, hq, e), jnp.float32))
    text = jax.jit(fwd_bwd).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("__gpu$xla.gpu.triton") == len(FORWARD_KERNELS | BACKWARD_KERNELS)


def test_unsupported_shapes_fall_back_with_a_logged_reason(rng, caplog):
    q, k, v, log_g = attention_inputs(rng, t=20, d=8, e=8)
    fwd = functools.partial(loss, p=2, chunk=16)
    with caplog.at_level(logging.WARNING, logger="sympow.kernels.pallas"):
        pallas._log_fallback.cache_clear()
        assert kc.pallas_call_names(fwd, q, k, v, log_g) == []
    assert "falls back to 'xla' for d=8 with p=2" in caplog.text
    expected = sympow.sympow_attention(q, k, v, log_g, p=2, impl="reference")
    assert rel_err(sympow.sympow_attention(q, k, v, log_g, p=2, impl="pallas"), expected) < 1e-5


def test_make_plan_reasons():
    assert isinstance(pallas.make_plan(2, 64, 64, 256, "bfloat16", False), pallas.Plan)
    assert "p=6" in pallas.make_plan(6, 64, 64, 256, "bfloat16", False)
    assert "d=64 with p=4" in pallas.make_plan(4, 64, 64, 256, "float32", False)
    assert "dtype float16" in pallas.make_plan(2, 64, 64, 256, "float16", False)
    assert "chunk_size=2048" in pallas.make_plan(2, 64, 64, 2048, "float32", False)


def test_tiled_feature_counts_are_unambiguous():
    """prefix_sum tells the kernel layout from F alone: no tile=1 F of any d, and no other
    supported d, has the same F."""
    for p, ds in pallas.SUPPORTED_D.items():
        tiled_fs = [expanded_dim(d, p, pallas.tile_width(d, p)) for d in ds]
        assert len(set(tiled_fs)) == len(ds)
        symmetric = {expanded_dim(d, p) for d in range(1, 1024)}
        assert not symmetric & set(tiled_fs), p
        assert [pallas._tiled_layout(f, p) for f in tiled_fs] == [
            (d, pallas.tile_width(d, p)) for d in ds]


def test_registration_and_defaults():
    assert pallas.is_available()
    assert [pallas.default_chunk_size(t) for t in (1, 17, 100, 5000)] == [16, 32, 128, 512]


# ---------------------------------------------------------------------------------------
# prefill hands decode_step a tile=1 state, in true units.


def test_prefill_state_matches_xla_and_decoding_continues(rng):
    p, t = 2, 40
    q, k, v, log_g = attention_inputs(rng, t=t + 2, d=16, e=8, scale=3.0)
    expected = sympow.sympow_attention(q, k, v, log_g, p=p, impl="reference")
    y, state = sympow.prefill(q[:, :t], k[:, :t], v[:, :t], log_g[:, :t], p=p, chunk_size=16,
                              impl="pallas")
    _, state_xla = sympow.prefill(q[:, :t], k[:, :t], v[:, :t], log_g[:, :t], p=p,
                                  chunk_size=16, impl="xla")
    assert state.s.shape == state_xla.s.shape == (2, 2, expanded_dim(16, p), 8)
    assert rel_err(state.s, state_xla.s) < 1e-5 and rel_err(state.z, state_xla.z) < 1e-5
    assert rel_err(y, expected[:, :t]) < 1e-5
    for i in range(t, t + 2):
        state, y_i = sympow.decode_step(state, q[:, i], k[:, i], v[:, i], log_g[:, i], p=p)
        assert rel_err(y_i, expected[:, i]) < 5e-5


def test_bf16_states_between_kernels(rng):
    """bf16 inputs: per-chunk and prefix states are stored in bf16 (they only feed MMAs), z
    and the final state in float32, all within bf16 rounding of the float32 oracle."""
    _, k, v, g = chunk_inputs(rng, d=32, n=4, dtype=jnp.bfloat16)
    prims = primitives(2)
    s, z = compiled(lambda *a: prims.update_state(*a, p=2))(k, v, g)
    s_in, z_in, s_fin, z_fin = compiled(prims.prefix_sum)(s, z, g[..., -1])
    assert s.dtype == s_in.dtype == jnp.bfloat16
    assert z.dtype == z_in.dtype == s_fin.dtype == z_fin.dtype == jnp.float32
    f32 = lambda x: jnp.asarray(x, jnp.float32)  # noqa: E731
    s_ref, z_ref = xla.update_state(f32(k), f32(v), g, p=2)
    s_in_ref, z_in_ref, s_fin_ref, z_fin_ref = xla.prefix_sum(s_ref, z_ref, g[..., -1])
    index, scale = tiled(32, 2)
    to_sym = lambda x: f32(x)[..., index, :] * scale[:, None]  # noqa: E731
    # bf16 S: each entry rounded once (2^-9) over bf16 MMA operands; z sums in float32.
    for got, want, tol in [(to_sym(s), s_ref, 2 ** -7), (to_sym(s_in), s_in_ref, 2 ** -7),
                           (s_fin, s_fin_ref, 2 ** -7), (z_fin, z_fin_ref, 1e-5),
                           (f32(z_in)[..., index] * scale, z_in_ref, 1e-5)]:
        assert rel_err(got, want) <= tol, (rel_err(got, want), tol)
