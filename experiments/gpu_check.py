"""Correctness of the kernel tiers on GPU (compiled, no interpreter): the checks of the
tests (sympow.attention.testing) at sizes up to T=16384, for every kernel row of the
implementation table (`implementations.kernel_rows()`: the Hopper tier's and the portable
Pallas tier's chunked algorithm and attention form), or those of --impls / --algorithms.
Prints a table; exits non-zero on a failure.

  PYTHONPATH=. python3 experiments/gpu_check.py [--quick] [--json=$OUT/gpu_check.json]
  PYTHONPATH=. python3 experiments/gpu_check.py --only=random --seed=S --cases=NAME  # one again
  PYTHONPATH=. python3 experiments/gpu_check.py --only=random --seed=1,2,3 --cases=NAME

bf16: gold/ref/test of sympow.attention.testing (gold = the float32 oracle: the quadratic
reference up to T=2048, the blocked pure-JAX attention form above). float32: relative L2
error. Adversarial inputs (zero queries/keys, norms 1e3, log_g = 0 and -1e4, T=1): finite
outputs and gradients that match the oracle; a NaN in q, k, v or log_g: NaN rows as the
contract says, never zeros.
"""

import functools
import json
import sys
import time
import traceback
import warnings
import zlib
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from absl import app, flags  # noqa: E402
from state_checks import check_state_kernels  # noqa: E402  (experiments/state_checks.py, beside this script)

_QUICK = flags.DEFINE_bool("quick", False, "a few small cases only")
_MAX_T = flags.DEFINE_integer("max_t", 16384, "skip cases longer than this")
_JSON = flags.DEFINE_string("json", None, "write the rows here as JSON")
_IMPLS = flags.DEFINE_list("impls", None, "backends to check (default: every kernel tier)")
_ALGORITHMS = flags.DEFINE_list("algorithms", None, "algorithms to check (default: all)")
_CASES = flags.DEFINE_string("cases", None, "only cases whose name contains this")
_SEED = flags.DEFINE_list("seed", None, "the inputs' seeds (default: the clock); printed and "
                          "recorded, each check's inputs drawn from its seed and the check's "
                          "name alone, so --seed and --cases rerun one check; several "
                          "seeds run every selected check once per seed")
_ONLY = flags.DEFINE_enum("only", "all",
                          ["all", "random", "edge", "precision", "decode", "primitives",
                           "rotary"],
                          "random: the CASES; edge: T=1 and the adversarial inputs; "
                          "precision: fp32 against float64 on the gate histories of "
                          "testing.PRECISION_KINDS; decode: the fused decoding step "
                          "against the specification (DECODE_CASES), the decode_linear "
                          "kernel against its reference (LINEAR_CASES) and GPT-2 small's "
                          "fused decoding against its blocks' (MODEL_CASES); primitives: "
                          "the Hopper attention kernels (forward, backward) against the "
                          "portable ones and its state kernels against their definitions; "
                          "rotary: the learned-rotary kernels (sympow.layers.rotary_kernel) "
                          "against their specification (ROTARY_CASES)")

