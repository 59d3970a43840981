"""Metrics: ``<workdir>/metrics.jsonl`` and TensorBoard event files, plus a progress bar.

One JSON object per logged step: ``{"step", "loss", "grad_norm", "learning_rate",
"tokens_per_sec", "tokens", "elapsed_s"}`` where ``step`` counts completed updates and
``loss`` is the mean training loss of the steps since the previous record. TensorBoard
(``tensorboard --logdir <workdir>``) reads the same scalars under ``train/``; event files are
written with tensorboardX when it is installed (otherwise only the JSONL is written).
"""

from __future__ import annotations

import json
import logging
import math
import os
import sys
import time
from pathlib import Path

METRICS_FILE = "metrics.jsonl"
TB_DIR = "tensorboard"

log = logging.getLogger("sympow.train")


def setup_logging(level: int = logging.INFO) -> None:
    """Our messages at ``level`` on stderr; absl (and orbax's chatty INFO lines) at WARNING."""
    from absl import logging as absl_logging

    absl_logging.set_verbosity(absl_logging.WARNING)
    if not any(getattr(h, "_sympow", False) for h in log.handlers):
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s",
                                               "%H:%M:%S"))
        handler._sympow = True
        log.addHandler(handler)
    log.setLevel(level)
    log.propagate = False


def read_metrics(workdir: str | os.PathLike) -> list[dict]:
    """Records of ``metrics.jsonl`` (a torn last line from a killed run is skipped)."""
    path = Path(workdir) / METRICS_FILE
    if not path.is_file():
        return []
    records = []
    for line in path.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records


def final_loss_window(config, num_train_steps: int) -> int:
    """Steps the final loss averages: ``config.final_loss_steps``, or with 0 (or absent) the
    last 10% of ``num_train_steps`` (at least 1)."""
    return int(config.get("final_loss_steps") or 0) or max(1, num_train_steps // 10)


def final_loss(records: list[dict], last_steps: int) -> float:
    """Mean training loss over the last ``last_steps`` steps (records weighted by the steps
    they cover)."""
    if not records:
        return math.nan
    end = records[-1]["step"]
    total, weight, prev = 0.0, 0, 0
    for rec in records:  # a record covers the steps (prev, step]
        covered = range(max(prev, end - last_steps), rec["step"])
        if len(covered) > 0:
            total += rec["loss"] * len(covered)
            weight += len(covered)
        prev = rec["step"]
    return total / weight if weight else math.nan


class MetricsWriter:
    """Appends records to ``metrics.jsonl`` and to TensorBoard (process 0 writes; others no-op).

    ``start_step``: records with a larger step (written by a run that was killed after its
    last checkpoint, and about to be recomputed) are dropped from the JSONL on open.
    """

    def __init__(self, workdir: str | os.PathLike, *, start_step: int = 0, enabled: bool = True,
                 tensorboard: bool = True):
        self.enabled = enabled
        self.path = Path(workdir) / METRICS_FILE
        self._tb = None
        if not enabled:
            return
        kept = [r for r in read_metrics(workdir) if r.get("step", 0) <= start_step]
        tmp = self.path.with_suffix(".jsonl.tmp")
        tmp.write_text("".join(json.dumps(r) + "\n" for r in kept))
        os.replace(tmp, self.path)
        self._file = self.path.open("a")
        if tensorboard:
            try:
                from tensorboardX import SummaryWriter
            except ImportError:
                log.warning("tensorboardX is not installed: writing %s only", METRICS_FILE)
            else:
                self._tb = SummaryWriter(str(Path(workdir) / TB_DIR), purge_step=start_step + 1
                                         if start_step else None)

    def write(self, step: int, scalars: dict[str, float], prefix: str = "train") -> None:
        if not self.enabled:
            return
        record = {"step": int(step), **{k: float(v) for k, v in scalars.items()}}
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        if self._tb is not None:
            for key, value in scalars.items():
                self._tb.add_scalar(f"{prefix}/{key}", float(value), int(step))

    def close(self) -> None:
        if not self.enabled:
            return
        self._file.close()
        if self._tb is not None:
            self._tb.close()


def _duration(seconds: float) -> str:
    if not math.isfinite(seconds):
        return "?"
    seconds = int(seconds)
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m:02d}:{s:02d}"


class Progress:
    """Progress bar with loss, tokens/s and ETA (tqdm when installed, else log lines)."""

    def __init__(self, total: int, initial: int, *, enabled: bool = True, desc: str = "train"):
        self.total, self.n, self.enabled = total, initial, enabled
        self._bar = None
        self._t0, self._n0 = time.perf_counter(), initial
        self._last_print = 0.0
        if not enabled:
            return
        try:
            from tqdm import tqdm
        except ImportError:
            return
        self._bar = tqdm(total=total, initial=initial, desc=desc, unit="step", dynamic_ncols=True,
                         mininterval=1.0 if sys.stderr.isatty() else 10.0, file=sys.stderr)

    def update(self, step: int, loss: float, tokens_per_sec: float) -> None:
        if not self.enabled:
            return
        done, self.n = step - self.n, step
        if self._bar is not None:
            self._bar.set_postfix_str(f"loss {loss:.4f}, {tokens_per_sec:,.0f} tok/s",
                                      refresh=False)
            self._bar.update(done)
            return
        now = time.perf_counter()
        if now - self._last_print < 10.0 and step < self.total:
            return
        self._last_print = now
        rate = (step - self._n0) / max(now - self._t0, 1e-9)
        eta = (self.total - step) / rate if rate > 0 else math.inf
        print(f"step {step}/{self.total} loss {loss:.4f} {tokens_per_sec:,.0f} tok/s "
              f"ETA {_duration(eta)}", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
