"""Figures and tables from finished (or running) training runs:
``python experiments/report.py --runs runs/sweep_p2 --out reports/sweep_p2``.

Each ``--runs`` is a run directory (``experiments/train.py --workdir``) or a folder of them
(a sweep's workdir; one level down); give it several times to report runs of several sweeps
or seeds together. Writes to OUT:

    curves.png            training loss vs tokens seen, every run on one figure (one colour
                          per variant and p, one line style per context and seed)
    relative_loss.csv     sympow-family loss / softmax loss at the same context (and seed),
    relative_loss.md      per variant, p and context; mean, std, min, max over seeds
    final_vs_context.png  final loss vs training context, one line per variant and p

and prints the markdown table. Nothing is trained or evaluated. Examples:

    python experiments/report.py --runs runs/quickstart --out runs/quickstart/report
    python experiments/report.py --runs runs/sweep_p2_seed0 --runs runs/sweep_p2_seed1 \\
        --out reports/p2 --metric heldout_loss --x step --smooth 5

    --x tokens|step          x axis of curves.png (default tokens)
    --smooth N               curves.png: trailing mean over N logged records (default 1)
    --metric final_loss|heldout_loss
                             the loss of the table and of final_vs_context.png: the final
                             training loss (summary.json), or the held-out loss at the
                             training context (from the sweep's sweep.csv or a
                             contextwise.json of experiments/evaluate.py)

The logic lives in ``sympow.train.reports``.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # an uninstalled sympow

from absl import app, flags  # noqa: E402

_RUNS = flags.DEFINE_multi_string("runs", None, "run directory or folder of run directories")
_OUT = flags.DEFINE_string("out", None, "output directory (created if missing)")
_X = flags.DEFINE_enum("x", "tokens", ["tokens", "step"], "x axis of the training curves")
_SMOOTH = flags.DEFINE_integer("smooth", 1, "training curves: mean over N logged records",
                               lower_bound=1)
_METRIC = flags.DEFINE_enum("metric", "final_loss", ["final_loss", "heldout_loss"],
                            "loss of the relative-loss table and the context figure")
_TITLE = flags.DEFINE_string("title", None, "figure title")
flags.mark_flags_as_required(["runs", "out"])


def main(argv):
    del argv
    from sympow.train import reports

    runs = reports.load_runs(_RUNS.value)
    out = Path(_OUT.value)
    out.mkdir(parents=True, exist_ok=True)
    for r in runs:
        print(f"{r.label:>40}: {len(r.steps)} records, step {r.steps[-1]}, final loss "
              f"{r.final_loss:.4f}, held-out {r.heldout_loss:.4f}  ({r.path})")
    paths = [reports.plot_curves(runs, out / reports.CURVES_PNG, x=_X.value,
                                 smooth=_SMOOTH.value, title=_TITLE.value)]
    rows = reports.relative_loss_table(runs, _METRIC.value)
    table = reports.markdown_table(rows, _METRIC.value)
    paths.append(reports.write_table_csv(out / reports.TABLE_CSV, rows))
    (out / reports.TABLE_MD).write_text(table)
    paths.append(out / reports.TABLE_MD)
    paths.append(reports.plot_final_vs_context(runs, out / reports.CONTEXT_PNG,
                                               metric=_METRIC.value, title=_TITLE.value))
    print()
    print(table)
    print("wrote " + ", ".join(str(p) for p in paths))


if __name__ == "__main__":
    app.run(main)
