"""GPT-2 small on one GPU: training throughput, decoding and inference, sympow next to softmax.

  PYTHONPATH=. python3 experiments/model_benchmark.py --train=softmax:0:4096,conformal:2:4096 \
      --out=$OUT
  PYTHONPATH=. python3 experiments/model_benchmark.py --train= \
      --decode=conformal:2:1024,conformal:2:65536:16,softmax:0:65536:16 --out=$OUT
  PYTHONPATH=. python3 experiments/model_benchmark.py --train= \
      --forward=sympow:2:16384,conformal:2:16384 --out=$OUT    # [conformal] appendix A.5
  PYTHONPATH=. python3 experiments/model_benchmark.py --train= --startup=conformal:2:4096 \
      --tokens=32768 --out=$OUT   # 8 documents a step: the embedded corpus has 11

Training cases are `variant:p:context` (optionally `:microbatches`): GPT-2 small of that
variant (the papers' settings: bf16 compute, float32 parameters, Adam 6e-4), --tokens tokens
a step (context x documents), --steps steps on the embedded corpus (the 11 training documents
cut into windows of the context, read in order and wrapped around). Reported: the algorithm
the cost model chose for the model's attention call, compile seconds, the median step time
over the steps after the first two (each step waited for: its loss read), tokens/s; then
the same --steps steps once more as trainer.py runs them (dispatched back to back, the
losses read at the end: the host prepares the next step while the GPU runs this one), their
mean step time and tokens/s ("pipelined"), and the same from the first step's end to the
last's ("steady": a long run's rate, without the latency before the first step's first
kernel, which the pipelined mean spreads over --steps steps), and how long each of those
calls took to return to the host ("dispatch_ms": near a step's time where the host waits on
the GPU instead of queueing ahead); the loss of every step of
both passes (must fall and stay finite) and the process's peak device memory.

Decode cases are `variant:p:prompt` (optionally `:batch`, default 1): the same model with
bf16 parameters, `generate` after `batch` prompts of that many corpus tokens for N =
--new_tokens tokens and for 2N, the medians of --reps calls after a compiling one; ms/token
= (generate(2N) - generate(N)) / N, the time of one more step of the whole batch with
everything a call does once taken out (the host's nnx.split of the model and jit dispatch,
the weights' packing, the prefill); tokens/s = batch / that. Also reported: the same call's
time less the prefill over N (`ms_per_token_in_call`, the measure before 2026-11-27), the
time a call spends besides its N steps and its prefill (`call_overhead_ms`), the host's
nnx.split of the model (`split_ms`), the prefill time, the cache bytes and the peak
memory. --decode_impls=reference,pallas times each
sympow case with the jnp decoding step and with the fused kernel (the model's decode_impl;
the prefill is the default choice in both); --decode_steps=blocks,fused times each with the
blocks' own decode and with the fused step of sympow.layers.fused_decode (generate's fused).

Forward cases are `variant:p:T`: inference wall time of the model's forward pass (logits of
--tokens tokens, T-token windows) at bf16 parameters, the median of --reps calls after a
compiling one: [conformal] appendix A.5 reports conformal-sympow's at 16,384 as 1.06x
sympow's.

Start-up cases are `variant:p:context`: `experiments/train.py` launched as a user launches it
(--startup_config, default GPT-2 small's configs/gpt2_context4096.py, at that context and
--tokens tokens a step, 2 steps, the embedded corpus), twice with one fresh compilation cache:
"cold" (nothing cached: parameters built, the step compiled) and "warm" (a relaunch reads the
compiled programs). Reported: seconds from the launch to the first finished step (its line in
metrics.jsonl) and to the process's exit. The CPU demo's:
`--startup=conformal:2:256 --startup_config=configs/quickstart.py:bytes --tokens=1024`.

Each case runs in its own process, so each peak memory is that case's and a case that runs
out of memory is recorded with its error instead of ending the run. Writes
model_benchmark.json under --out and prints one table.
"""

import json
import statistics
import subprocess
import sys
import tempfile
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
_STARTUP = flags.DEFINE_list("startup", [], "start-up cases variant:p:context (train.py)")
_STARTUP_CONFIG = flags.DEFINE_string("startup_config", "configs/gpt2_context4096.py",
                                      "config file[:arg] of the start-up cases (the case "
                                      "adds variant, p and steps=2 to its arg)")
_REPS = flags.DEFINE_integer("reps", 5, "timed calls per forward case, and of prefill and "
                             "generate per decode case (medians)")
