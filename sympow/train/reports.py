"""Reports from training run directories: training curves, relative loss, loss vs context.

Reads what ``sympow.train.trainer.train`` leaves in a run directory (``config.json``,
``metrics.jsonl``, ``summary.json``) and, where one was made, the held-out loss of an
evaluation. Nothing is trained or evaluated here, so a report of finished (or still running)
runs takes seconds; ``experiments/report.py`` is its command line.

- ``plot_curves``: training loss vs tokens seen of several runs on one figure ([conformal]
  Figures 3-4, A.5.2 Training Curves; docs/references.md).
- ``relative_loss_table``: sympow-family loss / softmax loss at the end of training, per p
  and context ([sympow] §4.2, the table of relative loss at 100K steps).
- ``plot_final_vs_context``: final loss vs training context ([conformal] Figure 1), also for
  runs of several sweeps or seeds (``sympow.train.sweep`` plots one sweep's runs).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections import defaultdict
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np

from sympow.train import sweep, tables
from sympow.train.config import CONFIG_FILE
from sympow.train.evaluation import JSON_FILE as CONTEXTWISE_JSON
from sympow.train.metrics import METRICS_FILE, final_loss, final_loss_window, read_metrics
from sympow.train.plots import context_axis, pyplot, save_figure
from sympow.train.trainer import SUMMARY_FILE

CURVES_PNG, TABLE_CSV, TABLE_MD = "curves.png", "relative_loss.csv", "relative_loss.md"
CONTEXT_PNG = "final_vs_context.png"
METRICS = ("final_loss", "heldout_loss")
TABLE_FIELDS = ("variant", "p", "form", "context", "seeds", "loss", "softmax_loss", "ratio",
                "ratio_std", "ratio_min", "ratio_max")


@dataclasses.dataclass(frozen=True, eq=False)  # eq=False: arrays do not compare to a bool
class Run:
    """One training run: its settings, its logged training loss and its final losses.

    ``p`` is None for softmax (its config's p is unused). ``form`` names where the run departs
    from the papers' form (``deviations``; '' for none), so that a deviation is neither pooled
    with the papers' runs as another seed nor drawn in their colour. ``final_loss`` is the summary's
    (mean of the last ``final_loss_steps`` steps), or the same mean over the metrics of a run
    without a summary (still training). ``heldout_loss`` is NaN unless the run was evaluated
    at its training context (``heldout_loss_of``).
    """

    path: Path
    label: str
    variant: str
    p: int | None
    context: int
    seed: int
    form: str
    gated: bool
    steps: np.ndarray  # [records] int: completed updates at each logged record
    tokens: np.ndarray  # [records] float: tokens seen at each record
    loss: np.ndarray  # [records] float: mean training loss since the previous record
    final_loss: float
    heldout_loss: float = math.nan
    devices: int | None = None  # devices the run trained on (its summary), None if unknown

    @property
    def key(self) -> tuple[str, int | None, str]:
        """(variant, p, form): one line or colour of a figure."""
        return self.variant, self.p, self.form


def _name(variant: str, p: int | None, form: str = "") -> str:
    return (variant if p is None else f"{variant} p={p}") + (f" ({form})" if form else "")


def deviations(config: dict) -> str:
    """Where a run's config departs from the papers' training form (configs/base.py): a gate
    bias on a gated model ('gate bias +5') and gradient clipping ('clip 1'), joined by ', ';
    '' for the papers' form. Configs written before these fields count as the papers' form
    only where they say so: a missing field is read as the library default it had."""
    model, optim = config.get("model", {}), config.get("optim", {})
    found = []
    bias = model.get("gate_bias", 5.0)
    if model.get("gating") and bias is not None:
        found.append(f"gate bias {float(bias):+g}")
    clip = float(optim.get("grad_clip", 1.0) or 0.0)
    if clip > 0:
        found.append(f"clip {clip:g}")
    return ", ".join(found)


def _form_parts(form: str, prefix: str = "") -> tuple[str, ...]:
    """The parts of a form (`deviations`) that start with prefix."""
    return tuple(part for part in form.split(", ") if part and part.startswith(prefix))


def _clip_part(form: str) -> str:
    """The optimizer's part of a form (what a softmax baseline can share)."""
    return ", ".join(_form_parts(form, "clip"))


def _read_json(path: Path):
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path}: unreadable ({exc})") from exc


