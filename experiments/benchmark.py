"""Time sympow attention (every backend of the implementation table) against cuDNN on GPU.

  PYTHONPATH=. python3 experiments/benchmark.py --out=$OUT          # the sweep
  PYTHONPATH=. python3 experiments/benchmark.py --breakdown         # per-kernel, T=65536 H=8
  PYTHONPATH=. python3 experiments/benchmark.py --breakdown --tier=mosaic_gpu --roofline
  PYTHONPATH=. python3 experiments/benchmark.py --form_variants='','attn_bq=128' --heads=12

Sweep: bf16, B*T = 65536, T in --ts, H in --heads, d = e = 64, p = 2, gating on (sympow),
causal. Each (impl, T, H) runs in its own process, so peak_bytes_in_use is that case's peak
of fwd+bwd (inputs included). Times are medians of --reps runs after warm-up, each ended by
block_until_ready; "pipelined" is fwd + bwd's time a call over --reps calls dispatched back
to back with one wait (the host's dispatch hidden, as inside a model's jit). Writes
benchmark.json and benchmark.png (log-log time vs T) under --out and prints a table with
the ratios to cuDNN of the same run; with --paired also the ratio of the two fwd + bwd
timed in turns in one process (machines drift between processes).
"""

import json
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from absl import app, flags  # noqa: E402
from timing import (  # noqa: E402  (experiments/timing.py, beside this script)
    attention_inputs,
    matmul_rate,
    timed,
    timed_interleaved,
    timed_pipelined,
)

_TS = flags.DEFINE_list("ts", ["1024", "4096", "16384", "65536"], "sequence lengths")
_HEADS = flags.DEFINE_list("heads", ["8", "12"], "head counts")
_IMPLS = flags.DEFINE_list("impls", None, "backends of sympow.attention.IMPLS, each optionally "
                           "with ':algorithm' (e.g. pallas:attention) and '@NAME=value;...' "
                           "settings of the Hopper state primitives (sympow.attention."
                           "mosaic_gpu.states, e.g. @COLUMNS_DTYPE=float32), and "
                           "'cudnn' (default: the kernel rows of the table, cudnn, xla)")
_P = flags.DEFINE_integer("p", 2, "the power of the sympow cases")
_REPS = flags.DEFINE_integer("reps", 20, "timed runs per measurement (median)")
_CHUNK = flags.DEFINE_integer("chunk", None, "sympow chunk size (None: the impl's default)")
_OUT = flags.DEFINE_string("out", None, "directory for benchmark.json / benchmark.png")
_CASE = flags.DEFINE_string("case", None, "internal: impl,T,H of one case (prints JSON)")
_BREAKDOWN = flags.DEFINE_bool("breakdown", False, "per-kernel times at --ts[-1], --heads[0]")
_TIER = flags.DEFINE_enum("tier", "pallas", ["pallas", "mosaic_gpu"],
                          "breakdown: the primitives of this backend")
_ROOFLINE = flags.DEFINE_bool("roofline", False, "breakdown: also time a bf16 matmul and a "
                              "copy, the machine's measured peak and copy rate")
_VARIANTS = flags.DEFINE_list(
    "variants", [""], "breakdown: plan overrides to compare, each 'field=value;...' with "
    "fields of sympow.attention.pallas.plan.Plan (and chunk=)")
_FORM_VARIANTS = flags.DEFINE_list(
    "form_variants", None, "time the attention form under each plan override "
    "('attn_bq=128;attn_bk=64;warps_attn=8', '' for the default) at --ts, --heads[0]")
_XLA_MAX_T = flags.DEFINE_integer("xla_max_t", 16384, "skip impl='xla' above this T")
_TIMEOUT = flags.DEFINE_integer("timeout", 240, "seconds per case process")
_TOKENS = flags.DEFINE_integer("tokens", 65536, "B * T")
_PAIRED = flags.DEFINE_bool("paired", False, "also time each sympow case's fwd + bwd against "
                            "cuDNN's in its own process, the two in turns (`timed_interleaved`)"
                            ": the 'paired' column, a ratio free of the machine's drift")

D = 64


def make_inputs(t: int, h: int, seed: int = 0):
    return attention_inputs(t, h, tokens=_TOKENS.value, seed=seed, d=D)


