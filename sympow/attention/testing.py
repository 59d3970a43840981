"""Cases and checks shared by the tests (CPU, Pallas interpreter) and the GPU runner
(experiments/gpu_check.py, Triton): one definition of what "an implementation is right" means.

bf16 follows docs/design.md §4: gold = the oracle on float32 inputs, ref = the oracle on bf16
inputs, test = the implementation on bf16 inputs; each output X (y and the four gradients,
under a random cotangent) must satisfy ||gold - test|| <= K ||gold - ref|| + ATOL ||gold||
in the L2 norm over X (the max norm alone swings by 3x between seeds on small problems;
it is kept as a looser element-wise guard).
float32 compares an implementation with the float32 oracle by relative L2 error.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np

from sympow.attention import reference
from sympow.attention.api import decode_step, sympow_attention

K_BF16 = 2.5  # test may be at most this many times further from gold than ref is (L2)
# ... plus this fraction of ||gold||: 2^-8, one bf16 ulp, since every output is stored in
# bf16 (at T=1, y = v, ref can land exactly on gold while the kernels differ by a rounding).
ATOL_BF16 = 2.0 ** -8
# Element-wise guard against a few wrong rows: max|gold - test| <= K_MAX max|gold - ref| +
# atol. Loose, because at p=4, d=32 (F = 84480 features summed from bf16 products) the
# largest deviation reaches 5-10x ref's while the L2 error stays within K_BF16.
K_MAX_BF16 = 10.0
TOL_FP32 = 1e-4  # relative L2 error of float32 kernels against the float32 oracle
OUTPUTS = ("y", "dq", "dk", "dv", "dlog_g")


@dataclasses.dataclass(frozen=True)
class Case:
    t: int
    p: int = 2
    d: int = 16
    e: int = 16
    hq: int = 2
    hk: int = 2
    b: int = 2
    chunk: int = 16
    gating: bool = True

    @property
    def name(self) -> str:
        return (f"b{self.b}_t{self.t}_h{self.hq}x{self.hk}_d{self.d}_e{self.e}_p{self.p}"
                f"_c{self.chunk}{'_gated' if self.gating else ''}")


def inputs(case: Case, rng: np.random.Generator, *, kind: str = "random"):
    """Float32 (q, k, v, log_g, dy) of a case; `kind` picks an adversarial variant."""
    b, t = case.b, case.t
    q = rng.normal(size=(b, t, case.hq, case.d))
    k = rng.normal(size=(b, t, case.hk, case.d))
    v = rng.normal(size=(b, t, case.hk, case.e))
    # Gates near 1 as after training (sigmoid of ~3), some strong ones mixed in.
    log_g = np.log(1 / (1 + np.exp(-rng.normal(3.0, 2.0, size=(b, t, case.hk)))))
    if kind == "zero_queries":
        q[:, ::3] = 0.0
    elif kind == "zero_keys":
        k[:, ::2] = 0.0
        k[0, :, 0] = 0.0
    elif kind == "huge_norms":
        q, k = q * 1e3, k * 1e3
    elif kind == "large_scales":  # norms whose squares overflow float32; q . k ~ 1e33
        q, k = q * 2.0**66, k * 2.0**40
    elif kind == "small_scales":  # norms whose squares underflow; q . k ~ 1e-29
        q, k = q * 2.0**-66, k * 2.0**-30
    elif kind == "no_decay":
        log_g[:] = 0.0
    elif kind == "full_decay":
        log_g[:] = -1e4
    elif kind != "random":
        raise ValueError(f"unknown kind {kind!r}")
    dy = rng.normal(size=(b, t, case.hq, case.e))
    f32 = lambda x: jnp.asarray(x, jnp.float32)  # noqa: E731
    return f32(q), f32(k), f32(v), (f32(log_g) if case.gating else None), f32(dy)


# An implementation to check: a backend (`impl=`), or (backend, algorithm).
Impl = str | tuple[str, str]

# Off GPU the kernels run in the Pallas interpreter, whose XLA programs take long to optimize
# and run for milliseconds: compile them at the lowest optimization level.
CPU_OPTIONS = {"xla_backend_optimization_level": 0} if jax.default_backend() == "cpu" else None


@functools.partial(jax.jit, static_argnames=("impl", "p", "chunk"),
                   compiler_options=CPU_OPTIONS)
def forward_and_grads(q, k, v, log_g, dy, *, impl: Impl, p: int, chunk: int):
    """y and its vjp (dq, dk, dv, dlog_g) under cotangent dy, as a dict of float32 arrays."""
    backend, algorithm = (impl, None) if isinstance(impl, str) else impl

    def f(q, k, v, log_g):
        return sympow_attention(q, k, v, log_g, p=p, chunk_size=chunk, impl=backend,
                                algorithm=algorithm)

    if log_g is None:
        y, vjp = jax.vjp(lambda q, k, v: f(q, k, v, None), q, k, v)
        grads = (*vjp(dy.astype(y.dtype)), None)
    else:
        y, vjp = jax.vjp(f, q, k, v, log_g)
        grads = vjp(dy.astype(y.dtype))
    return {name: None if x is None else x.astype(jnp.float32)
            for name, x in zip(OUTPUTS, (y, *grads), strict=True)}


def run(case: Case, args, impl: Impl, dtype=jnp.float32):
    q, k, v, log_g, dy = args
    cast = lambda x: x.astype(dtype)  # noqa: E731
    return forward_and_grads(cast(q), cast(k), cast(v), log_g, dy, impl=impl, p=case.p,
                             chunk=case.chunk)


def _l2(x, y=None) -> float:
    x = np.asarray(x, np.float64)
    return float(np.linalg.norm(x if y is None else x - np.asarray(y, np.float64)))


def check_bf16(case: Case, args, impl: Impl, gold_impl: Impl = "reference",
               floor: float = 1e-2):
    """Rows (output, err_test, err_ref, bound, ok) of the gold/ref/test comparison.

    err = ||gold - x|| / ||gold|| (L2 over the whole output); ok iff
    err_test <= K_BF16 err_ref + ATOL_BF16, and no element is more than K_MAX_BF16 times
    further from gold than ref's largest deviation (a guard against a few wrong rows).
    floor: as in `check_fp32`.
    """
    gold = run(case, args, gold_impl)
    ref = run(case, args, gold_impl, jnp.bfloat16)
    test = run(case, args, impl, jnp.bfloat16)
    floor_scale = floor * max(_l2(x) for x in gold.values() if x is not None)
    rows = []
    for name in OUTPUTS:
        if gold[name] is None:
            continue
        scale = max(_l2(gold[name]), floor_scale, 1e-30)
        err_test, err_ref = _l2(gold[name], test[name]) / scale, _l2(gold[name], ref[name]) / scale
        bound = K_BF16 * err_ref + ATOL_BF16
        ok = bool(np.all(np.isfinite(np.asarray(test[name]))) and err_test <= bound
                  and max_err(gold[name], test[name])
              <= K_MAX_BF16 * max_err(gold[name], ref[name])
              + ATOL_BF16 * max(float(np.max(np.abs(np.asarray(gold[name])))),
                                floor_scale / np.sqrt(gold[name].size)))
        rows.append((name, err_test, err_ref, bound, ok))
    return rows


def check_fp32(case: Case, args, impl: Impl, gold_impl: Impl | None = "reference",
               tol: float = TOL_FP32, floor: float = 1e-2):
    """Rows (output, err, tol, ok) of the kernels against the float32 oracle, or with
    gold_impl None against `float64_oracle` (the quadratic form in float64).

    err = ||test - gold|| / max(||gold||, floor * max over outputs of ||gold||), so an output
    that is zero up to rounding (dq at T = 1 or under log_g = -1e4, where each row attends
    only to itself) is measured against the problem's scale instead of its own noise. There
    the float32 specification's own noise is ~1e-4 of that scale (p / s amplifies it), so
    such cases take the float64 oracle.
    """
    gold = (float64_oracle(*args, p=case.p) if gold_impl is None
            else run(case, args, gold_impl))
    test = run(case, args, impl)
    scale = floor * max(_l2(x) for x in gold.values() if x is not None)
    rows = []
    for name in OUTPUTS:
        if gold[name] is None:
            continue
        x, y = np.asarray(test[name], np.float64), np.asarray(gold[name], np.float64)
        err = float(np.linalg.norm(x - y) / max(np.linalg.norm(y), scale, 1e-30))
        rows.append((name, err, tol, bool(np.all(np.isfinite(x))) and err <= tol))
    return rows


def pallas_calls(fn, *args) -> list:
    """Every pallas_call equation in the jaxpr of fn(*args), nested jaxprs included, in
    order (their params, operands and results)."""
    calls = []

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "pallas_call":
                calls.append(eqn)
            for sub in jax.extend.core.jaxprs_in_params(eqn.params):
                walk(sub)

    walk(jax.make_jaxpr(fn)(*args).jaxpr)
    return calls


def pallas_call_names(fn, *args) -> list[str]:
    """Names of every pallas_call in the jaxpr of fn(*args), nested jaxprs included."""
    return [str(eqn.params["name"]) for eqn in pallas_calls(fn, *args)]


# ---------------------------------------------------------------------------------------
# Inputs and error measures of the small test suites.


def attention_inputs(rng, *, b=2, t=37, hq=4, hk=2, d=8, e=6, gating=True, dtype=jnp.float32,
                     scale=1.0):
    """Fresh random q [B,T,Hq,D], k [B,T,Hk,D], v [B,T,Hk,E], log_g [B,T,Hk] (or None)."""
    q = jnp.asarray(scale * rng.normal(size=(b, t, hq, d)), dtype)
    k = jnp.asarray(scale * rng.normal(size=(b, t, hk, d)), dtype)
    v = jnp.asarray(rng.normal(size=(b, t, hk, e)), dtype)
    log_g = jnp.asarray(np.log(rng.uniform(0.5, 1.0, size=(b, t, hk))), dtype) if gating else None
    return q, k, v, log_g


def rel_err(x, y) -> float:
    """||x - y|| / ||y|| in float64."""
    x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
    return float(np.linalg.norm(x - y) / max(np.linalg.norm(y), 1e-30))


def max_err(x, y) -> float:
    return float(np.max(np.abs(np.asarray(x, np.float64) - np.asarray(y, np.float64))))


NAN_INPUTS = ("q", "k", "v", "log_g")


def nan_input_rows(attend, q, k, v, log_g, name: str, at: int) -> tuple[bool, list[int]]:
    """(ok, the NaN rows seen in kv head 0's query heads of batch 0): whether y =
    attend(q, k, v, log_g) with a NaN put into input `name` at token `at` of batch 0, kv
    head 0, has the NaN rows of the contract (`sympow_attention`'s docstring), never
    zeros: q's makes row `at` of query head 0 NaN and no other; k's, log_g's and v's make
    every row from `at` on NaN in that kv head's query heads, k's and log_g's none before
    it (v's may: a masked weight's 0 times NaN); the other heads and batch rows stay
    finite."""
    inputs = {"q": q, "k": k, "v": v, "log_g": log_g}
    inputs[name] = inputs[name].at[0, at, 0].set(jnp.nan)
    y = np.asarray(attend(*inputs.values()), np.float32)
    group = q.shape[2] // k.shape[2]  # kv head 0's query heads
    nan_rows = np.isnan(y[0, :, :group]).any(axis=(1, 2))
    if name == "q":
        ok = np.flatnonzero(nan_rows).tolist() == [at] and bool(np.isnan(y[0, at, 0]).all())
    else:
        ok = bool(nan_rows[at:].all()) and (name == "v" or not nan_rows[:at].any())
    ok = ok and bool(np.isfinite(y[0, :, group:]).all() and np.isfinite(y[1:]).all())
    return ok, np.flatnonzero(nan_rows).tolist()


# Gate histories that expose decays formed as differences of large cumulative sums
# (docs/design.md §4): fp32 error against a float64 oracle must stay at fp32 level.
PRECISION_KINDS = ("strong_every_97", "offset_at_start", "gates_x200", "ordinary")
TOL_PRECISION = 1e-5
# dq and dk under gates x200 are bound by conditioning, not by the decays: rows that attend
# to one or two keys get dl = w (dO . V_j - dO . Y) with Y ~ V_j, a cancellation that p / s
# amplifies. The float32 specification itself errs 2e-6 to 1.2e-5 there across seeds, so the
# bound is this many times its error (and at least TOL_PRECISION).
K_CONDITIONING = 3.0


def precision_inputs(kind: str, *, t: int = 900, h: int = 2, d: int = 64, seed: int = 0):
    """Float32 (q, k, v, log_g, dy), B = 1, of a gate history: 'strong_every_97' (log_g =
    -1e4 every 97 tokens, 0 elsewhere), 'offset_at_start' (ordinary gates, -5000 at t = 0),
    'gates_x200' (ordinary gates times 200: |G| up to ~3e4), 'ordinary' (sigmoid(3 + 2N))."""
    if kind not in PRECISION_KINDS:
        raise ValueError(f"kind must be one of {PRECISION_KINDS}, got {kind!r}")
    rng = np.random.default_rng(seed)
    q, k, v, dy = (rng.normal(size=(1, t, h, d)) for _ in range(4))
    log_g = np.log(1 / (1 + np.exp(-rng.normal(3.0, 2.0, size=(1, t, h)))))
    if kind == "strong_every_97":
        log_g = np.where(np.arange(t)[None, :, None] % 97 == 0, -1e4, 0.0) * np.ones_like(log_g)
    elif kind == "offset_at_start":
        log_g[:, 0] -= 5000
    elif kind == "gates_x200":
        log_g = log_g * 200
    f32 = lambda x: jnp.asarray(x, jnp.float32)  # noqa: E731
    return f32(q), f32(k), f32(v), f32(log_g), f32(dy)


@contextlib.contextmanager
def float64_enabled():
    """jax_enable_x64 inside the block (restored after), so float64 arrays exist there."""
    previous = jax.config.jax_enable_x64
    jax.config.update("jax_enable_x64", True)
    try:
        yield
    finally:
        jax.config.update("jax_enable_x64", previous)


def float64_oracle(q, k, v, log_g, dy, *, p: int):
    """y and its gradients computed in float64 (returned as float32 arrays): the quadratic
    specification up to T = 2048, the blocked attention form (local decay sums, its own vjp)
    beyond. log_g None: ungated (no dlog_g)."""
    impl = "reference" if q.shape[1] <= 2048 else ("xla", "attention")
    with float64_enabled():
        f64 = lambda x: None if x is None else jnp.asarray(x, jnp.float64)  # noqa: E731
        return forward_and_grads(f64(q), f64(k), f64(v), f64(log_g), f64(dy), impl=impl,
                                 p=p, chunk=None)


def check_precision(kind: str, impl: Impl, *, p: int = 2, chunk: int | None = None, **shape):
    """Rows (output, err, bound, ok): the fp32 implementation against the float64 oracle on
    a `precision_inputs` history; relative L2 error <= TOL_PRECISION (dq and dk under
    'gates_x200': <= K_CONDITIONING x the float32 specification's own error)."""
    args = precision_inputs(kind, **shape)
    gold = float64_oracle(*args, p=p)
    test = forward_and_grads(*args, impl=impl, p=p, chunk=chunk)
    spec = (forward_and_grads(*args, impl="reference", p=p, chunk=None)
            if kind == "gates_x200" else None)
    rows = []
    for name in OUTPUTS:
        err = rel_err(test[name], gold[name])
        bound = TOL_PRECISION
        if spec is not None and name in ("dq", "dk"):
            bound = max(bound, K_CONDITIONING * rel_err(spec[name], gold[name]))
        rows.append((name, err, bound, bool(np.all(np.isfinite(np.asarray(test[name]))))
                     and err <= bound))
    return rows


# Decoding: the fused step against the specification (`reference.recurrent_step`) over
# chained steps from a prompt's state. The state is float32 whatever the inputs' dtype, so
# it must agree to float32 rounding per its largest entry (entries near zero are
# cancellations of larger terms); y is rounded to the inputs' dtype.
TOL_DECODE_STATE = 2e-6
TOL_DECODE_Y = {"float32": 1e-5, "bfloat16": 1e-2}


def decode_prompt_state(rng, *, b: int, hk: int, d: int, e: int, p: int, length: int = 12):
    """The float32 state after `length` random tokens: its denominators are sums of many
    non-negative terms, so the readout is well conditioned, as after a real prefill."""
    q = jnp.asarray(rng.normal(size=(b, length, hk, d)), jnp.float32)
    k = jnp.asarray(rng.normal(size=(b, length, hk, d)) / np.sqrt(d), jnp.float32)
    v = jnp.asarray(rng.normal(size=(b, length, hk, e)), jnp.float32)
    log_g = jnp.asarray(np.log(rng.uniform(0.8, 1.0, size=(b, length, hk))), jnp.float32)
    return reference.recurrent_form(q, k, v, log_g, p)[1]


def decode_token(rng, *, b: int, hq: int, hk: int, d: int, e: int, dtype, gated: bool = True):
    """(q [B, Hq, D], k [B, Hk, D], v [B, Hk, E], log_g [B, Hk] or None) of one token."""
    q = jnp.asarray(rng.normal(size=(b, hq, d)), dtype)
    k = jnp.asarray(rng.normal(size=(b, hk, d)) / np.sqrt(d), dtype)
    v = jnp.asarray(rng.normal(size=(b, hk, e)), dtype)
    log_g = jnp.asarray(np.log(rng.uniform(0.8, 1.0, size=(b, hk))), jnp.float32)
    return q, k, v, log_g if gated else None


def check_decode(rng, impl: str, *, b: int, hq: int, hk: int, d: int, e: int, p: int,
                 dtype: str, gated: bool = True, steps: int = 3, prompt: int = 12):
    """Rows (output, err, tol, ok) of `decode_step(impl=impl)` against impl='reference' in
    float64 (the same inputs and prompt state, exactly widened) after `steps` chained tokens:
    s and z by max error per the largest entry, y by max error per the largest |y|
    (TOL_DECODE_Y of the dtype). A float32 specification is no gold at that tolerance: its
    readout, a sum over F features with cancellation, errs ~1e-5 of max |y| itself at p = 4
    (an H100's kernel 1.39e-5 from it at one seed, 2026-11-27, docs/kernels.md)."""
    shape = dict(b=b, hk=hk, d=d, e=e)
    got = decode_prompt_state(rng, p=p, length=prompt, **shape)
    with float64_enabled():
        want = jax.tree.map(lambda x: jnp.asarray(x, jnp.float64), got)
    worst = {"s": 0.0, "z": 0.0, "y": 0.0}
    finite = True
    for _ in range(steps):
        token = decode_token(rng, hq=hq, dtype=jnp.dtype(dtype), gated=gated, **shape)
        got, y = decode_step(got, *token, p=p, impl=impl)
        with float64_enabled():
            wide = [None if x is None else jnp.asarray(x, jnp.float64) for x in token]
            want, y_ref = decode_step(want, *wide, p=p, impl="reference")
        if y.shape != (b, hq, e) or y.dtype != jnp.dtype(dtype):
            raise AssertionError(f"y is {y.shape} {y.dtype}, want {(b, hq, e)} {dtype}")
        for name, x, x_ref in (("s", got.s, want.s), ("z", got.z, want.z), ("y", y, y_ref)):
            finite &= bool(np.all(np.isfinite(np.asarray(x, np.float32))))
            scale = max(float(jnp.max(jnp.abs(x_ref.astype(jnp.float32)))), 1e-30)
            worst[name] = max(worst[name], max_err(x, x_ref) / scale)
    tols = {"s": TOL_DECODE_STATE, "z": TOL_DECODE_STATE, "y": TOL_DECODE_Y[dtype]}
    return [(name, err, tols[name], finite and err <= tols[name]) for name, err in worst.items()]