_STEPS = flags.DEFINE_integer("steps", 8, "training steps per case")
_TOKENS = flags.DEFINE_integer("tokens", 65536, "tokens per training step")
_NEW_TOKENS = flags.DEFINE_integer("new_tokens", 32, "tokens generated per decode case")
_SIZE = flags.DEFINE_string("size", "small", "model size of sympow.layers.SIZES")
_OUT = flags.DEFINE_string("out", None, "directory for model_benchmark.json")
_TIMEOUT = flags.DEFINE_integer("timeout", 300, "seconds per case process")
_CASE = flags.DEFINE_string("case", None, "internal: kind:variant:p:T[:n] (prints JSON)")
_DECODE_UNROLL = flags.DEFINE_integer("decode_unroll", 1, "decode steps per iteration of "
                                      "generate's device loop (lax.scan unroll)", lower_bound=1)
_DECODE_IMPL = flags.DEFINE_enum("decode_impl", "reference", ["reference", "pallas"],
                                 "internal: the decode_step impl of this decode case")
_DECODE_STEPS = flags.DEFINE_list("decode_steps", ["blocks"],
                                  "steps to time per decode case: blocks (each block's "
                                  "decode), fused (sympow.layers.fused_decode: the blocks' "
                                  "products as fused kernels, B <= 64)")
_DECODE_STEP = flags.DEFINE_enum("decode_step", "blocks", ["blocks", "fused"],
                                 "internal: the step of this decode case")
KINDS = {"train": "microbatches", "decode": "batch", "forward": None,
         "startup": None}  # kind: its 4th field
ROOT = Path(__file__).resolve().parents[1]


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
    # The same steps again as trainer.py runs them: dispatched back to back, the losses read
    # at the end (its log points), so the host prepares a step while the GPU runs the last.
    start = time.perf_counter()
    queued, first_done, dispatch = [], None, []
    for i, (x, y) in enumerate(batches):
        called = time.perf_counter()
        state, metrics = compiled(state, x, y)
        dispatch.append(time.perf_counter() - called)  # ~ a step's time if the host waits
        queued.append(metrics["loss"])
        if i == 1:  # the first step's end, while the second runs
            jax.block_until_ready(queued[0])
            first_done = time.perf_counter()
    losses += [float(v) for v in jax.device_get(queued)]
    end = time.perf_counter()
    pipelined_s = (end - start) / len(batches)
    # the steady state: from the first step's end to the last's, no first-dispatch latency
    steady_s = (end - first_done) / (len(batches) - 1) if len(batches) > 1 else pipelined_s
    finite = all(map(lambda v: v == v and abs(v) != float("inf"), losses))
    return {**case, "kind": "train", "rows": rows, "algorithm": chosen_algorithm(config, t),
            "params": mdef.num_params, "init_s": round(init_s, 2),
            "compile_s": round(compile_s, 1), "step_ms": round(step_s * 1e3, 2),
            "tokens_per_s": round(rows * t / step_s),
            "pipelined_step_ms": round(pipelined_s * 1e3, 2),
            "pipelined_tokens_per_s": round(rows * t / pipelined_s),
            "steady_step_ms": round(steady_s * 1e3, 2),
            "steady_tokens_per_s": round(rows * t / steady_s),
            "dispatch_ms": [round(d * 1e3, 2) for d in dispatch],
            "losses": [round(v, 4) for v in losses],
            "finite": finite, "loss_fell": finite and losses[-1] < losses[0],
            "peak_gib": peak_gib()}




NO_LAUNCH = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast"}


def kernel_launches(hlo: str) -> int:
    """Instructions of the ENTRY computation of an optimized HLO module that run on the
    device (fusions, library calls, copies...): every one but parameters, constants,
    tuples and bitcasts. On GPU, each is (about) one kernel launch."""
    entry = hlo[hlo.index("\nENTRY"):]
    entry = entry[:entry.index("\n}")]
    count = 0
    for line in entry.splitlines()[1:]:
        _, eq, rest = line.partition(" = ")
        if not eq:
            continue
        rest = rest.strip()
        if rest.startswith("("):  # a tuple type: skip to its closing parenthesis
            depth = 0
            for i, ch in enumerate(rest):
                depth += {"(": 1, ")": -1}.get(ch, 0)
                if depth == 0:
                    rest = rest[i + 1:]
                    break
        else:
            rest = rest.partition(" ")[2]
        opcode = rest.strip().partition("(")[0]
        count += opcode not in NO_LAUNCH
    return count


