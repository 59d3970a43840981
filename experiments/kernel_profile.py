"""The GPU kernels of a jitted call, from jax's own profiler: names, counts and times.

  PYTHONPATH=. python3 experiments/kernel_profile.py --decode=conformal:2:1024:1,softmax:0:1024:1 \
      --out=$OUT
  PYTHONPATH=. python3 experiments/kernel_profile.py --decode= \
      --attention=mosaic_gpu:chunked:65536:8 --out=$OUT
  PYTHONPATH=. python3 experiments/kernel_profile.py --decode= \
      --train=conformal:2:4096,softmax:0:4096 --out=$OUT

nsys is not installed on the GPU machine (ncu runs there: experiments/ncu_profile.py);
`jax.profiler.trace` records the device's kernels through CUPTI and
`jax.profiler.ProfileData` reads the trace back, so this runs wherever jax does.

Decode cases `variant:p:prompt[:batch]`: GPT-2 small at bf16 parameters and compute (the
decode benchmark's model), prefilled on random tokens (the step's work does not depend on
them), then a jitted device loop of --steps greedy decode steps (generate's loop) traced
--reps times, with each step of --decode_steps (the blocks' own decode, the fused step).
Training cases `variant:p:T`: one step of GPT-2 small at bf16 compute (Adam, 65,536 tokens
of random ids; the state is not donated, so each traced call starts from the same one);
with --chained, --reps steps as trainer.py runs them (the state donated and passed on, the
steps dispatched back to back, one wait at the end): a call is then a step, and the idle
gaps show what the GPU waits on between steps.
Attention cases `impl:algorithm:T:H`: sympow p = 2 (d = e = 64, bf16, gating, B x T =
65,536) forward + backward, the benchmark's call. Per case: wall ms per call, kernels per
call, the GPU's busy time (kernels' union) and each kernel's count and total time, slowest
first, with an XLA kernel's shapes and source lines (timing.hlo_kernels); the GPU's idle
time between kernels and its longest gaps by the kernels around them; the time by
source file (`timing.time_by_source`). Writes
kernel_profile.json under --out.
"""

import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from absl import app, flags  # noqa: E402
from timing import (  # noqa: E402
    attention_inputs,
    hlo_kernels,
    summarize_kernels,
    time_by_source,
    trace_kernels,
)

_DECODE = flags.DEFINE_list("decode", ["conformal:2:1024:1", "softmax:0:1024:1"],
                            "decode cases variant:p:prompt[:batch]")
_ATTENTION = flags.DEFINE_list("attention", [], "attention cases impl:algorithm:T:H, or "
                               "impl:algorithm:T:H:C with chunk C")
_TRAIN = flags.DEFINE_list("train", [], "training-step cases variant:p:T (GPT-2 small, "
                           "65,536 tokens a step)")
_STEPS = flags.DEFINE_integer("steps", 16, "decode steps per traced call", lower_bound=1)
_DECODE_STEPS = flags.DEFINE_list("decode_steps", ["blocks", "fused"],
                                  "decode steps to profile: blocks (each block's decode), "
                                  "fused (sympow.layers.fused_decode), fused:IMPL (its "
                                  "products by decode_linear's impl IMPL)")
_REPS = flags.DEFINE_integer("reps", 3, "traced calls per case (after a compiling one)")
_CHAINED = flags.DEFINE_bool("chained", False, "training cases: the steps chained and "
                             "dispatched back to back, state donated (as trainer.py)")
_TOP = flags.DEFINE_integer("top", 25, "kernels printed per case")
_SOURCES = flags.DEFINE_integer("sources", 2, "source lines printed per XLA kernel")
_GAPS = flags.DEFINE_integer("gaps", 8, "idle gaps printed per case")
_HLO = flags.DEFINE_string("hlo", "", "when set, each case's optimized HLO is written under "
                            "--out as <this>_<n>.hlo.txt")
_OUT = flags.DEFINE_string("out", None, "directory for kernel_profile.json")


