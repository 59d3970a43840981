"""The portable Pallas tier ('pallas'): registration, heuristics and the per-primitive vjps.

Kernels are `pl.pallas_call`s lowered through Triton on GPU and run by the Pallas
interpreter elsewhere (CPU CI), chosen from `AttentionConfig.interpret`. Each of the four
`ChunkPrimitives` is a `jax.custom_vjp` whose backward runs Pallas kernels, so the public
custom_vjp (which differentiates the composed forward with jax.vjp) runs them too.

Feature layout. The state kernels use the tiled embedding of width `Plan.tile` (F =
expanded_dim(d, p, tile), the layout of `embedding_tables(d, p, tile)`): per-chunk states
and the prefix states are in that layout. `prefix_sum` returns the final state (the one
`prefill` hands to `decode_step`) gathered into the tile=1 layout, so the recurrent state
is the same whatever the tier. prefix_sum sees only F: it recognizes a tiled F by
`_tiled_layout` (no tiled F of a supported d equals a tile=1 F, checked in the tests).

Support: p = 2 with d in {16, 32, 64, 128}; p = 4 with d in {16, 32}; any e <= 128 and
any chunk <= 1024 (run zero-padded to a power of two >= 16); bfloat16 or float32. Anything
else falls back to the pure-JAX primitives of `sympow.attention.xla`, with a logged warning
naming the reason (all four primitives decide alike, so the layouts always agree).

Design notes, the FLOP and byte floors and the measured per-kernel breakdown:
docs/kernels.md; results: docs/benchmarks.md.
"""

from __future__ import annotations

import functools
import logging
from typing import NamedTuple

import jax
import jax.numpy as jnp

from sympow.attention import xla
from sympow.attention.chunked import ChunkPrimitives
from sympow.embedding import expanded_dim
from sympow.kernels import pallas_attention, pallas_state
from sympow.kernels.pallas_common import Plan, PrefixPlan, to_symmetric_layout

logger = logging.getLogger(__name__)

SUPPORTED_D = {2: (16, 32, 64, 128), 4: (16, 32)}
SUPPORTED_E = (16, 32, 64, 128)
SUPPORTED_DTYPES = ("bfloat16", "float32")
MAX_CHUNK = 512  # the default chunk for long sequences (see default_chunk_size)
MAX_PADDED_CHUNK = 1024  # the largest chunk the kernels take


def is_available() -> bool:
    """True on GPU (Triton) and on CPU (the Pallas interpreter, for CI)."""
    return jax.default_backend() in ("gpu", "cpu")


def default_chunk_size(length: int) -> int:
    """The smallest power of two >= 16 covering `length`, at most MAX_CHUNK.

    512 beat 256 on H100 at T=65536 (21.5 vs 22.7 ms fwd+bwd): the prefix sum and the
    state traffic halve while the intra-chunk attention doubles (docs/kernels.md).
    """
    return min(MAX_CHUNK, max(16, 1 << max(0, length - 1).bit_length()))


def tile_width(d: int, p: int) -> int:
    """t with t^p = 256 features per tile: one [256, E] state tile is a full MMA operand."""
    return min(d, 16 if p == 2 else 4)


def _unsupported(p: int, d: int, e: int, c: int, dtype: str) -> str | None:
    if p not in SUPPORTED_D:
        return f"p={p} (supported: {sorted(SUPPORTED_D)})"
    if d not in SUPPORTED_D[p]:
        return f"d={d} with p={p} (supported: {SUPPORTED_D[p]})"
    if e not in SUPPORTED_E:
        return f"e={e} (supported: up to {SUPPORTED_E[-1]})"
    if dtype not in SUPPORTED_DTYPES:
        return f"dtype {dtype} (supported: {SUPPORTED_DTYPES})"
    if c > MAX_PADDED_CHUNK:
        return f"chunk_size={c} (supported: up to {MAX_PADDED_CHUNK})"
    return None


