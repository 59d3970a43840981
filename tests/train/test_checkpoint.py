"""sympow.train.checkpoint: save / restore round trip of a TrainState-shaped pytree and its
meta, retention (newest N plus every keep_period-th step), read-only opening; faults: saves
that fail (a full disk, a read-only folder) and unreadable checkpoints on restore."""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sympow.train import data as datalib
from sympow.train.checkpoint import (
    Checkpointer,
    CheckpointRestoreError,
    CheckpointWriteError,
    checkpoint_dir,
    with_sharding,
)
from tests.train.helpers import file_size_limit, truncate_data_files


def state(i: int) -> dict:
    """A small TrainState (see sympow.train.steps) whose every leaf depends on i."""
    return {"params": {"w": jnp.full((2, 3), float(i)), "b": jnp.arange(3.0) + i},
            "rest": {}, "opt_state": (jnp.arange(4, dtype=jnp.int32) * i,),
            "step": jnp.asarray(i, jnp.int32), "rng": jax.random.PRNGKey(i)}


def save_steps(directory, steps, **kwargs) -> list[bool]:
    with Checkpointer(directory, **kwargs) as ckpt:
        return [ckpt.save(i, state(i), {"step": i, "data_index": i}) for i in steps]


def test_round_trip(tmp_path):
    assert checkpoint_dir(tmp_path) == tmp_path.resolve() / "checkpoints"
    assert save_steps(checkpoint_dir(tmp_path), [3, 7], max_to_keep=None) == [True, True]
    abstract = jax.eval_shape(lambda: state(0))
    with Checkpointer(checkpoint_dir(tmp_path), read_only=True) as ckpt:
        assert ckpt.all_steps() == [3, 7] and ckpt.latest_step() == 7
        restored, meta = ckpt.restore(3, abstract)
        model, meta7 = ckpt.restore_model(7, {"params": abstract["params"], "rest": {}})
    assert meta == {"step": 3, "data_index": 3} and meta7["step"] == 7
    for got, want in zip(jax.tree.leaves(restored), jax.tree.leaves(state(3)), strict=True):
        assert got.dtype == want.dtype
        np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(restored["rng"], [0, 3])  # PRNGKey(3) = [0, 3]
    assert set(model) == {"params", "rest"}
    np.testing.assert_array_equal(model["params"]["w"], np.full((2, 3), 7.0))


def test_saving_an_existing_step_is_refused(tmp_path):
    assert save_steps(tmp_path, [1, 1, 2]) == [True, False, True]


@pytest.mark.parametrize("kwargs, kept", [
    (dict(max_to_keep=2), [4, 5]),
    (dict(max_to_keep=1, keep_period=2), [2, 4, 5]),  # newest, plus multiples of 2
    (dict(max_to_keep=None), [1, 2, 3, 4, 5]),
])
def test_retention(tmp_path, kwargs, kept):
    save_steps(tmp_path, range(1, 6), **kwargs)
    with Checkpointer(tmp_path, read_only=True) as ckpt:
        assert ckpt.all_steps() == kept


def test_read_only_creates_nothing(tmp_path):
    with Checkpointer(tmp_path / "none", read_only=True) as ckpt:
        assert ckpt.all_steps() == [] and ckpt.latest_step() is None
    assert not (tmp_path / "none").exists()


def test_with_sharding_places_restore_targets():
    sharding = datalib.replicated(datalib.make_mesh())
    target = with_sharding(jax.eval_shape(lambda: state(0)), sharding)
    leaves = jax.tree.leaves(target)
    assert all(isinstance(x, jax.ShapeDtypeStruct) and x.sharding == sharding for x in leaves)
    assert target["params"]["w"].shape == (2, 3) and target["step"].dtype == jnp.int32


def assert_state(got, i: int) -> None:
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(state(i)), strict=True):
        np.testing.assert_array_equal(a, b)


def big_state(i: int) -> dict:
    """``state(i)`` with 1.2 MB of incompressible parameters."""
    return {**state(i), "params": {**state(i)["params"],
                                   "big": jax.random.normal(jax.random.key(i), (300_000,))}}


