"""sympow.train.optim: learning-rate schedules at given steps, gradient clipping, weight decay
on matrices only, invalid settings (each a ValueError naming the field)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from sympow.train.optim import learning_rate_schedule, make_optimizer

LR = 1e-3


def optim(**fields) -> dict:
    return {"name": "adam", "learning_rate": LR, **fields}


@pytest.mark.parametrize("fields, values", [
    ({}, {0: LR, 7: LR, 10_000: LR}),  # the papers' setting: constant, no warmup
    ({"warmup_steps": 10}, {0: 0.0, 5: LR / 2, 10: LR, 500: LR}),  # linear warmup
    # warmup to LR over 10 steps, then half a cosine from LR down to 0.1 LR over steps 10..110
    ({"schedule": "cosine", "warmup_steps": 10}, {0: 0.0, 5: LR / 2, 10: LR,
                                                  60: (0.1 + 0.9 * 0.5) * LR, 110: 0.1 * LR}),
    ({"schedule": "cosine", "min_lr_ratio": 0.0}, {0: LR, 55: LR / 2, 110: 0.0}),
])
def test_schedule_values(fields, values):
    schedule = learning_rate_schedule(optim(**fields), num_train_steps=110)
    for step, want in values.items():
        assert float(schedule(step)) == pytest.approx(want, rel=1e-5, abs=1e-12), step


def update(fields: dict, grads: dict, params: dict) -> dict:
    optimizer, _ = make_optimizer(optim(**fields), num_train_steps=10)
    updates, _ = optimizer.update(grads, optimizer.init(params), params)
    return {k: np.asarray(v) for k, v in updates.items()}


def test_gradient_clipping_scales_the_gradient_by_its_global_norm():
    """With eps = 1 Adam's first update is -lr g / (|g| + 1), so the scale of g shows: g =
    (3, 4) has norm 5, clipped to norm 1 it is (0.6, 0.8)."""
    params, grads = {"w": jnp.zeros(2)}, {"w": jnp.asarray([3.0, 4.0])}
    common = {"learning_rate": 1.0, "eps": 1.0}
    clipped = update({**common, "grad_clip": 1.0}, grads, params)["w"]
    np.testing.assert_allclose(clipped, [-0.6 / 1.6, -0.8 / 1.8], rtol=2e-5)  # float32
    unclipped = update({**common, "grad_clip": 0.0}, grads, params)["w"]
    np.testing.assert_allclose(unclipped, [-3 / 4, -4 / 5], rtol=2e-5)
    loose = update({**common, "grad_clip": 10.0}, grads, params)["w"]  # norm 5 < 10: no-op
    np.testing.assert_allclose(loose, unclipped, rtol=2e-5)


def test_weight_decay_on_matrices_only_and_only_for_adamw():
    """A zero gradient leaves Adam's part at 0, so the update is the decay -lr wd w alone."""
    params = {"kernel": jnp.full((2, 2), 2.0), "bias": jnp.full((2,), 2.0)}
    grads = {k: jnp.zeros_like(v) for k, v in params.items()}
    decayed = update({"name": "adamw", "learning_rate": 0.1, "weight_decay": 0.5}, grads, params)
    np.testing.assert_allclose(decayed["kernel"], np.full((2, 2), -0.1 * 0.5 * 2.0), rtol=1e-6)
    np.testing.assert_array_equal(decayed["bias"], [0.0, 0.0])
    plain = update({"name": "adam", "learning_rate": 0.1, "weight_decay": 0.5}, grads, params)
    np.testing.assert_array_equal(plain["kernel"], np.zeros((2, 2)))


def test_adam_first_step_moves_each_weight_by_the_learning_rate():
    """Adam's bias-corrected first step is -lr g / (|g| + eps) = -lr sign(g)."""
    grads = {"w": jnp.asarray([2.0, -3.0, 1e-3])}
    got = update({"learning_rate": 0.01}, grads, {"w": jnp.zeros(3)})["w"]
    np.testing.assert_allclose(got, [-0.01, 0.01, -0.01], rtol=1e-4)


@pytest.mark.parametrize("fields, match", [
    ({"schedule": "linear"}, "optim.schedule: 'linear'"),
    ({"name": "sgd"}, "optim.name: 'sgd'"),
    ({"learning_rate": 0.0}, r"optim.learning_rate: need a finite number > 0, got 0.0"),
    ({"learning_rate": float("nan")}, "optim.learning_rate: need a finite number > 0, got nan"),
    ({"learning_rate": None}, "optim.learning_rate: missing"),
    ({"learning_rate": True}, "optim.learning_rate: need a finite number > 0, got True"),
    ({"b2": 1.0}, r"optim.b2: need a number in \[0, 1\), got 1.0"),
    ({"eps": 0}, "optim.eps: need a finite number > 0, got 0"),
    ({"warmup_steps": 2.5}, "optim.warmup_steps: need an int >= 0, got 2.5"),
    ({"min_lr_ratio": 1.5}, r"optim.min_lr_ratio: need a number in \[0, 1\]"),
])
def test_invalid_settings_raise(fields, match):
    with pytest.raises(ValueError, match=match):
        make_optimizer(optim(**fields), num_train_steps=10)
