"""The Hopper backward's dQ epilogue (`dq_epilogue.dq_and_dhead`) in the Pallas
interpreter: dq = dq_off + dq_diag in q's dtype and dhead = q . dq_off / p per row, in both
layouts of the wide arrays, against the same arithmetic in float64."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from sympow.attention.mosaic_gpu import dq_epilogue


@pytest.mark.parametrize(("shape", "p"), [
    ((1, 3, 2, 128, 64), 2),  # chunk layout [B, Hq, N, C, D]
    ((2, 256, 3, 128), 4),  # token layout [B, T, Hq, D], wide rows
    ((1, 2, 1, 24, 16), 2),  # rows that are no multiple of a full program
])
def test_dq_and_dhead_sum_the_partials_row_by_row(rng, shape, p):
    q = jnp.asarray(rng.normal(size=shape), jnp.bfloat16)
    off, diag = (jnp.asarray(rng.normal(size=shape), jnp.float32) for _ in range(2))
    dq, dhead = dq_epilogue.dq_and_dhead(q, off, diag, p=p, interpret=True)
    assert dq.shape == shape and dq.dtype == jnp.bfloat16
    assert dhead.shape == shape[:-1] and dhead.dtype == jnp.float32
    off64, diag64 = np.asarray(off, np.float64), np.asarray(diag, np.float64)
    want_dq = off64 + diag64
    # one bf16 rounding of the float32 sum
    assert np.all(np.abs(np.asarray(dq, np.float64) - want_dq) <= 2.0 ** -8 * np.abs(want_dq))
    want_dhead = np.einsum("...d,...d->...", np.asarray(q, np.float64), off64) / p
    scale = np.einsum("...d,...d->...", np.abs(np.asarray(q, np.float64)), np.abs(off64)) / p
    assert np.all(np.abs(np.asarray(dhead) - want_dhead) <= 1e-6 * scale)
    # dhead takes the off-diagonal partial only: with the diagonal's too it would be off
    with_diag = np.einsum("...d,...d->...", np.asarray(q, np.float64), want_dq) / p
    assert np.max(np.abs(with_diag - want_dhead) / scale) > 1e-2


@pytest.mark.parametrize(("rows", "width", "block"), [
    (1 << 20, 64, 256), (1 << 20, 128, 128), (384, 64, 128), (24, 16, 8), (7, 64, 1)])
def test_a_program_takes_a_power_of_two_of_rows_that_divides_them(rows, width, block):
    assert dq_epilogue.rows_per_program(rows, width) == block


def test_the_partials_must_be_float32_of_qs_shape():
    q = jnp.zeros((1, 2, 1, 128, 64), jnp.bfloat16)
    f32 = jnp.zeros(q.shape, jnp.float32)
    with pytest.raises(ValueError, match=r"dq_off and dq_diag must have q's shape"):
        dq_epilogue.dq_and_dhead(q, f32[..., :32], f32, p=2, interpret=True)
    with pytest.raises(ValueError, match=r"dq_off and dq_diag must be float32"):
        dq_epilogue.dq_and_dhead(q, f32, f32.astype(jnp.bfloat16), p=2, interpret=True)