# orbax's background writer reports the failure again as it is torn down
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_failed_save_raises_naming_the_folder_and_keeps_the_previous(tmp_path):
    ckpt = Checkpointer(tmp_path / "ckpt", max_to_keep=1)  # retention would delete step 1
    ckpt.save(1, big_state(1), {"step": 1, "data_index": 1})
    ckpt.wait()
    with file_size_limit(200_000):
        ckpt.save(2, big_state(2), {"step": 2, "data_index": 2})  # fails in the background
        deadline = time.monotonic() + 60
        while not ckpt.save_finished():  # polling does not block and does not raise
            assert time.monotonic() < deadline, "the failing save did not end within 60 s"
            time.sleep(0.01)
        with pytest.raises(CheckpointWriteError, match=r"checkpoint: saving step 2 to .*ckpt "
                           r"failed \(.*File too large.*\); the checkpoints on disk are intact: "
                           r"steps \[1\]"):
            ckpt.wait()
    ckpt.close()  # the failure was reported once
    with Checkpointer(tmp_path / "ckpt", read_only=True) as back:
        assert back.all_steps() == [1]
        restored, _ = back.restore(1, jax.eval_shape(lambda: big_state(0)))
    np.testing.assert_array_equal(restored["params"]["big"], big_state(1)["params"]["big"])


def test_save_into_a_read_only_folder_fails_at_once(tmp_path, make_read_only):
    """Orbax alone would fail in a background thread and leave threads waiting for the step
    folder, hanging the process at exit; the probe fails before orbax starts."""
    ckpt = Checkpointer(make_read_only(tmp_path / "ckpt"))
    with pytest.raises(CheckpointWriteError, match=r"saving step 1 to .*ckpt failed \(.*"
                                                   r"(Read-only|Permission denied)"):
        ckpt.save(1, state(1), {"step": 1, "data_index": 1})
    ckpt.close()


def test_unreadable_newest_checkpoints_are_set_aside(tmp_path, train_log):
    directory = tmp_path / "ckpt"
    save_steps(directory, [3, 6, 9], max_to_keep=None)
    truncate_data_files(directory / "9")
    (directory / "6" / "meta" / "metadata").unlink()
    abstract = jax.eval_shape(lambda: state(0))
    with Checkpointer(directory) as ckpt:
        step, restored, meta = ckpt.restore_latest(abstract)
        assert (step, meta) == (3, {"step": 3, "data_index": 3})
        assert_state(restored, 3)
        assert ckpt.all_steps() == [3]
        assert ckpt.save(6, state(6), {"step": 6, "data_index": 6})  # rewritten in its place
    assert sorted(p.name for p in (tmp_path / "ckpt_unreadable").iterdir()) == ["6", "9"]
    warnings = [r.getMessage() for r in train_log.records if r.levelname == "WARNING"]
    assert any(f"{directory / '9'} cannot be restored" in w for w in warnings), warnings
    assert any(f"{directory / '6'} cannot be restored" in w for w in warnings), warnings
    assert any("resuming from step 3" in w and "[9, 6]" in w for w in warnings), warnings


def test_check_rejects_a_restored_checkpoint(tmp_path):
    save_steps(tmp_path / "ckpt", [1, 2], max_to_keep=None)

    def check(step, restored, meta):
        if step == 2:
            raise ValueError("inconsistent")

    with Checkpointer(tmp_path / "ckpt") as ckpt:
        assert ckpt.restore_latest(jax.eval_shape(lambda: state(0)), check)[0] == 1
    assert (tmp_path / "ckpt_unreadable" / "2").is_dir()


def test_no_restorable_checkpoint_raises_and_moves_nothing(tmp_path):
    directory = tmp_path / "ckpt"
    save_steps(directory, [3, 6], max_to_keep=None)
    for step in ("3", "6"):
        truncate_data_files(directory / step)
    with Checkpointer(directory) as ckpt:
        with pytest.raises(CheckpointRestoreError, match=rf"none of the checkpoints in "
                           rf"{directory} can be restored \(step 6: .*; step 3: .*\)\. Not "
                           "starting from scratch"):
            ckpt.restore_latest(jax.eval_shape(lambda: state(0)))
        assert ckpt.all_steps() == [3, 6]
    assert not (tmp_path / "ckpt_unreadable").exists()
    with Checkpointer(tmp_path / "empty") as ckpt:
        assert ckpt.restore_latest(jax.eval_shape(lambda: state(0))) is None
