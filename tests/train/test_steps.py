"""sympow.train.steps: per-token cross entropy, the train step against an independent gradient
(SGD makes the update visible), microbatching = one batch, the contextwise sums."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from sympow.train.model import init_model_state, model_def
from sympow.train.steps import (
    init_train_state,
    logsumexp_one_pass,
    make_contextwise_fn,
    make_train_step,
    token_losses,
)
from tests.train.helpers import MODEL

LR = 0.5


def log_softmax_nll(logits, labels) -> np.ndarray:
    """-log softmax(logits)[label] in float64 numpy."""
    logits = np.asarray(logits, np.float64)
    top = logits.max(-1, keepdims=True)
    log_z = top[..., 0] + np.log(np.exp(logits - top).sum(-1))
    return log_z - np.take_along_axis(logits, np.asarray(labels)[..., None], -1)[..., 0]


def test_token_losses_gradient_is_one_elementwise_pass():
    """The custom backward equals autodiff of optax's cross entropy (float32 logits, a
    non-uniform cotangent), returns the logits' dtype, and has no scatter: one pass."""
    rng = np.random.default_rng(2)
    logits = jnp.asarray(3 * rng.normal(size=(2, 4, 11)), jnp.float32)
    labels = jnp.asarray(rng.integers(0, 11, (2, 4)), jnp.int32)
    dloss = jnp.asarray(rng.uniform(0.1, 2.0, (2, 4)), jnp.float32)
    ours = jax.vjp(lambda x: token_losses(x, labels), logits)[1](dloss)[0]
    theirs = jax.vjp(lambda x: optax.softmax_cross_entropy_with_integer_labels(x, labels),
                     logits)[1](dloss)[0]
    np.testing.assert_allclose(ours, theirs, rtol=1e-5, atol=1e-6)
    assert not np.allclose(ours, 0.0)
    low = jax.grad(lambda x: token_losses(x, labels).sum())(logits.astype(jnp.bfloat16))
    assert low.dtype == jnp.bfloat16
    np.testing.assert_allclose(low.astype(jnp.float32),
                               jax.grad(lambda x: token_losses(x, labels).sum())(
                                   logits.astype(jnp.bfloat16).astype(jnp.float32)),
                               rtol=2 ** -7, atol=1e-3)
    backward = jax.make_jaxpr(jax.grad(lambda x: token_losses(x, labels).sum()))(logits)
    plain = jax.make_jaxpr(jax.grad(
        lambda x: optax.softmax_cross_entropy_with_integer_labels(x, labels).sum()))(logits)
    assert "scatter" not in str(backward) and "scatter" in str(plain)  # nested jaxprs too


@pytest.mark.parametrize("scale", [1.0, 40.0])
def test_logsumexp_one_pass_matches_two_passes(scale):
    rng = np.random.default_rng(3)
    x = jnp.asarray(scale * rng.normal(size=(3, 4, 257)), jnp.float32)
    x = x.at[0, 0].set(-jnp.inf).at[1, 1, :100].set(-jnp.inf).at[2, 2, 5].set(80.0 * scale)
    ours, theirs = logsumexp_one_pass(x), jax.nn.logsumexp(x, axis=-1)
    assert float(ours[0, 0]) == -np.inf  # an all -inf row, as the two-pass form gives
    np.testing.assert_allclose(np.asarray(ours)[~np.isinf(np.asarray(theirs))],
                               np.asarray(theirs)[~np.isinf(np.asarray(theirs))], rtol=2e-6)
    assert np.isinf(np.asarray(ours)).sum() == 1


@pytest.fixture(scope="module")
def setup():
    mdef = model_def(MODEL)
    params, rest = init_model_state(mdef, seed=1)
    rng = np.random.default_rng(0)
    inputs, labels = (jnp.asarray(rng.integers(0, 64, (4, 8)), jnp.int32) for _ in range(2))
    return mdef, params, rest, inputs, labels


def test_token_losses():
    logits = jnp.asarray(np.random.default_rng(1).normal(size=(2, 3, 5)), jnp.bfloat16)
    labels = jnp.asarray([[0, 4, 2], [1, 1, 3]], jnp.int32)
    got = token_losses(logits, labels)
    assert got.shape == (2, 3) and got.dtype == jnp.float32
    np.testing.assert_allclose(got, log_softmax_nll(logits.astype(jnp.float32), labels),
                               rtol=1e-5)


def test_init_train_state(setup):
    mdef, params, rest, _, _ = setup
    state = init_train_state(params, rest, optax.sgd(LR), seed=7)
    assert state["step"].dtype == jnp.int32 and int(state["step"]) == 0
    np.testing.assert_array_equal(state["rng"], [0, 7])  # PRNGKey(7)


def test_train_step_is_sgd_on_the_mean_cross_entropy(setup):
    mdef, params, rest, inputs, labels = setup
    schedule = optax.constant_schedule(LR)
    step = jax.jit(make_train_step(mdef, optax.sgd(schedule), schedule))
    state = init_train_state(params, rest, optax.sgd(schedule), seed=0)
    new, metrics = step(state, inputs, labels)

    def loss(params):  # the GPT called directly, not through ModelDef.apply
        logits = nnx.merge(mdef.graphdef, params, rest)(inputs)
        return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

    grads = jax.grad(loss)(params)
    logits = nnx.merge(mdef.graphdef, params, rest)(inputs)
    assert float(metrics["loss"]) == pytest.approx(log_softmax_nll(logits, labels).mean(),
                                                   rel=1e-5)
    norm = np.sqrt(sum(np.sum(np.asarray(g, np.float64) ** 2) for g in jax.tree.leaves(grads)))
    assert float(metrics["grad_norm"]) == pytest.approx(norm, rel=1e-5)
    assert float(metrics["learning_rate"]) == LR and int(new["step"]) == 1
    for got, p, g in zip(*(jax.tree.leaves(t) for t in (new["params"], params, grads)),
                         strict=True):
        np.testing.assert_allclose(got, np.asarray(p) - LR * np.asarray(g), rtol=1e-5,
                                   atol=1e-6)


def test_microbatches_give_the_same_update(setup):
    mdef, params, rest, inputs, labels = setup
    optimizer, schedule = optax.adam(1e-2), optax.constant_schedule(1e-2)
    results = []
    for m in (1, 4):  # 4 slices of one row each: rows 0, 1, 2, 3
        state = init_train_state(params, rest, optimizer, seed=0)
        results.append(jax.jit(make_train_step(mdef, optimizer, schedule, m))(
            state, inputs, labels))
    (one, m1), *others = results
    for state, metrics in others:
        assert float(metrics["loss"]) == pytest.approx(float(m1["loss"]), rel=1e-5)
        assert float(metrics["grad_norm"]) == pytest.approx(float(m1["grad_norm"]), rel=1e-4)
        for a, b in zip(jax.tree.leaves(state["params"]), jax.tree.leaves(one["params"]),
                        strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)
    step = make_train_step(mdef, optimizer, schedule, 3)
    with pytest.raises(ValueError, match="microbatches: 3 does not divide the batch of 4"):
        step(init_train_state(params, rest, optimizer, seed=0), inputs, labels)


def test_contextwise_fn_sums_losses_over_rows(setup):
    mdef, params, rest, inputs, labels = setup
    got = jax.jit(make_contextwise_fn(mdef))(params, rest, inputs, labels)
    logits = nnx.merge(mdef.graphdef, params, rest)(inputs)
    assert got.shape == (8,)
    np.testing.assert_allclose(got, log_softmax_nll(logits, labels).sum(0), rtol=1e-5)