BOTH = ("chunked", "attention")
# (case kwargs, dtypes, algorithms); Case defaults: p=2, d=e=16, hq=hk=2, b=2, chunk=16, gating.
CASES = [
    (dict(t=45, d=32, e=32), ("float32", "bfloat16"), BOTH),
    (dict(t=45), ("float32", "bfloat16"), BOTH),
    (dict(t=1), ("float32", "bfloat16"), BOTH),
    (dict(t=1000, d=32, e=32, hq=4, hk=2, chunk=128, gating=False), ("float32", "bfloat16"),
     BOTH),
    (dict(t=1024, d=64, e=64, hq=8, hk=8, chunk=256), ("float32", "bfloat16"), BOTH),
    (dict(t=777, d=64, e=64, hq=6, hk=2, chunk=64), ("bfloat16",), BOTH),
    (dict(t=2048, d=128, e=128, hq=4, hk=4, b=1, chunk=256), ("float32", "bfloat16"), BOTH),
    (dict(t=1024, p=4, d=16, e=64, hq=4, hk=2, chunk=64), ("float32", "bfloat16"), BOTH),
    (dict(t=512, p=4, d=32, e=32, hq=2, hk=2, b=1, chunk=128), ("float32", "bfloat16"), BOTH),
    (dict(t=16384, d=64, e=64, hq=4, hk=4, b=1, chunk=256), ("bfloat16",), BOTH),
    # The Hopper tier's square-layout states (p = 2, d = 64, bf16, chunks of a multiple of
    # 128): grouped heads with T not a multiple of the chunk; values padded to 64.
    (dict(t=1500, d=64, e=64, hq=6, hk=2, chunk=128), ("bfloat16",), ("chunked",)),
    (dict(t=600, d=64, e=32, hq=2, hk=1, chunk=256, gating=False), ("bfloat16",), ("chunked",)),
    # The attention form only: shapes whose chunked states do not fit (p = 4 at d = 64, as in
    # the papers; p = 6), and the widest heads.
    (dict(t=4096, p=4, d=64, e=64, hq=4, hk=4, b=1), ("float32", "bfloat16"), ("attention",)),
    (dict(t=1000, p=6, d=32, e=32, hq=4, hk=2), ("float32", "bfloat16"), ("attention",)),
    (dict(t=512, d=256, e=256, hq=2, hk=2, b=1), ("float32", "bfloat16"), ("attention",)),
]
QUICK = [0, 2, 4, 6, 7]
# --only=decode: (b, hq, hk, d, e, p) of decode_step(impl='pallas'), both dtypes, gated and
# not: GPT-2 small's heads at B = 1 and 16, grouped heads, R padded, p = 4.
DECODE_CASES = [(1, 12, 12, 64, 64, 2), (16, 12, 12, 64, 64, 2), (2, 4, 2, 16, 16, 2),
                (1, 3, 1, 8, 32, 2), (1, 12, 12, 32, 64, 4), (4, 8, 8, 16, 128, 4)]
# --only=decode, the products of the fused decoding step (sympow.layers.decode_linear): (rows,
# K, N, LayerNorm, GELU, residual): GPT-2 small's four products at 1, 16 and 64 rows, and 5
# rows with K read in blocks of 64.
LINEAR_CASES = [(1, 768, 2336, True, False, False), (1, 768, 768, False, False, True),
                (1, 768, 3072, True, True, False), (1, 3072, 768, False, False, True),
                (16, 3072, 768, False, False, True), (64, 768, 3072, True, True, True),
                (5, 192, 48, True, False, True)]
# --only=decode, GPT-2 small (2 of its layers) decoding 8 tokens after a 40-token prompt with
# the fused step against the blocks' step: (variant, batch).
# --only=rotary: (b, t, h, hk, d) of rotary_kernel.rotate, both dtypes: GPT-2 small's queries
# at 65,536 tokens, grouped heads with rows not a multiple of the block, the widest heads.
ROTARY_CASES = [(1, 65536, 12, 12, 64), (2, 1000, 6, 2, 64), (3, 45, 4, 4, 128),
                (1, 300, 2, 1, 16)]
MODEL_CASES = [("conformal", 1), ("conformal", 5), ("softmax", 1), ("sympow", 16)]
# --only=primitives: (b, hq, hk, n, c, d, e, p, gates) of the Hopper attention forward against
# the portable one; gates 'ordinary', 'strong' (-1e4 every 97 tokens, 0 elsewhere), 'full'
# (-1e4 everywhere), 'none' (0).
PRIMITIVE_CASES = [
    (1, 2, 2, 1, 128, 64, 64, 2, "ordinary"), (2, 4, 2, 2, 512, 64, 64, 2, "ordinary"),
    (1, 2, 2, 1, 1024, 64, 64, 2, "strong"), (1, 4, 4, 3, 512, 64, 64, 2, "full"),
    (1, 2, 1, 1, 4096, 64, 64, 4, "ordinary"), (1, 2, 2, 1, 2048, 128, 128, 2, "none"),
    (1, 2, 2, 1, 1024, 64, 128, 2, "ordinary"),
    # many diagonal blocks (256): a rare wrong straddle sum showed in this shape only
    (2, 8, 8, 4, 256, 64, 64, 2, "ordinary")]