def decode_case(case: dict) -> dict:
    import jax
    import jax.numpy as jnp
    from flax import nnx
    from timing import timed_call  # experiments/timing.py: the case runs as this script

    from sympow.layers import GPT, decode_step, generate
    from sympow.layers.fused_decode import decode_weights

    t, n, batch = case["t"], _NEW_TOKENS.value, case["batch"]
    sympow = case["variant"] != "softmax"
    config = gpt_config(case["variant"], case["p"], param_dtype="bfloat16", max_length=t + n,
                        **({"decode_impl": _DECODE_IMPL.value} if sympow else {}))
    model = GPT(config, rngs=nnx.Rngs(0))
    prompt = jnp.asarray(_take(corpus_windows(t)[0], 0, batch))  # [batch, t], EOT first
    graphdef, weights = nnx.split(model)

    @jax.jit
    def prefill(weights, prompt):
        return nnx.merge(graphdef, weights).prefill(prompt, max_length=t + n, last_only=True)

    prefill_s, (_, cache) = timed_call(prefill, weights, prompt, reps=_REPS.value)
    cache_bytes = sum(x.nbytes for x in jax.tree.leaves(cache.layers))
    cache_spec = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), cache)
    del cache
    fused = _DECODE_STEP.value == "fused"

    def generate_call(new_tokens):
        return timed_call(lambda: generate(model, prompt, new_tokens,
                                           unroll=_DECODE_UNROLL.value, fused=fused),
                          reps=_REPS.value)

    generate_s, tokens = generate_call(n)
    step_s = (generate_call(2 * n)[0] - generate_s) / n  # one more step, nothing fixed
    split_s, _ = timed_call(nnx.split, model, reps=_REPS.value)
    packed = jax.jit(lambda w: decode_weights(nnx.merge(graphdef, w)))(weights) if fused else None
    step = jax.jit(lambda w, packed, token, cache: decode_step(
        nnx.merge(graphdef, w), token, cache, weights=packed))
    launches = kernel_launches(step.lower(weights, packed, tokens[:, -1],
                                          cache_spec).compile().as_text())
    return {**case, "kind": "decode", "new_tokens": n, "decode_step": _DECODE_STEP.value,
            "decode_impl": "kv cache" if case["variant"] == "softmax" else _DECODE_IMPL.value,
            "unroll": _DECODE_UNROLL.value, "launches_per_step": launches,
            "algorithm": chosen_algorithm(config, t, need_state=True),
            "prefill_ms": round(prefill_s * 1e3, 1), "generate_ms": round(generate_s * 1e3, 1),
            "ms_per_token": round(step_s * 1e3, 3), "tokens_per_s": round(batch / step_s, 1),
            "ms_per_token_in_call": round((generate_s - prefill_s) / n * 1e3, 3),
            "call_overhead_ms": round((generate_s - prefill_s - n * step_s) * 1e3, 1),
            "split_ms": round(split_s * 1e3, 2),
            "cache_gb": round(cache_bytes / 1e9, 2), "tokens_shape": list(tokens.shape),
            "peak_gib": peak_gib()}


def forward_case(case: dict) -> dict:
    import jax
    import jax.numpy as jnp
    from flax import nnx
    from timing import timed_call  # experiments/timing.py: the case runs as this script

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
    forward_s, _ = timed_call(forward, weights, inputs, reps=_REPS.value, warmup=0)
    return {**case, "kind": "forward", "rows": rows, "algorithm": chosen_algorithm(config, t),
            "compile_s": round(compile_s, 1), "forward_ms": round(forward_s * 1e3, 2),
            "tokens_per_s": round(rows * t / forward_s), "peak_gib": peak_gib()}


def startup_launch(case: dict, workdir: Path, cache: Path) -> dict:
    """One launch of experiments/train.py: seconds to its first metrics line and to exit."""
    config, _, arg = _STARTUP_CONFIG.value.partition(":")
    p = "" if case["variant"] == "softmax" else f"p={case['p']}"  # softmax takes no p
    arg = ",".join(x for x in (arg, case["variant"], p, "steps=2") if x)
    t = case["t"]
    command = [sys.executable, str(ROOT / "experiments" / "train.py"),
               f"--config={ROOT / config}:{arg}", f"--workdir={workdir}", "--noprogress",
               f"--compilation_cache={cache}", f"--config.data.context_size={t}",
               f"--config.data.docs_per_batch={max(1, _TOKENS.value // t)}", "--config.log_every=1"]
    metrics = workdir / "metrics.jsonl"
    start = time.perf_counter()
    first = None
    with tempfile.TemporaryFile("w+") as log:
        proc = subprocess.Popen(command, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
        while proc.poll() is None and time.perf_counter() - start < _TIMEOUT.value:
            if first is None and metrics.exists() and metrics.read_text().strip():
                first = time.perf_counter() - start
            time.sleep(0.05)
        if proc.poll() is None:
            proc.kill()
            return {"error": f"timeout after {_TIMEOUT.value} s"}
        total = time.perf_counter() - start
        if first is None and metrics.exists() and metrics.read_text().strip():
            first = total  # the step ended within the last poll
        if proc.returncode != 0 or first is None:
            log.seek(0)
            return {"error": " | ".join(log.read().strip().splitlines()[-3:])[-600:]}
    return {"first_step_s": round(first, 1), "exit_s": round(total, 1)}


def _device_name() -> str:
    """The GPU's name from nvidia-smi, else 'cpu': the start-up cases must not initialize a
    backend in this process (it would hold the GPU's memory the launched run needs)."""
    try:
        names = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                               capture_output=True, text=True, timeout=30).stdout.split("\n")
    except (OSError, subprocess.TimeoutExpired):
        return "cpu"
    return names[0].strip() or "cpu"


