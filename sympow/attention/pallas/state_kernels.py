"""State kernels of the chunked algorithm: update_state and query_state, forward and backward.

Two kernel shapes cover the state products, phi expanded tile by tile on chip (never
written to memory); x is a row block (keys or queries) scaled per row by exp(ls):

* rows -> state (`rows_to_state`), one program per (chunk, tile, value block):
    S_tile = sum_rows phi_tile(x)^T A,  z_tile = sum_rows phi_tile(x) b
  update_state forward (x = K, ls = (g_last - g) / p, A = V, b = 1) and the query_state
  backward's state cotangent (x = Q of the R query heads, ls = g / p, A = dO_inter,
  b = dden_inter).
* state -> rows, one program per (chunk, query head, row block), looping over the tiles:
  `query_rows` (phi(x) S and phi(x) z, then the combine with the intra-chunk (o, den, m)),
  `rows_product` (phi(x) S: the update_state backward's dV = phi(K) dS) and `rows_grad`
  (dphi = A S^T + b z^T chained back through the tile products to dx: the query_state
  backward's dQ with S = S_in, A = dO_inter, b = dden_inter, and the update_state
  backward's dK with S = dS, A = V, b = 1); rows_grad also returns the row-scale
  cotangent dls = sum_d dx x for the gate gradients.

States between kernels (S, the prefix states and their cotangents) are in the matmul
dtype: they only ever feed MMAs, and every sum over rows or chunks runs in float32 on chip.
z and the normalizer terms stay float32.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from sympow.attention.chunked import combine_weights
from sympow.attention.pallas.launch import dot, idiv, irem, launch, split_heads
from sympow.attention.pallas.phi import (
    expand_factors_t,
    load_factors,
    product,
    scatter_blocks,
    tile_factor_grads,
    tile_products,
    tile_tables,
)
from sympow.attention.pallas.plan import Plan
from sympow.numerics import safe_reciprocal


def _tables(plan: Plan):
    blocks, weights = tile_tables(plan.d, plan.p, plan.tile)
    full = lambda a: pl.BlockSpec(a.shape, lambda *_: (0,) * a.ndim)  # noqa: E731
    return (jnp.asarray(blocks), jnp.asarray(weights)), [full(blocks), full(weights)]


def _tile(blocks_ref, weights_ref, f, p: int):
    return [blocks_ref[f, k] for k in range(p)], weights_ref[f]


def _rows_to_state_kernel(blocks_ref, weights_ref, x_ref, ls_ref, a_ref, *refs, plan: Plan,
                          groups: int, n_eb: int, has_b: bool):
    b_ref, s_ref, z_ref = refs if has_b else (None, *refs)
    br, tp = plan.state_br, plan.tile_features
    n_rb = plan.c // br
    blocks, weight = _tile(blocks_ref, weights_ref, idiv(pl.program_id(0), n_eb), plan.p)

    def body(it, carry):
        s, z = carry
        r = idiv(it, n_rb)
        rows = pl.ds(pl.multiple_of(irem(it, n_rb) * br, br), br)
        # S += phi^T A: phi^T [tp, br] by selection products, the register A operand.
        row_scale = jnp.exp(plan.p * ls_ref[rows]) * weight  # phi is p-homogeneous
        phi_t = product(expand_factors_t(x_ref, blocks, plan, rows, (r,))) * row_scale
        zw = phi_t if b_ref is None else phi_t * b_ref[r, rows][None, :]
        return s + dot(phi_t, a_ref[r, rows, :], plan), z + jnp.sum(zw, axis=1)

    init = (jnp.zeros((tp, plan.state_be), jnp.float32), jnp.zeros((tp,), jnp.float32))
    s, z = jax.lax.fori_loop(0, groups * n_rb, body, init)
    s_ref[...] = s.astype(s_ref.dtype)

    @pl.when(irem(pl.program_id(0), n_eb) == 0)
    def _():
        z_ref[...] = z


def rows_to_state(x, ls, a, b, plan: Plan, *, name: str):
    """S [B,Hk,N,F,E] (matmul dtype), z [B,Hk,N,F] (float32) summed over rows and the R
    heads of a group.

    x [B, R Hk, N, C, D]; ls [B, Hk, N, C] row log-scales; a [B, R Hk, N, C, E];
    b [B, R Hk, N, C] or None (ones).
    """
    bsz, hx, n, c, d = x.shape
    hk = ls.shape[1]
    groups, e, be, tp = hx // hk, a.shape[-1], plan.state_be, plan.tile_features
    n_eb = e // be
    tables, table_specs = _tables(plan)
    at = lambda *blk: lambda i, n_, bh: (*split_heads(bh, hk), n_) + blk  # noqa: E731
    in_specs = [*table_specs,
                pl.BlockSpec((None, groups, None, c, d), at(0, 0)),
                pl.BlockSpec((None, None, None, c), at(0)),
                pl.BlockSpec((None, groups, None, c, be),
                             lambda i, n_, bh: (*split_heads(bh, hk), n_, 0, irem(i, n_eb)))]
    args = [*tables, x, ls, a.astype(plan.mm_dtype)]
    if b is not None:
        in_specs.append(pl.BlockSpec((None, groups, None, c), at(0)))
        args.append(b)
    f32 = jnp.float32
    return launch(
        lambda *refs: _rows_to_state_kernel(*refs, plan=plan, groups=groups, n_eb=n_eb,
                                            has_b=b is not None),
        plan=plan, name=name, grid=(plan.n_tiles * n_eb, n, bsz * hk), in_specs=in_specs,
        out_specs=[pl.BlockSpec((None, None, None, tp, be), lambda i, n_, bh: (
                       *split_heads(bh, hk), n_, idiv(i, n_eb), irem(i, n_eb))),
                   pl.BlockSpec((None, None, None, tp),
                                lambda i, n_, bh: (*split_heads(bh, hk), n_, idiv(i, n_eb)))],
        out_shape=[jax.ShapeDtypeStruct((bsz, hk, n, plan.features, e), plan.mm_dtype),
                   jax.ShapeDtypeStruct((bsz, hk, n, plan.features), f32)],
        warps=plan.warps_state)(*args)


def _row_specs(plan: Plan, hx: int, hk: int, br: int):
    """Specs for grid (R * C / br, N, B Hk): row block i % (C / br) of head hk R + i // (C / br)."""
    groups, n_rb = hx // hk, plan.c // br

    def per_row(width=None):  # [B, Hx, N, C(, W)]
        shape = (None, None, None, br) + (() if width is None else (width,))
        return pl.BlockSpec(shape, lambda i, n, bh: (
            idiv(bh, hk), irem(bh, hk) * groups + idiv(i, n_rb), n, irem(i, n_rb))
            + (() if width is None else (0,)))

    ls = pl.BlockSpec((None, None, None, br),
                      lambda i, n, bh: (*split_heads(bh, hk), n, irem(i, n_rb)))
    state = pl.BlockSpec((None, None, None, plan.features, plan.e),
                         lambda i, n, bh: (*split_heads(bh, hk), n, 0, 0))
    norm = pl.BlockSpec((None, None, None, plan.features),
                        lambda i, n, bh: (*split_heads(bh, hk), n, 0))
    return per_row, ls, state, norm