# --only=primitives, the Hopper state kernels against their definitions: (b, hq, hk, n, c, e,
# log-scales) with log-scales 'ordinary' (uniform in [-2, 0]) or 'full' (-5000: every row
# scaled to 0).
STATE_CASES = [(1, 2, 2, 1, 128, 64, "ordinary"), (2, 4, 2, 3, 512, 64, "ordinary"),
               (1, 2, 1, 2, 256, 128, "ordinary"), (1, 2, 2, 2, 256, 64, "full"),
               (1, 2, 2, 4, 256, 64, "ordinary")]  # N = 4: four chunks a program
ADVERSARIAL = ("zero_queries", "zero_keys", "huge_norms", "large_scales", "small_scales",
               "no_decay", "full_decay")
# (gate history, T) of --only=precision: issue 11's three histories and 65,536 ordinary gates.
PRECISION = [("strong_every_97", 900), ("offset_at_start", 900), ("gates_x200", 900),
             ("ordinary", 65536)]


def check_case(testing, impl, case, dtype: str, kind: str, rng):
    """Rows (output, err, note, ok) of one case of the shared checks (fp32 or bf16)."""
    gold = "reference" if case.t <= 2048 else ("xla", "attention")
    args = testing.inputs(case, rng, kind=kind)
    # T=1 and adversarial inputs: some gradients are 0 up to rounding (y = v).
    floor = 1e-2 if kind == "random" and case.t > 1 else 1.0
    if dtype == "bfloat16":
        return [(n, e_t, f"ref {e_r:.2e} bound {b:.2e}", ok) for n, e_t, e_r, b, ok
                in testing.check_bf16(case, args, impl, gold_impl=gold, floor=floor)]
    # adversarial float32 cases against float64: there the float32 specification's zero
    # gradients are noise of ~1e-4 of the scale, so only float64 measures the kernels' own
    # (the portable tier's under full decay were up to 1.4e-3 on an H100 until dden came
    # from the kernels' arithmetic, `attention_kernels.row_dots`; <= 7e-12 since: the
    # float64 oracle's own noise)
    adversarial = kind != "random"
    return [(n, e, f"tol {tol:.0e}{' (float64 gold)' if adversarial else ''}", ok)
            for n, e, tol, ok in testing.check_fp32(
                case, args, impl, gold_impl=None if adversarial else gold, floor=floor)]


def check_nan_input(testing, impl, case, dtype: str, name: str, rng):
    """One row: y's NaN rows for a NaN in input `name` at token 150 (`testing.nan_input_rows`:
    NaN rows as the contract says, never zeros); err is the count of NaN rows seen."""
    from sympow.attention import sympow_attention

    q, k, v, log_g, _ = testing.inputs(case, rng)
    backend, algorithm = impl
    ok, rows = testing.nan_input_rows(
        lambda *x: sympow_attention(*x, p=case.p, chunk_size=case.chunk, impl=backend,
                                    algorithm=algorithm),
        *(x.astype(dtype) for x in (q, k, v)), log_g, name, 150)
    seen = f"NaN rows {rows[0]}-{rows[-1]}" if rows else "no NaN row"
    return [("y", float(len(rows)), seen, ok)]


def check_precision(testing, impl, history: str, t: int):
    """Rows (output, err, note, ok) of fp32 against float64 on one gate history."""
    return [(n, e, f"bound {b:.1e}", ok) for n, e, b, ok in testing.check_precision(
        history, impl, chunk=128 if impl[1] == "chunked" else None, t=t)]


