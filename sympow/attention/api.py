"""Public functional API: `sympow_attention`, `prefill` and `decode_step`.

Arguments are validated here (ValueErrors that name the argument and the shapes), the
implementation is chosen from the one table (`implementations.py`), and the custom_vjp is
applied once, with the static settings in one frozen `AttentionConfig`. Its forward runs the
chosen implementation under jax.vjp and keeps what that saves (the kernels' own residuals,
each primitive's custom_vjp), so a gradient runs the forward once. Callers who would rather
recompute it than hold those residuals wrap the call (or their layer) in jax.checkpoint.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

from sympow.attention import implementations
from sympow.attention.chunked import norm_bound
from sympow.attention.config import AttentionConfig
from sympow.attention.pallas import decode_kernel
from sympow.attention.reference import (
    Keys,
    LogGates,
    Outputs,
    Queries,
    SympowState,
    Values,
    check_p,
    recurrent_step,
)
from sympow.attention.streaming import streamed_state
from sympow.embedding import expanded_dim

__all__ = ["sympow_attention", "prefill", "decode_step", "make_config", "check_settings"]


def _shape_error(name: str, expected: str, args: dict) -> ValueError:
    shapes = ", ".join(f"{k} {_shape_of(v)}" for k, v in args.items() if v is not None)
    return ValueError(f"{name} must be {expected}; got {shapes}")


def _shape_of(x) -> str:
    """x's shape as a tuple, or its type where it has none (a list, None)."""
    return str(tuple(x.shape)) if hasattr(x, "shape") else f"of type {type(x).__name__}"


def validate_inputs(q, k, v, log_g, p) -> None:
    """Raise ValueError naming the argument and the shapes for anything outside the contract."""
    check_p(p)
    args = {"q": q, "k": k, "v": v, "log_g": log_g}
    for name in ("q", "k", "v"):
        if getattr(args[name], "ndim", None) != 4:
            raise _shape_error(name, "rank 4 [B, T, H, D]", args)
    (b, t, hq, d), (hk, e) = q.shape, (k.shape[2], v.shape[3])
    if k.shape != (b, t, hk, d):
        raise _shape_error("k", f"[B, T, Hk, D] = [{b}, {t}, Hk, {d}] to match q", args)
    if v.shape[:3] != (b, t, hk):
        raise _shape_error("v", f"[B, T, Hk, E] = [{b}, {t}, {hk}, E] to match k", args)
    if t < 1 or d < 1 or e < 1 or hk < 1:
        raise _shape_error("q", "non-empty (T, H, D and E >= 1)", args)
    if hq % hk:
        raise _shape_error("q", f"[B, T, Hq, D] with Hq a multiple of Hk = {hk} (grouped "
                                "query heads)", args)
    if log_g is not None:
        if getattr(log_g, "shape", None) != (b, t, hk):
            raise _shape_error("log_g", f"[B, T, Hk] = [{b}, {t}, {hk}]", args)
        if not jnp.issubdtype(log_g.dtype, jnp.floating):
            raise ValueError(f"log_g must be floating point, got dtype {log_g.dtype}")
    dtypes = {name: args[name].dtype for name in ("q", "k", "v")}
    if len(set(dtypes.values())) != 1:
        raise ValueError(f"q, k and v must share one dtype, got {dtypes}")
    if not jnp.issubdtype(q.dtype, jnp.floating):
        raise ValueError(f"q, k and v must be floating point, got dtype {q.dtype}")


def check_settings(*, p, chunk_size, impl, algorithm=None) -> None:
    """ValueError for a p, chunk_size, impl or algorithm outside the contract (what the
    layers check at construction, before any input exists)."""
    check_p(p)
    if chunk_size is not None and (not isinstance(chunk_size, int) or isinstance(chunk_size, bool)
                                   or chunk_size <= 0):
        raise ValueError(f"chunk_size must be a positive int or None, got "
                         f"chunk_size={chunk_size!r}")
    implementations.check_impl(impl, algorithm)


