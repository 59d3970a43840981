"""GPT-2 small on one GPU: training throughput, decoding and inference, sympow next to softmax.

  PYTHONPATH=. python3 experiments/model_benchmark.py --train=softmax:0:4096,conformal:2:4096 \
      --out=$OUT
  PYTHONPATH=. python3 experiments/model_benchmark.py --train= \
      --decode=conformal:2:1024,conformal:2:65536:16,softmax:0:65536:16 --out=$OUT
  PYTHONPATH=. python3 experiments/model_benchmark.py --train= \
      --forward=sympow:2:16384,conformal:2:16384 --out=$OUT    # [conformal] appendix A.5

Training cases are `variant:p:context` (optionally `:microbatches`): GPT-2 small of that
variant (the papers' settings: bf16 compute, float32 parameters, Adam 6e-4), --tokens tokens
a step (context x documents), --steps steps on the embedded corpus (the 11 training documents
cut into windows of the context, read in order and wrapped around). Reported: the algorithm
the cost model chose for the model's attention call, compile seconds, the median step time
over the steps after the first two, tokens/s, the loss of every step (must fall and stay
finite) and the process's peak device memory.

Decode cases are `variant:p:prompt` (optionally `:batch`, default 1): the same model with
bf16 parameters, `generate` after `batch` prompts of that many corpus tokens for --new_tokens
tokens, timed after a compiling call; ms/token = (generate - prefill) / new_tokens (one step
of the whole batch), tokens/s = batch x new_tokens / (generate - prefill). Reported with the
prefill time, the cache bytes and the peak memory. --decode_impls=reference,pallas times each
sympow case with the jnp decoding step and with the fused kernel (the model's impl='pallas',
whose prefill is the GPU's default kernels too).

Forward cases are `variant:p:T`: inference wall time of the model's forward pass (logits of
--tokens tokens, T-token windows) at bf16 parameters, the median of --reps calls after a
compiling one: [conformal] appendix A.5 reports conformal-sympow's at 16,384 as 1.06x
sympow's.

Each case runs in its own process, so each peak memory is that case's and a case that runs
out of memory is recorded with its error instead of ending the run. Writes
model_benchmark.json under --out and prints one table.
"""

import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from absl import app, flags  # noqa: E402

_TRAIN = flags.DEFINE_list("train", ["softmax:0:4096", "conformal:2:4096"],
                           "training cases variant:p:context[:microbatches]")
_DECODE = flags.DEFINE_list("decode", [], "decode cases variant:p:prompt[:batch]")
_DECODE_IMPLS = flags.DEFINE_list("decode_impls", ["reference"],
                                  "decode_step impls to time per sympow decode case: "
                                  "reference (jnp step), pallas (fused kernel)")
_FORWARD = flags.DEFINE_list("forward", [], "inference forward cases variant:p:T")
_REPS = flags.DEFINE_integer("reps", 5, "timed calls per forward case (median)")
_STEPS = flags.DEFINE_integer("steps", 8, "training steps per case")
_TOKENS = flags.DEFINE_integer("tokens", 65536, "tokens per training step")
_NEW_TOKENS = flags.DEFINE_integer("new_tokens", 32, "tokens generated per decode case")
_SIZE = flags.DEFINE_string("size", "small", "model size of sympow.layers.SIZES")
_OUT = flags.DEFINE_string("out", None, "directory for model_benchmark.json")
_TIMEOUT = flags.DEFINE_integer("timeout", 300, "seconds per case process")
_CASE = flags.DEFINE_string("case", None, "internal: kind:variant:p:T[:n] (prints JSON)")
_DECODE_IMPL = flags.DEFINE_enum("decode_impl", "reference", ["reference", "pallas"],
                                 "internal: the decode_step impl of this decode case")
KINDS = {"train": "microbatches", "decode": "batch", "forward": None}  # kind: 4th field


def parse_case(spec: str, kind: str = "train") -> dict:
    """'variant:p:T[:n]' -> fields (n: a training case's microbatches, a decode case's batch;
    forward cases take none); ValueError naming the spec otherwise."""
    extra = KINDS[kind]
    parts = spec.split(":")
    lengths = (3, 4) if extra else (3,)
    if (len(parts) not in lengths or not all(x.isdigit() for x in parts[1:])
            or int(parts[2]) < 1 or (len(parts) == 4 and int(parts[3]) < 1)):
        form = f"variant:p:T[:{extra}]" if extra else "variant:p:T"
        raise ValueError(f"{kind} case {spec!r}: need {form} with integer p, and positive "
                         "integer T and count (p is ignored for softmax)")
    case = {"variant": parts[0], "p": int(parts[1]), "t": int(parts[2])}
    if extra:
        case[extra] = int(parts[3]) if len(parts) == 4 else 1
    return case


def gpt_config(variant: str, p: int, **overrides):
    from sympow.layers import GPTConfig
    from sympow.train.model import gpt_config as from_mapping

    extra = {} if variant == "softmax" else {"p": p}
    base = GPTConfig.preset(variant, _SIZE.value, dtype="bfloat16", **extra, **overrides)
    return from_mapping(base.__dict__)  # dtype names -> dtypes