def check_decode(testing, rng, **case):
    """Rows (output, err, note, ok) of the fused decoding step against the specification."""
    return [(n, e, f"tol {tol:.0e}", ok)
            for n, e, tol, ok in testing.check_decode(rng, "pallas", **case)]


def check_linear(rng, dtype: str, rows, k, n, norm, gelu, residual):
    """Rows (output, err, note, ok) of the decode_linear kernel against its reference."""
    import jax
    import jax.numpy as jnp

    from sympow.layers.decode_linear import LayerNormWeights, linear, linear_reference

    draw = lambda *shape, scale=1.0: jnp.asarray(  # noqa: E731
        scale * rng.standard_normal(shape), jnp.float32)
    x, wt = draw(rows, k).astype(dtype), draw(n, k, scale=k ** -0.5).astype(dtype)
    kw = dict(b=draw(n), gelu=gelu,
              norm=LayerNormWeights(1 + draw(k, scale=0.1), draw(k, scale=0.1), 1e-5)
              if norm else None, residual=draw(rows, n).astype(dtype) if residual else None)
    got = jax.jit(lambda x, wt: linear(x, wt, **kw, out_dtype=jnp.float32))(x, wt)
    with jax.default_matmul_precision("highest"):
        want = linear_reference(x, wt, **kw, out_dtype=jnp.float32)
    err = float(jnp.linalg.norm(got - want) / jnp.linalg.norm(want))
    tol = 1e-5 if dtype == "float32" else 2e-3  # bf16: the normalized x rounds to bf16
    return [("y", err, f"tol {tol:.0e}", err < tol)]


