"""The training loop: data parallel over all devices, exact resume, nothing lost on interrupt.

``train(config, workdir)`` trains ``config.num_train_steps`` steps of the config's GPT on its
data, resuming from the newest checkpoint in ``<workdir>/checkpoints`` if there is one.

- Parallelism: a 1-D mesh over every device of every process (axis 'data'); the batch is
  sharded over it and the parameters and optimizer state are replicated. Multi-host runs call
  ``jax.distributed.initialize()`` first (``experiments/train.py --multihost``); each process
  then reads its own rows of every batch.
- Exact resume: a checkpoint holds params, optimizer state, step and RNG key; batch k is loader
  index k (``sympow.train.data.train_batches``), so a resumed run computes bitwise the same
  steps as an uninterrupted one.
- Interruption: SIGTERM or Ctrl-C finish the current step, save a checkpoint and return
  (``summary['interrupted']`` names the signal); a second Ctrl-C raises KeyboardInterrupt
  after the same save. A hard kill loses only the steps after the last periodic checkpoint
  (also when it lands during a save).
- Bad input fails before the first step, with a ValueError naming it: the resolved config
  (``sympow.train.config.validate``), a workdir that cannot be written, a workdir that
  another training process holds (``sympow.train.workdir.WorkdirLock``), data ids outside
  the model's vocabulary (checked on every batch).
- Divergence: a logged loss that is NaN or infinite, or more than ``config.max_loss_ratio``
  times the first logged loss, stops the run with ``DivergenceError`` (no final checkpoint).
- Faults: a failed checkpoint save raises ``CheckpointWriteError`` naming the folder; an
  unreadable newest checkpoint is set aside and the run resumes from the one before it, with
  a warning (``sympow.train.checkpoint``).
"""

from __future__ import annotations

import contextlib
import datetime
import json
import logging
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path

import jax
import numpy as np

from sympow.train import config as configlib
from sympow.train import data as datalib
from sympow.train.checkpoint import Checkpointer, checkpoint_dir, with_sharding
from sympow.train.metrics import (
    MetricsWriter,
    Progress,
    final_loss,
    final_loss_window,
    read_metrics,
)
from sympow.train.model import init_model_state, model_def
from sympow.train.optim import make_optimizer
from sympow.train.steps import init_train_state, make_train_step
from sympow.train.workdir import WorkdirLock, check_writable

log = logging.getLogger("sympow.train")

SUMMARY_FILE = "summary.json"


class StopRequest(contextlib.AbstractContextManager):
    """Turns SIGTERM and the first SIGINT into a flag the loop polls between steps.

    A second SIGINT raises KeyboardInterrupt as usual. Handlers are installed only in the main
    thread and restored on exit.
    """

    def __init__(self):
        self.signal_name: str | None = None
        self._previous = {}

    def _handle(self, signum, frame):
        if self.signal_name is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.signal_name = signal.Signals(signum).name
        log.warning("%s received: stopping after this step and saving a checkpoint",
                    self.signal_name)

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            for signum in (signal.SIGINT, signal.SIGTERM):
                self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, *exc):
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        return False


def _any_process(*flags: bool) -> list[bool]:
    """Each flag True on every process if it is True on any (all processes act at one step);
    one gather for all of them."""
    if jax.process_count() == 1:
        return [bool(f) for f in flags]
    from jax.experimental import multihost_utils

    gathered = multihost_utils.process_allgather(np.asarray(flags, bool))  # [processes, flags]
    return [bool(x) for x in np.any(gathered, axis=0)]


class DivergenceError(FloatingPointError, ValueError):
    """The training loss is NaN or infinite, or exceeds ``max_loss_ratio`` times its first
    logged value. A ValueError too: the usual cause is a setting (the learning rate)."""


def check_loss(loss: float, step: int, first: tuple[int, float], max_ratio: float,
               learning_rate: float) -> None:
    """Raises DivergenceError if ``loss`` (logged at ``step``) is not finite, or if
    ``max_ratio > 0`` and it exceeds ``max_ratio`` times ``first`` = (step, loss) of the run's
    first logged loss."""
    hint = f"try a lower optim.learning_rate (now {learning_rate:g})"
    if not np.isfinite(loss):
        raise DivergenceError(f"loss is {loss} at step {step}: training diverged; {hint}")
    first_step, first_loss = first
    if max_ratio > 0 and loss > max_ratio * first_loss:
        raise DivergenceError(
            f"loss {loss:.4g} at step {step} is more than max_loss_ratio={max_ratio:g} times "
            f"the first logged loss {first_loss:.4g} (step {first_step}): training diverged; "
            f"{hint}, or set --config.max_loss_ratio=0 to turn this check off")


