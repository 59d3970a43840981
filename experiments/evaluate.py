"""Contextwise loss of trained checkpoints: ``python experiments/evaluate.py --workdir DIR``.

Evaluates the latest checkpoint of the training run in DIR with that run's saved config
(DIR/config.json) on held-out windows, and writes DIR/contextwise.{csv,json,png}: the mean loss
at each position 1..L, plotted against position on a log axis (dashed red: training context).

    --steps all | latest | 1000,2000   checkpoints of DIR to evaluate (one curve each)
    --length N                         window length (any N <= 65536; default config.eval.length)
    --num_windows N                    held-out windows averaged (default config.eval.num_windows)
    --compare DIR2,DIR3                overlay the latest checkpoint of other runs
    --out OUTDIR                       write the files there instead of DIR

The logic lives in ``sympow.train.evaluation``.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # an uninstalled sympow

from absl import app, flags  # noqa: E402

from sympow.train.compilation import define_cache_flag  # noqa: E402

_WORKDIR = flags.DEFINE_string("workdir", None, "training run directory")
_STEPS = flags.DEFINE_string("steps", "latest", "'latest', 'all' or comma-separated steps")
_LENGTH = flags.DEFINE_integer("length", None, "window length (default: config.eval.length)",
                               lower_bound=1)
_NUM_WINDOWS = flags.DEFINE_integer("num_windows", None,
                                    "held-out windows (default: config.eval.num_windows)",
                                    lower_bound=1)
_BATCH_SIZE = flags.DEFINE_integer("batch_size", None,
                                   "windows per jitted call (default: config.eval.batch_size)",
                                   lower_bound=1)
_COMPARE = flags.DEFINE_list("compare", [], "more training workdirs to overlay (latest step)")
_DATA_PATH = flags.DEFINE_string("data_path", None, "held-out store (default: the run's)")
_OUT = flags.DEFINE_string("out", None, "output directory (default: --workdir)")
_TITLE = flags.DEFINE_string("title", None, "plot title")
_COMPILATION_CACHE = define_cache_flag()
flags.mark_flags_as_required(["workdir"])


def main(argv):
    del argv
    from sympow.train.metrics import setup_logging

    setup_logging()
    from sympow.train.compilation import enable_compilation_cache

    enable_compilation_cache(_COMPILATION_CACHE.value)
    from sympow.train import evaluation

    kwargs = dict(length=_LENGTH.value, num_windows=_NUM_WINDOWS.value,
                  batch_size=_BATCH_SIZE.value, data_path=_DATA_PATH.value)
    curves = evaluation.evaluate_workdir(_WORKDIR.value, _STEPS.value, **kwargs)
    length = len(curves[0].losses)
    for other in _COMPARE.value:
        curves += evaluation.evaluate_workdir(other, "latest", **{**kwargs, "length": length})
    paths = evaluation.write_outputs(_OUT.value or _WORKDIR.value, curves, title=_TITLE.value)
    for c in curves:
        train_ctx = (f", mean over 1..{c.train_context}: {c.losses[:c.train_context].mean():.4f}"
                     if c.train_context and c.train_context < len(c.losses) else "")
        print(f"{c.label}: mean loss over 1..{len(c.losses)} = {c.mean:.4f}{train_ctx}, "
              f"at position {len(c.losses)}: {c.losses[-16:].mean():.4f} "
              f"(last 16 positions), {c.num_windows} windows")
        if len(c.losses) >= 256:
            beyond = (f", beyond the training context ({c.train_context + 1}.."
                      f"{len(c.losses)}): {c.band(c.train_context + 1, len(c.losses)):.4f}"
                      if c.train_context and c.train_context < len(c.losses) else "")
            print(f"  positions 1-2: {c.band(1, 2):.4f}, 64-256: {c.band(64, 256):.4f} "
                  f"(context is worth {c.uses_context():.2f} nats){beyond}")
    print("wrote " + ", ".join(str(p) for p in paths.values()))


if __name__ == "__main__":
    app.run(main)
