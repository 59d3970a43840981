"""Shared base of every experiment config (not an experiment itself).

Fields of a config (``ml_collections.ConfigDict``; override any with ``--config.a.b=value``):

  variant           the model's ``sympow.layers.PRESETS`` name: 'softmax' | 'sympow' |
                    'sympow_gating' | 'conformal' (the config arg also takes the aliases of
                    ``GPTConfig.preset``, e.g. 'gating', and stores the preset name)
  seed              parameter init seed
  num_train_steps   training steps (``--config.num_train_steps=N`` works for every config)
  model.*           ``sympow.layers.GPTConfig`` fields (dtype names as strings): the preset's
                    attention, gating and rotary, and a ``sympow.layers.SIZES`` entry's
                    n_layer, n_head, n_kv_head, d_model
  model.gate_bias   initial value of the gate's bias b_gamma (gated variants; default 5.0:
                    gamma ~ 0.9933 at init); None = no bias, the papers' gate
                    gamma = sigmoid(W_gamma x): ``--config.model.gate_bias=None`` (the field
                    takes any literal, so also ``=0.0`` or ``=-1``; ``validate`` checks it)
  data.path         a LongCrawl64-layout store; default the embedded Austen corpus
                    (``sympow.data.AUSTEN_PATH``); for the real data set
                    ``--config.data.path=/path/to/longcrawl64`` (the folder holding train.zarr
                    and heldout.zarr)
  data.context_size training context T;  data.docs_per_batch: B (global), tokens/step = B * T
  data.eot          the id that begins every window's inputs (GPT-2's end-of-text, 50256;
                    the byte-level corpus: 256)
  optim.*           Adam(W): learning_rate, b1, b2, eps, weight_decay, grad_clip,
                    schedule ('constant' | 'cosine'), warmup_steps, min_lr_ratio
  microbatches      gradient accumulation slices per step (same update, less memory)
  log_every, checkpoint_every, max_checkpoints, keep_checkpoint_period, final_loss_steps
  max_loss_ratio    stop with an error (like a NaN loss) once a logged loss exceeds this many
                    times the first loss the process logged (after a resume: the first since
                    it): a diverged run fails instead of reporting success (default 10; 0
                    turns the check off)
  eval.*            contextwise evaluation defaults: length, num_windows, batch_size

Paper setting (docs/references.md: [sympow] §2; [conformal] §4): a GPT-2 small (124M) shaped
model (size 'small') with rotary embeddings and a layernorm after the input embedding,
LongCrawl64, 524,288 tokens per batch, bf16 mixed precision (params fp32), Adam with learning
rate 6e-4 and no schedule, no gradient clipping, and a gate without bias. Two of our
defaults deviate from that, each a field: the gate bias starting at +5 (``model.gate_bias``;
None: the papers' form) and gradient clipping at global norm 1.0 (``optim.grad_clip``; 0:
the papers' form, no clipping); both in the papers' form:
``--config.model.gate_bias=None --config.optim.grad_clip=0``. Adam's betas (0.9, 0.999) are
not stated by the papers; they are our choice.

The config arg (after ``:`` in ``--config configs/x.py:ARG``) is a comma-separated list of
``key=value`` items and bare words: a variant name, ``runlocal`` (a tiny smoke version, size
'micro', that runs on a CPU with the embedded corpus in seconds), e.g.
``conformal,p=4,context=1024,runlocal``.

Every field is checked after all overrides (``sympow.train.config.validate``): e.g.
``--config.variant=flash`` or a variant that is not the model's preset is a ValueError
naming the field and the allowed values; choose the variant with the config arg.
"""

from __future__ import annotations

import ast

import ml_collections
from ml_collections import config_dict

from sympow.data import AUSTEN_PATH, EOT
from sympow.layers.model import PRESETS, SIZES, GPTConfig, preset_name

PAPER_SIZE = "small"  # GPT-2 small: 12 layers, 12 heads, d_model 768
RUNLOCAL_SIZE = "micro"  # 2 layers, 2 heads, d_model 64: CPU smoke runs
PAPER_BATCH_TOKENS = 524_288
PAPER_LEARNING_RATE = 6e-4
# [conformal-article] reports the loss "at the end of training on 400k documents": 400,000 x
# 65,536 tokens = 26.2B tokens = 50,000 steps of 524,288 tokens, used at every training context.
SWEEP_STEPS = 50_000
# [sympow] reports "relative loss at 100K steps" at context 4096.
CONTEXT4096_STEPS = 100_000


