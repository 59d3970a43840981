"""The papers' orderings at small scale on one GPU: [conformal] Figures 1b and 2 (issue 12).

A model sized so one run takes minutes on an H100: 4 layers, 4 heads of size 64 (d_model
256), the GPT-2 vocabulary; 65,536 tokens per step (docs_per_batch = 65,536 / context), in
the papers' form: Adam 6e-4 constant, no gradient clipping, a gate without bias
(``optim.grad_clip=0``, ``model.gate_bias=None``; configs/base.py), bf16 compute. Data: a
LongCrawl64-layout store with long documents, e.g. the Linux-source subset of
docs/experiments.md (``data/linux_small``); every run of a part reads the same batches.

The study in parts (one sweep directory each, so run names never collide):

    S="--set data.path=data/linux_small"
    # (a) p = 2: the four variants at training contexts 256, 1024, 4096 (seed 0)
    python experiments/sweep.py --sweep configs/study_small.py:part=contexts \
        --workdir runs/study/contexts $S
    # the key comparisons again with seed 1 (softmax and conformal at 1024 and 4096)
    python experiments/sweep.py --sweep configs/study_small.py:part=seeds \
        --workdir runs/study/seeds $S
    # (c) p = 4 at context 1024 (sympow, sympow_gating, conformal)
    python experiments/sweep.py --sweep configs/study_small.py:part=p4 \
        --workdir runs/study/p4 $S
    # the library's two deviations, one run each (conformal, 1024)
    python experiments/sweep.py --sweep configs/study_small.py:part=gate_bias \
        --workdir runs/study/gate_bias $S
    python experiments/sweep.py --sweep configs/study_small.py:part=clip \
        --workdir runs/study/clip $S
    # (b) contextwise held-out loss of the 1024-context runs, to 16,384
    R=runs/study/contexts
    python experiments/evaluate.py --workdir $R/conformal_p2_ctx1024 \
        --compare $R/softmax_ctx1024,$R/sympow_p2_ctx1024,$R/sympow_gating_p2_ctx1024 \
        --length 16384 --num_windows 64 --out runs/study/contextwise
    python experiments/report.py --runs runs/study/contexts --runs runs/study/seeds \
        --runs runs/study/p4 --out runs/study/report

One run: ``python experiments/train.py --config configs/study_small.py:conformal,context=1024
--workdir runs/study/one --config.data.path=data/linux_small``.

get_config arg: variant, ``p=2``, ``context=1024``, ``steps=N`` (default 400: 26.2M tokens),
``seed=0``, ``deviation=none|gate_bias|clip`` (the library's +5 gate bias, or clipping at
1.0), ``runlocal``. get_sweep arg: ``part=contexts|seeds|p4|gate_bias|clip``, ``steps=N``,
``contexts=1024+4096`` and ``variants=softmax+conformal`` (a subset of the part's runs, to
split a part over device calls), ``runlocal`` (the micro model on the embedded corpus,
contexts 64-256: a CPU smoke test).

Expected result ([conformal] Figure 1b, Figure 2): sympow falls behind softmax as the
training context grows; gating closes the gap and conformal-sympow is lowest; past the training
context sympow's loss rises while the gated variants' does not.
"""

from configs import base

CONTEXTS = (256, 1024, 4096)
LOCAL_CONTEXTS = (64, 128, 256)
BATCH_TOKENS = 65_536
STEPS = 400
MODEL = {"n_layer": 4, "n_head": 4, "n_kv_head": 4, "d_model": 256}
EVAL_TOKENS = 262_144  # held-out tokens per run at its training context
DEVIATIONS = ("none", "gate_bias", "clip")
PARTS = {  # part: (variants, contexts, p, seed, deviation)
    "contexts": (("softmax", "sympow", "sympow_gating", "conformal"), CONTEXTS, 2, 0, "none"),
    "seeds": (("softmax", "conformal"), (1024, 4096), 2, 1, "none"),
    "p4": (("sympow", "sympow_gating", "conformal"), (1024,), 4, 0, "none"),
    "gate_bias": (("conformal",), (1024,), 2, 0, "gate_bias"),
    "clip": (("conformal",), (1024,), 2, 0, "clip"),
}


def get_config(arg: str | None = None):
    args = base.parse_arg(arg, variant="conformal", p=2, context=1024, steps=STEPS, seed=0,
                          deviation="none", runlocal=False)
    if args["deviation"] not in DEVIATIONS:
        raise ValueError(f"config arg: deviation {args['deviation']!r} not in {DEVIATIONS}")
    context = int(args["context"])
    config = base.get_base_config(variant=args["variant"], p=args["p"], context_size=context,
                                  batch_tokens=BATCH_TOKENS, num_train_steps=args["steps"])
    config.model.update(MODEL)
    config.seed = int(args["seed"])
    config.model.gate_bias = 5.0 if args["deviation"] == "gate_bias" else None
    config.optim.grad_clip = 1.0 if args["deviation"] == "clip" else 0.0
    config.log_every = 10
    config.checkpoint_every = 200
    config.keep_checkpoint_period = 0
    config.eval.length = context
    config.eval.num_windows = EVAL_TOKENS // context
    config.eval.batch_size = max(1, BATCH_TOKENS // context // 4)
    if args["runlocal"]:
        base.make_runlocal(config, context_size=context if "context=" in (arg or "") else 128)
        config.num_train_steps = args["steps"] if "steps=" in (arg or "") else 20
        config.eval.length = int(config.data.context_size)
    return config


def get_sweep(arg: str | None = None):
    args = base.parse_arg(arg, part="contexts", contexts="", variants="", steps=0,
                          runlocal=False)
    if args["part"] not in PARTS:
        raise ValueError(f"sweep arg: part {args['part']!r} not in {sorted(PARTS)}")
    variants, contexts, p, seed, deviation = PARTS[args["part"]]
    if args["runlocal"]:
        contexts = LOCAL_CONTEXTS[:len(contexts)]
    variants = _subset(args["variants"], variants, str, "variants")
    contexts = _subset(args["contexts"], contexts, int, "contexts")
    extra = f",p={p},seed={seed},deviation={deviation}"
    extra += (",runlocal" if args["runlocal"] else "") + (
        f",steps={args['steps']}" if args["steps"] else "")
    return [get_config(f"{v},context={t}{extra}") for v in variants for t in contexts]


def _subset(chosen, allowed, cast, name):
    """The part's ``allowed`` values named by ``chosen`` ('a+b'; '' = all), in that order."""
    if chosen in ("", None):
        return list(allowed)
    values = [cast(v) for v in str(chosen).split("+")]
    if set(values) - set(allowed):
        raise ValueError(f"sweep arg: {name} {sorted(set(values) - set(allowed))} not in this "
                         f"part's {list(allowed)}")
    return values