def corpus_windows(t: int):
    """(inputs, labels) int32 [W, t]: the embedded training documents cut into windows,
    inputs shifted right with EOT first (the loader's rule)."""
    import numpy as np

    from sympow.data import AUSTEN_PATH, EOT, LongCrawl64

    store = LongCrawl64(AUSTEN_PATH, "train", docs_per_batch=1, context_size=65536,
                        prefetch=0, process_index=0, process_count=1)
    labels = np.concatenate([store[k][1] for k in range(len(store))])  # [docs, 65536]
    labels = labels.reshape(-1, t)
    inputs = np.concatenate([np.full((len(labels), 1), EOT, np.int32), labels[:, :-1]], 1)
    return inputs, labels


def _take(array, start: int, rows: int):
    """rows consecutive rows of array from start, wrapping around."""
    import numpy as np

    return array[(start + np.arange(rows)) % len(array)]


def peak_gib() -> float | None:
    import jax

    stats = jax.devices()[0].memory_stats() or {}
    peak = stats.get("peak_bytes_in_use")
    return None if peak is None else peak / 2**30


def chosen_algorithm(config, t: int, need_state: bool = False) -> str:
    """What the layers run at context t: the cost model's choice (prefill: need_state)."""
    import jax

    from sympow.attention.api import make_config

    if config.attention == "softmax":
        return "cudnn" if jax.default_backend() == "gpu" else "xla"
    head = config.d_model // config.n_head
    return make_config(t, config.p, config.chunk_size, config.impl, config.algorithm,
                       need_state=need_state, widths=(head, head)).algorithm


def train_case(case: dict) -> dict:
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from sympow.layers import GPT
    from sympow.train.model import model_def
    from sympow.train.optim import make_optimizer
    from sympow.train.steps import init_train_state, make_train_step

    t, mb = case["t"], case["microbatches"]
    rows = _TOKENS.value // t
    config = gpt_config(case["variant"], case["p"], max_length=t)
    mdef = model_def(config.__dict__)
    start = time.perf_counter()
    _, params, rest = nnx.split(GPT(config, rngs=nnx.Rngs(0)), nnx.Param, ...)  # eager
    init_s = time.perf_counter() - start
    optimizer, schedule = make_optimizer({"name": "adam", "learning_rate": 6e-4}, _STEPS.value)
    state = init_train_state(params, rest, optimizer, seed=0)
    step = jax.jit(make_train_step(mdef, optimizer, schedule, microbatches=mb),
                   donate_argnums=0)
    inputs, labels = corpus_windows(t)
    batches = [(jnp.asarray(_take(inputs, i, rows)), jnp.asarray(_take(labels, i, rows)))
               for i in range(0, rows * _STEPS.value, rows)]
    start = time.perf_counter()
    compiled = step.lower(state, *batches[0]).compile()
    compile_s = time.perf_counter() - start
    losses, times = [], []
    for x, y in batches:
        start = time.perf_counter()
        state, metrics = compiled(state, x, y)
        losses.append(float(metrics["loss"]))  # the host read waits for the step
        times.append(time.perf_counter() - start)
    step_s = statistics.median(times[2:]) if len(times) > 2 else times[-1]
    finite = all(map(lambda v: v == v and abs(v) != float("inf"), losses))
    return {**case, "kind": "train", "rows": rows, "algorithm": chosen_algorithm(config, t),
            "params": mdef.num_params, "init_s": round(init_s, 2),
            "compile_s": round(compile_s, 1), "step_ms": round(step_s * 1e3, 2),
            "tokens_per_s": round(rows * t / step_s), "losses": [round(v, 4) for v in losses],
            "finite": finite, "loss_fell": finite and losses[-1] < losses[0],
            "peak_gib": peak_gib()}




def decode_case(case: dict) -> dict:
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from sympow.layers import GPT, generate

    t, n, batch = case["t"], _NEW_TOKENS.value, case["batch"]
    fused = case["variant"] != "softmax" and _DECODE_IMPL.value == "pallas"
    config = gpt_config(case["variant"], case["p"], param_dtype="bfloat16", max_length=t + n,
                        **({"impl": "pallas"} if fused else {}))
    model = GPT(config, rngs=nnx.Rngs(0))
    prompt = jnp.asarray(_take(corpus_windows(t)[0], 0, batch))  # [batch, t], EOT first
    graphdef, weights = nnx.split(model)

    @jax.jit
    def prefill(weights, prompt):
        logits, cache = nnx.merge(graphdef, weights).prefill(prompt, max_length=t + n)
        return logits[:, -1], cache

    def timed(fn):
        jax.block_until_ready(fn())  # compiles
        start = time.perf_counter()
        out = jax.block_until_ready(fn())
        return time.perf_counter() - start, out

    prefill_s, (_, cache) = timed(lambda: prefill(weights, prompt))
    cache_bytes = sum(x.nbytes for x in jax.tree.leaves(cache.layers))
    del cache
    generate_s, tokens = timed(lambda: generate(model, prompt, n))
    decode_s = generate_s - prefill_s
    return {**case, "kind": "decode", "new_tokens": n,
            "decode_impl": "kv cache" if case["variant"] == "softmax" else _DECODE_IMPL.value,
            "algorithm": chosen_algorithm(config, t, need_state=True),
            "prefill_ms": round(prefill_s * 1e3, 1), "generate_ms": round(generate_s * 1e3, 1),
            "ms_per_token": round(decode_s / n * 1e3, 3),
            "tokens_per_s": round(batch * n / decode_s, 1),
            "cache_gb": round(cache_bytes / 1e9, 2), "tokens_shape": list(tokens.shape),
            "peak_gib": peak_gib()}


