"""Figure helpers shared by evaluation, sweeps and reports: matplotlib on the Agg backend,
imported on first use (tables and runs load without it), a log2 training-context axis and
saving a figure."""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path


def pyplot():
    """matplotlib's pyplot on the Agg backend (files only, no display)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def context_axis(ax, contexts: Iterable[int], ylabel: str) -> None:
    """A log2 training-context x axis with a tick at each context, grid and legend."""
    ax.set_xscale("log", base=2)
    contexts = sorted(set(contexts))
    ax.set_xticks(contexts, [str(c) for c in contexts], fontsize=8)
    ax.set_xlabel("training context (tokens)")
    ax.set_ylabel(ylabel)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)


def save_figure(fig, path: str | os.PathLike, title: str | None = None) -> Path:
    """Writes ``fig`` (with ``title`` above it, if given) to ``path`` at 120 dpi and closes it."""
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    pyplot().close(fig)
    return Path(path)
