"""Quickstart: a tiny GPT that visibly learns on the embedded Jane Austen corpus on a CPU.

2 layers, d_model 128, 4 heads (head dim 32; the size 'tiny' of ``sympow.layers.SIZES``),
p = 2, training context 256, 4 documents x 256 tokens = 1,024 tokens per step, 200 steps of
Adam at 3e-3 after a 20-step warmup (the tiny model and short run want a larger step than the
papers' 6e-4), bf16 compute. Data: the
embedded corpus ``sympow.data.AUSTEN_PATH``. Evaluation: 16 held-out windows of 2,048 tokens.

Launch (the ``make demo`` job trains this config as softmax and as conformal, then overlays
both contextwise curves; experiments/demo.sh):

    python experiments/train.py --config configs/quickstart.py --workdir runs/quickstart/conformal
    python experiments/evaluate.py --workdir runs/quickstart/conformal

Arg: a variant (softmax | sympow | sympow_gating, alias gating | conformal; default
conformal), ``p=4``, ``context=N``, ``steps=N``, ``bytes`` (the byte-level corpus
``data/austen_bytes``, vocabulary 257, 800 steps and 64 evaluation windows by default: what
``make demo`` runs), ``runlocal`` (a ~20-step smoke run), e.g.
``--config configs/quickstart.py:softmax,steps=100``.

Expected result with ``bytes`` (``make demo``, 2-core CPU, jax 0.10.2, 2026-11-23): training
loss 1.815 (softmax) and 1.811 (conformal) nats per byte (``final_loss``), about 65 s per
run; held-out (64 windows of 2,048 bytes) positions 1-2: 3.23 / 3.27, 64-256: 1.87 / 1.86,
beyond the training context (257-2,048): softmax 2.96, conformal 1.85.

Expected result on GPT-2 tokens (2-core CPU, jax 0.10.2, 2026-11-23; the automatic choice runs
the attention form at this context, docs/design.md §5.1): the training loss falls from 10.82
(~ln 50304) to about 6.2 (summary ``final_loss`` 6.243 for conformal, 6.216 for softmax: the
mean of the last 20 steps), about 1 min 50 s per run. Contextwise held-out loss (Persuasion, 16
windows of 2,048 tokens): positions 1-2 8.22 / 8.39 (conformal / softmax), 64-256 6.66 / 6.64,
beyond the training context (257-2,048) 6.58 / 6.60: flat past ~64 positions (200 steps is too
short to learn much use of long context; with 16 windows the curve is noisy below ~64
positions), the two variants within noise, and no rise beyond the training context 256.
"""

from configs import base
from sympow.data import AUSTEN_BYTES_EOT, AUSTEN_BYTES_PATH, AUSTEN_BYTES_VOCAB

BYTE_STEPS = 800


def use_bytes(config) -> None:
    """The byte-level Austen store (vocabulary 257 = 256 bytes + end-of-text): the output
    layer shrinks 200x, so a CPU trains many more tokens in the same time."""
    config.data.path = str(AUSTEN_BYTES_PATH)
    config.data.eot = AUSTEN_BYTES_EOT
    config.model.vocab_size = AUSTEN_BYTES_VOCAB
    config.eval.num_windows = 64  # cheap at this vocabulary: a smoother curve


def get_config(arg: str | None = None):
    args = base.parse_arg(arg, variant="conformal", p=2, context=256, steps=None, bytes=False,
                          runlocal=False)
    if args["steps"] is None:
        args["steps"] = BYTE_STEPS if args["bytes"] else 200
    config = base.get_base_config(
        variant=args["variant"], p=args["p"], context_size=args["context"],
        batch_tokens=4 * args["context"], num_train_steps=args["steps"], size="tiny")
    config.optim.learning_rate = 3e-3
    config.optim.warmup_steps = 20
    config.log_every = 10
    config.checkpoint_every = 50
    config.keep_checkpoint_period = 0
    config.final_loss_steps = 20
    config.eval.length = 8 * args["context"]
    config.eval.num_windows = 16
    config.eval.batch_size = 1
    if args["runlocal"]:
        base.make_runlocal(config, context_size=min(args["context"], 128))
    if args["bytes"]:  # after runlocal, which points at the GPT-2 store
        use_bytes(config)
    return config