def variant_name(word: str, what: str = "config arg") -> str:
    """The preset name of a variant word (aliases such as 'gating' allowed); ValueError else."""
    try:
        return preset_name(word)
    except ValueError:
        raise ValueError(f"{what}: variant {word!r} not in {sorted(PRESETS)} (or an alias "
                         "such as 'gating')") from None


def _is_variant(word: str) -> bool:
    try:
        preset_name(word)
    except ValueError:
        return False
    return True


def parse_arg(arg: str | None, **defaults):
    """``'conformal,p=4,runlocal'`` -> dict over ``defaults``' keys (values typed like them).

    Bare words: a variant name or alias sets ``variant`` (to the preset name); ``runlocal``
    sets ``runlocal=True``.
    """
    out = dict(defaults)
    for item in (arg or "").split(","):
        item = item.strip()
        if not item:
            continue
        key, sep, text = item.partition("=")
        if not sep:
            if "variant" in out and _is_variant(item):
                key, value = "variant", item
            elif item in out and isinstance(out[item], bool):
                key, value = item, True
            else:
                raise ValueError(f"config arg: unknown word {item!r} in {arg!r} (variants "
                                 f"{sorted(PRESETS)}, keys {sorted(out)})")
        else:
            if key not in out:
                raise ValueError(f"config arg: unknown key {key!r} in {arg!r} "
                                 f"(keys {sorted(out)})")
            try:
                value = ast.literal_eval(text)
            except (ValueError, SyntaxError):
                value = text
        out[key] = value
    if "variant" in out:
        out["variant"] = variant_name(out["variant"])
    if "p" in out and (not isinstance(out["p"], int) or out["p"] <= 0 or out["p"] % 2):
        raise ValueError(f"config arg: p must be a positive even int, got {out['p']!r}")
    return out


def size_fields(size: str) -> dict[str, int]:
    """``config.model`` fields of a ``sympow.layers.SIZES`` entry, n_kv_head explicit (an int,
    so that ``--config.model.n_kv_head=N`` can override it)."""
    if size not in SIZES:
        raise ValueError(f"size: {size!r} not in {sorted(SIZES)}")
    gpt = GPTConfig(**SIZES[size])
    return {"n_layer": gpt.n_layer, "n_head": gpt.n_head, "n_kv_head": gpt.kv_heads,
            "d_model": gpt.d_model}


def model_config(variant: str, p: int, size: str) -> ml_collections.ConfigDict:
    """``config.model``: ``GPTConfig.preset(variant, size, p=p)`` as GPTConfig fields, with bf16
    compute over fp32 parameters, the gate bias explicit (``GPTConfig.gate_bias``, 5.0) and
    chunk_size / impl / algorithm left to ``sympow.sympow_attention``."""
    return ml_collections.ConfigDict({
        "vocab_size": GPTConfig.vocab_size,  # 50304: GPT-2's 50,257 tokens padded to 64
        **size_fields(size),
        **PRESETS[variant_name(variant)],
        "p": p,
        # Any literal, so that --config.model.gate_bias=None (the papers' bias-free gate)
        # parses: a float field's flag rejects None. validate() checks the value.
        "gate_bias": config_dict.FieldReference(GPTConfig.gate_bias, field_type=object),
        "chunk_size": config_dict.placeholder(int),
        "impl": config_dict.placeholder(str),
        "algorithm": config_dict.placeholder(str),
        "dtype": "bfloat16",
        "param_dtype": "float32",
    })


