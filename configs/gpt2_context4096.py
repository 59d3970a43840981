"""Sympow vs softmax at context 4096: [sympow] §4 (the p table) and §2 (docs/references.md).

GPT-2 small (12 layers, 12 heads, d_model 768, rotary, layernorm after the embedding),
context 4096, 128 documents x 4096 = 524,288 tokens per batch, Adam 6e-4 constant, bf16
compute, 100,000 steps, LongCrawl64. Arg: variant (softmax | sympow | sympow_gating, alias
gating | conformal; default sympow) and ``p=2|4|6`` (default 4), ``steps=N``, ``runlocal``.

    python experiments/train.py --config configs/gpt2_context4096.py:softmax \
        --workdir runs/ctx4096/softmax --config.data.path=/path/to/longcrawl64
    for p in 2 4 6; do
      python experiments/train.py --config configs/gpt2_context4096.py:sympow,p=$p \
          --workdir runs/ctx4096/sympow_p$p --config.data.path=/path/to/longcrawl64
    done

Expected result ([sympow], "relative loss at 100K steps", sympow / softmax): p = 2: 1.03x,
p = 4: 0.98x, p = 6: 0.97x (p = 4 matches the baseline with a 14 GB state). Needs a node of
8 H100-class GPUs; add ``--config.microbatches=2`` (or more) if a step does not fit.
CPU smoke: ``--config configs/gpt2_context4096.py:sympow,runlocal``.
"""

from configs import base


def get_config(arg: str | None = None):
    args = base.parse_arg(arg, variant="sympow", p=4, steps=base.CONTEXT4096_STEPS,
                          runlocal=False)
    config = base.get_base_config(variant=args["variant"], p=args["p"], context_size=4096,
                                  num_train_steps=args["steps"])
    config.eval.length = 4096
    config.eval.num_windows = 256
    if args["runlocal"]:
        base.make_runlocal(config)
    return config
