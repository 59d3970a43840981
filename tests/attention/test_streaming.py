"""streaming.py: the state after a prompt, streamed over feature tiles, against the float64
recurrence; its memory (no per-chunk states) and `prefill` on the attention form."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import sympow
from sympow.attention.reference import recurrent_form
from sympow.attention.streaming import feature_tile, streamed_state, suffix_decays
from sympow.attention.testing import Case, inputs, rel_err
from sympow.embedding import expanded_dim


def oracle_state(k, v, log_g, p):
    """The recurrence's final state in float64 (queries do not enter it)."""
    f64 = lambda x: None if x is None else jnp.asarray(x, jnp.float64)  # noqa: E731
    q = jnp.zeros(k.shape, jnp.float64)
    return recurrent_form(q, f64(k), f64(v), f64(log_g), p)[1]


@pytest.mark.parametrize("kind", ["random", "zero_keys", "huge_norms", "no_decay",
                                  "full_decay"])
@pytest.mark.parametrize(("p", "d", "tile"), [(2, 8, None), (2, 8, 16), (4, 4, 8),
                                             (6, 4, 24)])
def test_state_matches_float64_recurrence(x64, rng, kind, p, d, tile):
    """fp32, prime T, grouped heads (the state is per kv head), tiles that do not divide F
    (F = 36, 35, 84), adversarial inputs."""
    case = Case(t=37, p=p, d=d, e=5, hq=4, hk=2)
    _, k, v, log_g, _ = inputs(case, rng, kind=kind)
    state = streamed_state(k, v, log_g, p=p, tile=tile)
    expected = oracle_state(k, v, log_g, p)
    assert state.s.dtype == jnp.float32 and state.s.shape == expected.s.shape
    assert rel_err(state.s, expected.s) < 1e-5 and rel_err(state.z, expected.z) < 1e-5


@pytest.mark.parametrize("gating", [True, False])
def test_bf16_inputs_give_the_state_of_the_rounded_inputs(x64, rng, gating):
    """bf16 keys and values are read once and accumulated in float32: the state is the
    float64 state of the rounded inputs to float32 accuracy (nothing is stored in bf16)."""
    case = Case(t=29, p=4, d=8, e=8, gating=gating)
    _, k, v, log_g, _ = inputs(case, rng)
    k, v = k.astype(jnp.bfloat16), v.astype(jnp.bfloat16)
    state = streamed_state(k, v, log_g, p=4, tile=128)
    expected = oracle_state(k, v, log_g, 4)
    assert state.s.dtype == jnp.float32
    assert rel_err(state.s, expected.s) < 1e-5 and rel_err(state.z, expected.z) < 1e-5


def test_suffix_decays_stay_exact_after_a_strong_gate(x64):
    """b_j = exp(sum_{k > j} log_g_k): a -1e4 gate early (or at j itself) costs the later
    decays no digits, which a difference of cumulative sums (ulp 1e-3 at 1e4) would."""
    log_g = np.full((1, 300, 1), -0.01)
    log_g[0, 5, 0] = -1e4
    log_g[0, 200, 0] = -1e4
    decays = suffix_decays(jnp.asarray(log_g, jnp.float32))[0, 0]
    later = np.concatenate([np.cumsum(log_g[0, :0:-1, 0])[::-1], [0.0]])
    expected = np.exp(later)
    assert decays.shape == (300,)
    np.testing.assert_allclose(np.asarray(decays[201:]), expected[201:], rtol=1e-6)
    assert np.all(np.asarray(decays[:200]) == 0.0)  # exp(-1e4) underflows, as it should
    assert decays[-1] == 1.0


def test_feature_tile_fits_the_budget():
    assert feature_tile(1, 12, 4096, 766_480, tile_bytes=1 << 30) == 5376
    assert feature_tile(1, 12, 65536, 766_480, tile_bytes=1 << 30) == 256
    assert feature_tile(1, 12, 1 << 22, 766_480, tile_bytes=1 << 30) == 128  # the floor
    assert feature_tile(2, 2, 37, 36) == 40  # F rounded up to 8
    with pytest.raises(ValueError, match=r"tile_bytes must be positive, got tile_bytes=0"):
        feature_tile(1, 1, 1, 1, tile_bytes=0)


def test_memory_is_the_state_not_per_chunk_states():
    """p = 4, d = e = 64 (F = 766,480: 196 MB per head): the compiled program's temporaries
    are one copy of the output and a tile, where 4 chunks of 16 tokens would hold 4 states."""
    b, t, hk, d = 1, 64, 1, 64
    k, v = jnp.ones((b, t, hk, d)), jnp.ones((b, t, hk, d))
    compiled = jax.jit(lambda k, v: streamed_state(k, v, None, p=4, tile=1024)).lower(
        k, v).compile()
    memory = compiled.memory_analysis()
    state_bytes = expanded_dim(d, 4) * (d + 1) * 4
    assert state_bytes <= memory.output_size_in_bytes < state_bytes + 1024  # + tuple header
    assert memory.temp_size_in_bytes < 1.1 * state_bytes


@pytest.mark.parametrize("impl", ["xla", "pallas"])
def test_prefill_on_the_attention_form_streams_the_state(rng, impl):
    """algorithm='attention' keeps no state: prefill streams it, equal to the chunked
    algorithm's, and decoding continues the attention."""
    q, k, v, log_g = sympow.attention.testing.attention_inputs(rng, t=21, d=8, e=6)
    t = 15
    y, state = sympow.prefill(q[:, :t], k[:, :t], v[:, :t], log_g[:, :t], p=2, impl=impl,
                              algorithm="attention")
    _, chunked = sympow.prefill(q[:, :t], k[:, :t], v[:, :t], log_g[:, :t], p=2, impl="xla",
                                algorithm="chunked", chunk_size=8)
    full = sympow.sympow_attention(q, k, v, log_g, p=2, impl="reference")
    assert rel_err(y, full[:, :t]) < 1e-5
    assert rel_err(state.s, chunked.s) < 1e-5 and rel_err(state.z, chunked.z) < 1e-5
    for i in range(t, q.shape[1]):
        state, y_i = sympow.decode_step(state, q[:, i], k[:, i], v[:, i], log_g[:, i], p=2)
        assert rel_err(y_i, full[:, i]) < 1e-5


def test_prefill_at_p4_d64_takes_the_attention_form():
    """p = 4, d = 64: the cost model picks the attention form plus the streamed state over
    the chunked algorithm's per-chunk states, on the GPU's rows and on the CPU's."""
    from sympow.attention import implementations as impls
    for platform in ("gpu", "cpu"):
        row = impls.select(None, need_state=True, platform=platform, shape=(4, 64, 64, 1024))
        assert row.algorithm == "attention"