def make_config(length: int, p: int, chunk_size: int | None, impl: str | None,
                algorithm: str | None = None, *, need_state: bool = False,
                widths: tuple[int, int] | None = None) -> AttentionConfig:
    """Choose the implementation and fill in the defaults: the frozen config of one call.

    widths: (d, e) of the call, so the cost model can choose the algorithm (otherwise the
    first row of the backend in table order)."""
    check_settings(p=p, chunk_size=chunk_size, impl=impl, algorithm=algorithm)
    shape = None if widths is None else (p, *widths, length)
    row = implementations.select(impl, algorithm, need_state=need_state, shape=shape,
                                 chunk_size=chunk_size)
    if row.default_chunk_size is None:
        chunk_size = None  # the row has no chunk or block
    elif chunk_size is None:
        chunk_size = row.default_chunk_size(length, p, None if widths is None else widths[0])
    return AttentionConfig(p=p, algorithm=row.algorithm, backend=row.backend,
                           chunk_size=chunk_size, interpret=jax.default_backend() != "gpu")


def chosen_algorithm(length: int, d: int | None = None, e: int | None = None, p: int = 2, *,
                     chunk_size: int | None = None, impl: str | None = None,
                     algorithm: str | None = None, need_state: bool = False) -> str:
    """The algorithm ('chunked', 'attention', 'recurrent') that `sympow_attention` (or, with
    need_state, `prefill`) runs for `length` tokens of heads of widths d and e with these
    settings: what a caller that lays out q and k for the op asks."""
    widths = None if d is None or e is None else (d, e)
    return make_config(length, p, chunk_size, impl, algorithm, need_state=need_state,
                       widths=widths).algorithm


def _run(config: AttentionConfig, q, k, v, log_g) -> tuple[Array, SympowState | None]:
    """(y in v's dtype, the final state or None) of the config's implementation."""
    y, state = implementations.lookup(config).run(config, q, k, v, log_g)
    return y.astype(v.dtype), state


def _forward(config: AttentionConfig, q, k, v, log_g) -> Array:
    return _run(config, q, k, v, log_g)[0]


class Residuals(NamedTuple):
    # dy -> (dq, dk, dv, dlog_g): jax.vjp's function of the forward, holding the residuals
    # the implementation's primitives saved. Until 2026-11-25 only (q, k, v, log_g) were
    # kept and the backward ran the forward again: a GPT-2 small step at 4k and 64k context
    # ran every attention forward twice (10 % of its time on an H100, docs/benchmarks.md).
    backward: Callable


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _attention(config: AttentionConfig, q, k, v, log_g):
    return _forward(config, q, k, v, log_g)


def _attention_fwd(config, q, k, v, log_g):
    y, backward = jax.vjp(functools.partial(_forward, config), q, k, v, log_g)
    return y, Residuals(backward)


def _attention_bwd(config, residuals: Residuals, dy):
    del config  # static; the residuals' function already carries it
    return residuals.backward(dy)


_attention.defvjp(_attention_fwd, _attention_bwd)
# Compiled per (config, shapes): eager callers get one fused program too; under an outer
# jit this inlines.
_attention_jit = jax.jit(_attention, static_argnums=0)


@functools.partial(jax.jit, static_argnums=(0,))
def _prefill(config: AttentionConfig, q, k, v, log_g):
    y, state = _run(config, q, k, v, log_g)
    if state is None:  # the attention form keeps no state: stream it, one feature tile at a time
        state = streamed_state(k, v, log_g, p=config.p)
    return y, state