def _same_dir(recorded: str, run_dir: Path) -> bool:
    """A directory recorded in a table is ``run_dir``: the same path, or the same last two
    parts (recorded from another working directory, or the runs moved together)."""
    recorded = Path(recorded)
    return recorded.resolve() == run_dir.resolve() or recorded.parts[-2:] == run_dir.parts[-2:]


def heldout_loss_of(run_dir: Path, context: int) -> float:
    """Held-out loss over windows of the training context, NaN if the run was not evaluated.

    ``run_sweep`` records it only in the sweep's ``sweep.csv`` (the run's parent folder);
    ``experiments/evaluate.py`` writes ``contextwise.json`` (in the run folder, or ``--out``,
    e.g. the parent) whose ``loss_at_train_context`` is the same mean over positions
    1..context. The sweep's value wins; of several evaluated checkpoints, the latest.
    """
    table = run_dir.parent / sweep.CSV_FILE
    if table.is_file():
        for row in sweep.read_csv(table):
            if _same_dir(row["workdir"], run_dir) and math.isfinite(row["heldout_loss"]):
                return row["heldout_loss"]
    best = (-1, math.nan)
    for path in (run_dir / CONTEXTWISE_JSON, run_dir.parent / CONTEXTWISE_JSON):
        for entry in _read_json(path) if path.is_file() else []:
            if (entry.get("workdir") and _same_dir(entry["workdir"], run_dir)
                    and entry.get("train_context") == context
                    and entry.get("length", 0) >= context  # a shorter window is not "at T"
                    and entry.get("loss_at_train_context") is not None):
                best = max(best, (entry.get("step") or 0, entry["loss_at_train_context"]))
    return float(best[1])


def load_run(run_dir: str | os.PathLike, label: str | None = None) -> Run:
    """The run in ``run_dir``; ValueError naming the directory and the file it lacks."""
    run_dir = Path(run_dir)
    for name in (CONFIG_FILE, METRICS_FILE):
        if not (run_dir / name).is_file():
            raise ValueError(f"{run_dir}: no {name} (not a training run directory?)")
    records = [r for r in read_metrics(run_dir) if "step" in r and "loss" in r]
    if not records:
        raise ValueError(f"{run_dir}: no records in {METRICS_FILE} (no step logged yet)")
    config = _read_json(run_dir / CONFIG_FILE)
    model, data = config.get("model", {}), config.get("data", {})
    context = int(data["context_size"])
    variant = config.get("variant") or model.get("attention", "?")
    p = None if model.get("attention") == "softmax" else int(model["p"])
    seed = int(config.get("seed", 0))
    form = deviations(config)
    steps = np.asarray([r["step"] for r in records], np.int64)
    per_step = int(data.get("docs_per_batch", 0)) * context  # older metrics lack "tokens"
    tokens = np.asarray([r.get("tokens", r["step"] * per_step) for r in records], np.float64)
    summary_path = run_dir / SUMMARY_FILE
    summary = _read_json(summary_path) if summary_path.is_file() else None
    if summary is not None:
        final = float(summary["final_loss"])
    else:  # still training: the trainer's own window over what is logged so far
        total = int(config.get("num_train_steps", steps[-1]))
        final = final_loss(records, final_loss_window(config, total))
    loss = np.asarray([r["loss"] for r in records], np.float64)
    devices = None if summary is None else summary.get("devices")
    return Run(run_dir, label or f"{_name(variant, p, form)} ctx={context} seed={seed}", variant,
               p, context, seed, form, bool(model.get("gating")), steps, tokens, loss, final,
               heldout_loss_of(run_dir, context), devices)


def find_runs(paths: Iterable[str | os.PathLike]) -> list[Path]:
    """Run directories of ``paths``: each is a run directory (it has ``metrics.jsonl``) or a
    folder of them (one level down, e.g. a sweep); sorted, without repeats. ValueError names a
    path that is neither."""
    found = set()
    for path in map(Path, paths):
        if (path / METRICS_FILE).is_file():
            found.add(path)
            continue
        subdirs = ({d for d in path.iterdir() if (d / METRICS_FILE).is_file()}
                   if path.is_dir() else set())
        if not subdirs:
            raise ValueError(f"{path}: neither a run directory (no {METRICS_FILE}) nor a "
                             "folder of run directories")
        found |= subdirs
    return sorted(found)


