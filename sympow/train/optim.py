"""Optimizer: Adam(W) with global-norm gradient clipping and an optional schedule.

The papers' setting (docs/references.md: [sympow] §2, [conformal] §4) is Adam with learning
rate 6e-4 and no schedule; ``schedule='cosine'`` (linear warmup then cosine decay to
``min_lr_ratio * learning_rate``) and a linear warmup on the constant schedule are available.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import jax
import optax

SCHEDULES = ("constant", "cosine")
OPTIMIZERS = ("adam", "adamw")

# field -> (test of its value, what the test needs), for ``check_optim``'s messages.
_NUMBER_RULES = {
    "learning_rate": (lambda x: 0 < x < math.inf, "a finite number > 0"),
    "b1": (lambda x: 0 <= x < 1, "a number in [0, 1)"),
    "b2": (lambda x: 0 <= x < 1, "a number in [0, 1)"),
    "eps": (lambda x: 0 < x < math.inf, "a finite number > 0"),
    "weight_decay": (lambda x: 0 <= x < math.inf, "a finite number >= 0"),
    "grad_clip": (lambda x: 0 <= x < math.inf, "a finite number >= 0 (0: no clipping)"),
    "min_lr_ratio": (lambda x: 0 <= x <= 1, "a number in [0, 1]"),
    "warmup_steps": (lambda x: x >= 0 and float(x).is_integer(), "an int >= 0"),
}


def check_optim(optim: Mapping[str, Any]) -> None:
    """Raises ValueError naming the first ``config.optim`` field that is out of range."""
    name = optim.get("name", "adamw")
    if name not in OPTIMIZERS:
        raise ValueError(f"optim.name: {name!r} not in {OPTIMIZERS}")
    if optim.get("schedule", "constant") not in SCHEDULES:
        raise ValueError(f"optim.schedule: {optim['schedule']!r} not in {SCHEDULES}")
    if optim.get("learning_rate") is None:
        raise ValueError("optim.learning_rate: missing")
    for key, (ok, need) in _NUMBER_RULES.items():
        value = optim.get(key)
        if value is None:
            continue  # optional: make_optimizer's default
        number = isinstance(value, (int, float)) and not isinstance(value, bool)
        if not number or not ok(value):
            raise ValueError(f"optim.{key}: need {need}, got {value!r}")


def learning_rate_schedule(optim: Mapping[str, Any], num_train_steps: int) -> optax.Schedule:
    lr, warmup = float(optim["learning_rate"]), int(optim.get("warmup_steps", 0))
    name = optim.get("schedule", "constant")
    if name not in SCHEDULES:
        raise ValueError(f"optim.schedule: {name!r} not in {SCHEDULES}")
    if name == "cosine":
        return optax.warmup_cosine_decay_schedule(
            init_value=0.0, peak_value=lr, warmup_steps=warmup,
            decay_steps=max(num_train_steps, warmup + 1),
            end_value=lr * float(optim.get("min_lr_ratio", 0.1)))
    if warmup > 0:
        return optax.join_schedules(
            [optax.linear_schedule(0.0, lr, warmup), optax.constant_schedule(lr)], [warmup])
    return optax.constant_schedule(lr)


def _decay_mask(params):
    """Weight decay on matrices only (not on norms' scales, biases or per-head gate vectors)."""
    return jax.tree.map(lambda x: x.ndim >= 2, params)


def make_optimizer(optim: Mapping[str, Any], num_train_steps: int):
    """(optax transformation, schedule) for ``config.optim`` (checked by ``check_optim``)."""
    check_optim(optim)
    name = optim.get("name", "adamw")
    schedule = learning_rate_schedule(optim, num_train_steps)
    parts = []
    if float(optim.get("grad_clip", 0.0)) > 0:
        parts.append(optax.clip_by_global_norm(float(optim["grad_clip"])))
    b1, b2, eps = float(optim.get("b1", 0.9)), float(optim.get("b2", 0.999)), float(
        optim.get("eps", 1e-8))
    weight_decay = float(optim.get("weight_decay", 0.0))
    if name == "adam" or weight_decay == 0.0:
        parts.append(optax.adam(schedule, b1=b1, b2=b2, eps=eps))
    else:
        parts.append(optax.adamw(schedule, b1=b1, b2=b2, eps=eps, weight_decay=weight_decay,
                                 mask=_decay_mask))
    return optax.chain(*parts), schedule
