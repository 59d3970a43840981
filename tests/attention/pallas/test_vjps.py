"""The log gates' cotangent from local sums: every pair (i, j) counted once per a_k it moves."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from sympow.attention import chunked, testing


def straddle_sums(dl):
    """da_k = sum_{i >= k > j} dl_ij by loops over the pairs (the definition)."""
    t = dl.shape[-1]
    out = np.zeros(dl.shape[:-2] + (t,))
    for k in range(t):
        out[..., k] = dl[..., k:, :k].sum(axis=(-2, -1))
    return out


@pytest.mark.parametrize(("blocks", "block"), [(1, 8), (3, 4), (5, 8)])
def test_block_gate_cotangent_is_the_straddle_sum(x64, rng, blocks, block):
    t = blocks * block
    dl = np.tril(rng.normal(size=(2, 3, t, t)))  # causal pair cotangents [.., i, j]
    tiles = dl.reshape(2, 3, blocks, block, blocks, block)  # [.., I, i, J, j]
    below = np.tril(np.ones((blocks, blocks), bool), -1)[:, None, :, None]  # J < I
    dhead = np.where(below, tiles, 0).sum(axis=(-2, -1))  # [.., I, i]
    dtail = np.where(below, tiles, 0).sum(axis=(-4, -3))  # [.., J, j]
    diag = np.stack([straddle_sums(tiles[:, :, b, :, b, :]) for b in range(blocks)], axis=2)
    pairs = np.where(below[:, 0, :, 0], tiles.sum(axis=(-3, -1)), 0)  # [.., I, J]
    got = chunked.block_gate_cotangent(*(jnp.asarray(x) for x in (dhead, dtail, diag, pairs)))
    np.testing.assert_allclose(np.asarray(got).reshape(2, 3, t), straddle_sums(dl),
                               rtol=1e-12, atol=1e-12)


def test_diagonal_straddle(x64, rng):
    dl = np.tril(rng.normal(size=(3, 16, 16)))
    np.testing.assert_allclose(np.asarray(chunked.diagonal_straddle(jnp.asarray(dl))),
                               straddle_sums(dl),
                               rtol=1e-12, atol=1e-12)


def gate_parts(dl_query_side, dl_key_side, blocks: int, block: int):
    """(dhead, dtail, ddiag, pairs) of [t, t] pair cotangents, the key-side sums (dtail) from
    the second copy, as the dkv kernel computes them from its own recomputed dl."""
    def tiles(x):
        return x.reshape(blocks, block, blocks, block)  # [I, i, J, j]
    below = np.tril(np.ones((blocks, blocks), bool), -1)[:, None, :, None]  # J < I
    q_side, k_side = tiles(dl_query_side), tiles(dl_key_side)
    dhead = np.where(below, q_side, 0).sum(axis=(-2, -1))
    dtail = np.where(below, k_side, 0).sum(axis=(-4, -3))
    diag = np.stack([straddle_sums(q_side[b, :, b, :]) for b in range(blocks)])
    pairs = np.where(below[:, 0, :, 0], q_side.sum(axis=(-3, -1)), 0)
    return dhead, dtail, diag, pairs


def pair_cotangents(kind: str, t: int, p: int = 2):
    """dl_ij [t, t] in float64 of head 0 of a `testing.precision_inputs` history: the
    cotangent of the logit of pair (i, j) under y = sum_j w_ij v_j / sum_j w_ij."""
    q, k, v, log_g, dy = (np.asarray(x, np.float64)[0, :, 0]
                          for x in testing.precision_inputs(kind, t=t))
    g = np.cumsum(log_g)
    s = q @ k.T
    valid = np.tril(np.ones((t, t), bool)) & (s != 0)
    logits = np.where(valid, p * np.log(np.abs(np.where(valid, s, 1.0)))
                      + g[:, None] - g[None, :], -np.inf)
    w = np.exp(logits - logits.max(axis=1, keepdims=True))
    den = w.sum(axis=1)
    y = (w @ v) / den[:, None]
    do, dden = dy / den[:, None], -np.sum(dy * y, axis=1) / den
    return w * (do @ v.T + dden[:, None])


def test_gate_cotangent_does_not_rely_on_two_copies_cancelling(x64, rng):
    """The dq and dkv kernels recompute each pair's dl with their own rounding. Emulated by
    independent relative noise of 2^-22 per copy on the history the H100 failed (gates
    x200), the local-sum cotangent stays at the noise level, while the former form
    (dG_i = sum_j dl_ij, dG_j -= sum_i dl_ij, da = reverse cumsum of dG) erred 1e-5: the
    rows of a normalized attention's dl sum to zero, so its da was what was left of sums
    that cancel."""
    blocks, block = 15, 64
    t = blocks * block  # 960 >= 900: zero-padded, as the kernels pad
    dl = np.pad(pair_cotangents("gates_x200", 900), ((0, t - 900), (0, t - 900)))
    exact = straddle_sums(dl)
    query_copy, key_copy = (dl * (1 + 2.0**-22 * rng.standard_normal(dl.shape))
                            for _ in range(2))
    parts = gate_parts(query_copy, key_copy, blocks, block)
    local = np.asarray(chunked.block_gate_cotangent(*map(jnp.asarray, parts))).reshape(t)
    d_g = query_copy.sum(axis=1) - key_copy.sum(axis=0)
    former = np.flip(np.cumsum(np.flip(d_g)))
    error = lambda got: np.linalg.norm(got - exact) / np.linalg.norm(exact)  # noqa: E731
    assert error(local) < 1e-6
    assert error(former) > 5e-6
