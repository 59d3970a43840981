"""Training-context sweep at p = 4: [conformal] Figure 1(a), Figure 3 (and the
introduction of [conformal-article]).

GPT-2 small (12 layers, 12 heads, d_model 768) with softmax / sympow / sympow+gating /
conformal-sympow attention at p = 4, training contexts 1024, 2048, ..., 65536, 524,288 tokens
per batch (512 x 1024 ... 8 x 65536), Adam 6e-4 constant, bf16 compute, 50,000 steps each
([conformal-article]'s "400k documents" = 26.2B tokens), LongCrawl64.

Whole sweep (one command; trains + evaluates every run, writes sweep.csv and sweep.png):

    python experiments/sweep.py --sweep configs/sweep_p4.py --workdir runs/sweep_p4 \
        --set data.path=/path/to/longcrawl64

One run:

    python experiments/train.py --config configs/sweep_p4.py:sympow,context=16384 \
        --workdir runs/sweep_p4/sympow_p4_ctx16384 --config.data.path=/path/to/longcrawl64

get_config arg: variant, ``context=T``, ``steps=N``, ``runlocal``. get_sweep arg:
``variants=softmax+conformal`` (default all four presets; run folders are named
``<preset>_p<p>_ctx<T>``, e.g. ``sympow_gating_p4_ctx4096``), ``contexts=1024+4096``,
``steps=N``, ``runlocal`` (tiny models, contexts 64, 128, 256, 20 steps, the embedded corpus: a
CPU smoke test of the whole pipeline). Citation keys: docs/references.md.

Expected result ([conformal] Figure 1a): final loss vs training context: sympow degrades relative
to softmax as the context grows (mildly at p = 4); sympow+gating closes the gap and
conformal-sympow is lowest, with no degradation up to 65536. Needs 8 H100-class GPUs
(the papers used one node of 8 H100s per run); not reproducible on the embedded corpus, whose
11 training documents cannot fill a 524,288-token batch below context 65536.
"""

from configs import base

CONTEXTS = (1024, 2048, 4096, 8192, 16384, 32768, 65536)
LOCAL_CONTEXTS = (64, 128, 256)


def get_config(arg: str | None = None):
    return base.context_sweep_config(arg, p=4, default_context=4096)


def get_sweep(arg: str | None = None):
    return base.context_sweep(arg, get_config, contexts=CONTEXTS, local_contexts=LOCAL_CONTEXTS)
