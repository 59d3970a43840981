"""Contextwise loss beyond the training context: [conformal] Figure 2 (and the
introduction of [conformal-article]).

GPT-2 small at p = 4 (the p = 4 sweep is the one that reaches 16384), training context 16384
(32 x 16384 = 524,288 tokens per batch), 50,000 steps, then the mean held-out loss at every
position of 65,536-token windows. Arg: variant (sympow | sympow_gating, alias gating |
conformal | softmax; default conformal), ``p=N``, ``steps=N``, ``runlocal``.

    for v in sympow sympow_gating conformal; do
      python experiments/train.py --config configs/contextwise_16k.py:$v \
          --workdir runs/ctx16k/$v --config.data.path=/path/to/longcrawl64
    done
    python experiments/evaluate.py --workdir runs/ctx16k/conformal \
        --compare runs/ctx16k/sympow,runs/ctx16k/sympow_gating --length 65536

Expected result: sympow's loss falls with position up to 16384 and rises sharply beyond it
(no length generalization); sympow+gating keeps falling or stays flat past 16384, and
conformal-sympow is lower still at every position.
"""

from configs import base


def get_config(arg: str | None = None):
    args = base.parse_arg(arg, variant="conformal", p=4, steps=base.SWEEP_STEPS, runlocal=False)
    config = base.get_base_config(variant=args["variant"], p=args["p"], context_size=16384,
                                  num_train_steps=args["steps"])
    config.eval.length = 65536
    config.eval.num_windows = 256
    config.eval.batch_size = 8
    if args["runlocal"]:
        base.make_runlocal(config, context_size=128)
        config.eval.length = 1024
    return config