def _tile_loop(plan: Plan, blocks_ref, weights_ref, x_ref, scale, body, init, split: int = 1):
    """fori_loop over the tiles in `split` parts each; body(carry, blocks, factors, prods,
    weight, feats). Part h of a tile takes the h-th 1/split of the first factor's slice:
    features [h tp / split, (h + 1) tp / split) of the tile (the first factor varies slowest).
    """
    t, part, width = plan.tile, plan.tile_features // split, plan.tile // split

    def step(it, carry):
        f, h = (idiv(it, split), irem(it, split)) if split > 1 else (it, 0)
        blocks, weight = _tile(blocks_ref, weights_ref, f, plan.p)
        first = pl.ds(pl.multiple_of(blocks[0] * t + h * width, width), width)
        factors = [x_ref[:, first].astype(jnp.float32) * scale[:, None],
                   *load_factors(x_ref, blocks[1:], t, scale)]
        feats = pl.ds(pl.multiple_of(f * plan.tile_features + h * part, part), part)
        return body(carry, blocks, factors, tile_products(factors), weight, feats)
    return jax.lax.fori_loop(0, plan.n_tiles * split, step, init)


def combine_rows(o, den, m, inter_o, inter_den):
    """`chunked.combine` as row scales: y = o ci + inter_o ce, with (y, ci, ce).

    ci = w_intra / total, ce = w_inter / total (0 where the total is 0), the weights of
    combine (`chunked.combine_weights`), so the backward needs only ci and ce.
    """
    w_intra, w_inter = combine_weights(den, m, inter_den)
    total = den * w_intra + inter_den * w_inter
    inv = safe_reciprocal(total)  # NaN carried (numerics.safe_divide)
    ci, ce = w_intra * inv, w_inter * inv
    return o * ci[:, None] + inter_o * ce[:, None], ci, ce