def _claim_workdir(workdir: Path, lead: bool) -> WorkdirLock:
    """Process 0 checks that the workdir and its checkpoints folder can be written (orbax
    would fail only in a background thread) and locks the workdir; every process raises the
    ValueError if that failed."""
    lock, error = WorkdirLock(workdir), None
    if lead:
        try:
            check_writable(workdir)
            lock.acquire()
            check_writable(checkpoint_dir(workdir))
        except ValueError as exc:
            lock.release()
            error = exc
    if _any_process(error is not None)[0]:
        raise error or ValueError(f"workdir: process 0 could not claim {workdir} (see its log)")
    return lock


def _consistent(step: int, state: dict, meta: dict) -> None:
    """A restored checkpoint whose parts disagree on the step is unreadable (see
    ``Checkpointer.restore_latest``)."""
    if int(state["step"]) != step or meta.get("data_index") != step:
        raise ValueError(f"inconsistent: step {int(state['step'])}, meta {meta}")


def _write_config(config, workdir: Path) -> None:
    path = workdir / configlib.CONFIG_FILE
    if path.is_file():
        changes = configlib.diff(json.loads(path.read_text()), configlib.to_dict(config))
        if changes:
            log.warning("config differs from the one saved in %s: %s", path, "; ".join(changes))
    configlib.save_config(config, workdir)


def train(config, workdir, *, stop_fn: Callable[[int], bool] | None = None,
          progress: bool = True) -> dict:
    """Trains (or resumes) the run in ``workdir``; returns the summary (also written to
    ``<workdir>/summary.json``).

    ``stop_fn(step)``: polled after every step; True stops the run exactly like SIGTERM
    (checkpoint, summary, return) -- for tests and schedulers.

    Raises ValueError (naming the field, directory or file) for bad input before training,
    DivergenceError when the loss diverges, CheckpointWriteError when a save fails.
    """
    configlib.validate(config)
    workdir = Path(workdir)
    lead = jax.process_index() == 0
    lock = _claim_workdir(workdir, lead)
    try:
        return _train(config, workdir, lead, stop_fn, progress)
    finally:
        lock.release()