def sympow_attention(q: Queries, k: Keys, v: Values, log_g: LogGates | None = None, *,
                     p: int = 2, chunk_size: int | None = None, impl: str | None = None,
                     algorithm: str | None = None) -> Outputs:
    """Causal (gated) symmetric power attention.

    Y_i = sum_{j<=i} B_ij V_j / sum_{j<=i} B_ij with B_ij = exp(G_i - G_j) (Q_i . K_j)^p and
    G = cumsum(log_g). Rows whose B_ij are all zero (e.g. a zero query) give Y_i = 0.
    A NaN in an input gives NaN rows, never zeros: q_i's makes row i NaN, k_j's and
    log_g_j's rows j on (earlier rows untouched); v_j's rows j on and possibly earlier ones
    (a masked weight's 0 times NaN is NaN in the products); tested for every backend (the
    GPU kernels by experiments/gpu_check.py).
    Layout follows jax.nn.dot_product_attention.

    Args:
      q: [B, T, Hq, D] queries (rotary, if any, already applied).
      k: [B, T, Hk, D] keys; Hq must be a multiple of Hk and query head n reads key/value
        head n // (Hq // Hk) (grouped queries).
      v: [B, T, Hk, E] values, same dtype as q and k.
      log_g: [B, T, Hk] log of the gate gamma in (0, 1], so log_g <= 0 (not checked: values
        are traced); None for no gating. Any floating dtype; used in float32.
      p: positive even power.
      chunk_size: chunk C of the chunked algorithm, or the block of the blocked attention
        form; None chooses. Any T works (the tail is padded). Ignored by impl='reference'.
      impl: the backend (docs/design.md §5.1): None picks the fastest available on the
        platform; 'mosaic_gpu' (GPU only: Mosaic GPU attention kernels on a Hopper GPU, and
        state kernels for p = 2, d = 64; the 'pallas' kernels for the rest) | 'pallas'
        (Pallas kernels; Triton on GPU, the interpreter elsewhere) | 'xla' (pure JAX) |
        'reference' (the specification; O(T^2) memory).
      algorithm: 'chunked' (linear in T: the chunked algorithm over per-chunk states) |
        'attention' (the attention form, quadratic in T, O(T x block) memory: flash-style
        kernels for 'mosaic_gpu' and 'pallas', blocked pure JAX for 'xla') | None: the
        backend's algorithm of least estimated cost for (p, d, e, T) (docs/design.md §5.1:
        with 'pallas' the attention form up to T ~ 4.5k at p = 2, d = e = 64, with
        'mosaic_gpu' up to T ~ 9k; always at p = 4, d = 64).

    Returns:
      [B, T, Hq, E] in v's dtype (accumulated in float32).
    """
    validate_inputs(q, k, v, log_g, p)
    config = make_config(q.shape[1], p, chunk_size, impl, algorithm,
                         widths=(q.shape[-1], v.shape[-1]))
    return _attention_jit(config, q, k, v, log_g)


def prefill(q: Queries, k: Keys, v: Values, log_g: LogGates | None = None, *, p: int = 2,
            chunk_size: int | None = None, impl: str | None = None,
            algorithm: str | None = None) -> tuple[Outputs, SympowState]:
    """Forward over a prompt that also returns the recurrent state after it.

    Same arguments as `sympow_attention`. The chunked algorithm returns its final state; the
    attention form (chosen by the cost model with the state's cost added, e.g. always at
    p = 4, d = 64, or forced) gets it streamed over feature tiles (`streaming.py`: no
    per-chunk states, so GPT-2 small at p = 4 fits on one GPU). impl='reference' runs the
    specification's recurrent scan, one token at a time, unless algorithm='attention'.
    Returns (y [B, T, Hq, E] in v's dtype, SympowState with s [B, Hk, F, E] and z [B, Hk, F]
    in float32, F = expanded_dim(D, p)) to continue with `decode_step`.
    """
    validate_inputs(q, k, v, log_g, p)
    config = make_config(q.shape[1], p, chunk_size, impl, algorithm, need_state=True,
                         widths=(q.shape[-1], v.shape[-1]))
    return _prefill(config, q, k, v, log_g)


DECODE_IMPLS = ("pallas", "reference")


def default_decode_impl() -> str:
    """decode_step's impl=None: the fused kernel on a GPU, the jnp step elsewhere."""
    return "pallas" if jax.default_backend() == "gpu" else "reference"


