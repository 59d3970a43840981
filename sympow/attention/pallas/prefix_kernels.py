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
                       dz_fin_ref, *refs, n: int, slotted: bool, weighted: bool):
    weights_ref, (ds_ref, dz_ref, ddecay_ref) = (refs[0], refs[1:]) if weighted else (
        None, refs)

    def body(it, carry):
        ds, dz = carry  # the cotangent of P_{i+1} = that of S_i
        i = n - 1 - it
        ds_ref[i + slotted] = ds.astype(ds_ref.dtype)  # slotted: over P_{i+1}'s, loaded last
        dz_ref[i + slotted] = dz
        s_in = s_in_ref[i].astype(jnp.float32)
        if weighted:  # [bf]: how many features of the whole state each one stands for
            ddecay_ref[i] = jnp.sum((jnp.sum(ds * s_in, axis=1) + dz * z_in_ref[i])
                                    * weights_ref[...])
        else:
            ddecay_ref[i] = jnp.sum(ds * s_in) + jnp.sum(dz * z_in_ref[i])
        decay = decay_ref[i]
        return ds_in_ref[i].astype(jnp.float32) + decay * ds, dz_in_ref[i] + decay * dz

    jax.lax.fori_loop(0, n, body, (ds_fin_ref[...], dz_fin_ref[...]))


def _prefix_specs(plan: PrefixPlan, hk: int, n: int, e: int,
                  group: tuple[int, int] | None = None):
    """BlockSpecs of the per-chunk arrays ([B, Hk, slots, F(, E)], slots = N or N + 1), the
    final states and the decays; with group = (first, blocks), for a group whose feature
    blocks are the grid's first + [0, blocks) (elsewhere clamped into the group: not read
    there)."""
    bf, slots = plan.bf, n + plan.slotted

    def block(f):
        return _block_in(f, group)

    chunks_e = pl.BlockSpec((None, None, slots, bf, e),
                            lambda f, bh: (*split_heads(bh, hk), 0, block(f), 0))
    chunks_1 = pl.BlockSpec((None, None, slots, bf),
                            lambda f, bh: (*split_heads(bh, hk), 0, block(f)))
    final_e = pl.BlockSpec((None, None, bf, e), lambda f, bh: (*split_heads(bh, hk), block(f), 0))
    final_1 = pl.BlockSpec((None, None, bf), lambda f, bh: (*split_heads(bh, hk), block(f)))
    decay = pl.BlockSpec((None, None, n), lambda f, bh: (*split_heads(bh, hk), 0))
    return chunks_e, chunks_1, final_e, final_1, decay


def _block_in(f, group: tuple[int, int] | None):
    """A group's own feature block at grid index f, clamped into the group (first, blocks);
    a lone group's (None) is f itself."""
    return f if group is None else jnp.clip(f - group[0], 0, group[1] - 1)


def _group(firsts: list[int], g: int) -> tuple[int, int] | None:
    """(first, blocks) of group g in the grid, or None when it is the only one."""
    return None if len(firsts) == 2 else (firsts[g], firsts[g + 1] - firsts[g])


def _check_slots(plan: PrefixPlan, slots: int, n: int, name: str) -> None:
    if slots != n + plan.slotted:
        layout = "N + 1 (slotted)" if plan.slotted else "N"
        raise ValueError(f"{name} must hold {layout} chunk slots for N = {n} decays, got "
                         f"{slots}")


def _listed(x, grouped: bool) -> list:
    """An argument's groups as a list (one group when not grouped)."""
    return list(x) if grouped else [x]


