"""Orbax checkpoints of a training run: ``<workdir>/checkpoints/<step>/{model,train,meta}``.

Items: ``model`` = {params, rest} (all evaluation needs), ``train`` = {opt_state, step, rng},
``meta`` = JSON {step, data_index, tokens, ...}. The data position is the step itself (batch
k of a run is loader index k; see ``sympow.train.data``). Saves are asynchronous; a checkpoint
becomes visible (its step folder appears) only once fully written, so a run killed mid-save
resumes from the previous one.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp

CHECKPOINT_DIR = "checkpoints"
ITEMS = ("model", "train", "meta")


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
      async_save: write in a background thread (``close`` waits for it to finish).
      read_only: open an existing folder for restoring only (no retention, no creation).
    """

    def __init__(self, directory: str | os.PathLike, *, max_to_keep: int | None = 3,
                 keep_period: int | None = None, async_save: bool = True,
                 read_only: bool = False):
        self.directory = Path(directory).resolve()
        if read_only:  # never saves, so nothing is deleted either
            max_to_keep, keep_period = None, None
        options = ocp.CheckpointManagerOptions(
            max_to_keep=max_to_keep, keep_period=keep_period or None, save_interval_steps=1,
            enable_async_checkpointing=async_save, create=not read_only)
        self._manager = ocp.CheckpointManager(self.directory, options=options, item_names=ITEMS)

    def all_steps(self) -> list[int]:
        return sorted(self._manager.all_steps())

    def latest_step(self) -> int | None:
        return self._manager.latest_step()

    def save(self, step: int, state: dict[str, Any], meta: dict[str, Any]) -> bool:
        """Saves a TrainState (see ``sympow.train.steps``) at ``step``; False if it exists."""
        if step in self._manager.all_steps():
            return False
        model = {"params": state["params"], "rest": state["rest"]}
        train = {"opt_state": state["opt_state"], "step": state["step"], "rng": state["rng"]}
        return self._manager.save(step, args=ocp.args.Composite(
            model=ocp.args.StandardSave(model), train=ocp.args.StandardSave(train),
            meta=ocp.args.JsonSave(meta)), force=True)

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

    def close(self) -> None:
        self._manager.wait_until_finished()
        self._manager.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
