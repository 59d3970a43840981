"""sympow.train.checkpoint: save / restore round trip of a TrainState-shaped pytree and its
meta, retention (newest N plus every keep_period-th step), read-only opening."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sympow.train import data as datalib
from sympow.train.checkpoint import Checkpointer, checkpoint_dir, with_sharding


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