def load_runs(paths: Iterable[str | os.PathLike]) -> list[Run]:
    """``load_run`` of every directory ``find_runs`` finds. A part of the form that every
    run it can apply to shares (the clipping of all runs, the gate bias of all gated runs)
    tells no runs apart: it is dropped from the forms and labels. Runs on different numbers
    of devices (data parallel) carry theirs in their labels."""
    runs = [load_run(d) for d in find_runs(paths)]
    clips = {_form_parts(r.form, "clip") for r in runs}
    biases = {_form_parts(r.form, "gate") for r in runs if r.gated}
    shared = set().union(*(next(iter(s)) for s in (clips, biases) if len(s) == 1))
    several_device_counts = len({r.devices for r in runs}) > 1
    trimmed = []
    for r in runs:
        form = ", ".join(p for p in _form_parts(r.form) if p not in shared)
        label = r.label.replace(f" ({r.form})", f" ({form})" if form else "")
        if several_device_counts:
            label += f" devices={r.devices}"
        trimmed.append(dataclasses.replace(r, form=form, label=label))
    return trimmed


def _order(run: Run) -> tuple:
    return (run.p is not None, run.p or 0, run.variant, run.form, run.context, run.seed,
            str(run.path))


def moving_mean(values: np.ndarray, window: int) -> np.ndarray:
    """Trailing mean over ``window`` records (fewer at the start); same length."""
    if window < 1:
        raise ValueError(f"smooth: need a window >= 1, got {window}")
    sums = np.cumsum(np.concatenate([[0.0], values]))
    ends = np.arange(1, len(values) + 1)
    starts = np.maximum(ends - window, 0)
    return (sums[ends] - sums[starts]) / (ends - starts)


_STYLES = ("-", "--", ":", "-.", (0, (5, 1, 1, 1, 1, 1)), (0, (1, 3)))