def _rows_out_kernel(blocks_ref, weights_ref, x_ref, ls_ref, s_ref, *refs, plan: Plan,
                     combine: bool):
    """out = phi(x) S per row block; with `combine`, the query_state forward: also the
    normalizer phi(x) z, combined with the intra-chunk (o, den, m) into (y, ci, ce)."""
    z_ref = refs[0] if combine else None
    scale = jnp.exp(ls_ref[...])

    def body(carry, blocks, factors, prods, weight, feats):
        num, den = carry
        phi = prods[-1] * weight  # [br, tp / split]
        num = num + dot(phi, s_ref[feats, :], plan)
        if combine:
            den = den + dot(phi, _split_columns(z_ref[feats], plan), plan)
        return num, den

    init = (jnp.zeros((plan.query_br, plan.e), jnp.float32),
            jnp.zeros((plan.query_br, 16) if combine else (), jnp.float32))
    num, den16 = _tile_loop(plan, blocks_ref, weights_ref, x_ref, scale, body, init,
                            plan.query_split)
    if not combine:
        refs[0][...] = num.astype(refs[0].dtype)
        return
    o_ref, den_ref, m_ref, y_ref, ci_ref, ce_ref = refs[1:]
    y, ci, ce = combine_rows(o_ref[...], den_ref[...], m_ref[...], num, jnp.sum(den16, axis=1))
    y_ref[...] = y
    ci_ref[...] = ci
    ce_ref[...] = ce


def _split_columns(z, plan: Plan):
    """[tp] f32 -> [tp, 16] (hi, lo, 0, ...) whose product with phi sums to phi . z.

    The normalizer rides on the tensor cores instead of a cross-lane row reduction per
    tile; splitting z into two matmul-dtype parts keeps it at float32 accuracy.
    """
    col = jnp.arange(16, dtype=jnp.int32)[None, :]
    hi = z.astype(plan.mm_dtype).astype(jnp.float32)
    return jnp.where(col == 0, hi[:, None], jnp.where(col == 1, (z - hi)[:, None], 0.0))


