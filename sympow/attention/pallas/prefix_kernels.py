"""The gated prefix sum over chunks of the chunked algorithm: Pallas forward and backward.

One program per (kv head, feature block) walks the chunks sequentially: forward
P_{n+1} = exp(g_last_n) P_n + S_n (P_0 = 0), returning the state entering each chunk and
the final one; backward the reverse recursion plus the cotangent of exp(g_last_n). The
kernels see only F, so they serve any feature layout.

Two layouts of the per-chunk states (`PrefixPlan.slotted`):

* exclusive: S [.., N, F, E] in, P [.., N, F, E] out, a second buffer of the states' size;
* slotted: one buffer of N + 1 slots, S_n at slot n + 1 (slot 0 unread), summed in place
  (`input_output_aliases`): P_{n+1} is written over S_n, P_0 = 0 to slot 0, so slot n holds
  the state entering chunk n and slot N the final one. The backward alike: the cotangent of
  P_n at slot n (slot N unread; the final state's comes apart) in, the cotangent of S_n
  written over slot n + 1. Every store replaces a value the same program loaded and that
  the stored value depends on, so no store can overtake the load it replaces, however
  Triton pipelines the loads (it issues them ahead through separate, aliased refs); a
  store that does not depend on its slot's load (the exclusive sum done in place) could,
  and reading and writing through one ref stopped the pipelining (docs/kernels.md).
  Peak memory: one buffer of the states' size less in each direction.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from sympow.attention.pallas.launch import launch, split_heads
from sympow.attention.pallas.plan import PrefixPlan


def _prefix_fwd_kernel(decay_ref, s_ref, z_ref, s_in_ref, z_in_ref, s_fin_ref, z_fin_ref, *,
                       n: int, slotted: bool):
    def body(i, carry):  # float32 on chip; s_in in the per-chunk states' dtype
        s, z = carry
        if not slotted:  # the state entering chunk i, before S_i joins it
            s_in_ref[i] = s.astype(s_in_ref.dtype)
            z_in_ref[i] = z
        decay = decay_ref[i]
        s = decay * s + s_ref[i + slotted].astype(jnp.float32)
        z = decay * z + z_ref[i + slotted]
        if slotted:  # over S_i, which this sum read
            s_in_ref[i + 1] = s.astype(s_in_ref.dtype)
            z_in_ref[i + 1] = z
        return s, z

    zeros = (jnp.zeros(s_fin_ref.shape, jnp.float32), jnp.zeros(z_fin_ref.shape, jnp.float32))
    if slotted:
        s_in_ref[0] = zeros[0].astype(s_in_ref.dtype)
        z_in_ref[0] = zeros[1]
    s, z = jax.lax.fori_loop(0, n, body, zeros)
    s_fin_ref[...] = s
    z_fin_ref[...] = z


def _prefix_bwd_kernel(decay_ref, s_in_ref, z_in_ref, ds_in_ref, dz_in_ref, ds_fin_ref,
                       dz_fin_ref, ds_ref, dz_ref, ddecay_ref, *, n: int, slotted: bool):
    def body(it, carry):
        ds, dz = carry  # the cotangent of P_{i+1} = that of S_i
        i = n - 1 - it
        ds_ref[i + slotted] = ds.astype(ds_ref.dtype)  # slotted: over P_{i+1}'s, loaded last
        dz_ref[i + slotted] = dz
        ddecay_ref[i] = (jnp.sum(ds * s_in_ref[i].astype(jnp.float32))
                         + jnp.sum(dz * z_in_ref[i]))
        decay = decay_ref[i]
        return ds_in_ref[i].astype(jnp.float32) + decay * ds, dz_in_ref[i] + decay * dz

    jax.lax.fori_loop(0, n, body, (ds_fin_ref[...], dz_fin_ref[...]))


def _prefix_specs(plan: PrefixPlan, hk: int, n: int, e: int):
    """BlockSpecs of the per-chunk arrays ([B, Hk, slots, F(, E)], slots = N or N + 1), the
    final states and the decays."""
    bf, slots = plan.bf, n + plan.slotted
    chunks_e = pl.BlockSpec((None, None, slots, bf, e),
                            lambda f, bh: (*split_heads(bh, hk), 0, f, 0))
    chunks_1 = pl.BlockSpec((None, None, slots, bf), lambda f, bh: (*split_heads(bh, hk), 0, f))
    final_e = pl.BlockSpec((None, None, bf, e), lambda f, bh: (*split_heads(bh, hk), f, 0))
    final_1 = pl.BlockSpec((None, None, bf), lambda f, bh: (*split_heads(bh, hk), f))
    decay = pl.BlockSpec((None, None, n), lambda f, bh: (*split_heads(bh, hk), 0))
    return chunks_e, chunks_1, final_e, final_1, decay


def _check_slots(plan: PrefixPlan, slots: int, n: int, name: str) -> None:
    if slots != n + plan.slotted:
        layout = "N + 1 (slotted)" if plan.slotted else "N"
        raise ValueError(f"{name} must hold {layout} chunk slots for N = {n} decays, got "
                         f"{slots}")


def prefix_fwd(s, z, decay, plan: PrefixPlan):
    """(s_in, z_in, s_final, z_final) of the gated prefix sum; decay = exp(g_last) [B, Hk, N].

    s [B, Hk, slots, F, E], z [B, Hk, slots, F] in the plan's layout (module docstring);
    s_in, z_in alike (slotted: s and z summed in place). Sums in float32; s_in keeps the
    dtype of s (the matmul dtype: the query kernels' MMA operand), z_in and the final state
    are float32.
    """
    b, hk, slots, f, e = s.shape
    n = decay.shape[-1]
    _check_slots(plan, slots, n, "s")
    chunks_e, chunks_1, final_e, final_1, decay_spec = _prefix_specs(plan, hk, n, e)
    sds = jax.ShapeDtypeStruct
    return launch(
        lambda *refs: _prefix_fwd_kernel(*refs, n=n, slotted=plan.slotted), plan=plan,
        name="sympow_prefix_sum", grid=(f // plan.bf, b * hk),
        in_specs=[decay_spec, chunks_e, chunks_1],
        out_specs=[chunks_e, chunks_1, final_e, final_1],
        out_shape=[sds(s.shape, s.dtype), sds(z.shape, jnp.float32),
                   sds((b, hk, f, e), jnp.float32), sds((b, hk, f), jnp.float32)],
        warps=plan.warps, aliases={1: 0, 2: 1} if plan.slotted else None)(decay, s, z)


def prefix_bwd(s_in, z_in, decay, ds_in, dz_in, ds_fin, dz_fin, plan: PrefixPlan):
    """(ds, dz, ddecay [B,Hk,N]) of `prefix_fwd` given its residuals and cotangents (ds in
    the dtype of s_in, like the s it is the cotangent of; slotted: over ds_in, dz_in)."""
    b, hk, slots, f, e = s_in.shape
    n = decay.shape[-1]
    _check_slots(plan, slots, n, "s_in")
    chunks_e, chunks_1, final_e, final_1, decay_spec = _prefix_specs(plan, hk, n, e)
    n_fb = f // plan.bf
    sds = jax.ShapeDtypeStruct
    ds, dz, ddecay = launch(
        lambda *refs: _prefix_bwd_kernel(*refs, n=n, slotted=plan.slotted), plan=plan,
        name="sympow_prefix_sum_bwd", grid=(n_fb, b * hk),
        in_specs=[decay_spec, chunks_e, chunks_1, chunks_e, chunks_1, final_e, final_1],
        out_specs=[chunks_e, chunks_1,
                   pl.BlockSpec((None, None, None, n),
                                lambda f_, bh: (*split_heads(bh, hk), f_, 0))],
        out_shape=[sds(s_in.shape, s_in.dtype), sds(z_in.shape, jnp.float32),
                   sds((b, hk, n_fb, n), jnp.float32)],
        warps=plan.warps, aliases={3: 0, 4: 1} if plan.slotted else None,
    )(decay, s_in, z_in, ds_in.astype(s_in.dtype), dz_in.astype(jnp.float32), ds_fin, dz_fin)
    return ds, dz, ddecay.sum(axis=2)