def startup_case(case: dict) -> dict:
    """Launch-to-first-step, cold and warm (module docstring)."""
    from importlib.metadata import version

    with tempfile.TemporaryDirectory(prefix="sympow-startup-") as tmp:
        cache = Path(tmp) / "cache"
        runs = {name: startup_launch(case, Path(tmp) / name, cache) for name in ("cold", "warm")}
    return {**case, "kind": "startup", "config": _STARTUP_CONFIG.value,
            "tokens": max(1, _TOKENS.value // case["t"]) * case["t"], **runs,
            "algorithm": "", "peak_gib": None, "device": _device_name(),
            "jax": version("jax")}


CASES = {"train": train_case, "decode": decode_case, "forward": forward_case}


def run_isolated(kind: str, spec: str, decode_impl: str = "reference",
                 decode_step: str = "blocks") -> dict:
    """One case in its own process: its JSON line, or its error."""
    command = [sys.executable, __file__, f"--case={kind}:{spec}", f"--steps={_STEPS.value}",
               f"--tokens={_TOKENS.value}", f"--new_tokens={_NEW_TOKENS.value}",
               f"--size={_SIZE.value}", f"--reps={_REPS.value}", f"--decode_impl={decode_impl}",
               f"--decode_step={decode_step}",
               f"--decode_unroll={_DECODE_UNROLL.value}"]
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
            f" B{r['batch']} {r.get('decode_impl', '')} {r.get('decode_step', '')}"
            if r["kind"] == "decode" else "")
        if "error" in r:
            print(f"{name:<26}{'':>10}{'':>17}{'':>10}  ERROR {r['error'][:80]}")
            continue
        value = {"decode": "ms_per_token", "startup": None}.get(r["kind"], "tokens_per_s")
        value = "" if value is None else r[value]
        peak = "" if r["peak_gib"] is None else f"{r['peak_gib']:.1f}"
        if r["kind"] == "train":
            note = (f"{r['losses'][0]:.2f} -> {r['losses'][-1]:.2f} compile {r['compile_s']} s"
                    f", pipelined {r['pipelined_tokens_per_s']} tok/s"
                    f", steady {r['steady_tokens_per_s']} tok/s")
        elif r["kind"] == "decode":
            note = (f"prefill {r['prefill_ms']} ms, cache {r['cache_gb']} GB, "
                    f"{r['tokens_per_s']} tok/s, {r['launches_per_step']} launches/step, "
                    f"in call {r['ms_per_token_in_call']} ms/tok, call overhead "
                    f"{r['call_overhead_ms']} ms (split {r['split_ms']} ms)")
        elif r["kind"] == "startup":
            note = f"launch to first step: cold {r['cold']}, warm {r['warm']}"
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
    cases = (("train", _TRAIN.value), ("decode", _DECODE.value), ("forward", _FORWARD.value),
             ("startup", _STARTUP.value))
    for kind, specs in cases:
        for spec in specs:
            parse_case(spec, kind)  # fail before any run
    bad = sorted(set(_DECODE_IMPLS.value) - {"reference", "pallas"})
    if bad or not _DECODE_IMPLS.value:
        raise ValueError(f"--decode_impls: each of reference, pallas, got {_DECODE_IMPLS.value}")
    if set(_DECODE_STEPS.value) - {"blocks", "fused"} or not _DECODE_STEPS.value:
        raise ValueError(f"--decode_steps: each of blocks, fused, got {_DECODE_STEPS.value}")
    out = Path(_OUT.value) if _OUT.value else None
    if out:
        out.mkdir(parents=True, exist_ok=True)
    for kind, specs in cases:
        for spec in specs:
            sympow_decode = kind == "decode" and not spec.startswith("softmax:")
            variants = [(impl, step)
                        for impl in (_DECODE_IMPLS.value if sympow_decode else ["reference"])
                        for step in (_DECODE_STEPS.value if kind == "decode" else ["blocks"])]
            for impl, step in variants:
                results.append(startup_case(parse_case(spec, kind)) if kind == "startup"
                               else run_isolated(kind, spec, impl, step))
                print(json.dumps(results[-1]), flush=True)
                if out:  # after every case: a run stopped from outside keeps what it measured
                    (out / "model_benchmark.json").write_text(json.dumps(results, indent=1))
    report(results)


if __name__ == "__main__":
    app.run(main)
