"""Training-context sweep at p = 2: [conformal] Figure 1(b), Figure 4 (and the
introduction of [conformal-article]).

As ``configs/sweep_p4.py`` with p = 2 (a 39 MB recurrent state for GPT-2 small) and training
contexts 256, 512, ..., 8192 (2048 x 256 ... 64 x 8192 = 524,288 tokens per batch), 50,000
steps each, LongCrawl64.

Whole sweep:

    python experiments/sweep.py --sweep configs/sweep_p2.py --workdir runs/sweep_p2 \
        --set data.path=/path/to/longcrawl64

One run:

    python experiments/train.py --config configs/sweep_p2.py:gating,context=2048 \
        --workdir runs/sweep_p2/sympow_gating_p2_ctx2048 --config.data.path=/path/to/longcrawl64

CPU smoke of the whole pipeline on the embedded corpus (tiny models, contexts 64-256):

    python experiments/sweep.py --sweep configs/sweep_p2.py:runlocal --workdir runs/sweep_p2_local

Expected result ([conformal] Figure 1b): at p = 2 sympow falls behind softmax already at short
contexts and the gap widens with the context; sympow+gating and conformal-sympow track or beat
softmax at every context, conformal lowest.
"""

from configs import base

CONTEXTS = (256, 512, 1024, 2048, 4096, 8192)
LOCAL_CONTEXTS = (64, 128, 256)


def get_config(arg: str | None = None):
    return base.context_sweep_config(arg, p=2, default_context=1024)


def get_sweep(arg: str | None = None):
    return base.context_sweep(arg, get_config, contexts=CONTEXTS, local_contexts=LOCAL_CONTEXTS)