def _train(config, workdir: Path, lead: bool, stop_fn, progress: bool) -> dict:
    """``train`` once the config is valid and the workdir is ours."""
    if lead:
        _write_config(config, workdir)

    mesh = datalib.make_mesh()
    microbatches = int(config.get("microbatches", 1))
    docs, context = int(config.data.docs_per_batch), int(config.data.context_size)
    datalib.check_divisible(docs, mesh, microbatches)
    rep, rows = datalib.replicated(mesh), datalib.batch_sharded(mesh)
    ds = datalib.open_loader(config.data, "train", docs, context,
                             vocab_size=int(config.model.vocab_size))

    mdef = model_def(config.model)
    total = int(config.num_train_steps)
    optimizer, schedule = make_optimizer(config.optim, total)
    seed = int(config.seed)

    def fresh_state():
        params, rest = init_model_state(mdef, seed, sharding=rep)
        return jax.jit(lambda p, r: init_train_state(p, r, optimizer, seed),
                       out_shardings=rep)(params, rest)

    abstract_state = jax.eval_shape(
        lambda: init_train_state(mdef.abstract_params, mdef.abstract_rest, optimizer, seed))
    step_fn = jax.jit(make_train_step(mdef, optimizer, schedule, microbatches),
                      in_shardings=(rep, rows, rows), out_shardings=(rep, rep),
                      donate_argnums=0)
    tokens_per_step = docs * context
    stop_reason, first_loss = None, None
    max_ratio = float(config.get("max_loss_ratio", 10.0))

    with contextlib.ExitStack() as closing:  # closed in reverse order, whatever is raised
        ckpt = closing.enter_context(Checkpointer(
            checkpoint_dir(workdir), max_to_keep=config.get("max_checkpoints", 3),
            keep_period=config.get("keep_checkpoint_period", None)))  # close waits for saves
        restored = ckpt.restore_latest(with_sharding(abstract_state, rep), check=_consistent)
        if restored is None:
            start, state = 0, fresh_state()
            log.info("initialized %s parameters (%.2fM)", config.get("variant", "model"),
                     mdef.num_params / 1e6)
        else:
            start, state, _ = restored
            log.info("resumed from %s at step %d", ckpt.directory, start)
        writer = MetricsWriter(workdir, start_step=start, enabled=lead)
        closing.callback(writer.close)
        bar = Progress(total, start, enabled=lead and progress,
                       desc=str(config.get("variant", "train")))
        closing.callback(bar.close)
        step, saved = start, set(ckpt.all_steps())
        pending: list = []
        t_start = t_last = time.perf_counter()
        t_warm, step_warm = None, start  # throughput excludes the first (compiling) step

        def save():
            if step in saved:
                return
            ckpt.save(step, state, {
                "step": step, "data_index": step, "tokens": step * tokens_per_step,
                "time": datetime.datetime.now().isoformat(timespec="seconds")})
            saved.add(step)

        try:
            with StopRequest() as stop:
                for k, inputs, labels in datalib.train_batches(ds, start, total):
                    state, metrics = step_fn(state, datalib.global_batch(inputs, rows, docs),
                                             datalib.global_batch(labels, rows, docs))
                    step = k + 1
                    pending.append(metrics)
                    if step % int(config.log_every) == 0 or step == total or step == start + 1:
                        fetched = jax.device_get(pending)
                        now = time.perf_counter()
                        rate = len(pending) * tokens_per_step / max(now - t_last, 1e-9)
                        loss = float(np.mean([m["loss"] for m in fetched]))
                        lr = float(fetched[-1]["learning_rate"])
                        first_loss = first_loss or (step, loss)
                        check_loss(loss, step, first_loss, max_ratio, lr)
                        writer.write(step, {
                            "loss": loss, "grad_norm": float(fetched[-1]["grad_norm"]),
                            "learning_rate": lr, "tokens_per_sec": rate,
                            "tokens": step * tokens_per_step, "elapsed_s": now - t_start})
                        bar.update(step, loss, rate)
                        pending, t_last = [], now
                        if t_warm is None:
                            t_warm, step_warm = now, step
                    if step % int(config.checkpoint_every) == 0:
                        save()
                    finished, requested = _any_process(
                        ckpt.save_finished(),
                        stop.signal_name is not None or (stop_fn is not None and stop_fn(step)))
                    if finished:
                        ckpt.wait()  # a failed save stops the run now, not at the next save
                    if requested:
                        stop_reason = stop.signal_name or "stop_fn"
                        break
        except KeyboardInterrupt:
            stop_reason = "KeyboardInterrupt"
            save()  # the state of the last completed step
            raise
        save()  # the state of the last completed step (also on SIGTERM or stop_fn); any other
        # exception (a diverged loss, a data error) saves nothing
    wall = time.perf_counter() - t_start
    records = read_metrics(workdir) if lead else []
    window = final_loss_window(config, total)
    warm_rate = ((step - step_warm) * tokens_per_step / (t_last - t_warm)
                 if t_warm is not None and t_last > t_warm else float("nan"))
    summary = {
        "variant": config.get("variant", None), "steps": step, "num_train_steps": total,
        "final_loss": final_loss(records, window), "final_loss_steps": window,
        "tokens": step * tokens_per_step, "tokens_per_sec": warm_rate, "wall_s": wall,
        "num_params": mdef.num_params, "devices": mesh.size, "interrupted": stop_reason,
        "workdir": str(workdir),
    }
    if lead:
        (workdir / SUMMARY_FILE).write_text(json.dumps(summary, indent=2) + "\n")
        print(summary_line(summary), flush=True)
    return summary


def summary_line(summary: dict) -> str:
    status = f" INTERRUPTED ({summary['interrupted']})" if summary.get("interrupted") else ""
    return (f"summary: {summary.get('variant')} steps {summary['steps']}/"
            f"{summary['num_train_steps']} final_loss {summary['final_loss']:.4f} "
            f"(mean of last {summary['final_loss_steps']} steps) tokens {summary['tokens']:,} "
            f"wall {summary['wall_s']:.1f}s {summary['tokens_per_sec']:,.0f} tok/s "
            f"params {summary['num_params'] / 1e6:.2f}M devices {summary['devices']} "
            f"workdir {summary['workdir']}{status}")


def stop_after(step: int) -> Callable[[int], bool]:
    """A ``stop_fn`` that stops once ``step`` steps are done."""
    return lambda s: s >= step


__all__ = ["train", "summary_line", "stop_after", "StopRequest", "DivergenceError", "check_loss"]
