"""GPT-2 small on one GPU: training throughput and decoding, sympow next to softmax (cuDNN).

  PYTHONPATH=. python3 experiments/model_benchmark.py --train=softmax:0:4096,conformal:2:4096 \
      --out=$OUT
  PYTHONPATH=. python3 experiments/model_benchmark.py --train= \
      --decode=conformal:4:4096,softmax:0:4096 --out=$OUT

Training cases are `variant:p:context` (optionally `:microbatches`): GPT-2 small of that
variant (the papers' settings: bf16 compute, float32 parameters, Adam 6e-4), --tokens tokens
a step (context x documents), --steps steps on the embedded corpus (the 11 training documents
cut into windows of the context, read in order and wrapped around). Reported: the algorithm
the cost model chose for the model's attention call, compile seconds, the median step time
over the steps after the first two, tokens/s, the loss of every step (must fall and stay
finite) and the process's peak device memory.

Decode cases are `variant:p:prompt`: the same model with bf16 parameters, `generate` after a
prompt of that many corpus tokens for --new_tokens tokens, timed after a compiling call;
ms/token = (generate - prefill) / new_tokens. Reported with the prefill time, the cache bytes
and the peak memory.

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
_DECODE = flags.DEFINE_list("decode", [], "decode cases variant:p:prompt")
_STEPS = flags.DEFINE_integer("steps", 8, "training steps per case")
_TOKENS = flags.DEFINE_integer("tokens", 65536, "tokens per training step")
_NEW_TOKENS = flags.DEFINE_integer("new_tokens", 32, "tokens generated per decode case")
_SIZE = flags.DEFINE_string("size", "small", "model size of sympow.layers.SIZES")
_OUT = flags.DEFINE_string("out", None, "directory for model_benchmark.json")
_TIMEOUT = flags.DEFINE_integer("timeout", 300, "seconds per case process")
_CASE = flags.DEFINE_string("case", None, "internal: train|decode:variant:p:T[:mb] (JSON)")

def parse_case(spec: str) -> dict:
    """'variant:p:T[:microbatches]' -> fields; ValueError naming the spec otherwise."""
    parts = spec.split(":")
    if len(parts) not in (3, 4) or not all(x.isdigit() for x in parts[1:]):
        raise ValueError(f"case {spec!r}: need variant:p:T[:microbatches] with integer p, T "
                         "and microbatches (p is ignored for softmax)")
    return {"variant": parts[0], "p": int(parts[1]), "t": int(parts[2]),
            "microbatches": int(parts[3]) if len(parts) == 4 else 1}


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

    t, n = case["t"], _NEW_TOKENS.value
    config = gpt_config(case["variant"], case["p"], param_dtype="bfloat16", max_length=t + n)
    model = GPT(config, rngs=nnx.Rngs(0))
    prompt = jnp.asarray(corpus_windows(65536)[1][:1, :t])  # [1, t]
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
    return {**case, "kind": "decode", "new_tokens": n,
            "algorithm": chosen_algorithm(config, t, need_state=True),
            "prefill_ms": round(prefill_s * 1e3, 1), "generate_ms": round(generate_s * 1e3, 1),
            "ms_per_token": round((generate_s - prefill_s) / n * 1e3, 3),
            "cache_gb": round(cache_bytes / 1e9, 2), "tokens_shape": list(tokens.shape),
            "peak_gib": peak_gib()}


def run_isolated(kind: str, spec: str) -> dict:
    """One case in its own process: its JSON line, or its error."""
    command = [sys.executable, __file__, f"--case={kind}:{spec}", f"--steps={_STEPS.value}",
               f"--tokens={_TOKENS.value}", f"--new_tokens={_NEW_TOKENS.value}",
               f"--size={_SIZE.value}"]
    case = {**parse_case(spec), "kind": kind}
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
        name = f"{r['kind']} {r['variant']} p{r['p']} T{r['t']}"
        if "error" in r:
            print(f"{name:<26}{'':>10}{'':>17}{'':>10}  ERROR {r['error'][:80]}")
            continue
        value = r["tokens_per_s"] if r["kind"] == "train" else r["ms_per_token"]
        peak = "" if r["peak_gib"] is None else f"{r['peak_gib']:.1f}"
        note = (f"{r['losses'][0]:.2f} -> {r['losses'][-1]:.2f} compile {r['compile_s']} s"
                if r["kind"] == "train" else
                f"prefill {r['prefill_ms']} ms, cache {r['cache_gb']} GB")
        print(f"{name:<26}{r['algorithm']:>10}{value:>17}{peak:>10}  {note}")


def main(argv):
    del argv
    if _CASE.value:
        kind, spec = _CASE.value.split(":", 1)
        case = parse_case(spec)
        result = train_case(case) if kind == "train" else decode_case(case)
        import jax

        result.update(device=jax.devices()[0].device_kind, jax=jax.__version__)
        print(json.dumps(result))
        return
    results = []
    for kind, specs in (("train", _TRAIN.value), ("decode", _DECODE.value)):
        for spec in specs:
            parse_case(spec)  # fail before any run
        for spec in specs:
            results.append(run_isolated(kind, spec))
            print(json.dumps(results[-1]), flush=True)
    report(results)
    if _OUT.value:
        out = Path(_OUT.value)
        out.mkdir(parents=True, exist_ok=True)
        (out / "model_benchmark.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    app.run(main)
