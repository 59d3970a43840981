"""One decoding step of the recurrence in one kernel: state update and readout fused.

`reference.recurrent_step` is the specification: S <- g S + phi(K) V^T, Z <- g Z + phi(K),
Y = phi(Q)^T S / phi(Q)^T Z for the R query heads of each key/value head. Written as jnp
operations, XLA reads the state [F, E] once to update it and again for the readout, in
several launches. Here one program per (batch x kv head, row tile of F) reads its tile of
S and Z once, writes the updated tile in place (`input_output_aliases`: no second state
buffer) and returns the tile's share of the readout, phi(Q)^T S_new over its rows, and of
its normalizer phi(Q)^T Z_new in one array (the normalizer repeated along E: one sum over
the tiles serves both, where two arrays took XLA two reductions); XLA adds the shares of the
F / rows tiles, carrying each addition's rounding error (`numerics.compensated_sum`: the
shares cancel, so a float32 sum's error depends on the order XLA reduces in, which differs
between backends), and divides. The features phi(Q) and phi(K) ([F] per head,
small beside the state) are built by `sympow_embedding` outside the kernel.

Triton wants power-of-two blocks: the row tile is the largest power of two dividing F (at
most 64, fewer where R E is large, to bound the [R, rows, E] product), R is padded with zero
query features, and E must be a power of two >= 16; other shapes fall back to the
specification with a logged reason.
"""

from __future__ import annotations

import dataclasses
import functools
import logging

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jaxtyping import Array, Float

from sympow.attention.pallas.launch import launch
from sympow.attention.reference import SympowState, recurrent_step
from sympow.embedding import sympow_embedding
from sympow.numerics import compensated_sum, safe_divide

logger = logging.getLogger(__name__)

MAX_ROWS = 64
PRODUCT_BUDGET = 8192  # elements of the [R, rows, E] readout product per program


@dataclasses.dataclass(frozen=True)
class DecodePlan:
    """Blocks of the fused step: `rows` of F per program, R padded to `groups`."""

    rows: int
    groups: int
    interpret: bool
    stages: int = 1


def _power_of_two_at_least(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def make_decode_plan(f: int, r: int, e: int, interpret: bool) -> DecodePlan | str:
    """The plan for F features, R query heads per kv head and value width E, or why not."""
    if e < 16 or e & (e - 1):
        return f"value width E = {e} (the kernel takes powers of two >= 16)"
    groups = _power_of_two_at_least(r)
    rows = min(f & -f, MAX_ROWS, max(1, PRODUCT_BUDGET // (groups * e)))
    return DecodePlan(rows=rows, groups=groups, interpret=interpret)


@functools.lru_cache(maxsize=32)
def _log_fallback(reason: str) -> None:
    logger.warning("sympow decode_step impl='pallas' falls back to the reference step for %s",
                   reason)


def _step_kernel(s_ref, z_ref, phi_k_ref, phi_q_ref, v_ref, gate_ref, s_out, z_out,
                 readout_ref):
    gate = gate_ref[...]  # [1]
    phi_k = phi_k_ref[...]  # [rows]
    s = gate[:, None] * s_ref[...] + phi_k[:, None] * v_ref[...][None, :]  # [rows, E]
    z = gate * z_ref[...] + phi_k  # [rows]
    s_out[...] = s
    z_out[...] = z
    phi_q = phi_q_ref[...]  # [R, rows]
    groups, e = phi_q.shape[0], s.shape[1]
    den = jnp.sum(phi_q * z[None, :], axis=1)  # [R]
    readout_ref[pl.ds(0, groups), :] = jnp.sum(phi_q[:, :, None] * s[None, :, :], axis=1)
    readout_ref[pl.ds(groups, groups), :] = jnp.broadcast_to(den[:, None], (groups, e))


def fused_step(plan: DecodePlan, state: SympowState, q: Float[Array, "B Hq D"],
               k: Float[Array, "B Hk D"], v: Float[Array, "B Hk E"],
               log_g: Float[Array, "B Hk"] | None, p: int
               ) -> tuple[SympowState, Float[Array, "B Hq E"]]:
    """`recurrent_step` (tile 1, float32 state) in one kernel launch plus small XLA ops."""
    b, hq, _ = q.shape
    hk, e = k.shape[1], v.shape[-1]
    f, r, ct = state.z.shape[-1], hq // hk, state.s.dtype
    bh, tiles = b * hk, f // plan.rows
    phi_k = sympow_embedding(k.astype(ct), p).reshape(bh, f)
    phi_q = sympow_embedding(q.astype(ct), p).reshape(bh, r, f)
    phi_q = jnp.pad(phi_q, ((0, 0), (0, plan.groups - r), (0, 0)))  # zero rows: no readout
    gate = (jnp.ones((bh, 1), ct) if log_g is None
            else jnp.exp(log_g.astype(ct)).reshape(bh, 1))
    rows, groups = plan.rows, plan.groups
    tile = lambda *block: pl.BlockSpec(block, lambda i, j: (i, j) + (0,) * (len(block) - 2))  # noqa: E731
    s, z, readout = launch(
        _step_kernel, plan=plan, name="sympow_decode_step", grid=(bh, tiles),
        in_specs=[tile(None, rows, e), tile(None, rows), tile(None, rows),
                  pl.BlockSpec((None, groups, rows), lambda i, j: (i, 0, j)),
                  pl.BlockSpec((None, e), lambda i, j: (i, 0)),
                  pl.BlockSpec((None, 1), lambda i, j: (i, 0))],
        out_specs=[tile(None, rows, e), tile(None, rows), tile(None, None, 2 * groups, e)],
        out_shape=[jax.ShapeDtypeStruct((bh, f, e), ct), jax.ShapeDtypeStruct((bh, f), ct),
                   jax.ShapeDtypeStruct((bh, tiles, 2 * groups, e), ct)],
        warps=4, aliases={0: 0, 1: 1},
    )(state.s.reshape(bh, f, e), state.z.reshape(bh, f), phi_k, phi_q, v.astype(ct).reshape(bh, e),
      gate)
    # [BH, 2 groups, E]: numerators, then normalizers; summed with each addition's rounding
    # kept (the tiles' shares cancel: a float32 sum's error depends on XLA's order)
    readout = compensated_sum(readout, axis=1)
    num, den = readout[:, :r], readout[:, groups:groups + r, 0]  # [BH, R, E], [BH, R]
    y = safe_divide(num, den).reshape(b, hq, e)
    return SympowState(s.reshape(state.s.shape), z.reshape(state.z.shape)), y


def decode_step(state: SympowState, q, k, v, log_g, p: int, *, interpret: bool):
    """The fused step where the kernel takes the shapes, else `recurrent_step` (logged)."""
    if state.s.dtype != jnp.float32:
        _log_fallback(f"a {state.s.dtype} state (the kernel keeps float32)")
        return recurrent_step(state, q, k, v, log_g, p)
    plan = make_decode_plan(state.z.shape[-1], q.shape[1] // k.shape[1], v.shape[-1],
                            interpret)
    if isinstance(plan, str):
        _log_fallback(plan)
        return recurrent_step(state, q, k, v, log_g, p)
    return fused_step(plan, state, q, k, v, log_g, p)