def _stages(tile_bytes: int) -> int:
    """Software-pipelining depth whose buffers fit in 160 KB of the 227 KB of shared memory
    of an H100 (d = e = 128 asked for 330 KB at 3 stages), leaving room for the operands."""
    return max(1, min(3, (160 << 10) // tile_bytes))


@functools.lru_cache(maxsize=256)
def make_plan(p: int, d: int, e: int, c: int, dtype: str, interpret: bool) -> Plan | str:
    """The one heuristics function: block sizes for a problem, or the reason it is unsupported.

    Each choice bounds the float32 register tiles of a kernel to about 64 KB per program.
    """
    reason = _unsupported(p, d, e, c, dtype)
    if reason is not None:
        return reason
    itemsize = jnp.dtype(dtype).itemsize
    return Plan(
        p=p, d=d, e=e, c=c, dtype=dtype, tile=tile_width(d, p),
        # Attention: [bq, bk] scores plus [bq, e] accumulator; 64 x 64 keeps both small for
        # d, e <= 128 and gives C / 64 query blocks of parallelism per chunk.
        attn_bq=min(c, 64), attn_bk=min(c, 64),
        # rows -> state: [256, br] phi^T per step into a [256, be] accumulator. br = 128 was
        # slower on H100 (update_state fwd 4.1 vs 2.4 ms at T=65536, H=8; docs/kernels.md).
        state_br=min(c, 64),
        # Split E above 64 columns: the [256, be] f32 accumulator stays at 64 KB.
        state_be=min(e, 64),
        # phi(x) S (query fwd, dV): 128 rows halve the state reads per row; half tiles
        # [128, 128] keep phi at 64 KB: query fwd 2.17 vs 3.00 ms (64 rows, whole tiles) on
        # H200; [256, 64] tiles: 2.34 ms. E = 128 keeps 64 rows ([rows, E] f32 at 32 KB).
        query_br=min(c, 128 if e <= 64 else 64), query_split=2,
        # dQ, dK (one [rows, d] accumulator): 128 rows halve the state reads per row (query
        # bwd 2.4 vs 3.1 ms at 64 on H200). dK and dV in one kernel, two accumulators, ran
        # at 64 rows only (128 spilled: 15.5 vs 3.4 ms).
        grad_br=min(c, 128),
        warps_attn=4,
        # 8 warps: 256 threads share the [256, 64] float32 tiles (64 registers each); 4 warps
        # were slower for every state kernel (H200, fwd+bwd of each primitive, measured
        # before the dK / dV split: update 5.0 vs 4.8 ms, query 11.4 vs 4.7).
        warps_state=8,
        # 3 stages: 2-15% faster than 2 on every kernel, within noise on none worse; fewer
        # where 3 copies of a loop's tiles would not fit in shared memory (d or e = 128).
        stages=3,
        attn_stages=_stages(2 * 64 * (d + e) * itemsize),  # k and v (q and dO) tiles
        # One [256, E] state tile (matmul dtype) per step.
        rows_stages=_stages(tile_width(d, p) ** p * e * itemsize),
        interpret=interpret,
    )


def prefix_plan(f: int, interpret: bool) -> PrefixPlan:
    """Feature block: the largest power of two <= 64 dividing F ([bf, E] f32 per step)."""
    bf = 1
    while bf < 64 and f % (2 * bf) == 0:
        bf *= 2
    return PrefixPlan(bf=bf, warps=4, stages=2, interpret=interpret)


@functools.lru_cache(maxsize=64)
def _log_fallback(reason: str) -> None:
    logger.warning("sympow impl='pallas' falls back to 'xla' for %s", reason)


@functools.lru_cache(maxsize=64)
def _tiled_layout(f: int, p: int) -> tuple[int, int] | None:
    """(d, tile) if F is the kernel layout's F of a supported d, else None."""
    for d in SUPPORTED_D.get(p, ()):
        if expanded_dim(d, p, tile_width(d, p)) == f:
            return d, tile_width(d, p)
    return None


# ---------------------------------------------------------------------------------------
# The four primitives, each a custom_vjp with named residuals.


class UpdateResiduals(NamedTuple):
    k: jax.Array
    v: jax.Array
    g: jax.Array


def _update_log_scale(g, p):
    return (g[..., -1:] - g) / p  # [B, Hk, N, C], <= 0


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def update_state(plan: Plan, k, v, g):
    return _update_fwd(plan, k, v, g)[0]


def _update_fwd(plan, k, v, g):
    s, z = pallas_state.rows_to_state(k, _update_log_scale(g, plan.p), v, None, plan,
                                      name="sympow_update_state")
    return (s, z), UpdateResiduals(k, v, g)


def _update_bwd(plan, res: UpdateResiduals, cts):
    ds, dz = cts
    ls = _update_log_scale(res.g, plan.p)
    dk, dls = pallas_state.rows_grad(res.k, ls, ds, dz, res.v, None, plan,
                                     name="sympow_update_state_dk")
    dv = pallas_state.rows_product(res.k, ls, ds, plan, name="sympow_update_state_dv")
    dls = dls / plan.p  # ls = (g_last - g) / p
    return dk, dv, (-dls).at[..., -1].add(dls.sum(axis=-1))


update_state.defvjp(_update_fwd, _update_bwd)


class PrefixResiduals(NamedTuple):
    s_in: jax.Array
    z_in: jax.Array
    decay: jax.Array


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def prefix_sum(plan: PrefixPlan, s, z, g_last):
    return _prefix_fwd(plan, s, z, g_last)[0]


def _prefix_fwd(plan, s, z, g_last):
    decay = jnp.exp(g_last)
    out = pallas_state.prefix_fwd(s, z, decay, plan)
    return out, PrefixResiduals(out[0], out[1], decay)


def _prefix_bwd(plan, res: PrefixResiduals, cts):
    ds, dz, ddecay = pallas_state.prefix_bwd(res.s_in, res.z_in, res.decay, *cts, plan)
    return ds, dz, ddecay * res.decay


prefix_sum.defvjp(_prefix_fwd, _prefix_bwd)


class AttentionResiduals(NamedTuple):
    q: jax.Array
    k: jax.Array
    v: jax.Array
    g: jax.Array
    m: jax.Array


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def attention(plan: Plan, q, k, v, g):
    return pallas_attention.attention_fwd(q, k, v, g, plan)


def _attention_fwd(plan, q, k, v, g):
    o, den, m = pallas_attention.attention_fwd(q, k, v, g, plan)
    return (o, den, m), AttentionResiduals(q, k, v, g, m)


def _attention_bwd(plan, res: AttentionResiduals, cts):
    do, dden, _ = cts  # m is a stop_gradient'ed row max, as in the oracle: no cotangent
    return pallas_attention.attention_bwd(*res, do, dden, plan)


attention.defvjp(_attention_fwd, _attention_bwd)


class QueryResiduals(NamedTuple):
    q: jax.Array
    s_in: jax.Array
    z_in: jax.Array
    g: jax.Array
    o: jax.Array
    den: jax.Array
    y: jax.Array
    c_intra: jax.Array  # w_intra / total per row: y = o c_intra + inter_o c_inter
    c_inter: jax.Array


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def query_state(plan: Plan, q, s_in, z_in, g, o, den, m):
    return _query_fwd(plan, q, s_in, z_in, g, o, den, m)[0]


def _query_fwd(plan, q, s_in, z_in, g, o, den, m):
    y, ci, ce = pallas_state.query_rows(q, g / plan.p, s_in, z_in, o, den, m, plan)
    return y, QueryResiduals(q, s_in, z_in, g, o, den, y, ci, ce)


def _query_bwd(plan, res: QueryResiduals, dy):
    b, hq, n, c, _ = res.q.shape
    hk = res.g.shape[1]
    ci, ce = res.c_intra[..., None], res.c_inter[..., None]
    delta = jnp.sum(dy * res.y, axis=-1, keepdims=True)  # y = num / total: d total = -delta
    do, dden = dy * ci, (-delta * ci)[..., 0]
    dm = (ci * (jnp.sum(dy * res.o, axis=-1, keepdims=True) - delta * res.den[..., None]))[..., 0]
    d_inter_o, d_inter_den = dy * ce, (-delta * ce)[..., 0]
    ls = res.g / plan.p
    dq, dls = pallas_state.rows_grad(res.q, ls, res.s_in, res.z_in, d_inter_o, d_inter_den,
                                     plan, name="sympow_query_state_dq")
    ds_in, dz_in = pallas_state.rows_to_state(res.q, ls, d_inter_o, d_inter_den, plan,
                                              name="sympow_query_state_ds")
    dg = dls.reshape(b, hk, hq // hk, n, c).sum(axis=2) / plan.p
    return dq, ds_in, dz_in, dg, do, dden, dm


query_state.defvjp(_query_fwd, _query_bwd)


# ---------------------------------------------------------------------------------------
# Registration.


def padded_width(e: int) -> int:
    """Value width the kernels run at: the next power of two >= 16 (zero columns are exact)."""
    return max(16, 1 << (e - 1).bit_length())


def _pad(x, axis: int, size: int, mode: str = "constant"):
    pad = size - x.shape[axis]
    if pad == 0:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, pad)
    return jnp.pad(x, widths, mode=mode)


def primitives_factory(config) -> ChunkPrimitives:
    """ChunkPrimitives of the Pallas tier for a resolved AttentionConfig.

    Shapes the kernels do not take natively run padded inside each primitive, outputs sliced
    back (so states and outputs keep the caller's shapes): a value width e that is not a power
    of two >= 16 gets zero columns, a chunk C that is not one gets zero rows at its end (zero
    keys add nothing, causality keeps the real rows from the padded ones, and g is padded
    with its last value so the chunk's decay is unchanged).
    """

    def plan_for(d, e, c, dtype) -> Plan | None:
        plan = make_plan(config.p, d, padded_width(e), padded_width(c), jnp.dtype(dtype).name,
                         config.interpret)
        if isinstance(plan, str):
            _log_fallback(plan)
            return None
        return plan

    def rows(x, plan):  # [B, H, N, C, ...] -> [B, H, N, plan.c, ...]
        return _pad(x, 3, plan.c)

    def gates(g, plan):
        return _pad(g, 3, plan.c, mode="edge")

    def cols(x, plan):
        return _pad(x, -1, plan.e)

    def update_state_(k, v, g, *, p):
        plan = plan_for(k.shape[-1], v.shape[-1], k.shape[3], k.dtype)
        if plan is None:
            return xla.update_state(k, v, g, p=p)
        s, z = update_state(plan, rows(k, plan), rows(cols(v, plan), plan), gates(g, plan))
        return s[..., :v.shape[-1]], z

    def prefix_sum_(s, z, g_last):
        layout = _tiled_layout(s.shape[-2], config.p)
        if layout is None:
            return xla.prefix_sum(s, z, g_last)
        e = s.shape[-1]  # loads of [bf, E] need a power of two: pad as the other kernels do
        s_in, z_in, s_fin, z_fin = prefix_sum(prefix_plan(s.shape[-2], config.interpret),
                                              _pad(s, -1, padded_width(e)), z, g_last)
        s_in, s_fin = s_in[..., :e], s_fin[..., :e]
        d, tile = layout
        index, scale = to_symmetric_layout(d, config.p, tile)
        return s_in, z_in, s_fin[..., index, :] * scale[:, None], z_fin[..., index] * scale

    def attention_(q, k, v, g, *, p):
        c, e = q.shape[3], v.shape[-1]
        plan = plan_for(q.shape[-1], e, c, q.dtype)
        if plan is None:
            return xla.attention(q, k, v, g, p=p)
        o, den, m = attention(plan, rows(q, plan), rows(k, plan), rows(cols(v, plan), plan),
                              gates(g, plan))
        return o[..., :c, :e], den[..., :c], m[..., :c]

    def query_state_(q, s_in, z_in, g, o, den, m, *, p):
        c, e = q.shape[3], s_in.shape[-1]
        plan = plan_for(q.shape[-1], e, c, q.dtype)
        if plan is None:
            return xla.query_state(q, s_in, z_in, g, o, den, m, p=p)
        y = query_state(plan, rows(q, plan), cols(s_in, plan), z_in, gates(g, plan),
                        rows(cols(o, plan), plan), rows(den, plan), rows(m, plan))
        return y[..., :c, :e]

    return ChunkPrimitives(update_state_, prefix_sum_, attention_, query_state_)


def register() -> None:
    from sympow import kernels

    kernels.register("pallas", is_available, default_chunk_size, primitives_factory)


register()