def attention_fn(impl: str, chunk: int | None = None):
    import jax

    import sympow

    if impl == "cudnn":
        return lambda q, k, v, log_g: jax.nn.dot_product_attention(
            q, k, v, implementation="cudnn", is_causal=True)
    impl, _, settings = impl.partition("@")
    apply_settings(settings)
    backend, _, algorithm = impl.partition(":")
    return lambda q, k, v, log_g: sympow.sympow_attention(
        q, k, v, log_g, p=_P.value, impl=backend, algorithm=algorithm or None,
        chunk_size=chunk or _CHUNK.value)


def apply_settings(settings: str) -> None:
    """'NAME=value;...': module settings of the Hopper state primitives, the variants a
    measurement compares in one run; each value read as its setting's type (bool: true or
    false, int, or str)."""
    from sympow.attention.mosaic_gpu import states

    for name, value in (kv.split("=") for kv in settings.split(";") if kv):
        if not hasattr(states, name):
            raise ValueError(f"--impls: states has no setting {name!r}")
        setattr(states, name, setting_value(name, value, getattr(states, name)))


def setting_value(name: str, value: str, current):
    """value (a string from --impls) as the type of the setting's current value."""
    if isinstance(current, bool):
        if value.lower() not in ("true", "false"):
            raise ValueError(f"--impls: {name} is true or false; got {value!r}")
        return value.lower() == "true"
    if isinstance(current, int):
        if not value.lstrip("-").isdigit():
            raise ValueError(f"--impls: {name} is an integer; got {value!r}")
        return int(value)
    return value


def run_case(impl: str, t: int, h: int, chunk: int | None = None) -> dict:
    import jax

    q, k, v, log_g, ct = make_inputs(t, h)
    f = attention_fn(impl, chunk)
    fwd = jax.jit(f)

    fwd_bwd = fwd_bwd_of(f)
    args = (q, k, v, log_g, ct)
    device = jax.devices()[0]
    base = (device.memory_stats() or {}).get("bytes_in_use", 0)
    jax.block_until_ready(fwd_bwd(*args))
    peak = (device.memory_stats() or {}).get("peak_bytes_in_use", 0)
    result = dict(impl=impl, p=_P.value, t=t, h=h, b=_TOKENS.value // t,
                  fwd_ms=timed(fwd, q, k, v, log_g, reps=_REPS.value),
                  fwd_bwd_ms=timed(fwd_bwd, *args, reps=_REPS.value),
                  fwd_bwd_pipelined_ms=timed_pipelined(fwd_bwd, *args, reps=_REPS.value),
                  peak_gib=peak / 2**30, inputs_gib=base / 2**30, device=device.device_kind,
                  jax=jax.__version__)
    if _PAIRED.value and impl != "cudnn":  # after the peak was read: cuDNN's buffers not in it
        result["paired_ms"], result["paired_cudnn_ms"] = timed_interleaved(
            [(fwd_bwd, args), (fwd_bwd_of(attention_fn("cudnn")), args)], reps=_REPS.value)
    return result


def fwd_bwd_of(f):
    """jit of (q, k, v, log_g, ct) -> the vjp of f at cotangent ct. The cotangent is an
    argument, as in training: closed over, it is a constant that XLA folds through the
    backward's first layout changes at compile time (a 128 MiB float32 constant at
    T = 65,536 until 2026-11-25), which hides their time and skews the peak."""
    import jax

    @jax.jit
    def fwd_bwd(q, k, v, log_g, ct):
        y, vjp = jax.vjp(f, q, k, v, log_g)
        return vjp(ct.astype(y.dtype))

    return fwd_bwd


def override_plans(spec: str, form: bool = False) -> int | None:
    """Apply 'field=value;...' to every Plan the tier makes (of the chunked primitives, or
    of the attention form with form=True); returns chunk= if given."""
    import dataclasses

    from sympow.attention.pallas import attention_form, primitives

    module, attribute = (attention_form, "make_form_plan") if form else (primitives,
                                                                         "make_plan")
    fields = dict(kv.split("=") for kv in spec.split(";") if kv)
    chunk = fields.pop("chunk", None)
    current = getattr(module, attribute)
    base = getattr(current, "__wrapped_base__", current)

    def make_plan(*args):
        plan = base(*args)
        if isinstance(plan, str) or not fields:
            return plan
        return dataclasses.replace(plan, **{k: type(getattr(plan, k))(v) if not isinstance(
            getattr(plan, k), bool) else v == "True" for k, v in fields.items()})

    make_plan.__wrapped_base__ = base
    setattr(module, attribute, make_plan)  # the name the tier's code calls
    return None if chunk is None else int(chunk)


