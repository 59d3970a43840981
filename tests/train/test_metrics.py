"""sympow.train.metrics: metrics.jsonl written and read back, truncation on resume, TensorBoard
files, the final-loss window, the progress bar and logging setup."""

from __future__ import annotations

import json
import logging
import math

import pytest

from sympow.train import metrics
from sympow.train.metrics import METRICS_FILE, MetricsWriter, Progress, final_loss, read_metrics


def _write(workdir, steps, start_step=0, **kwargs):
    writer = MetricsWriter(workdir, start_step=start_step, **kwargs)
    for step in steps:
        writer.write(step, {"loss": 10.0 - step, "tokens": 128 * step})
    writer.close()


def test_records_round_trip(tmp_path):
    _write(tmp_path, [1, 2, 3], tensorboard=False)
    assert read_metrics(tmp_path) == [
        {"step": 1, "loss": 9.0, "tokens": 128.0}, {"step": 2, "loss": 8.0, "tokens": 256.0},
        {"step": 3, "loss": 7.0, "tokens": 384.0}]
    lines = (tmp_path / METRICS_FILE).read_text().splitlines()
    assert json.loads(lines[0]) == {"step": 1, "loss": 9.0, "tokens": 128.0}
    assert not (tmp_path / metrics.TB_DIR).exists()


def test_resume_drops_records_after_the_checkpoint(tmp_path):
    """A run killed at step 5 after a checkpoint at 3: steps 4 and 5 are recomputed, so the
    writer reopened at start_step=3 drops them first."""
    _write(tmp_path, [1, 2, 3, 4, 5], tensorboard=False)
    _write(tmp_path, [4, 5, 6], start_step=3, tensorboard=False)
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2, 3, 4, 5, 6]


def test_torn_last_line_is_skipped(tmp_path):
    _write(tmp_path, [1, 2], tensorboard=False)
    with (tmp_path / METRICS_FILE).open("a") as f:
        f.write('{"step": 3, "lo')  # killed mid-write
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2]
    assert read_metrics(tmp_path / "no_run_here") == []


def test_disabled_writer_writes_nothing(tmp_path):
    _write(tmp_path, [1, 2], enabled=False)
    assert list(tmp_path.iterdir()) == []


def test_tensorboard_event_files(tmp_path):
    pytest.importorskip("tensorboardX")
    _write(tmp_path, [1, 2])
    assert list((tmp_path / metrics.TB_DIR).glob("events.out.tfevents.*"))


def test_final_loss_weights_records_by_steps():
    records = [{"step": 10, "loss": 5.0}, {"step": 20, "loss": 3.0}, {"step": 25, "loss": 1.0}]
    assert final_loss(records, 5) == 1.0
    assert final_loss(records, 10) == pytest.approx((5 * 3.0 + 5 * 1.0) / 10)
    assert final_loss(records, 100) == pytest.approx((10 * 5 + 10 * 3 + 5 * 1) / 25)
    assert math.isnan(final_loss([], 10))


def test_duration_format():
    assert metrics._duration(65) == "01:05"
    assert metrics._duration(3661) == "1:01:01"
    assert metrics._duration(math.inf) == "?"


def test_progress_counts_steps():
    bar = Progress(10, 2, enabled=True, desc="t")
    bar.update(5, 3.0, 100.0)
    assert bar.n == 5
    if bar._bar is not None:  # tqdm installed
        assert bar._bar.n == 5
    bar.close()
    off = Progress(10, 0, enabled=False)
    off.update(4, 3.0, 100.0)
    assert off.n == 0 and off._bar is None


def test_setup_logging_installs_one_handler():
    log = metrics.log
    saved = (list(log.handlers), log.level, log.propagate)
    try:
        metrics.setup_logging(logging.DEBUG)
        metrics.setup_logging(logging.DEBUG)
        ours = [h for h in log.handlers if getattr(h, "_sympow", False)]
        assert len(ours) == 1 and log.level == logging.DEBUG and log.propagate is False
    finally:
        log.handlers[:] = saved[0]
        log.setLevel(saved[1])
        log.propagate = saved[2]