def check_rotary(rng, dtype: str, b: int, t: int, h: int, hk: int, d: int):
    """Rows (output, err, note, ok) of the learned-rotary kernels against their
    specification: x' and the cotangents of x and mu, relative L2 errors, in both layouts;
    then with a bias [H, D] added as the rows load (outputs ending in _b; its cotangent
    dbias). mu grows as the layers' does (beta in (0, 2) summed over the tokens, up to ~1e5
    at 65,536)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from sympow.layers import rotary_kernel

    x = jnp.asarray(rng.standard_normal((b, t, h, d)), dtype)
    mu = jnp.asarray(np.cumsum(rng.uniform(0, 2, (b, t, hk)), axis=1), jnp.float32)
    dy = jnp.asarray(rng.standard_normal((b, t, h, d)), dtype)
    bias = jnp.asarray(rng.standard_normal((h, d)), jnp.float32)

    @functools.partial(jax.jit, static_argnums=0)
    def run(fn, x, mu, dy, bias):
        if bias is None:
            y, vjp = jax.vjp(lambda x, mu: fn(x, mu, base=65536.0), x, mu)
        else:
            y, vjp = jax.vjp(lambda x, mu, bias: fn(x, mu, base=65536.0, bias=bias), x, mu,
                             bias)
        return (y, *vjp(dy))

    # bf16 outputs: the same float32 rotation rounded once (cos and sin may differ in an
    # ulp); float32 and every mu cotangent: float32 sums in another order. dbias is the
    # kernel's float32 sum of dx before dx is rounded (either dtype): its row reports
    # max |error| / (1e-5 sum |dx|), cos and sin erring by <= 2^-20.5 a term.
    tols = (4e-3, 4e-3, 1e-4, 1.0) if dtype == "bfloat16" else (1e-5, 1e-5, 1e-4, 1.0)
    unit = 1e-5

    def dbias_err(got, want, dx):
        bound = unit * np.abs(np.asarray(dx, np.float64)).sum(axis=(0, 1))
        return float(np.max(np.abs(np.asarray(got, np.float64) - np.asarray(want)) / bound))

    rows = []
    for shift in (None, bias):
        want = run(rotary_kernel.rotate_reference, x, mu, dy, shift)
        for layout in rotary_kernel.LAYOUTS:  # outputs of the 'heads' layout end in _h
            got = run(functools.partial(rotary_kernel.rotate, layout=layout), x, mu, dy, shift)
            suffix = "_h" * (layout == "heads") + "_b" * (shift is not None)
            names = ("y", "dx", "dmu", "dbias")[:len(got)]
            for name, a, c, tol in zip(names, got, want, tols[:len(got)], strict=True):
                a, c = np.asarray(a, np.float64), np.asarray(c, np.float64)
                err = float(np.linalg.norm(a - c) / max(np.linalg.norm(c), 1e-30))
                if name == "dbias":
                    err = dbias_err(a, c, want[1])
                rows.append((name + suffix, err, f"tol {tol:g}",
                             bool(np.all(np.isfinite(a))) and err <= tol))
    # q (x, biased) and k [B, T, Hk, D] (unbiased) rotated together, several kv heads a
    # program (outputs ending in _t): against the specification array by array
    k = jnp.asarray(rng.standard_normal((b, t, hk, d)), dtype)
    dk = jnp.asarray(rng.standard_normal((b, t, hk, d)), dtype)
    kv_heads = max(n for n in (1, 2, 3, 4) if hk % n == 0)

    @functools.partial(jax.jit, static_argnums=0)
    def run_together(fn, xs, mu, dys, biases):
        ys, vjp = jax.vjp(fn, xs, mu, biases)
        return (ys, *vjp(dys))

    def separately(xs, mu, biases):
        return tuple(rotary_kernel.rotate_reference(x, mu, base=65536.0, bias=bias)
                     for x, bias in zip(xs, biases, strict=True))

    want = run_together(separately, (x, k), mu, (dy, dk), (bias, None))
    for layout in rotary_kernel.LAYOUTS:
        got = run_together(functools.partial(
            lambda xs, mu, biases, layout: rotary_kernel.rotate_together(
                xs, mu, base=65536.0, biases=biases, layout=layout, kv_heads=kv_heads),
            layout=layout), (x, k), mu, (dy, dk), (bias, None))
        pairs = [("y", got[0][0], want[0][0], tols[0]), ("yk", got[0][1], want[0][1], tols[0]),
                 ("dx", got[1][0], want[1][0], tols[1]), ("dk", got[1][1], want[1][1], tols[1]),
                 ("dmu", got[2], want[2], tols[2]), ("dbias", got[3][0], want[3][0], tols[3])]
        for name, a, c, tol in pairs:
            a, c = np.asarray(a, np.float64), np.asarray(c, np.float64)
            err = float(np.linalg.norm(a - c) / max(np.linalg.norm(c), 1e-30))
            if name == "dbias":
                err = dbias_err(a, c, want[1][0])
            rows.append((name + "_h" * (layout == "heads") + "_t", err,
                         f"tol {tol:g}, kv_heads {kv_heads}",
                         bool(np.all(np.isfinite(a))) and err <= tol))
    return rows


def check_fused_model(rng, dtype: str, variant: str, batch: int):
    """Rows (output, err, note, ok): logits of 8 fused decoding steps of GPT-2 small's
    first 2 layers against the blocks' own steps (same prompt, same teacher-forced
    tokens), under float32 matmuls for dtype float32."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from sympow.layers import GPT, GPTConfig, decode_step
    from sympow.layers.fused_decode import decode_weights
    from sympow.train.model import gpt_config

    extra = {} if variant == "softmax" else {"p": 2}
    config = gpt_config(GPTConfig.preset(variant, "small", n_layer=2, dtype=dtype,
                                         max_length=64, **extra).__dict__)
    graphdef, weights = nnx.split(GPT(config, rngs=nnx.Rngs(int(rng.integers(1 << 30)))))
    toks = jnp.asarray(rng.integers(0, 50257, (batch, 48)), jnp.int32)

    @functools.partial(jax.jit, static_argnums=2)
    def run(weights, toks, fused):
        model = nnx.merge(graphdef, weights)
        packed = decode_weights(model) if fused else None
        _, cache = model.prefill(toks[:, :40], max_length=64, last_only=True)

        def step(cache, token):
            logits, cache = decode_step(model, token, cache, weights=packed)
            return cache, logits

        return jax.lax.scan(step, cache, toks[:, 40:].T)[1]  # [8, B, V]

    with jax.default_matmul_precision("highest" if dtype == "float32" else "default"):
        got, want = run(weights, toks, True), run(weights, toks, False)
    err = float(jnp.max(jnp.abs(got - want)) / jnp.max(jnp.abs(want)))
    tol = 1e-5 if dtype == "float32" else 3e-2  # bf16: the residual stream rounds apart
    return [("logits", err, f"tol {tol:.0e}", err < tol)]


