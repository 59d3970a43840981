"""One parameterized suite for every implementation of `sympow.sympow_attention`.

Subclass `AttentionSuite` with `impl = "<name>"` (and `chunk`) in a test module; the
reference is the attention form on float32 inputs. bf16 uses the gold/ref/test method:
gold = reference on fp32 inputs, ref = reference on bf16 inputs, test = impl on bf16 inputs,
and requires ||gold - test|| <= 2 ||gold - ref|| + 1e-3 ||gold||.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import sympow
from sympow.attention.testing import NAN_INPUTS, attention_inputs, nan_input_rows, rel_err

ADVERSARIAL = ["zero_queries", "zero_keys", "huge_norms", "gate_open", "gate_shut", "length_1"]


def adversarial_inputs(rng, case, dtype):
    t = 1 if case == "length_1" else 24
    q, k, v, log_g = attention_inputs(rng, t=t, d=16, e=8, dtype=jnp.float32)
    if case == "zero_queries":
        q = q.at[:, ::3].set(0.0)
    elif case == "zero_keys":
        k = k.at[:, 1::2].set(0.0)
    elif case == "huge_norms":
        q, k = 1e3 * q / jnp.linalg.norm(q, axis=-1, keepdims=True), 1e3 * k
    elif case == "gate_open":
        log_g = jnp.zeros_like(log_g)
    elif case == "gate_shut":
        log_g = jnp.full_like(log_g, -1e4)
    return tuple(x.astype(dtype) for x in (q, k, v)) + (log_g,)


@functools.cache
def _value_and_grad(impl, chunk, p, algorithm=None):
    """One jitted function per setting, so cases of equal shapes share the compilation."""

    def loss(q, k, v, log_g, cotangent):
        y = sympow.sympow_attention(q, k, v, log_g, p=p, chunk_size=chunk, impl=impl,
                                    algorithm=algorithm)
        return jnp.sum(y.astype(jnp.float32) * cotangent)

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3)))


def grads(impl, chunk, p, cotangent, q, k, v, log_g, algorithm=None):
    """(loss, (dq, dk, dv, dlog_g)) of sum(y * cotangent)."""
    return _value_and_grad(impl, chunk, p, algorithm)(q, k, v, log_g, cotangent)


class AttentionSuite:
    impl: str = "xla"
    algorithm: str | None = None
    chunk = 16

    def attend(self, q, k, v, log_g, p, chunk=None):
        """y of the implementation under test (chunk: this suite's unless given)."""
        return sympow.sympow_attention(q, k, v, log_g, p=p, impl=self.impl,
                                       algorithm=self.algorithm, chunk_size=chunk or self.chunk)

    def grads(self, p, cotangent, q, k, v, log_g):
        return grads(self.impl, self.chunk, p, cotangent, q, k, v, log_g, self.algorithm)

    @pytest.mark.parametrize("p", [2, 4])
    @pytest.mark.parametrize(("t", "heads", "gating"), [(37, (4, 2), True), (16, (2, 2), False)])
    def test_forward_fp32(self, rng, p, t, heads, gating):
        q, k, v, log_g = attention_inputs(rng, t=t, hq=heads[0], hk=heads[1], d=16, e=8,
                                          gating=gating)
        expected = sympow.sympow_attention(q, k, v, log_g, p=p, impl="reference")
        got = self.attend(q, k, v, log_g, p)
        assert got.dtype == jnp.float32 and got.shape == expected.shape
        assert rel_err(got, expected) < 1e-5

    @pytest.mark.parametrize("p", [2, 4])
    def test_forward_and_grads_bf16_gold_ref_test(self, rng, p):
        q, k, v, log_g = attention_inputs(rng, t=37, hq=4, hk=2, d=16, e=8)
        cot = jnp.asarray(rng.normal(size=(2, 37, 4, 8)), jnp.float32)
        bf16 = [x.astype(jnp.bfloat16) for x in (q, k, v)]
        gold = grads("reference", None, p, cot, q, k, v, log_g)
        ref = grads("reference", None, p, cot, *bf16, log_g)
        test = self.grads(p, cot, *bf16, log_g)
        reference = functools.partial(sympow.sympow_attention, p=p, impl="reference")
        outputs = [
            ("y", reference(q, k, v, log_g), reference(*bf16, log_g), self.attend(*bf16, log_g, p))
        ] + [(name, g, r, t) for name, g, r, t in zip("dq dk dv dlog_g".split(), gold[1], ref[1],
                                                       test[1], strict=True)]
        for name, g, r, t in outputs:
            assert t.dtype == r.dtype, name
            g, r, t = (np.asarray(x, np.float64) for x in (g, r, t))
            bound = 2 * np.linalg.norm(g - r) + 1e-3 * np.linalg.norm(g)
            assert np.linalg.norm(g - t) <= bound, name

    @pytest.mark.parametrize("case", ADVERSARIAL)
    @pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
    def test_adversarial_inputs_stay_finite(self, rng, case, dtype):
        q, k, v, log_g = adversarial_inputs(rng, case, dtype)
        cot = jnp.asarray(rng.normal(size=(*q.shape[:3], v.shape[-1])), jnp.float32)
        value, gradients = self.grads(2, cot, q, k, v, log_g)
        assert np.isfinite(float(value))
        for g in gradients:
            assert np.all(np.isfinite(np.asarray(g, np.float32)))
        y = self.attend(q, k, v, log_g, 2)
        assert np.all(np.isfinite(np.asarray(y, np.float32)))
        if case == "zero_queries":  # the documented output for rows with no weight
            assert np.all(np.asarray(y[:, ::3]) == 0)
        if case in ("huge_norms", "gate_open", "gate_shut"):
            expected = sympow.sympow_attention(*(x.astype(jnp.float32) for x in (q, k, v)),
                                               log_g, p=2, impl="reference")
            assert rel_err(y, expected) < (1e-5 if dtype == jnp.float32 else 2e-2)

    @pytest.mark.parametrize("name", NAN_INPUTS)
    def test_a_nan_input_gives_nan_rows_not_zeros(self, rng, name):
        """A NaN in q, k, v or log_g gives the contract's NaN rows (`nan_input_rows`), never
        the zeros of a row without weight, which a `den > 0` test once gave."""
        ok, rows = nan_input_rows(lambda *x: self.attend(*x, 2),
                                  *attention_inputs(rng, t=40, hq=4, hk=2, d=16, e=8), name, 19)
        assert ok, rows

    def test_gate_shut_attends_to_self_only(self, rng):
        q, k, v, log_g = adversarial_inputs(rng, "gate_shut", jnp.float32)
        y = self.attend(q, k, v, log_g, 2)
        np.testing.assert_allclose(y, jnp.repeat(v, 2, axis=2), rtol=1e-5, atol=1e-6)

    def test_jit_and_vmap_compose(self, rng):
        q, k, v, log_g = attention_inputs(rng, t=20, d=16, e=8)
        fn = functools.partial(self.attend, p=2, chunk=8)
        direct = fn(q, k, v, log_g)
        np.testing.assert_allclose(jax.jit(fn)(q, k, v, log_g), direct, rtol=1e-5, atol=1e-6)
        mapped = jax.vmap(fn)(q[:, None], k[:, None], v[:, None], log_g[:, None])[:, 0]
        np.testing.assert_allclose(mapped, direct, rtol=1e-5, atol=1e-6)

    @pytest.mark.parametrize(("q_scale", "k_scale"), [(2.0**66, 1.0), (1.0, 2.0**66),
                                                      (2.0**-66, 1.0), (1.0, 2.0**-66)])
    def test_queries_and_keys_at_any_scale(self, rng, q_scale, k_scale):
        """q or k where a norm's sum of squares overflows float32 (2^66 ~ 7e19 > 1.8e19) or
        underflows: y is invariant to the scales and dq, dk scale inversely, so the
        unscaled inputs' gradients give the expected ones. Within 1e-4: at |s| ~ 2^66 a
        log-space logit (the specification's, the attention form's) carries ulp(p log|s|)."""
        q, k, v, log_g = attention_inputs(rng, t=24, hq=4, hk=2, d=16, e=8)
        cot = jnp.asarray(rng.normal(size=(2, 24, 4, 8)), jnp.float32)
        _, (dq, dk, dv, dlog_g) = grads("reference", None, 2, cot, q, k, v, log_g)
        scaled = (q * q_scale, k * k_scale, v, log_g)
        expected = [sympow.sympow_attention(q, k, v, log_g, p=2, impl="reference"),
                    dq / q_scale, dk / k_scale, dv, dlog_g]
        _, got_grads = self.grads(2, cot, *scaled)
        got = [self.attend(*scaled, 2), *got_grads]
        for name, x, y in zip("y dq dk dv dlog_g".split(), got, expected, strict=True):
            assert np.all(np.isfinite(np.asarray(x))), name
            assert rel_err(x, y) < 1e-4, (name, rel_err(x, y))