def forward_case(case: dict) -> dict:
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from sympow.layers import GPT

    t = case["t"]
    rows = max(1, _TOKENS.value // t)
    config = gpt_config(case["variant"], case["p"], param_dtype="bfloat16", max_length=t)
    graphdef, weights = nnx.split(GPT(config, rngs=nnx.Rngs(0)))
    inputs = jnp.asarray(_take(corpus_windows(t)[0], 0, rows))  # [rows, t]
    forward = jax.jit(lambda w, x: nnx.merge(graphdef, w)(x))
    start = time.perf_counter()
    jax.block_until_ready(forward(weights, inputs))
    compile_s = time.perf_counter() - start
    times = []
    for _ in range(_REPS.value):
        start = time.perf_counter()
        jax.block_until_ready(forward(weights, inputs))
        times.append(time.perf_counter() - start)
    forward_s = statistics.median(times)
    return {**case, "kind": "forward", "rows": rows, "algorithm": chosen_algorithm(config, t),
            "compile_s": round(compile_s, 1), "forward_ms": round(forward_s * 1e3, 2),
            "tokens_per_s": round(rows * t / forward_s), "peak_gib": peak_gib()}


CASES = {"train": train_case, "decode": decode_case, "forward": forward_case}


def run_isolated(kind: str, spec: str, decode_impl: str = "reference") -> dict:
    """One case in its own process: its JSON line, or its error."""
    command = [sys.executable, __file__, f"--case={kind}:{spec}", f"--steps={_STEPS.value}",
               f"--tokens={_TOKENS.value}", f"--new_tokens={_NEW_TOKENS.value}",
               f"--size={_SIZE.value}", f"--reps={_REPS.value}", f"--decode_impl={decode_impl}"]
    case = {**parse_case(spec, kind), "kind": kind}
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=_TIMEOUT.value)
    except subprocess.TimeoutExpired:
        return {**case, "error": f"timeout after {_TIMEOUT.value} s"}
    for line in reversed(done.stdout.splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
    return {**case, "error": " | ".join(tail)[-600:]}


def report(results: list[dict]) -> None:
    print(f"{'case':<26}{'alg':>10}{'tok/s or ms/tok':>17}{'peak GiB':>10}  losses / note")
    for r in results:
        name = f"{r['kind']} {r['variant']} p{r['p']} T{r['t']}" + (
            f" B{r['batch']} {r.get('decode_impl', '')}" if r["kind"] == "decode" else "")
        if "error" in r:
            print(f"{name:<26}{'':>10}{'':>17}{'':>10}  ERROR {r['error'][:80]}")
            continue
        value = r["ms_per_token"] if r["kind"] == "decode" else r["tokens_per_s"]
        peak = "" if r["peak_gib"] is None else f"{r['peak_gib']:.1f}"
        if r["kind"] == "train":
            note = f"{r['losses'][0]:.2f} -> {r['losses'][-1]:.2f} compile {r['compile_s']} s"
        elif r["kind"] == "decode":
            note = (f"prefill {r['prefill_ms']} ms, cache {r['cache_gb']} GB, "
                    f"{r['tokens_per_s']} tok/s")
        else:
            note = f"forward {r['forward_ms']} ms"
        print(f"{name:<26}{r['algorithm']:>10}{value:>17}{peak:>10}  {note}")


def main(argv):
    del argv
    if _CASE.value:
        kind, spec = _CASE.value.split(":", 1)
        result = CASES[kind](parse_case(spec, kind))
        import jax

        result.update(device=jax.devices()[0].device_kind, jax=jax.__version__)
        print(json.dumps(result))
        return
    results = []
    cases = (("train", _TRAIN.value), ("decode", _DECODE.value), ("forward", _FORWARD.value))
    for kind, specs in cases:
        for spec in specs:
            parse_case(spec, kind)  # fail before any run
    bad = sorted(set(_DECODE_IMPLS.value) - {"reference", "pallas"})
    if bad or not _DECODE_IMPLS.value:
        raise ValueError(f"--decode_impls: each of reference, pallas, got {_DECODE_IMPLS.value}")
    for kind, specs in cases:
        for spec in specs:
            sympow_decode = kind == "decode" and not spec.startswith("softmax:")
            for impl in _DECODE_IMPLS.value if sympow_decode else ["reference"]:
                results.append(run_isolated(kind, spec, impl))
                print(json.dumps(results[-1]), flush=True)
    report(results)
    if _OUT.value:
        out = Path(_OUT.value)
        out.mkdir(parents=True, exist_ok=True)
        (out / "model_benchmark.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    app.run(main)
