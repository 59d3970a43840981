"""The Hopper tier's normalizer products: float32 results from bf16 tensor-core GEMMs.

Checked against their definitions in float64 (forward, and every gradient against autodiff
of the definition, for cotangents that are not symmetric), with a tolerance a one-part
split (a plain bf16 product) fails; and for CUDA every product lowers to a dot of bf16
operands.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sympow.attention.mosaic_gpu import normalizers

BF16, F32, F64 = jnp.bfloat16, jnp.float32, jnp.float64
FLOAT32_TOL = 2e-6  # float32 products summed over 192 rows, relative to the result's norm


def _inputs(rng, shape=(2, 3, 192, 64)):
    x = jnp.asarray(rng.normal(size=shape), BF16)
    ls = jnp.asarray(rng.uniform(-4.0, 0.0, size=shape[:-1]), F32)
    z = jnp.asarray(rng.normal(size=(*shape[:-2], shape[-1], shape[-1])), F32)
    return x, ls, z


def _state_definition(x, ls):
    u = x.astype(F64) * jnp.exp(ls.astype(F64))[..., None]
    return jnp.einsum("...ci,...cj->...ij", u, u)


def _rows_definition(x, ls, z):
    u = x.astype(F64) * jnp.exp(ls.astype(F64))[..., None]
    return jnp.einsum("...ci,...ij,...cj->...c", u, z.astype(F64), u)


def _rel(got, want):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return np.linalg.norm(got - want) / np.linalg.norm(want)


def test_split_holds_float32_in_three_bf16_parts(x64, rng):
    x = jnp.asarray(rng.normal(size=(5, 7)) * 10.0 ** rng.integers(-20, 20, size=(5, 7)), F32)
    parts = normalizers.split(x)
    assert parts.dtype == BF16 and parts.shape == (5, 7 * normalizers.PARTS)
    total = sum(parts[:, i * 7:(i + 1) * 7].astype(F64) for i in range(normalizers.PARTS))
    np.testing.assert_array_less(np.abs(total - x.astype(F64)), 2.0 ** -26 * np.abs(x) + 1e-45)


def test_the_forwards_are_float32_products(x64, rng):
    x, ls, z = _inputs(rng)
    assert _rel(normalizers.normalizer_state(x, ls), _state_definition(x, ls)) < FLOAT32_TOL
    assert _rel(normalizers.normalizer_rows(x, ls, z), _rows_definition(x, ls, z)) < FLOAT32_TOL


def test_a_single_bf16_part_fails_the_tolerance(x64, rng, monkeypatch):
    # The tolerance tells a float32 product from a bf16 one: the tests above can fail.
    monkeypatch.setattr(normalizers, "PARTS", 1)
    x, ls, z = _inputs(rng)
    assert _rel(normalizers.normalizer_state(x, ls), _state_definition(x, ls)) > 10 * FLOAT32_TOL
    assert _rel(normalizers.normalizer_rows(x, ls, z),
                _rows_definition(x, ls, z)) > 10 * FLOAT32_TOL


def _check_gradients(f, definition, args, ct):
    got = jax.vjp(f, *args)[1](ct)
    want = jax.vjp(definition, *(a.astype(F64) for a in args))[1](ct.astype(F64))
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert g.dtype == args[i].dtype
        # The rows' gradient is returned in their dtype (bf16): its rounding, no more.
        tol = 2.0 ** -8 if g.dtype == BF16 else FLOAT32_TOL
        assert _rel(g, w) < tol, (i, _rel(g, w))


def test_the_state_gradients_are_the_definitions(x64, rng):
    x, ls, _ = _inputs(rng)
    dz = jnp.asarray(rng.normal(size=(2, 3, 64, 64)), F32)  # not symmetric
    _check_gradients(normalizers.normalizer_state, _state_definition, (x, ls), dz)


def test_the_row_gradients_are_the_definitions(x64, rng):
    x, ls, z = _inputs(rng)  # z not symmetric
    dden = jnp.asarray(rng.normal(size=(2, 3, 192)), F32)
    _check_gradients(normalizers.normalizer_rows, _rows_definition, (x, ls, z), dden)


@pytest.mark.parametrize("which", ["state", "rows"])
def test_every_product_lowers_to_a_bf16_dot(rng, which):
    x, ls, z = _inputs(rng, (1, 2, 128, 64))
    if which == "state":
        fn, args, ct = normalizers.normalizer_state, (x, ls), z
    else:
        fn, args, ct = normalizers.normalizer_rows, (x, ls, z), ls

    def forward_and_backward(*args):
        y, vjp = jax.vjp(fn, *args)
        return y, vjp(ct)

    text = jax.jit(forward_and_backward).trace(*args).lower(
        lowering_platforms=("cuda",)).as_text()
    dots = [line for line in text.splitlines() if "stablehlo.dot_general" in line]
    assert len(dots) == (3 if which == "rows" else 2), dots
    for line in dots:
        operands = line.rsplit(":", 1)[-1]
        assert operands.count("bf16") == 2 and "-> tensor<" in operands, line