def form_variants(specs: list[str]) -> list[dict]:
    """The attention form at --ts, --heads[0] under each plan override (blocks, warps)."""
    import jax

    rows = []
    for spec in specs:
        jax.clear_caches()
        override_plans(spec, form=True)
        for t in map(int, _TS.value):
            row = dict(spec=spec, **run_case("pallas:attention", t, int(_HEADS.value[0])))
            print(f"form [{spec}] T={t}: fwd {row['fwd_ms']:.2f} ms, fwd+bwd "
                  f"{row['fwd_bwd_ms']:.2f} ms", flush=True)
            rows.append(row)
    return rows


def breakdown(t: int, h: int, spec: str = "") -> dict:
    """fwd and bwd (= fwd+bwd - fwd) of each primitive at one size, with achieved rates."""
    import jax
    import jax.numpy as jnp

    from sympow.attention.api import make_config
    from sympow.attention.chunked import normalize_queries_and_keys, to_chunks
    from sympow.attention.mosaic_gpu import primitives as hopper
    from sympow.attention.mosaic_gpu import states
    from sympow.attention.pallas import primitives

    jax.clear_caches()  # the public API's jit would reuse the previous variant's kernels
    chunk = override_plans(spec) or _CHUNK.value
    tier = _TIER.value
    config = make_config(t, 2, chunk, tier, "chunked")
    c = config.chunk_size
    q, k, v, log_g, _ = make_inputs(t, h)
    n = t // c
    q, k, _ = normalize_queries_and_keys(q, k)
    qc, kc, vc = (to_chunks(x, n, c) for x in (q, k, v))
    g = jnp.cumsum(to_chunks(log_g, n, c), axis=-1)
    prims = (hopper if tier == "mosaic_gpu" else primitives).primitives(config)
    plan = primitives.make_plan(2, D, D, c, "bfloat16", config.interpret)
    square = tier == "mosaic_gpu" and states.unsupported(config, D, D, c, "bfloat16") is None
    f_dim, b = D * D if square else plan.features, _TOKENS.value // t
    s, z = jax.jit(lambda k, v, g: prims.update_state(k, v, g, p=2))(kc, vc, g)
    s_in, z_in, *_ = jax.jit(prims.prefix_sum)(s, z, g[..., -1])
    o, den, m = jax.jit(lambda *a: prims.attention(*a, p=2))(qc, kc, vc, g)
    state_flop = 2 * b * h * t * f_dim * D  # one [T, F] x [F, E] product per head
    attn_flop = 2 * b * h * t * (c / 2) * 2 * D  # causal QK^T and PV
    state_bytes = b * h * n * f_dim * D * 4
    items = [
        ("attention", lambda *a: prims.attention(*a, p=2), (qc, kc, vc, g), attn_flop, 2.5),
        ("update_state", lambda *a: prims.update_state(*a, p=2), (kc, vc, g), state_flop, 2),
        ("prefix_sum", prims.prefix_sum, (s, z, g[..., -1]), None, None),
        ("query_state", lambda *a: prims.query_state(*a, p=2),
         (qc, s_in, z_in, g, o, den, m), state_flop, 2),
    ]
    print(f"breakdown {tier} [{spec}] T={t} H={h} B={b} C={c} F={f_dim} "
          f"{'square' if square else f'tile={plan.tile}'} states "
          f"{state_bytes / 2**30:.2f} GiB per pass (rates: executed products of this F)")
    rows = []
    for name, fn, args, flop, bwd_factor in items:
        out = jax.eval_shape(fn, *args)
        cts = jax.tree.map(lambda x: jnp.ones(x.shape, x.dtype) * 0.01, out)

        def fb(*a, fn=fn, cts=cts):  # the outputs too: else XLA drops forward kernels
            out, vjp = jax.vjp(fn, *a)  # the backward does not read (update_state's S)
            return out, vjp(cts)

        f_ms = timed(jax.jit(fn), *args, reps=_REPS.value)
        fb_ms = timed(jax.jit(fb), *args, reps=_REPS.value)
        rate = lambda fl, ms: f"{fl / ms / 1e9:6.1f} TFLOP/s" if fl else (  # noqa: E731
            f"{2 * state_bytes / ms / 1e6:6.0f} GB/s")
        print(f"  {name:13s} fwd {f_ms:7.2f} ms ({rate(flop, f_ms)})   bwd {fb_ms - f_ms:7.2f} ms "
              f"({rate(flop and flop * bwd_factor, fb_ms - f_ms)})")
        rows.append(dict(name=name, fwd_ms=f_ms, bwd_ms=fb_ms - f_ms))
    whole = run_case(f"{tier}:chunked", t, h, chunk=c)
    print(f"  whole call    fwd {whole['fwd_ms']:7.2f} ms   fwd+bwd {whole['fwd_bwd_ms']:7.2f} ms",
          flush=True)
    return dict(spec=spec, tier=tier, chunk=c, features=f_dim, rows=rows, whole=whole)