def decode_step(
    state: SympowState,
    q: Float[Array, "B Hq D"],
    k: Float[Array, "B Hk D"],
    v: Float[Array, "B Hk E"],
    log_g: Float[Array, "B Hk"] | None = None,
    *,
    p: int = 2,
    impl: str | None = None,
) -> tuple[SympowState, Float[Array, "B Hq E"]]:
    """Advance the recurrent state by one token in O(F E), independent of the context length.

    impl: 'pallas' (the update and readout fused in one kernel that reads the state once and
    writes it in place; `pallas/decode_kernel.py`; the interpreter off GPU), 'reference'
    (`reference.recurrent_step`, jnp operations), or None: 'pallas' on a GPU (checked there
    against the reference, fp32 and bf16, and 2.4x faster at B = 16 on an H100:
    docs/benchmarks.md), 'reference' elsewhere (the interpreter is slow on a CPU).
    q may have any scale (the readout is invariant to it; q is divided by a power of two
    >= its norm before phi(q), so |q|^p stays inside float32).
    Returns (new state, y [B, Hq, E] in v's dtype).
    """
    _validate_step(state, q, k, v, log_g, p)
    if impl is None:
        impl = default_decode_impl()
    if impl not in DECODE_IMPLS:
        raise ValueError(f"impl must be one of {DECODE_IMPLS} or None, got impl={impl!r}")
    state, y = _decode_step(p, impl, jax.default_backend() != "gpu", state, q, k, v, log_g)
    return state, y.astype(v.dtype)


def _validate_step(state, q, k, v, log_g, p) -> None:
    """ValueError naming the argument and shapes for a token or a state outside
    decode_step's contract: the state must be one of this p and D (F = expanded_dim(D, p))."""
    args = {"q": q, "k": k, "v": v, "log_g": log_g}
    for name, rank, spec in (("q", 3, "[B, Hq, D]"), ("k", 3, "[B, Hk, D]"),
                             ("v", 3, "[B, Hk, E]"), ("log_g", 2, "[B, Hk]")):
        if args[name] is not None and getattr(args[name], "ndim", None) != rank:
            raise _shape_error(name, f"rank {rank} {spec} (one token)", args)
    validate_inputs(q[:, None], k[:, None], v[:, None],
                    None if log_g is None else log_g[:, None], p)
    if not isinstance(state, SympowState):
        raise ValueError(f"state must be a SympowState(s, z) (from prefill or init_state), "
                         f"got {type(state).__name__}")
    (b, hk, d), e = k.shape, v.shape[-1]
    f = expanded_dim(d, p)
    which = f"F = expanded_dim(D={d}, p={p}) = {f}"
    states = {"state.s": state.s, "state.z": state.z}
    for name, want, spec in (("state.s", (b, hk, f, e), "[B, Hk, F, E]"),
                             ("state.z", (b, hk, f), "[B, Hk, F]")):
        if getattr(states[name], "shape", None) != want:
            raise _shape_error(name, f"{spec} = {list(want)} ({which}; a state of another p "
                                     "or D does not fit)", states)
    if not all(jnp.issubdtype(x.dtype, jnp.floating) for x in states.values()):
        raise ValueError(f"state.s and state.z must be floating point, got dtypes "
                         f"{state.s.dtype} and {state.z.dtype}")


@functools.partial(jax.jit, static_argnums=(0, 1, 2))
def _decode_step(p, impl, interpret, state, q, k, v, log_g):
    # the readout phi(q)^T S / phi(q)^T Z is invariant to q's scale: q over a power of two
    # >= |q| (exact) keeps |q|^p inside float32, past which the row was inf / inf or 0 / 0
    q = q.astype(state.s.dtype)
    q = q / norm_bound(q, axis=(-1,))
    if impl == "pallas":
        return decode_kernel.decode_step(state, q, k, v, log_g, p, interpret=interpret)
    return recurrent_step(state, q, k, v, log_g, p)