def _groups(name: str, s, plan: PrefixPlan) -> tuple[list, list[int]]:
    """s as a list of groups [B, Hk, slots, F_g, E] and each group's first feature block in
    the grid (one more: the grid's length)."""
    groups = _listed(s, isinstance(s, (tuple, list)))
    shapes = [g.shape for g in groups]
    if any(sh[:3] + sh[4:] != shapes[0][:3] + shapes[0][4:] or sh[3] % plan.bf
           for sh in shapes):
        raise ValueError(f"{name}: groups [B, Hk, slots, F, E] alike but F, each F a "
                         f"multiple of the feature block {plan.bf}; got {shapes}")
    firsts = [0]
    for sh in shapes:
        firsts.append(firsts[-1] + sh[3] // plan.bf)
    return groups, firsts


def _launch_over_groups(kernel, firsts: list[int], *, plan: PrefixPlan, name: str, hk: int,
                        b: int, group_specs, shared_specs, per_group_in: int, aliases):
    """One launch of `kernel(shared..., group refs...)` over every group's feature blocks:
    grid (firsts[-1], B Hk), each program running the kernel on the refs of the group its
    feature block lies in. group_specs(g) -> (in_specs, out_specs, out_shapes) of group g;
    inputs ordered shared, then group by group; aliases(g) -> {input: output} within the
    group (its in and out indices from 0)."""
    count = len(firsts) - 1
    specs = [group_specs(g) for g in range(count)]
    per_group_out = len(specs[0][1])
    shared = len(shared_specs)

    def body(*refs):
        ins, outs = refs[shared:shared + count * per_group_in], refs[shared + count *
                                                                     per_group_in:]
        for g in range(count):
            group = (*refs[:shared], *ins[g * per_group_in:(g + 1) * per_group_in],
                     *outs[g * per_group_out:(g + 1) * per_group_out])
            if count == 1:
                kernel(*group)
            else:
                f = pl.program_id(0)
                pl.when((f >= firsts[g]) & (f < firsts[g + 1]))(
                    lambda group=group: kernel(*group))

    all_aliases = {shared + g * per_group_in + i: g * per_group_out + o
                   for g in range(count) for i, o in (aliases(g) or {}).items()}
    return launch(body, plan=plan, name=name, grid=(firsts[-1], b * hk),
                  in_specs=[*shared_specs, *(s for sp in specs for s in sp[0])],
                  out_specs=[s for sp in specs for s in sp[1]],
                  out_shape=[s for sp in specs for s in sp[2]], warps=plan.warps,
                  aliases=all_aliases or None)


def prefix_fwd(s, z, decay, plan: PrefixPlan):
    """(s_in, z_in, s_final, z_final) of the gated prefix sum; decay = exp(g_last) [B, Hk, N].

    s [B, Hk, slots, F, E], z [B, Hk, slots, F] in the plan's layout (module docstring);
    s_in, z_in alike (slotted: s and z summed in place). Sums in float32; s_in keeps the
    dtype of s (the matmul dtype: the query kernels' MMA operand), z_in and the final state
    are float32. s and z may each be a tuple of groups (F differing; one launch over them
    all, so a state stored in several arrays costs what one array of their size costs):
    then every output is a tuple of the groups' own.
    """
    grouped = isinstance(s, (tuple, list))
    ss, firsts = _groups("s", s, plan)
    zs = _listed(z, grouped)
    b, hk, slots, _, e = ss[0].shape
    n = decay.shape[-1]
    _check_slots(plan, slots, n, "s")
    sds = jax.ShapeDtypeStruct

    def group_specs(g):
        f = ss[g].shape[3]
        chunks_e, chunks_1, final_e, final_1, _ = _prefix_specs(plan, hk, n, e,
                                                                _group(firsts, g))
        return ([chunks_e, chunks_1], [chunks_e, chunks_1, final_e, final_1],
                [sds(ss[g].shape, ss[g].dtype), sds(zs[g].shape, jnp.float32),
                 sds((b, hk, f, e), jnp.float32), sds((b, hk, f), jnp.float32)])

    out = _launch_over_groups(
        lambda *refs: _prefix_fwd_kernel(*refs, n=n, slotted=plan.slotted), firsts, plan=plan,
        name="sympow_prefix_sum", hk=hk, b=b, group_specs=group_specs,
        shared_specs=[_prefix_specs(plan, hk, n, e)[4]], per_group_in=2,
        aliases=lambda g: {0: 0, 1: 1} if plan.slotted else None,
    )(decay, *(y for pair in zip(ss, zs, strict=True) for y in pair))
    return tuple(tuple(out[k::4]) if grouped else out[k] for k in range(4))


def prefix_bwd(s_in, z_in, decay, ds_in, dz_in, ds_fin, dz_fin, plan: PrefixPlan,
               weights=None):
    """(ds, dz, ddecay [B,Hk,N]) of `prefix_fwd` given its residuals and cotangents (ds in
    the dtype of s_in, like the s it is the cotangent of; slotted: over ds_in, dz_in); with
    groups, every array argument and weights a tuple of the groups' own, ds and dz too.

    weights [F] float32 (None: ones): how many features of the whole state each stored
    feature stands for in ddecay's sum over the features, for a layout that stores one
    feature for w equal ones and carries the cotangent of one of them (the Hopper tier's
    upper layout of a symmetric state: w = 2 for a pair (i, j), (j, i) stored once)."""
    grouped = isinstance(s_in, (tuple, list))
    ss, firsts = _groups("s_in", s_in, plan)
    zs, dss, dzs, ds_fins, dz_fins = (_listed(x, grouped)
                                      for x in (z_in, ds_in, dz_in, ds_fin, dz_fin))
    ws = None if weights is None else _listed(weights, grouped)
    b, hk, slots, _, e = ss[0].shape
    n = decay.shape[-1]
    _check_slots(plan, slots, n, "s_in")
    for g, s_g in enumerate(ss):
        if ws is not None and ws[g].shape != (s_g.shape[3],):
            raise ValueError(f"weights must be [F] = [{s_g.shape[3]}] for s_in {s_g.shape}, "
                             f"got {ws[g].shape}")
    weighted = ws is not None
    sds = jax.ShapeDtypeStruct

    def group_specs(g):
        group, blocks = _group(firsts, g), firsts[g + 1] - firsts[g]
        chunks_e, chunks_1, final_e, final_1, _ = _prefix_specs(plan, hk, n, e, group)
        weights_spec = pl.BlockSpec((plan.bf,), lambda f, bh: (_block_in(f, group),))
        return ([chunks_e, chunks_1, chunks_e, chunks_1, final_e, final_1,
                 *([weights_spec] if weighted else [])],
                [chunks_e, chunks_1, pl.BlockSpec((None, None, None, n), lambda f, bh: (
                    *split_heads(bh, hk), _block_in(f, group), 0))],
                [sds(ss[g].shape, ss[g].dtype), sds(zs[g].shape, jnp.float32),
                 sds((b, hk, blocks, n), jnp.float32)])

    inputs = [(ss[g], zs[g], dss[g].astype(ss[g].dtype), dzs[g].astype(jnp.float32),
               ds_fins[g], dz_fins[g], *([ws[g].astype(jnp.float32)] if weighted else []))
              for g in range(len(ss))]
    out = _launch_over_groups(
        lambda *refs: _prefix_bwd_kernel(*refs, n=n, slotted=plan.slotted, weighted=weighted),
        firsts, plan=plan, name="sympow_prefix_sum_bwd", hk=hk, b=b, group_specs=group_specs,
        shared_specs=[_prefix_specs(plan, hk, n, e)[4]], per_group_in=6 + weighted,
        aliases=lambda g: {2: 0, 3: 1} if plan.slotted else None,
    )(decay, *(y for group in inputs for y in group))
    ds, dz = (tuple(out[k::3]) if grouped else out[k] for k in range(2))
    return ds, dz, sum(y.sum(axis=2) for y in out[2::3])