def get_base_config(*, variant: str = "conformal", p: int = 2, context_size: int = 4096,
                    batch_tokens: int = PAPER_BATCH_TOKENS, num_train_steps: int = 100_000,
                    size: str = PAPER_SIZE, runlocal: bool = False) -> ml_collections.ConfigDict:
    """The paper setup at ``context_size`` (docs_per_batch = batch_tokens / context_size) for
    the preset ``variant`` at the ``sympow.layers.SIZES`` entry ``size``."""
    if batch_tokens % context_size:
        raise ValueError(f"batch_tokens {batch_tokens} is not a multiple of {context_size}")
    config = ml_collections.ConfigDict()
    config.variant = variant_name(variant)
    config.seed = 0
    config.num_train_steps = num_train_steps
    config.model = model_config(variant, p, size)
    config.data = ml_collections.ConfigDict({
        "path": str(AUSTEN_PATH),
        "context_size": context_size,
        "docs_per_batch": batch_tokens // context_size,
        "backend": "auto",
        "prefetch": 2,
        "eot": EOT,
    })
    config.optim = ml_collections.ConfigDict({
        "name": "adam",
        "learning_rate": PAPER_LEARNING_RATE,
        "b1": 0.9,
        "b2": 0.999,
        "eps": 1e-8,
        "weight_decay": 0.0,
        "grad_clip": 1.0,
        "schedule": "constant",
        "warmup_steps": 0,
        "min_lr_ratio": 0.1,
    })
    config.microbatches = 1
    config.log_every = 50
    config.checkpoint_every = 1000
    config.max_checkpoints = 3
    config.keep_checkpoint_period = 10_000  # also keep every 10k steps (for evaluate --steps)
    config.final_loss_steps = 0  # 0: the last 10% of steps
    config.max_loss_ratio = 10.0  # loss > 10x its first value: diverged, stop (0: no check)
    config.eval = ml_collections.ConfigDict({
        "length": 65536,
        "num_windows": 128,
        "batch_size": 8,
    })
    if runlocal:
        make_runlocal(config)
    return config


def make_runlocal(config: ml_collections.ConfigDict, context_size: int | None = None):
    """Shrinks a config in place to a seconds-long CPU smoke run on the embedded corpus."""
    config.model.update(size_fields(RUNLOCAL_SIZE))
    config.data.path = str(AUSTEN_PATH)
    config.data.context_size = context_size or min(int(config.data.context_size), 256)
    config.data.docs_per_batch = 4
    config.num_train_steps = 20
    config.log_every = 5
    config.checkpoint_every = 10
    config.keep_checkpoint_period = 0
    config.eval.length = 2 * int(config.data.context_size)
    config.eval.num_windows = 4
    config.eval.batch_size = 1
    return config


def context_sweep_config(arg: str | None, *, p: int, default_context: int):
    """One run of a training-context sweep ([conformal] §4.1/§4.2): GPT-2 small, p, context T,
    524,288 tokens per batch, SWEEP_STEPS steps, held-out eval at the training context."""
    args = parse_arg(arg, variant="conformal", context=default_context, steps=SWEEP_STEPS,
                     runlocal=False)
    config = get_base_config(variant=args["variant"], p=p, context_size=args["context"],
                             num_train_steps=args["steps"])
    config.eval.length = args["context"]
    config.eval.num_windows = max(8, PAPER_BATCH_TOKENS // args["context"] // 8)
    if args["runlocal"]:
        make_runlocal(config, context_size=args["context"] if "context=" in (arg or "") else 128)
        config.num_train_steps = args["steps"] if "steps=" in (arg or "") else 20
        config.eval.length = int(config.data.context_size)
    return config


def _split_list(value, cast):
    if isinstance(value, (tuple, list)):
        return [cast(v) for v in value]
    return [cast(v) for v in str(value).replace("+", " ").split()]


def context_sweep(arg: str | None, get_config, *, contexts, local_contexts):
    """Configs of every (variant, context) of a sweep; arg: ``variants=a+b``,
    ``contexts=256+512``, ``steps=N``, ``runlocal`` (tiny models on ``local_contexts``)."""
    args = parse_arg(arg, variants="softmax+sympow+sympow_gating+conformal", contexts="",
                     steps=0, runlocal=False)
    variants = [variant_name(v, "sweep arg") for v in _split_list(args["variants"], str)]
    default = local_contexts if args["runlocal"] else contexts
    ctxs = _split_list(args["contexts"], int) if args["contexts"] else list(default)
    extra = (",runlocal" if args["runlocal"] else "") + (
        f",steps={args['steps']}" if args["steps"] else "")
    return [get_config(f"{v},context={t}{extra}") for v in variants for t in ctxs]