def traced(fn, *args, reps: int, chained: bool = False) -> dict:
    """Kernel summary of `reps` calls of the jitted fn(*args), per call, each XLA kernel with
    its shapes and the source lines of its operations (`hlo_kernels` of the compiled
    module); `chained` as `timing.run_calls`."""
    compiled = fn.lower(*args).compile()
    events, wall_s = trace_kernels(compiled, *args, reps=reps, chained=chained)
    summary = summarize_kernels(events, calls=reps, wall_s=wall_s)
    text = compiled.as_text()
    if _OUT.value and _HLO.value:  # for reading what hlo_kernels does not say
        name = "".join(c if c.isalnum() else "_" for c in _HLO.value)
        Path(_OUT.value).mkdir(parents=True, exist_ok=True)
        (Path(_OUT.value) / f"{name}_{len(list(Path(_OUT.value).glob(name + '_*')))}.hlo.txt"
         ).write_text(text)
    hlo = hlo_kernels(text)
    for kernel in summary["kernels"]:
        kernel.update(hlo.get(kernel["name"], {}))
    summary["by_source"] = time_by_source(summary["kernels"])
    return summary


def decode_case(spec: str, step_name: str) -> dict:
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from sympow.layers import GPT, GPTConfig, decode_step
    from sympow.layers.fused_decode import decode_weights
    from sympow.train.model import gpt_config

    variant, p, t, *batch = spec.split(":")
    t, batch, steps = int(t), int(batch[0]) if batch else 1, _STEPS.value
    extra = {} if variant == "softmax" else {"p": int(p)}
    config = gpt_config(GPTConfig.preset(
        variant, "small", dtype="bfloat16", param_dtype="bfloat16", max_length=t + steps + 1,
        **extra).__dict__)
    graphdef, weights = nnx.split(GPT(config, rngs=nnx.Rngs(0)))
    prompt = jax.random.randint(jax.random.PRNGKey(1), (batch, t), 0, 50257)  # [batch, t]
    prefill = jax.jit(lambda w, x: nnx.merge(graphdef, w).prefill(
        x, max_length=t + steps + 1, last_only=True))
    logits, cache = prefill(weights, prompt)

    fused, _, products = step_name.partition(":")
    fused = fused == "fused"
    packed = jax.jit(lambda w: decode_weights(nnx.merge(graphdef, w)))(weights) if fused else None

    @jax.jit
    def loop(weights, packed, token, cache):  # generate's device loop, greedy
        model = nnx.merge(graphdef, weights)

        def step(carry, _):
            token, cache = carry
            logits, cache = decode_step(model, token, cache, weights=packed,
                                        **({"products": products} if products else {}))
            token = jnp.argmax(logits, axis=-1).astype(jnp.int32)
            return (token, cache), token

        return jax.lax.scan(step, (token, cache), None, length=steps)[1]

    token = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    summary = traced(loop, weights, packed, token, cache, reps=_REPS.value)
    per_step = {key: round(summary[key] / steps, 4) for key in ("wall_ms", "busy_ms")}
    return {"case": spec, "kind": "decode", "decode_step": step_name,
            "steps": steps, "per_step": per_step,
            "kernels_per_step": round(summary["kernels_per_call"] / steps, 1), **summary}


def attention_case(spec: str) -> dict:
    import jax

    import sympow

    impl, algorithm, t, h, *chunk = spec.split(":")
    q, k, v, log_g, ct = attention_inputs(int(t), int(h))
    chunk_size = int(chunk[0]) if chunk else None  # None: the impl's default

    def attention(q, k, v, log_g):
        return sympow.sympow_attention(q, k, v, log_g, p=2, impl=impl,
                                       algorithm=algorithm or None, chunk_size=chunk_size)

    @jax.jit
    def fwd_bwd(q, k, v, log_g, ct):  # ct an argument, as benchmark.run_case has it
        y, vjp = jax.vjp(attention, q, k, v, log_g)
        return vjp(ct.astype(y.dtype))

    return {"case": spec, "kind": "attention",
            **traced(fwd_bwd, q, k, v, log_g, ct, reps=_REPS.value)}


