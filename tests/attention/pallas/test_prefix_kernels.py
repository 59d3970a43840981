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


@pytest.mark.parametrize("slotted", [False, True])
def test_weighted_features_count_in_g_lasts_cotangent_as_the_features_they_stand_for(
        rng, slotted):
    """A state whose feature f stands for w_f equal features (stored once, carrying the
    cotangent of one of them): the weighted sum's g_last cotangent is the plain sum's over
    the state with each feature repeated w_f times, each copy with that cotangent; s and z
    and their cotangents are the unweighted ones."""
    b, hk, n, f, e = 1, 2, 3, 32, 16
    weights = np.asarray(rng.integers(1, 4, size=f))
    slots, first = n + slotted, int(slotted)
    s = jnp.asarray(rng.normal(size=(b, hk, slots, f, e)), jnp.float32)
    z = jnp.asarray(rng.normal(size=(b, hk, slots, f)), jnp.float32)
    g_last = jnp.asarray(np.log(rng.uniform(0.3, 1.0, size=(b, hk, n))), jnp.float32)
    cts = (jnp.asarray(rng.normal(size=(b, hk, slots, f, e)), jnp.float32),
           jnp.asarray(rng.normal(size=(b, hk, slots, f)), jnp.float32),
           jnp.asarray(rng.normal(size=(b, hk, f, e)), jnp.float32),
           jnp.asarray(rng.normal(size=(b, hk, f)), jnp.float32))
    if slotted:  # slot 0 of S and slot N of the cotangent are never read
        s, z = s.at[:, :, 0].set(jnp.nan), z.at[:, :, 0].set(jnp.nan)
        cts = (cts[0].at[:, :, n].set(jnp.nan), cts[1].at[:, :, n].set(jnp.nan), *cts[2:])

    def grads(plan, weights, s, z, *cts):
        _, vjp = jax.vjp(lambda *a: vjps.prefix_sum(plan, *a, weights), s, z, g_last)
        return vjp(cts)

    got = compiled(functools.partial(grads, prefix_plan(f, True, slotted), jnp.asarray(
        weights, jnp.float32)))(s, z, *cts)
    copies = np.repeat(np.arange(f), weights)  # feature f, w_f times
    repeated = compiled(functools.partial(grads, prefix_plan(len(copies), True, slotted),
                                          None))(
        s[..., copies, :], z[..., copies], cts[0][..., copies, :], cts[1][..., copies],
        cts[2][..., copies, :], cts[3][..., copies])
    plain = compiled(functools.partial(grads, prefix_plan(f, True, slotted), None))(s, z, *cts)
    close = functools.partial(np.testing.assert_allclose, rtol=1e-5, atol=1e-5)
    close(np.asarray(got[2]), np.asarray(repeated[2]))
    assert not np.allclose(np.asarray(got[2]), np.asarray(plain[2]))  # the weights count
    for got_, want in zip(got[:2], plain[:2], strict=True):
        close(np.asarray(got_)[:, :, first:first + n], np.asarray(want)[:, :, first:first + n])


def test_the_weights_must_be_one_per_feature():
    f, e, n = 16, 16, 2
    zeros = jnp.zeros((1, 1, n, f, e))
    with pytest.raises(ValueError, match=r"weights must be \[F\] = \[16\] for s_in "
                                         r"\(1, 1, 2, 16, 16\), got \(8,\)"):
        prefix_kernels.prefix_bwd(zeros, zeros[..., 0], jnp.ones((1, 1, n)), zeros,
                                  zeros[..., 0], zeros[:, :, 0], zeros[:, :, 0, :, 0],
                                  prefix_plan(f, True), weights=jnp.ones(8))


@pytest.mark.parametrize("slotted", [False, True])
def test_groups_of_features_sum_in_one_launch_as_each_alone(rng, slotted):
    """s and z as tuples of groups (F differing, weighted or not): one launch each way,
    every output and cotangent the group's own sum's, g_last's cotangent their sum."""
    b, hk, n, e, fs = 1, 2, 3, 16, (48, 16, 32)
    slots = n + slotted
    plan = prefix_plan(16, True, slotted)
    normal = lambda *shape: jnp.asarray(rng.normal(size=shape), jnp.float32)  # noqa: E731
    s, z = tuple(normal(b, hk, slots, f, e) for f in fs), tuple(normal(b, hk, slots, f)
                                                                for f in fs)
    cts = (tuple(normal(b, hk, slots, f, e) for f in fs),
           tuple(normal(b, hk, slots, f) for f in fs),
           tuple(normal(b, hk, f, e) for f in fs), tuple(normal(b, hk, f) for f in fs))
    weights = tuple(jnp.asarray(rng.integers(1, 3, size=f), jnp.float32) for f in fs)
    g_last = jnp.asarray(np.log(rng.uniform(0.3, 1.0, size=(b, hk, n))), jnp.float32)

    def sums_and_grads(s, z, cts, weights):
        out, vjp = jax.vjp(lambda *a: vjps.prefix_sum(plan, *a, weights), s, z, g_last)
        return out, vjp(cts)[:3]

    got = compiled(sums_and_grads)(s, z, cts, weights)
    alone = [compiled(sums_and_grads)(s[g], z[g], tuple(c[g] for c in cts), weights[g])
             for g in range(len(fs))]
    close = functools.partial(np.testing.assert_allclose, rtol=1e-5, atol=1e-5)
    rows = slice(0, n) if not slotted else slice(0, n + 1)
    for g, (out, grads) in enumerate(alone):
        for k in range(4):
            close(np.asarray(got[0][k][g]), np.asarray(out[k]))
        for k in range(2):  # slotted: slot 0 of the cotangents is the unread P_0's
            close(np.asarray(got[1][k][g])[:, :, rows][:, :, slotted:],
                  np.asarray(grads[k])[:, :, rows][:, :, slotted:])
    close(np.asarray(got[1][2]), np.asarray(sum(grads[2] for _, grads in alone)))
    launches = testing.pallas_calls(lambda *a: sums_and_grads(*a)[1], s, z, cts, weights)
    assert [call.params["name"] for call in launches] == [
        "sympow_prefix_sum", "sympow_prefix_sum_bwd"]


def test_groups_must_share_all_but_their_features():
    plan = prefix_plan(16, True)
    with pytest.raises(ValueError, match=r"s: groups \[B, Hk, slots, F, E\] alike but F, "
                                         r"each F a multiple of the feature block 16; got "
                                         r"\[\(1, 1, 2, 16, 16\), \(1, 1, 2, 24, 16\)\]"):
        prefix_kernels.prefix_fwd((jnp.zeros((1, 1, 2, 16, 16)), jnp.zeros((1, 1, 2, 24, 16))),
                                  (jnp.zeros((1, 1, 2, 16)), jnp.zeros((1, 1, 2, 24))),
                                  jnp.ones((1, 1, 2)), plan)
