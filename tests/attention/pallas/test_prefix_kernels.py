"""Prefix-sum kernels (prefix_kernels.py) through their custom_vjp, against the pure-JAX
prefix sum; the final state comes back in the tile=1 layout."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sympow.attention import testing, xla
from sympow.attention.pallas import prefix_kernels, vjps
from sympow.attention.pallas.plan import prefix_plan
from tests.attention.pallas.helpers import chunk_inputs, compiled, primitives, tiled, vjp_close


@pytest.mark.parametrize(("p", "d"), [(2, 32), (4, 16)])
def test_prefix_sum_primitive(x64, rng, p, d):
    """States in the kernels' layout from update_state; the prefix sum is layout-agnostic
    except for the final state it returns in tile=1."""
    _, k, v, g = chunk_inputs(rng, d=d)
    prims = primitives(p)
    index, scale = tiled(d, p)
    s, z = compiled(lambda *a: prims.update_state(*a, p=p))(k, v, g)

    def oracle(s, z, g_last):
        s_in, z_in, s_fin, z_fin = xla.prefix_sum(s, z, g_last)
        return s_in, z_in, s_fin[..., index, :] * scale[:, None], z_fin[..., index] * scale

    vjp_close(prims.prefix_sum, oracle, (s, z, g[..., -1]), rng)


def _with_nan_slot(x, *, first: bool):
    """x with one more chunk slot (axis 2) of NaN, first or last: a read of it shows."""
    nan = jnp.full_like(x[:, :, :1], jnp.nan)
    return jnp.concatenate([nan, x] if first else [x, nan], axis=2)


def test_the_slotted_sum_is_the_exclusive_one_in_place(rng):
    """S_n at slot n + 1 of N + 1 (slot 0 NaN: never read), summed in place: slot n holds
    the state entering chunk n and slot N the final one. The backward takes the cotangent
    of P_n at slot n (slot N NaN: never read; the final state's comes apart) and returns
    that of S_n at slot n + 1, over its input. Same numbers as the exclusive sum."""
    b, hk, n, f, e = 2, 2, 5, 16, 16
    s, ds_in = (jnp.asarray(rng.normal(size=(b, hk, n, f, e)), jnp.float32) for _ in range(2))
    z, dz_in = (jnp.asarray(rng.normal(size=(b, hk, n, f)), jnp.float32) for _ in range(2))
    g_last = jnp.asarray(np.log(rng.uniform(0.3, 1.0, size=(b, hk, n))), jnp.float32)
    ds_fin = jnp.asarray(rng.normal(size=(b, hk, f, e)), jnp.float32)
    dz_fin = jnp.asarray(rng.normal(size=(b, hk, f)), jnp.float32)
    exclusive, slotted = prefix_plan(f, True), prefix_plan(f, True, slotted=True)

    def run(plan, s, z, ds_in, dz_in):
        out, vjp = jax.vjp(lambda *a: vjps.prefix_sum(plan, *a), s, z, g_last)
        return out, vjp((ds_in, dz_in, ds_fin, dz_fin))

    (s_in, z_in, s_fin, z_fin), (ds, dz, dg) = compiled(functools.partial(run, exclusive))(
        s, z, ds_in, dz_in)
    (p_all, zp_all, s_fin2, z_fin2), (ds2, dz2, dg2) = compiled(functools.partial(
        run, slotted))(_with_nan_slot(s, first=True), _with_nan_slot(z, first=True),
                       _with_nan_slot(ds_in, first=False), _with_nan_slot(dz_in, first=False))
    close = functools.partial(np.testing.assert_allclose, rtol=1e-6, atol=1e-6)
    for got, want in ((p_all[:, :, :n], s_in), (zp_all[:, :, :n], z_in), (p_all[:, :, n], s_fin),
                      (zp_all[:, :, n], z_fin), (s_fin2, s_fin), (z_fin2, z_fin),
                      (ds2[:, :, 1:], ds), (dz2[:, :, 1:], dz), (dg2, dg)):
        close(np.asarray(got), np.asarray(want))


@pytest.mark.parametrize("slotted", [False, True])
def test_the_slotted_kernels_write_over_their_inputs(rng, slotted):
    b, hk, n, f, e = 1, 1, 2, 16, 16
    plan = prefix_plan(f, True, slotted=slotted)
    slots = n + slotted
    args = (jnp.zeros((b, hk, slots, f, e)), jnp.zeros((b, hk, slots, f)), jnp.zeros((b, hk, n)))

    def fwd_bwd(s, z, g_last):
        out, vjp = jax.vjp(lambda *a: vjps.prefix_sum(plan, *a), s, z, g_last)
        return vjp(out)

    calls = testing.pallas_calls(fwd_bwd, *args)
    aliases = [tuple(call.params["input_output_aliases"]) for call in calls]
    assert aliases == ([((1, 0), (2, 1)), ((3, 0), (4, 1))] if slotted else [(), ()])


def test_the_slot_count_must_fit_the_layout():
    f, e, n = 16, 16, 3
    with pytest.raises(ValueError, match=r"s must hold N \+ 1 \(slotted\) chunk slots for "
                                         r"N = 3 decays, got 3"):
        prefix_kernels.prefix_fwd(jnp.zeros((1, 1, n, f, e)), jnp.zeros((1, 1, n, f)),
                                  jnp.ones((1, 1, n)), prefix_plan(f, True, slotted=True))
    with pytest.raises(ValueError, match=r"s_in must hold N chunk slots for N = 3 decays, "
                                         r"got 4"):
        zeros = jnp.zeros((1, 1, n + 1, f, e))
        prefix_kernels.prefix_bwd(zeros, zeros[..., 0], jnp.ones((1, 1, n)), zeros,
                                  zeros[..., 0], zeros[:, :, 0], zeros[:, :, 0, :, 0],
                                  prefix_plan(f, True))