def plot_curves(runs: Sequence[Run], out_png: str | os.PathLike, *, x: str = "tokens",
                smooth: int = 1, title: str | None = None) -> Path:
    """Training loss of ``runs`` on one figure vs ``x`` ('tokens' seen or 'step'); one colour
    per (variant, p), one line style per (context, seed, devices); ``smooth`` records
    averaged (trailing mean)."""
    if x not in ("tokens", "step"):
        raise ValueError(f"x: need 'tokens' or 'step', got {x!r}")
    if not runs:
        raise ValueError("plot_curves: no runs")
    plt = pyplot()
    runs = sorted(runs, key=_order)
    colours = {k: f"C{i % 10}" for i, k in enumerate(dict.fromkeys(r.key for r in runs))}
    style_of = lambda r: (r.context, r.seed, r.devices or 0)  # noqa: E731
    styles = {k: _STYLES[i % len(_STYLES)]
              for i, k in enumerate(sorted({style_of(r) for r in runs}))}
    fig, ax = plt.subplots(figsize=(7, 4.5))
    curves = [moving_mean(r.loss, smooth) for r in runs]
    for r, y in zip(runs, curves, strict=True):
        ax.plot(r.tokens if x == "tokens" else r.steps, y, color=colours[r.key],
                linestyle=styles[style_of(r)], linewidth=1.4, label=r.label)
    # The first records (loss ~ ln V) would flatten the rest: the top is the highest loss
    # after the first 5% of each run, which keeps the whole tail of every curve in view.
    tail = [y[len(y) // 20:] for y in curves]
    top, bottom = max(float(t.max()) for t in tail), min(float(t.min()) for t in tail)
    ax.set_ylim(bottom - 0.05 * (top - bottom + 1e-3), top + 0.05 * (top - bottom + 1e-3))
    if x == "tokens":
        from matplotlib.ticker import EngFormatter

        ax.xaxis.set_major_formatter(EngFormatter())  # 200 k, 1 M: not 200000, 1e6
    ax.set_xlabel("tokens seen" if x == "tokens" else "training step")
    ax.set_ylabel("training loss (nats)" + (f", mean of {smooth} records"
                                            if smooth > 1 else ""))
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7)
    return save_figure(fig, out_png, title)


def _metric(run: Run, metric: str) -> float:
    if metric not in METRICS:
        raise ValueError(f"metric: need one of {METRICS}, got {metric!r}")
    return getattr(run, metric)


def relative_loss_table(runs: Sequence[Run], metric: str = "final_loss") -> list[dict]:
    """Rows (variant, p, form, context): each sympow-family run's ``metric`` over the softmax
    run's at the same context, seed and optimizer form (clipping; a gate bias has no softmax
    counterpart), mean / sample std / min / max over seeds (std None for one seed). A seed
    without its own softmax run is compared with the mean softmax loss at that context and
    form; runs without any such softmax run (or a NaN loss) are left out."""
    softmax = defaultdict(dict)  # (context, clip form) -> seed -> loss
    for r in runs:
        if r.p is None and math.isfinite(_metric(r, metric)):
            softmax[r.context, r.form][r.seed] = _metric(r, metric)
    groups = defaultdict(list)  # (variant, p, form, context) -> [(loss, softmax loss)]
    for r in runs:
        base = softmax.get((r.context, _clip_part(r.form)))
        if r.p is None or not base or not math.isfinite(_metric(r, metric)):
            continue
        ref = base.get(r.seed, float(np.mean(list(base.values()))))
        groups[r.variant, r.p, r.form, r.context].append((_metric(r, metric), ref))
    rows = []
    for (variant, p, form, context), pairs in sorted(groups.items(),
                                                     key=lambda g: (g[0][1], g[0])):
        losses, refs = np.asarray(pairs).T
        ratios = losses / refs
        rows.append({"variant": variant, "p": p, "form": form, "context": context,
                     "seeds": len(pairs),
                     "loss": float(losses.mean()), "softmax_loss": float(refs.mean()),
                     "ratio": float(ratios.mean()),
                     "ratio_std": float(ratios.std(ddof=1)) if len(pairs) > 1 else None,
                     "ratio_min": float(ratios.min()), "ratio_max": float(ratios.max())})
    return rows


def write_table_csv(path: str | os.PathLike, rows: Sequence[dict]) -> Path:
    return tables.write_csv(path, TABLE_FIELDS, ([r[k] for k in TABLE_FIELDS] for r in rows))


def markdown_table(rows: Sequence[dict], metric: str = "final_loss") -> str:
    """``rows`` of ``relative_loss_table`` as a markdown table (ratio: mean ± std [min, max]
    where there are several seeds)."""
    what = "final training loss" if metric == "final_loss" else "held-out loss"
    if not rows:
        return f"(no sympow run with a softmax run at its context: no relative {what})\n"
    lines = [f"Relative {what}: sympow-family / softmax at the same context (and seed).", "",
             "| variant | p | context | seeds | loss | softmax loss | loss / softmax |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        ratio = f"{r['ratio']:.4f}"
        if r["seeds"] > 1:
            ratio += f" ± {r['ratio_std']:.4f} [{r['ratio_min']:.4f}, {r['ratio_max']:.4f}]"
        variant = r["variant"] + (f" ({r['form']})" if r["form"] else "")
        lines.append(f"| {variant} | {r['p']} | {r['context']} | {r['seeds']} | "
                     f"{r['loss']:.4f} | {r['softmax_loss']:.4f} | {ratio} |")
    return "\n".join(lines) + "\n"


def plot_final_vs_context(runs: Sequence[Run], out_png: str | os.PathLike, *,
                          metric: str = "final_loss", title: str | None = None) -> Path:
    """``metric`` vs training context (log2 x), one line per (variant, p): the mean over
    seeds, with min-max error bars where a context has several. ValueError if no run has the
    metric (e.g. 'heldout_loss' of runs never evaluated)."""
    points = defaultdict(lambda: defaultdict(list))  # (variant, p) -> context -> values
    for r in sorted(runs, key=_order):
        if math.isfinite(_metric(r, metric)):
            points[r.key][r.context].append(_metric(r, metric))
    if not points:
        raise ValueError(f"plot_final_vs_context: no run has a finite {metric} (held-out: "
                         "run experiments/evaluate.py, or a sweep with evaluation)")
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    for (variant, p, form), by_context in points.items():
        contexts = sorted(by_context)
        values = [np.asarray(by_context[c]) for c in contexts]
        mean = np.asarray([v.mean() for v in values])
        err = np.asarray([[m - v.min() for m, v in zip(mean, values, strict=True)],
                          [v.max() - m for m, v in zip(mean, values, strict=True)]])
        ax.errorbar(contexts, mean, yerr=err if err.any() else None, marker="o", capsize=3,
                    label=_name(variant, p, form))
    seeds = max(len(v) for by_context in points.values() for v in by_context.values())
    ylabel = ("final training loss" if metric == "final_loss"
              else "held-out loss at training context")
    context_axis(ax, [c for by_context in points.values() for c in by_context],
                 ylabel + (f" (mean, min-max of {seeds} seeds)" if seeds > 1 else ""))
    return save_figure(fig, out_png, title)
