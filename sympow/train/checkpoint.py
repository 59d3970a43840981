"""Orbax checkpoints of a training run: ``<workdir>/checkpoints/<step>/{model,train,meta}``.

Items: ``model`` = {params, rest} (all evaluation needs), ``train`` = {opt_state, step, rng},
``meta`` = JSON {step, data_index, tokens, ...}. The data position is the step itself (batch
k of a run is loader index k; see ``sympow.train.data``). Saves are asynchronous; a checkpoint
becomes visible (its step folder appears) only once fully written, so a run killed mid-save
resumes from the previous one (the partial ``<step>.orbax-checkpoint-tmp`` folder is removed
when the next run opens the folder).

Faults:
- A save that fails (a full disk, a folder that turned read-only) raises
  ``CheckpointWriteError`` naming the folder and the step, at the next ``save``, ``wait`` or
  ``close`` (saves run in the background; the trainer calls ``wait`` as soon as
  ``save_finished`` says the save ended); the checkpoints already on disk are untouched,
  and the failed one never appears. Before each save the folder is probed with a small
  file, because orbax's background threads wait forever for a step folder they could not
  create (a process that hangs at exit instead of failing).
- ``restore_latest`` resumes from the newest checkpoint that restores; newer ones that do not
  (truncated or corrupt files) are logged and moved to ``<folder>_unreadable/<step>``, so that
  the run rewrites them. If none restores it raises ``CheckpointRestoreError``: a run never
  starts from scratch because its checkpoints could not be read.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp

from sympow.train.workdir import probe_writable

CHECKPOINT_DIR = "checkpoints"
ITEMS = ("model", "train", "meta")
UNREADABLE_SUFFIX = "_unreadable"

log = logging.getLogger("sympow.train")


class CheckpointWriteError(OSError):
    """A checkpoint could not be written; the checkpoints already on disk are intact."""


class CheckpointRestoreError(RuntimeError):
    """Checkpoints exist but none of them can be restored."""


def _first_line(error: BaseException, head: int = 150, tail: int = 250) -> str:
    """``Type: message`` on one line; a long message keeps its start and its end (orbax puts
    the operating system's reason, e.g. 'No space left on device', last)."""
    text = str(error).strip().splitlines()[0] if str(error).strip() else ""
    text = text if len(text) <= head + tail else f"{text[:head]} ... {text[-tail:]}"
    return f"{type(error).__name__}: {text}"


def checkpoint_dir(workdir: str | os.PathLike) -> Path:
    return Path(workdir).resolve() / CHECKPOINT_DIR


def with_sharding(abstract, sharding):
    """ShapeDtypeStructs of ``abstract`` placed with ``sharding`` (a restore target)."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding),
                        abstract)


class Checkpointer:
    """Thin wrapper over ``ocp.CheckpointManager`` with the run's items and retention.

    Args:
      directory: the checkpoints folder (created).
      max_to_keep: newest checkpoints kept (None: all).
      keep_period: also keep every step that is a multiple of this (None: no extra).
      async_save: write in a background thread (``wait`` and ``close`` wait for it).
      read_only: open an existing folder for restoring only (no retention, no creation, no
        removal of partial saves).
    """

    def __init__(self, directory: str | os.PathLike, *, max_to_keep: int | None = 3,
                 keep_period: int | None = None, async_save: bool = True,
                 read_only: bool = False):
        self.directory = Path(directory).resolve()
        self.read_only = read_only
        if read_only:  # never saves, so nothing is deleted either
            max_to_keep, keep_period = None, None
        options = ocp.CheckpointManagerOptions(
            max_to_keep=max_to_keep, keep_period=keep_period or None, save_interval_steps=1,
            enable_async_checkpointing=async_save, create=not read_only,
            cleanup_tmp_directories=not read_only)
        self._manager = ocp.CheckpointManager(self.directory, options=options, item_names=ITEMS)
        self._pending: int | None = None  # the step being written in the background

    def all_steps(self) -> list[int]:
        return sorted(self._manager.all_steps())

    def latest_step(self) -> int | None:
        return self._manager.latest_step()

    def _write_error(self, step: int | None, error: BaseException) -> CheckpointWriteError:
        try:
            self._manager.reload()  # orbax's step list may still hold the failed step
            intact = f"the checkpoints on disk are intact: steps {self.all_steps()}"
        except Exception:  # the folder itself is unreadable: say nothing about it
            intact = "the checkpoints on disk were not touched"
        what = "a checkpoint" if step is None else f"step {step}"
        return CheckpointWriteError(f"checkpoint: saving {what} to {self.directory} failed "
                                    f"({_first_line(error)}); {intact}")

    def save_finished(self) -> bool:
        """True once the background save started by ``save`` has ended, successfully or not
        (``wait`` then returns at once, raising if it failed). Cheap: poll it every step."""
        return self._pending is not None and not self._manager.is_saving_in_progress()

    def wait(self) -> None:
        """Waits for the background save; CheckpointWriteError if it failed."""
        step, self._pending = self._pending, None
        try:
            self._manager.wait_until_finished()
        except Exception as error:
            raise self._write_error(step, error) from error

    def save(self, step: int, state: dict[str, Any], meta: dict[str, Any]) -> bool:
        """Saves a TrainState (see ``sympow.train.steps``) at ``step``; False if it exists.

        Raises CheckpointWriteError if this save cannot start or the previous one failed.
        """
        self.wait()  # orbax would wait too; here a failure of the previous save is named
        if step in self._manager.all_steps():
            return False
        model = {"params": state["params"], "rest": state["rest"]}
        train = {"opt_state": state["opt_state"], "step": state["step"], "rng": state["rng"]}
        try:
            probe_writable(self.directory)
            started = self._manager.save(step, args=ocp.args.Composite(
                model=ocp.args.StandardSave(model), train=ocp.args.StandardSave(train),
                meta=ocp.args.JsonSave(meta)), force=True)
        except Exception as error:
            raise self._write_error(step, error) from error
        self._pending = step if started else None
        return started

    def restore_model(self, step: int, abstract_model: dict[str, Any]) -> tuple[dict, dict]:
        """({params, rest}, meta) at ``step``; ``abstract_model`` gives shapes and shardings."""
        out = self._manager.restore(step, args=ocp.args.Composite(
            model=ocp.args.StandardRestore(abstract_model), meta=ocp.args.JsonRestore()))
        return out["model"], dict(out["meta"])

    def restore(self, step: int, abstract_state: dict[str, Any]) -> tuple[dict, dict]:
        """(TrainState, meta) at ``step``; ``abstract_state`` gives shapes and shardings."""
        model = {"params": abstract_state["params"], "rest": abstract_state["rest"]}
        train = {k: abstract_state[k] for k in ("opt_state", "step", "rng")}
        out = self._manager.restore(step, args=ocp.args.Composite(
            model=ocp.args.StandardRestore(model), train=ocp.args.StandardRestore(train),
            meta=ocp.args.JsonRestore()))
        return {**out["model"], **out["train"]}, dict(out["meta"])

    def restore_latest(self, abstract_state: dict[str, Any],
                       check: Callable[[int, dict, dict], None] | None = None,
                       ) -> tuple[int, dict, dict] | None:
        """(step, TrainState, meta) of the newest checkpoint that restores, or None if there
        are no checkpoints.

        ``check(step, state, meta)`` may raise to reject a restored checkpoint (e.g. a step
        that disagrees with its meta). Checkpoints newer than the one restored failed to
        restore: each is logged with its error and moved to ``<folder>_unreadable/<step>``
        (left in place when ``read_only``). Raises CheckpointRestoreError, moving nothing, if
        none restores (a wrong config is as likely as corruption then).
        """
        failures: list[tuple[int, BaseException]] = []
        for step in reversed(self.all_steps()):
            try:
                state, meta = self.restore(step, abstract_state)
                if check is not None:
                    check(step, state, meta)
            except Exception as error:  # orbax raises many types for bad files
                log.warning("checkpoint %s cannot be restored (%s); trying the one before it",
                            self.directory / str(step), _first_line(error))
                failures.append((step, error))
                continue
            if failures:
                if not self.read_only:  # out of the way, so that the run rewrites those steps
                    for bad, _ in failures:
                        self._move_unreadable(bad)
                where = "left in place" if self.read_only else f"moved to {self._unreadable_dir()}"
                log.warning("resuming from step %d: newer checkpoint(s) %s were unreadable, %s",
                            step, [s for s, _ in failures], where)
            return step, state, meta
        if failures:
            listed = "; ".join(f"step {s}: {_first_line(e)}" for s, e in failures)
            raise CheckpointRestoreError(
                f"checkpoint: none of the checkpoints in {self.directory} can be restored "
                f"({listed}). Not starting from scratch: if the config changed, train with the "
                "one saved in the workdir (config.json); to start over, move the folder away"
            ) from failures[0][1]
        return None

    def _unreadable_dir(self) -> Path:
        return self.directory.parent / (self.directory.name + UNREADABLE_SUFFIX)

    def _move_unreadable(self, step: int) -> None:
        """Moves the folder of ``step`` out of the way (kept for inspection, never deleted)."""
        if jax.process_index() == 0:
            target = self._unreadable_dir() / str(step)
            n = 0
            while target.exists():  # an earlier unreadable copy of the same step
                n += 1
                target = self._unreadable_dir() / f"{step}-{n}"
            target.parent.mkdir(parents=True, exist_ok=True)
            os.replace(self.directory / str(step), target)
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils

            multihost_utils.sync_global_devices(f"sympow_move_unreadable_{step}")
        self._manager.reload()

    def close(self) -> None:
        """Waits for the background save (CheckpointWriteError if it failed) and closes."""
        try:
            self.wait()
        except CheckpointWriteError:
            try:
                self._manager.close()
            except Exception:  # the same failure again; the first one is being raised
                pass
            raise
        self._manager.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