def roofline(n: int = 8192, copy_gib: float = 2.0) -> dict:
    """The machine's measured bf16 matmul rate (`timing.matmul_rate`: [n, n] x [n, n],
    float32 accumulation, by wall time and by kernel time) and copy rate (read + write of a
    copy_gib array), for the rates of the breakdown."""
    import jax
    import jax.numpy as jnp

    row = matmul_rate(n, reps=_REPS.value)
    x = jnp.ones((int(copy_gib * 2**30) // 4,), jnp.float32)
    copy_ms = timed(jax.jit(lambda x: x * 2.0), x, reps=_REPS.value)
    row.update(copy_gbs=2 * x.nbytes / copy_ms / 1e6, copy_gib=copy_gib)
    print(f"roofline: bf16 matmul {row['matmul_tflops']:.0f} TFLOP/s by wall time, "
          f"{row['matmul_kernel_tflops']:.0f} by kernel time ({n}^3), copy "
          f"{row['copy_gbs']:.0f} GB/s ({copy_gib} GiB read + written)", flush=True)
    return row


def impls() -> list[str]:
    """--impls, checked against the implementation table (and 'cudnn', the baseline)."""
    from sympow.attention import implementations

    if _IMPLS.value is None:
        kernels = [f"{backend}:{algorithm}" for algorithm, backend in
                   implementations.kernel_rows("gpu")]
        return [*kernels, "cudnn", "xla"]
    for impl in _IMPLS.value:
        if impl != "cudnn":
            backend, _, algorithm = impl.partition("@")[0].partition(":")
            implementations.check_impl(backend, algorithm or None)
    return list(_IMPLS.value)


def sweep() -> list[dict]:
    results = []
    for h in map(int, _HEADS.value):
        for t in map(int, _TS.value):
            for impl in impls():
                if impl.startswith("xla") and t > _XLA_MAX_T.value:
                    results.append(dict(impl=impl, t=t, h=h, skipped=f"T > {_XLA_MAX_T.value}"))
                    continue
                cmd = [sys.executable, __file__, f"--case={impl},{t},{h}",
                       f"--reps={_REPS.value}", f"--tokens={_TOKENS.value}", f"--p={_P.value}"]
                cmd += [f"--chunk={_CHUNK.value}"] if _CHUNK.value else []
                cmd += ["--paired"] if _PAIRED.value else []
                try:
                    proc = subprocess.run(cmd, capture_output=True, text=True,
                                          timeout=_TIMEOUT.value)
                    line = [x for x in proc.stdout.splitlines() if x.startswith("{")]
                    res = json.loads(line[-1]) if line else dict(
                        impl=impl, t=t, h=h, skipped=proc.stderr.strip().splitlines()[-1][:200])
                except subprocess.TimeoutExpired:
                    res = dict(impl=impl, t=t, h=h, skipped=f"timeout {_TIMEOUT.value}s")
                print(json.dumps(res), flush=True)
                results.append(res)
    return results


def report(results: list[dict]) -> None:
    cudnn = {(r["t"], r["h"]): r for r in results if r["impl"] == "cudnn" and "fwd_ms" in r}
    w = max([16] + [len(r["impl"]) for r in results])
    print(f"\n{'impl':{w}s} {'H':>3s} {'T':>6s} {'fwd ms':>8s} {'fwd+bwd':>8s} {'vs cuDNN':>9s} "
          f"{'pipelined':>9s} {'vs cuDNN':>9s} {'peak GiB':>9s} {'paired':>8s}")
    for r in results:
        if "fwd_ms" not in r:
            print(f"{r['impl']:{w}s} {r['h']:3d} {r['t']:6d}  skipped: {r['skipped']}")
            continue
        base = cudnn.get((r["t"], r["h"]))
        ratio = f"{base['fwd_bwd_ms'] / r['fwd_bwd_ms']:8.2f}x" if base else "       -"
        piped = (f"{base['fwd_bwd_pipelined_ms'] / r['fwd_bwd_pipelined_ms']:8.2f}x" if base
                 else "       -")
        paired = (f"{r['paired_cudnn_ms'] / r['paired_ms']:7.2f}x" if "paired_ms" in r
                  else "       -")
        print(f"{r['impl']:{w}s} {r['h']:3d} {r['t']:6d} {r['fwd_ms']:8.2f} {r['fwd_bwd_ms']:8.2f} "
              f"{ratio} {r['fwd_bwd_pipelined_ms']:9.2f} {piped} {r['peak_gib']:9.2f} {paired}")
    if not _OUT.value:
        return
    out = Path(_OUT.value)
    out.mkdir(parents=True, exist_ok=True)
    (out / "benchmark.json").write_text(json.dumps(results, indent=1))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    heads = sorted({r["h"] for r in results})
    fig, axes = plt.subplots(1, len(heads), figsize=(6 * len(heads), 4.5), squeeze=False)
    for ax, h in zip(axes[0], heads, strict=True):
        for impl in impls():
            pts = sorted((r["t"], r["fwd_ms"], r["fwd_bwd_ms"]) for r in results
                         if r["impl"] == impl and r["h"] == h and "fwd_ms" in r)
            if pts:
                ts, f, fb = zip(*pts, strict=True)
                line, = ax.plot(ts, fb, "o-", label=f"{impl} fwd+bwd")
                ax.plot(ts, f, "x--", color=line.get_color(), label=f"{impl} fwd")
        ax.set(xscale="log", yscale="log", xlabel="T (B*T = 65536)", ylabel="ms",
               title=f"bf16, H={h}, d=64, p={_P.value}, causal")
        ax.legend(fontsize=8)
        ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(out / "benchmark.png", dpi=120)


def main(argv):
    del argv
    if _PAIRED.value:
        import jax

        if jax.default_backend() != "gpu":
            raise ValueError(f"--paired times each case against cuDNN, which needs a GPU; "
                             f"the backend is {jax.default_backend()!r}")
    if _CASE.value:
        impl, t, h = _CASE.value.split(",")
        print(json.dumps(run_case(impl, int(t), int(h))))
    elif _BREAKDOWN.value:
        results = []
        peak = roofline() if _ROOFLINE.value else None
        for spec in _VARIANTS.value:
            try:
                results.append(breakdown(int(_TS.value[-1]), int(_HEADS.value[0]), spec))
            except Exception as err:  # noqa: BLE001  (a variant may not compile)
                print(f"variant [{spec}] failed: {type(err).__name__}: {str(err)[:300]}")
        print("\nvariant                         " + "".join(
            f"{r['name'][:9]:>10s}f{'':>1s}{r['name'][:5]:>6s}b" for r in results[0]["rows"])
            + "   fwd  fwd+bwd" if results else "")
        for res in results:
            print(f"{res['spec'] or 'default':30s} " + "".join(
                f"{r['fwd_ms']:11.2f}{r['bwd_ms']:7.2f}" for r in res["rows"])
                + f" {res['whole']['fwd_ms']:6.2f} {res['whole']['fwd_bwd_ms']:7.2f}")
        if _OUT.value:
            Path(_OUT.value).mkdir(parents=True, exist_ok=True)
            Path(_OUT.value, "breakdown.json").write_text(json.dumps(
                dict(roofline=peak, variants=results), indent=1))
    elif _FORM_VARIANTS.value is not None:
        rows = []
        for spec in _FORM_VARIANTS.value:
            try:
                rows += form_variants([spec])
            except Exception as err:  # noqa: BLE001  (a variant may not compile)
                print(f"form variant [{spec}] failed: {type(err).__name__}: {str(err)[:300]}")
        if _OUT.value:
            Path(_OUT.value).mkdir(parents=True, exist_ok=True)
            Path(_OUT.value, "form_variants.json").write_text(json.dumps(rows, indent=1))
    else:
        report(sweep())


if __name__ == "__main__":
    app.run(main)
