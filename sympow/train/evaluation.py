"""Contextwise loss: the mean held-out loss at each position of windows of any length.

For a window length L (any L <= 65536, also longer than the training context), windows are
read from the held-out split of the run's store: the loader reads rectangles of the next power
of two >= L (a divisor of the store's 65536 columns) and crops them to L. The per-position loss
is a ``jax.jit`` function of the parameters (``sympow.train.steps.make_contextwise_fn``),
summed over windows on the host in float64.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Iterator, Sequence
from pathlib import Path

import jax
import ml_collections
import numpy as np

from sympow.data import LongCrawl64
from sympow.train import config as configlib
from sympow.train import data as datalib
from sympow.train import tables
from sympow.train.checkpoint import Checkpointer, checkpoint_dir, with_sharding
from sympow.train.model import ModelDef, model_def
from sympow.train.plots import pyplot, save_figure
from sympow.train.steps import make_contextwise_fn

CSV_FILE, PNG_FILE, JSON_FILE = "contextwise.csv", "contextwise.png", "contextwise.json"


@dataclasses.dataclass
class Curve:
    """Mean loss at each position 1..L over ``num_windows`` held-out windows."""

    label: str
    losses: np.ndarray  # [L] float64
    num_windows: int
    train_context: int | None = None
    step: int | None = None
    workdir: str | None = None

    @property
    def mean(self) -> float:
        return float(np.mean(self.losses))

    def band(self, first: int, last: int) -> float:
        """Mean loss over positions first..last (1-based, inclusive, clipped to the curve)."""
        if not 1 <= first <= last:
            raise ValueError(f"band: need 1 <= first <= last, got {first}..{last}")
        window = self.losses[first - 1:last]
        if not len(window):
            raise ValueError(f"band: positions {first}..{last} are past the curve's "
                             f"{len(self.losses)}")
        return float(np.mean(window))

    def uses_context(self) -> float:
        """How much context helps: loss at positions 1-2 minus loss at 64-256 (nats)."""
        return self.band(1, 2) - self.band(64, 256)


class WindowSource:
    """Batches of held-out windows, as global arrays on ``mesh``.

    Rows are sharded over the mesh when the batch divides evenly over its devices (each
    process reading its own rows), else replicated (every process reads whole batches).
    """

    def __init__(self, data, length: int, num_windows: int, batch_size: int, mesh,
                 vocab_size: int | None = None):
        self.length = int(length)
        self.loader_length = datalib.window_loader_length(self.length)
        docs = LongCrawl64(data.path, "heldout", 1, self.loader_length, process_index=0,
                           process_count=1, prefetch=0, backend=data.get("backend", "auto")
                           ).shape[0]
        self.batch_size = max(1, min(int(batch_size), docs))
        self.sharded = self.batch_size % mesh.size == 0
        self.sharding = (datalib.batch_sharded if self.sharded else datalib.replicated)(mesh)
        self.ds = datalib.open_loader(data, "heldout", self.batch_size, self.loader_length,
                                      vocab_size=vocab_size, sharded=self.sharded)
        self.num_batches = min(math.ceil(int(num_windows) / self.batch_size), len(self.ds))
        if self.num_batches < 1:
            raise ValueError(f"num_windows: need >= 1, got {num_windows}")
        self.num_windows = self.num_batches * self.batch_size

    def __iter__(self) -> Iterator[tuple[jax.Array, jax.Array]]:
        for _, inputs, labels in self.ds.iterate(0, self.num_batches):
            inputs, labels = inputs[:, :self.length], labels[:, :self.length]
            yield (datalib.global_batch(inputs, self.sharding, self.batch_size),
                   datalib.global_batch(labels, self.sharding, self.batch_size))


def contextwise_loss(fn, params, rest, batches) -> tuple[np.ndarray, int]:
    """(mean loss at each position [L] float64, number of windows) of a jitted
    ``make_contextwise_fn`` over an iterable of (inputs, labels) batches."""
    total, count = None, 0
    for inputs, labels in batches:
        sums = np.asarray(jax.device_get(fn(params, rest, inputs, labels)), np.float64)
        total = sums if total is None else total + sums
        count += inputs.shape[0]
    if total is None:
        raise ValueError("contextwise_loss: no batches")
    return total / count, count


def jit_contextwise(mdef: ModelDef, mesh):
    rep = datalib.replicated(mesh)
    return jax.jit(make_contextwise_fn(mdef), out_shardings=rep)


def _is_count(value, minimum: int = 1) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool) and (
        value >= minimum)


def parse_steps(steps: str | Sequence[int] | None) -> str | list[int]:
    """``'latest'`` (also None), ``'all'``, or a list of step numbers (``'1000,2000'`` or a
    sequence of ints); ValueError naming ``steps`` for anything else (also ``''``)."""
    if steps is None or steps in ("latest", "all"):
        return steps or "latest"
    if isinstance(steps, str):
        items = [item.strip() for item in steps.split(",")]
        if not all(item.isascii() and item.isdigit() for item in items):
            raise ValueError(f"steps: {steps!r} is not 'latest', 'all' or comma-separated "
                             "step numbers")
        return [int(item) for item in items]
    steps = list(steps)
    if not steps or not all(_is_count(s, minimum=0) for s in steps):
        raise ValueError(f"steps: need 'latest', 'all' or step numbers >= 0, got {steps!r}")
    return steps


def resolve_steps(workdir, steps: str | Sequence[int] | None) -> list[int]:
    """'latest' (default), 'all', or explicit steps -> existing checkpoint steps."""
    steps = parse_steps(steps)
    ckpt = Checkpointer(checkpoint_dir(workdir), read_only=True)
    available = ckpt.all_steps()
    ckpt.close()
    if not available:
        raise FileNotFoundError(f"workdir: no checkpoints in {checkpoint_dir(workdir)}")
    if steps == "latest":
        return [available[-1]]
    if steps == "all":
        return available
    missing = sorted(set(steps) - set(available))
    if missing:
        raise ValueError(f"steps: {missing} not among the checkpoints {available} of {workdir}")
    return list(steps)


def evaluate_workdir(workdir, steps: str | Sequence[int] | None = "latest", *,
                     length: int | None = None, num_windows: int | None = None,
                     batch_size: int | None = None, data_path: str | None = None,
                     label: str | None = None, mesh=None) -> list[Curve]:
    """Contextwise curves of checkpoints of a training workdir, with that run's config.

    Defaults (None) come from the run's ``config.eval`` (length, num_windows, batch_size);
    given values must be positive ints. The data store is the run's unless ``data_path`` is
    given. Arguments are checked (ValueError naming each) before anything is read.
    """
    parse_steps(steps)
    for name, value in (("length", length), ("num_windows", num_windows),
                        ("batch_size", batch_size)):
        if value is not None and not _is_count(value):
            raise ValueError(f"{name}: need a positive int, got {value!r}")
    workdir = Path(workdir)
    config = configlib.load_workdir_config(workdir)
    ev = config.get("eval", {})
    length = int(length or ev.get("length", config.data.context_size))
    num_windows = int(num_windows or ev.get("num_windows", 8))
    batch_size = int(batch_size or ev.get("batch_size", 1))
    data = config.data
    if data_path:
        data = ml_collections.ConfigDict(configlib.to_dict(config.data))
        data.path = data_path
    mesh = mesh or datalib.make_mesh()
    rep = datalib.replicated(mesh)
    mdef = model_def(config.model)
    fn = jit_contextwise(mdef, mesh)
    source = WindowSource(data, length, num_windows, batch_size, mesh,
                          vocab_size=int(config.model.vocab_size))
    abstract = with_sharding({"params": mdef.abstract_params, "rest": mdef.abstract_rest}, rep)
    curves = []
    ckpt = Checkpointer(checkpoint_dir(workdir), read_only=True)
    try:
        for step in resolve_steps(workdir, steps):
            model, _ = ckpt.restore_model(step, abstract)
            losses, count = contextwise_loss(fn, model["params"], model["rest"], source)
            variant = config.get("variant", "?")
            name = label or (workdir.name if workdir.name == variant
                             else f"{workdir.name} ({variant})")
            curves.append(Curve(f"{name} step {step}", losses, count,
                                int(config.data.context_size), step, str(workdir)))
    finally:
        ckpt.close()
    return curves


def write_csv(path: str | os.PathLike, curves: Sequence[Curve]) -> Path:
    """``position,<label>,...``: one row per position 1..max L (empty past a curve's end)."""
    n = max(len(c.losses) for c in curves)
    rows = ([i + 1, *[float(c.losses[i]) if i < len(c.losses) else None for c in curves]]
            for i in range(n))
    return tables.write_csv(path, ["position", *[c.label for c in curves]], rows)


def read_csv(path: str | os.PathLike) -> list[Curve]:
    """The curves of a ``write_csv`` file (labels and losses; num_windows unknown: 0)."""
    header, body = tables.read_csv(path)
    return [Curve(label, np.asarray([float(r[j + 1]) for r in body if r[j + 1] != ""]), 0)
            for j, label in enumerate(header[1:])]


def write_json(path: str | os.PathLike, curves: Sequence[Curve]) -> Path:
    path = Path(path)
    path.write_text(json.dumps([{
        "label": c.label, "workdir": c.workdir, "step": c.step, "length": len(c.losses),
        "num_windows": c.num_windows, "train_context": c.train_context, "mean_loss": c.mean,
        "loss_at_train_context": (float(np.mean(c.losses[:c.train_context]))
                                  if c.train_context else None),
    } for c in curves], indent=2) + "\n")
    return path


def log_binned(losses: np.ndarray, bins: int = 48) -> tuple[np.ndarray, np.ndarray]:
    """(positions, mean losses) over log-spaced position bins (1-based positions)."""
    n = len(losses)
    edges = np.unique(np.round(np.geomspace(1, n + 1, bins + 1)).astype(int))
    pairs = list(zip(edges[:-1], edges[1:], strict=True))  # bin [a, b) of 1-based positions
    centers = [math.sqrt(a * (b - 1)) if b - 1 > a else a for a, b in pairs]
    means = [losses[a - 1:b - 1].mean() for a, b in pairs]
    return np.asarray(centers), np.asarray(means)


def plot_contextwise(path: str | os.PathLike, curves: Sequence[Curve], *, title: str | None = None,
                     bins: int = 48) -> Path:
    """Loss vs position (log x, log-binned means), one line per curve; a dashed red line at
    each training context."""
    fig, ax = pyplot().subplots(figsize=(7, 4.5))
    for c in curves:
        x, y = log_binned(c.losses, bins)
        ax.plot(x, y, label=c.label, linewidth=1.6)
    for t in sorted({c.train_context for c in curves if c.train_context}):
        ax.axvline(t, color="red", linestyle="--", linewidth=1, alpha=0.7)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("position in window (tokens)")
    ax.set_ylabel("held-out loss (nats)")
    n = max(c.num_windows for c in curves)
    ax.set_title(title or f"contextwise loss ({n} held-out windows; dashed: training context)",
                 fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    return save_figure(fig, path)


def write_outputs(out_dir: str | os.PathLike, curves: Sequence[Curve], *,
                  title: str | None = None) -> dict[str, Path]:
    """CSV, JSON and PNG of ``curves`` into ``out_dir``."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    return {"csv": write_csv(out_dir / CSV_FILE, curves),
            "json": write_json(out_dir / JSON_FILE, curves),
            "png": plot_contextwise(out_dir / PNG_FILE, curves, title=title)}
