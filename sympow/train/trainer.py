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
  after the same save. A hard kill loses only the steps after the last periodic checkpoint.
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
from sympow.train.metrics import MetricsWriter, Progress, final_loss, read_metrics
from sympow.train.model import init_model_state, model_def
from sympow.train.optim import make_optimizer
from sympow.train.steps import init_train_state, make_train_step

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


def _any_process(flag: bool) -> bool:
    """True on every process if ``flag`` is True on any (all processes stop at one step)."""
    if jax.process_count() == 1:
        return flag
    from jax.experimental import multihost_utils

    return bool(np.any(multihost_utils.process_allgather(np.asarray(flag))))


def _check_config(config) -> None:
    if int(config.num_train_steps) < 0:
        raise ValueError(f"num_train_steps: need >= 0, got {config.num_train_steps}")
    for key in ("log_every", "checkpoint_every"):
        if int(config[key]) <= 0:
            raise ValueError(f"{key}: need a positive int, got {config[key]}")


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
    """
    _check_config(config)
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    lead = jax.process_index() == 0
    if lead:
        _write_config(config, workdir)

    mesh = datalib.make_mesh()
    microbatches = int(config.get("microbatches", 1))
    docs, context = int(config.data.docs_per_batch), int(config.data.context_size)
    datalib.check_divisible(docs, mesh, microbatches)
    rep, rows = datalib.replicated(mesh), datalib.batch_sharded(mesh)
    ds = datalib.open_loader(config.data, "train", docs, context)

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
    ckpt = Checkpointer(checkpoint_dir(workdir), max_to_keep=config.get("max_checkpoints", 3),
                        keep_period=config.get("keep_checkpoint_period", None))
    start = ckpt.latest_step()
    if start is None:
        start, state = 0, fresh_state()
        log.info("initialized %s parameters (%.2fM)", config.get("variant", "model"),
                 mdef.num_params / 1e6)
    else:
        state, meta = ckpt.restore(start, with_sharding(abstract_state, rep))
        if int(state["step"]) != start or meta.get("data_index") != start:
            raise RuntimeError(f"checkpoint {start} is inconsistent: step {int(state['step'])}, "
                               f"meta {meta}")
        log.info("resumed from %s at step %d", ckpt.directory, start)

    step_fn = jax.jit(make_train_step(mdef, optimizer, schedule, microbatches),
                      in_shardings=(rep, rows, rows), out_shardings=(rep, rep),
                      donate_argnums=0)
    writer = MetricsWriter(workdir, start_step=start, enabled=lead)
    bar = Progress(total, start, enabled=lead and progress,
                   desc=str(config.get("variant", "train")))
    tokens_per_step = docs * context
    step, saved = start, set(ckpt.all_steps())
    pending: list = []
    t_start = t_last = time.perf_counter()
    t_warm, step_warm = None, start  # throughput excludes the first (compiling) step
    stop_reason, failed = None, False

    def save():
        if step in saved:
            return
        ckpt.save(step, state, {"step": step, "data_index": step, "tokens": step * tokens_per_step,
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
                    if not np.isfinite(loss):
                        raise FloatingPointError(f"loss is {loss} at step {step}")
                    writer.write(step, {
                        "loss": loss, "grad_norm": float(fetched[-1]["grad_norm"]),
                        "learning_rate": float(fetched[-1]["learning_rate"]),
                        "tokens_per_sec": rate, "tokens": step * tokens_per_step,
                        "elapsed_s": now - t_start})
                    bar.update(step, loss, rate)
                    pending, t_last = [], now
                    if t_warm is None:
                        t_warm, step_warm = now, step
                if step % int(config.checkpoint_every) == 0:
                    save()
                requested = stop.signal_name is not None or (stop_fn is not None
                                                             and stop_fn(step))
                if _any_process(requested):
                    stop_reason = stop.signal_name or "stop_fn"
                    break
    except KeyboardInterrupt:
        stop_reason = "KeyboardInterrupt"
        raise
    except BaseException:
        failed = True
        raise
    finally:
        bar.close()
        if not failed:
            save()  # the state of the last completed step (also on interruption)
        ckpt.close()
        writer.close()
    wall = time.perf_counter() - t_start
    records = read_metrics(workdir) if lead else []
    window = int(config.get("final_loss_steps", 0)) or max(1, total // 10)
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


__all__ = ["train", "summary_line", "stop_after", "StopRequest"]