def _launch_rows_out(x, ls, s, rest, plan: Plan, *, name: str, out_dtype):
    """Grid and specs of `_rows_out_kernel` over row blocks of plan.query_br; rest = (z, o,
    den, m) for the combine, else ()."""
    bsz, hx, n, c, _ = x.shape
    hk = s.shape[1]
    per_row, ls_spec, state, norm = _row_specs(plan, hx, hk, plan.query_br)
    tables, table_specs = _tables(plan)
    rows_e = jax.ShapeDtypeStruct((bsz, hx, n, c, plan.e), out_dtype)
    rows_1 = jax.ShapeDtypeStruct((bsz, hx, n, c), jnp.float32)
    in_specs = [*table_specs, per_row(plan.d), ls_spec, state]
    out_specs, out_shape = [per_row(plan.e)], [rows_e]
    if rest:
        in_specs += [norm, per_row(plan.e), per_row(), per_row()]
        out_specs += [per_row(), per_row()]
        out_shape += [rows_1, rows_1]
    return launch(
        lambda *refs: _rows_out_kernel(*refs, plan=plan, combine=bool(rest)), plan=plan,
        name=name, grid=(hx // hk * (c // plan.query_br), n, bsz * hk), in_specs=in_specs,
        out_specs=out_specs, out_shape=out_shape, warps=plan.warps_state,
        stages=plan.rows_stages)(*tables, x, ls, s, *rest)


def query_rows(q, ls, s, z, o, den, m, plan: Plan):
    """query_state forward: (y [B,Hq,N,C,E], ci, ce [B,Hq,N,C]) in float32.

    q [B,Hq,N,C,D]; ls = g / p [B,Hk,N,C]; s [B,Hk,N,F,E] in the matmul dtype, z [B,Hk,N,F]
    in float32 (`_split_columns`), both in the kernel layout.
    """
    return _launch_rows_out(q, ls, s, (z, o, den, m), plan, name="sympow_query_state",
                            out_dtype=jnp.float32)


def rows_product(x, ls, s, plan: Plan, *, name: str):
    """phi(x exp(ls)) s [B,Hx,N,C,E] in x's dtype (the update_state backward's dV, the
    cotangent of values of that dtype)."""
    return _launch_rows_out(x, ls, s, (), plan, name=name, out_dtype=x.dtype)[0]


def _rows_grad_kernel(blocks_ref, weights_ref, x_ref, ls_ref, s_ref, z_ref, a_ref, *refs,
                      plan: Plan, has_b: bool):
    b = refs[0][...] if has_b else None
    dx_ref, dls_ref = refs[1:] if has_b else refs
    scale = jnp.exp(ls_ref[...])
    a = a_ref[...]
    t, br = plan.tile, plan.grad_br

    def body(dx3, blocks, factors, prods, weight, feats):
        s_t, z_t = s_ref[feats, :], z_ref[feats]
        dphi = dot(a, s_t, plan, trans_b=True)  # [br, tp]
        dphi = dphi + (z_t[None, :] if b is None else b[:, None] * z_t[None, :])
        return scatter_blocks(dx3, tile_factor_grads(dphi * weight, factors, prods), blocks)

    dx3 = _tile_loop(plan, blocks_ref, weights_ref, x_ref, scale, body,
                     jnp.zeros((br, plan.d // t, t), jnp.float32))
    dx = dx3.reshape(br, plan.d)
    x = x_ref[...].astype(jnp.float32) * scale[:, None]
    dx_ref[...] = (dx * scale[:, None]).astype(dx_ref.dtype)
    dls_ref[...] = jnp.sum(dx * x, axis=1)


def rows_grad(x, ls, s, z, a, b, plan: Plan, *, name: str):
    """Backward through phi(x) against a state: (dx [like x], dls [B,Hx,N,C] f32) for
    dphi = a s^T + b z^T (b None: ones). x, a, b are per row of head Hx = R Hk; ls, s, z per
    kv head.
    """
    bsz, hx, n, c, d = x.shape
    hk = s.shape[1]
    br = plan.grad_br
    per_row, ls_spec, state, norm = _row_specs(plan, hx, hk, br)
    tables, table_specs = _tables(plan)
    in_specs = [*table_specs, per_row(d), ls_spec, state, norm, per_row(plan.e)]
    args = [*tables, x, ls, s, z, a.astype(plan.mm_dtype)]
    if b is not None:
        in_specs.append(per_row())
        args.append(b)
    return launch(
        lambda *refs: _rows_grad_kernel(*refs, plan=plan, has_b=b is not None),
        plan=plan, name=name, grid=(hx // hk * (c // br), n, bsz * hk), in_specs=in_specs,
        out_specs=[per_row(d), per_row()],
        out_shape=[jax.ShapeDtypeStruct(x.shape, x.dtype),
                   jax.ShapeDtypeStruct((bsz, hx, n, c), jnp.float32)],
        warps=plan.warps_state, stages=plan.rows_stages)(*args)