def train_case(spec: str) -> dict:
    """One training step of GPT-2 small (bf16 compute, Adam, 65,536 tokens of random ids;
    the kernels do not depend on the ids), as model_benchmark.py's training cases run it."""
    import jax
    from flax import nnx

    from sympow.layers import GPT, GPTConfig
    from sympow.train.model import gpt_config, model_def
    from sympow.train.optim import make_optimizer
    from sympow.train.steps import init_train_state, make_train_step

    variant, p, t = spec.split(":")
    t = int(t)
    rows = max(1, 65536 // t)
    extra = {} if variant == "softmax" else {"p": int(p)}
    config = gpt_config(GPTConfig.preset(variant, "small", dtype="bfloat16", max_length=t,
                                         **extra).__dict__)
    _, params, rest = nnx.split(GPT(config, rngs=nnx.Rngs(0)), nnx.Param, ...)
    optimizer, schedule = make_optimizer({"name": "adam", "learning_rate": 6e-4}, 100)
    state = init_train_state(params, rest, optimizer, seed=0)
    # traced whole, (state, metrics) out: a loss alone would let XLA drop the backward
    step = jax.jit(make_train_step(model_def(config.__dict__), optimizer, schedule),
                   donate_argnums=(0,) if _CHAINED.value else ())
    ids = jax.random.randint(jax.random.PRNGKey(1), (rows, t + 1), 0, 50257)
    inputs, labels = ids[:, :-1], ids[:, 1:]
    return {"case": spec, "kind": "train", "chained": _CHAINED.value,
            **traced(step, state, inputs, labels, reps=_REPS.value, chained=_CHAINED.value)}


def main(argv):
    del argv
    import jax

    results = []
    for spec in _TRAIN.value:
        results.append(train_case(spec))
    for spec in _DECODE.value:
        for step in _DECODE_STEPS.value:
            results.append(decode_case(spec, step))
    for spec in _ATTENTION.value:
        results.append(attention_case(spec))
    device = jax.devices()[0].device_kind
    for r in results:
        print(f"\n== {r['kind']} {r['case']} {r.get('decode_step', '')} ({device}, jax "
              f"{jax.__version__}): "
              f"{r['wall_ms']:.3f} ms wall per call, {r['kernels_per_call']} kernels, "
              f"GPU busy {r['busy_ms']:.3f} ms" + (
                  f"; per step {r['per_step']['wall_ms']} ms wall, "
                  f"{r['kernels_per_step']} kernels, busy {r['per_step']['busy_ms']} ms"
                  if r["kind"] == "decode" else ""))
        print(f"  GPU idle {r['idle_ms']:.3f} ms a call; longest gaps, by the kernels "
              "around them:")
        for g in r["idle"][:_GAPS.value]:
            print(f"  {g['total_us']:10.1f} us  {g['count']:6.1f}x  after {g['after'][:50]}"
                  f"  before {g['before'][:50]}")
        print("  by source file: " + ", ".join(
            f"{row['source']} {row['total_us'] / 1e3:.2f} ms" for row in r["by_source"][:8]))
        for k in r["kernels"][:_TOP.value]:
            print(f"  {k['total_us']:10.1f} us  {k['count']:6.1f}x  {k['name'][:110]}")
            if "shape" in k:
                print(f"{'':24}{k['shape']} <- {', '.join(k['operands'])}"[:200])
            for where in k.get("sources", [])[:_SOURCES.value]:
                print(f"{'':24}{where[:150]}")
    if _OUT.value:
        out = Path(_OUT.value)
        out.mkdir(parents=True, exist_ok=True)
        (out / "kernel_profile.json").write_text(json.dumps(
            {"device": device, "jax": jax.__version__, "date": time.strftime("%Y-%m-%d"),
             "command": " ".join(sys.argv), "results": results}, indent=1))


if __name__ == "__main__":
    app.run(main)
