"""Context-size sweeps: train and evaluate every (variant, training context) of a sweep file.

A sweep file is a config file with ``get_sweep(arg) -> list[ConfigDict]`` (one training config
per run; see ``configs/sweep_p4.py``). ``run_sweep`` trains each run in
``<workdir>/<variant>_p<p>_ctx<T>`` (no ``_p<p>`` for softmax; ``variant`` is the config's
preset name, e.g. ``sympow_gating_p2_ctx1024``), resuming unfinished ones and skipping finished
ones, evaluates its held-out loss at the training context, and writes ``sweep.csv`` and
``sweep.png``: final loss vs training context, one line per variant ([conformal] Figure 1;
docs/references.md). A sweep split over several invocations in one workdir (a subset of its
runs each, e.g. one per device call) accumulates: the table keeps the rows of earlier
invocations' runs that this one did not run.
"""

from __future__ import annotations

import json
import logging
import math
import os
from collections.abc import Sequence
from pathlib import Path

from sympow.train import config as configlib
from sympow.train import tables
from sympow.train.evaluation import evaluate_workdir
from sympow.train.plots import context_axis, pyplot, save_figure
from sympow.train.trainer import SUMMARY_FILE, train

log = logging.getLogger("sympow.train")

CSV_FILE, PNG_FILE = "sweep.csv", "sweep.png"
FIELDS = ("variant", "p", "context", "final_loss", "heldout_loss", "steps", "tokens_per_sec",
          "workdir")


def load_sweep(spec: str) -> list:
    """The run configs of ``path.py[:arg]`` (its ``get_sweep(arg)``)."""
    path, arg = configlib.split_spec(spec)
    module = configlib.load_module(path)
    if not hasattr(module, "get_sweep"):
        raise ValueError(f"sweep: {path} has no get_sweep(arg)")
    runs = module.get_sweep(arg) if arg is not None else module.get_sweep()
    if not runs:
        raise ValueError(f"sweep: {spec} has no runs")
    return list(runs)


def run_name(config) -> str:
    variant = config.get("variant", "model")
    p = "" if config.model.attention == "softmax" else f"_p{config.model.p}"
    return f"{variant}{p}_ctx{config.data.context_size}"


def _finished(run_dir: Path, num_train_steps: int) -> dict | None:
    path = run_dir / SUMMARY_FILE
    if not path.is_file():
        return None
    summary = json.loads(path.read_text())
    done = summary.get("steps", 0) >= num_train_steps and not summary.get("interrupted")
    return summary if done else None


def run_sweep(spec: str, workdir: str | os.PathLike, *, overrides: Sequence[str] = (),
              evaluate: bool = True, eval_windows: int | None = None,
              progress: bool = True) -> list[dict]:
    """Trains (or resumes) and evaluates every run of the sweep; returns this invocation's
    table rows (``sweep.csv`` also keeps earlier invocations' rows of other runs).

    Stops early (returning the rows so far) if a run is interrupted (SIGTERM / Ctrl-C):
    rerunning the same command resumes it.
    """
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    rows = []
    runs = load_sweep(spec)
    for config in runs:  # every run checked before the first one trains
        for item in overrides:
            configlib.apply_override(config, item)
        configlib.validate(config)
    earlier = _earlier_rows(workdir / CSV_FILE, [run_name(c) for c in runs])
    for i, config in enumerate(runs):
        name = run_name(config)
        run_dir = workdir / name
        log.info("sweep run %d/%d: %s", i + 1, len(runs), name)
        print(f"[sweep {i + 1}/{len(runs)}] {name}", flush=True)
        summary = _finished(run_dir, int(config.num_train_steps))
        if summary is None:
            summary = train(config, run_dir, progress=progress)
            if summary.get("interrupted"):
                log.warning("sweep interrupted during %s; rerun to resume", name)
                break
        heldout = math.nan
        if evaluate:
            curve, = evaluate_workdir(run_dir, length=int(config.data.context_size),
                                      num_windows=eval_windows)
            heldout = curve.mean
        rows.append({
            "variant": config.get("variant", ""), "p": int(config.model.p),
            "context": int(config.data.context_size), "final_loss": summary["final_loss"],
            "heldout_loss": heldout, "steps": summary["steps"],
            "tokens_per_sec": summary.get("tokens_per_sec", math.nan), "workdir": str(run_dir)})
        write_csv(workdir / CSV_FILE, earlier + rows)
    if rows:
        plot_sweep(workdir / PNG_FILE, earlier + rows,
                   title=f"sweep {Path(spec.split(':')[0]).stem}")
    return rows


def _earlier_rows(table: Path, runs: list[str]) -> list[dict]:
    """The rows of an existing ``sweep.csv`` for runs other than ``runs`` (folder names)."""
    if not table.is_file():
        return []
    return [row for row in read_csv(table) if Path(row["workdir"]).name not in runs]


def write_csv(path: str | os.PathLike, rows: list[dict]) -> Path:
    """``sweep.csv``: one row per run, columns ``FIELDS``."""
    return tables.write_csv(path, FIELDS, ([row[k] for k in FIELDS] for row in rows))


def read_csv(path: str | os.PathLike) -> list[dict]:
    """The rows of a ``write_csv`` file, with int and float columns typed back."""
    header, body = tables.read_csv(path)
    rows = [dict(zip(header, r, strict=True)) for r in body]
    for row in rows:
        for key in ("p", "context", "steps"):
            row[key] = int(row[key])
        for key in ("final_loss", "heldout_loss", "tokens_per_sec"):
            row[key] = float(row[key])
    return rows


def plot_sweep(path: str | os.PathLike, rows: list[dict], *, title: str | None = None) -> Path:
    """Final training loss (and held-out loss, if evaluated) vs training context, log2 x, one
    line per variant."""
    plt = pyplot()
    metrics = [("final_loss", "final training loss")]
    if any(math.isfinite(r["heldout_loss"]) for r in rows):
        metrics.append(("heldout_loss", "held-out loss at training context"))
    fig, axes = plt.subplots(1, len(metrics), figsize=(6 * len(metrics), 4.2), squeeze=False)
    variants = list(dict.fromkeys(r["variant"] for r in rows))
    for ax, (key, ylabel) in zip(axes[0], metrics, strict=False):
        for variant in variants:
            pts = sorted((r["context"], r[key]) for r in rows if r["variant"] == variant)
            ax.plot([c for c, _ in pts], [v for _, v in pts], marker="o", label=variant)
        context_axis(ax, (r["context"] for r in rows), ylabel)
    return save_figure(fig, path, title)
