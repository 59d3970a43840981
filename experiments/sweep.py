"""Context-size sweep in one command:
``python experiments/sweep.py --sweep configs/sweep_p4.py[:arg] --workdir runs/sweep_p4``.

Trains every run of the sweep file's ``get_sweep(arg)`` (one variant x training context each,
in WORKDIR/<variant>_p<p>_ctx<T>; finished runs are skipped, interrupted ones resumed),
evaluates each on held-out windows of its training context, and writes WORKDIR/sweep.csv and
WORKDIR/sweep.png (final loss vs training context, one line per variant; [conformal] Figure 1
in docs/references.md).

    --set key=value          override a field of every run's config (repeatable), e.g.
                             --set data.path=/path/to/longcrawl64
    --num_train_steps N      shorthand for --set num_train_steps=N
    --eval_windows N         held-out windows per run (default: each config's eval.num_windows)
    --noevaluate             skip the held-out evaluation (plot training loss only)

The logic lives in ``sympow.train.sweep``.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # configs/ and an uninstalled sympow

from absl import app, flags  # noqa: E402

from sympow.train.compilation import define_cache_flag  # noqa: E402

_SWEEP = flags.DEFINE_string("sweep", None, "sweep file configs/<name>.py[:arg] with get_sweep")
_WORKDIR = flags.DEFINE_string("workdir", None, "sweep directory (one subfolder per run)")
_SET = flags.DEFINE_multi_string("set", [], "key=value override for every run")
_STEPS = flags.DEFINE_integer("num_train_steps", None, "training steps of every run")
_EVAL_WINDOWS = flags.DEFINE_integer("eval_windows", None, "held-out windows per run")
_EVALUATE = flags.DEFINE_bool("evaluate", True, "evaluate held-out loss of every run")
_MULTIHOST = flags.DEFINE_bool("multihost", False, "call jax.distributed.initialize()")
_PROGRESS = flags.DEFINE_bool("progress", True, "show progress bars")
_COMPILATION_CACHE = define_cache_flag()
flags.mark_flags_as_required(["sweep", "workdir"])


def main(argv):
    del argv
    from sympow.train.metrics import setup_logging

    setup_logging()
    from sympow.train.compilation import enable_compilation_cache

    enable_compilation_cache(_COMPILATION_CACHE.value)
    import jax

    if _MULTIHOST.value:
        jax.distributed.initialize()
    from sympow.train.sweep import CSV_FILE, PNG_FILE, run_sweep

    overrides = list(_SET.value)
    if _STEPS.value is not None:
        overrides.append(f"num_train_steps={_STEPS.value}")
    rows = run_sweep(_SWEEP.value, _WORKDIR.value, overrides=overrides,
                     evaluate=_EVALUATE.value, eval_windows=_EVAL_WINDOWS.value,
                     progress=_PROGRESS.value)
    for r in rows:
        print(f"{r['variant']:>10} p={r['p']} context {r['context']:>6}: final train loss "
              f"{r['final_loss']:.4f}, held-out {r['heldout_loss']:.4f} ({r['steps']} steps)")
    out = Path(_WORKDIR.value)
    print(f"wrote {out / CSV_FILE}, {out / PNG_FILE}")


if __name__ == "__main__":
    app.run(main)