def check_primitive(rng, b, hq, hk, n, c, d, e, p, gates):
    """Rows (output, err, note, ok): the Hopper attention kernels against the portable ones
    on the same bf16 inputs (the same functions): the forward's y = o / den, den e^m and m
    (the Hopper forward's shift: at least the portable kernels' exact row max, above it by
    at most `weights.SEPARABLE_SPREAD` log2 units), and the backward's dq, dk, dv
    and gate cotangent da under random cotangents of o e^m and den e^m (each side's
    cotangents of o and den scaled by its own e^m: the kernels' o and den may differ by
    e^(m2 - m1), their products with e^m not)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from sympow.attention.mosaic_gpu import vjps as hopper
    from sympow.attention.mosaic_gpu import weights
    from sympow.attention.pallas import vjps as portable
    from sympow.attention.pallas.plan import make_form_plan

    q, k = (rng.normal(size=(b, h, n, c, d)) / d ** 0.5 for h in (hq, hk))
    v = rng.normal(size=(b, hk, n, c, e))
    a = {"ordinary": np.log(1 / (1 + np.exp(-rng.normal(3.0, 2.0, size=(b, hk, n, c))))),
         "strong": np.where(np.arange(c) % 97 == 0, -1e4, 0.0) * np.ones((b, hk, n, c)),
         "full": np.full((b, hk, n, c), -1e4), "none": np.zeros((b, hk, n, c))}[gates]
    q, k, v = (jnp.asarray(x, jnp.bfloat16) for x in (q, k, v))
    a = jnp.asarray(a, jnp.float32)
    do = jnp.asarray(rng.normal(size=(b, hq, n, c, e)), jnp.float32)
    dden = jnp.asarray(rng.normal(size=(b, hq, n, c)), jnp.float32)
    plan = make_form_plan(p, d, e, c, "bfloat16", False)
    assert hopper.unsupported(plan) is None, hopper.unsupported(plan)

    @jax.jit
    def run(q, k, v, a, do, dden):
        forwards = [jax.vjp(lambda *x, f=attention: f(plan, *x), q, k, v, a)
                    for attention in (portable.attention, hopper.attention)]
        m_exact = forwards[0][0][2]
        outs = []
        for (o, den, m), vjp in forwards:
            ratio = jnp.exp(m - m_exact)  # cotangents of o e^m and den e^m, as e^(m_exact)
            outs.append(((o, den, m), vjp((do * ratio[..., None], dden * ratio,
                                           jnp.zeros_like(dden)))))
        return outs

    ((o1, den1, m1), grads1), ((o2, den2, m2), grads2) = jax.tree.map(
        lambda x: np.asarray(x, np.float64), run(q, k, v, a, do, dden))
    rel = lambda x, y: float(np.linalg.norm(x - y) / max(np.linalg.norm(y), 1e-30))  # noqa: E731
    finite = lambda *xs: all(np.all(np.isfinite(x)) for x in xs)  # noqa: E731
    y1, y2 = o1 / den1[..., None], o2 / den2[..., None]
    t1, t2 = den1 * np.exp(m1), den2 * np.exp(m2)
    # m: not below the exact max (1e-5 relative), at most the spread above it
    below = float(np.max((m1 - m2) / np.maximum(1.0, np.abs(m1))))
    above = float(np.max(m2 - m1))
    spread = weights.SEPARABLE_SPREAD * np.log(2.0)
    rows = [("y", rel(y2, y1), "tol 1e-2", finite(y2) and rel(y2, y1) <= 1e-2),
            ("den", rel(t2, t1), "tol 1e-4 (den e^m)", finite(t2) and rel(t2, t1) <= 1e-4),
            ("m", max(below, 0.0), f"below exact <= 1e-5, above {above:.3g} <= {spread:.3g}",
             bool(finite(m2) and below <= 1e-5 and above <= spread + 1e-4))]
    for name, x, y in zip(("dq", "dk", "dv", "da"), grads2, grads1, strict=True):
        rows.append((name, rel(x, y), "tol 3e-2", finite(x) and rel(x, y) <= 3e-2))
    return rows


def main(argv):
    del argv
    import jax

    from sympow.attention import testing

    print(f"jax {jax.__version__}, devices {jax.devices()}, backend {jax.default_backend()}")
    results, failures = [], 0
    seeds = [int(time.time())] if _SEED.value is None else [int(s) for s in _SEED.value]
    print(f"seeds {seeds}")
    checks = [(*check, seed) for seed in seeds for check in selected_checks(testing, seed)]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for impl, name, dtype, kind, run, seed in checks:
            start = time.time()
            try:
                got = run()
            except Exception:  # noqa: BLE001  (report every case, then fail)
                traceback.print_exc()
                got = [("error", float("nan"), "exception", False)]
            for output, err, note, ok in got:
                failures += not ok
                label = "/".join(impl)  # backend/algorithm
                results.append(dict(impl=label, case=name, dtype=dtype, kind=kind,
                                    output=output, err=err, note=note, ok=ok, seed=seed,
                                    seconds=round(time.time() - start, 1)))
                print(f"{label:16s} {name:42s} {dtype:8s} {kind:12s} {output:6s} {err:9.2e} "
                      f"{note:28s} {'ok' if ok else 'FAIL'}" + f"  seed {seed}" * (len(seeds) > 1),
                      flush=True)
    triton_warnings = [str(w.message) for w in caught if "Triton" in str(w.message)]
    print(f"Triton warnings that escaped the filter: {len(triton_warnings)}")
    print(f"other warnings: {sorted({str(w.message)[:100] for w in caught})[:10]}")
    if _JSON.value:
        Path(_JSON.value).write_text(json.dumps(results, indent=1))
    print(f"{len(results) - failures}/{len(results)} checks passed")
    sys.exit(1 if failures or triton_warnings else 0)


def selected_checks(testing, seed):
    """The checks the flags select, their inputs drawn from `seed`: (impl, case name, dtype,
    kind, run() -> rows (output, err, note, ok))."""
    import numpy as np

    from sympow.attention import implementations

    def rng(*name):  # one generator per check, from the seed and the check's name
        return np.random.default_rng([seed, zlib.crc32("/".join(map(str, name)).encode())])

    selected = [CASES[i] for i in QUICK] if _QUICK.value else CASES
    for impl in _IMPLS.value or ():
        implementations.check_impl(impl)
    for algorithm in _ALGORITHMS.value or ():
        implementations.check_impl(None, algorithm)
    rows = [(backend, algorithm) for algorithm, backend in implementations.kernel_rows()
            if backend in (_IMPLS.value or (backend,))
            and algorithm in (_ALGORITHMS.value or (algorithm,))]
    jobs = [((backend, algorithm), testing.Case(**kw), dt, "random")
            for kw, dts, algorithms in selected for dt in dts
            for backend, algorithm in rows if algorithm in algorithms]
    if _ONLY.value == "edge":
        jobs = [job for job in jobs if job[1].t == 1]
    if _ONLY.value != "random":
        jobs += [(impl, testing.Case(t=300, d=64, e=64, hq=4, hk=2, chunk=128), dtype, kind)
                 for impl in rows for kind in ADVERSARIAL for dtype in ("float32", "bfloat16")]
    # Each check: (impl, case name, dtype, kind, run() -> rows (output, err, note, ok)).
    checks = [(impl, case.name, dtype, kind,
               functools.partial(check_case, testing, impl, case, dtype, kind,
                                 rng(*impl, case.name, dtype, kind)))
              for impl, case, dtype, kind in jobs if case.t <= _MAX_T.value]
    if _ONLY.value in ("all", "edge"):  # a NaN input gives NaN rows, never zeros
        nan_case = testing.Case(t=300, d=64, e=64, hq=4, hk=2, chunk=128)
        checks += [(impl, nan_case.name, dtype, f"nan_{name}",
                    functools.partial(check_nan_input, testing, impl, nan_case, dtype, name,
                                      rng(*impl, dtype, name)))
                   for impl in rows for dtype in ("float32", "bfloat16")
                   for name in testing.NAN_INPUTS]
    if _ONLY.value == "precision":
        checks = [(impl, f"{history}_t{t}", "float32", "precision",
                   functools.partial(check_precision, testing, impl, history, t))
                  for impl in rows for history, t in PRECISION]
    if _ONLY.value == "decode":
        checks = [(("pallas", "decode"), f"b{b}_h{hq}x{hk}_d{d}_e{e}_p{p}"
                   f"{'_gated' if gated else ''}", dtype, "decode",
                   functools.partial(check_decode, testing, rng(shape, dtype, gated),
                                     dtype=dtype, gated=gated,
                                     **dict(zip("b hq hk d e p".split(), shape, strict=True))))
                  for shape in DECODE_CASES for b, hq, hk, d, e, p in [shape]
                  for dtype in ("float32", "bfloat16") for gated in (True, False)]
        checks += [(("layers", "decode_linear"), "r{}_k{}_n{}{}{}{}".format(
                    *case[:3], "_ln" * case[3], "_gelu" * case[4], "_res" * case[5]), dtype,
                    "decode", functools.partial(check_linear, rng(case, dtype), dtype, *case))
                   for case in LINEAR_CASES for dtype in ("float32", "bfloat16")]
        checks += [(("layers", "fused_decode"), f"gpt2_2layers_{variant}_b{batch}", dtype,
                    "decode", functools.partial(check_fused_model, rng(variant, batch, dtype),
                                                dtype, variant, batch))
                   for variant, batch in MODEL_CASES for dtype in ("float32", "bfloat16")]
    if _ONLY.value == "primitives":
        checks = [(("mosaic_gpu", "attention"), "b{}_h{}x{}_n{}_c{}_d{}_e{}_p{}_{}".format(
                   *case), "bfloat16", "primitive",
                   functools.partial(check_primitive, rng(case), *case))
                  for case in PRIMITIVE_CASES]
        checks += [(("mosaic_gpu", "states"), "states_b{}_h{}x{}_n{}_c{}_e{}_{}".format(*case),
                    "bfloat16", "primitive",
                    functools.partial(check_state_kernels, rng(case), *case))
                   for case in STATE_CASES]
    if _ONLY.value == "rotary":
        checks = [(("layers", "rotary_kernel"), "b{}_t{}_h{}x{}_d{}".format(*case), dtype,
                   "rotary", functools.partial(check_rotary, rng(case, dtype), dtype, *case))
                  for case in ROTARY_CASES for dtype in ("float32", "bfloat16")]
    if _CASES.value:
        checks = [check for check in checks if _CASES.value in check[1]]
    return checks


if __name__ == "__main__":
    app.run(main)
