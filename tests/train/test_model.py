"""sympow.train.model: ``config.model`` -> GPTConfig, the abstract model definition and its
parameter count, sharded initialization equal to building the GPT directly."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from sympow.layers import GPT
from sympow.train.model import gpt_config, init_model_state, model_def
from tests.layers.helpers import gpt2_params
from tests.train.helpers import MODEL


def test_gpt_config_from_config_fields():
    config = gpt_config({**MODEL, "dtype": "bfloat16"})
    assert config.dtype == jnp.bfloat16 and config.param_dtype == jnp.float32
    assert (config.vocab_size, config.n_layer, config.d_model) == (64, 1, 16)
    with pytest.raises(ValueError, match="model.dtype: 'float8'"):
        gpt_config({**MODEL, "dtype": "float8"})
    with pytest.raises(ValueError, match=r"unknown GPTConfig field\(s\) \['n_embd'\]"):
        gpt_config({**MODEL, "n_embd": 16})


def test_model_def_counts_gpt2_parameters():
    mdef = model_def(MODEL)
    assert mdef.num_params == gpt2_params(64, 1, 16)
    assert jax.tree.leaves(mdef.abstract_rest) == []  # the GPT keeps no buffers


def test_init_and_apply_equal_the_gpt_built_directly():
    mdef = model_def(MODEL)
    params, rest = init_model_state(mdef, seed=5)
    direct = GPT(gpt_config(MODEL), rngs=nnx.Rngs(5))
    want = nnx.state(direct, nnx.Param)
    for got, ref in zip(jax.tree.leaves(params), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(got, ref, rtol=1e-6, atol=1e-9)  # jitted vs eager init
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 64, (2, 9)), jnp.int32)
    logits, _ = mdef.apply(params, rest, tokens)
    assert logits.shape == (2, 9, 64) and logits.dtype == jnp.float32
    np.testing.assert_allclose(logits, direct(tokens), rtol=1e-6, atol=1e-6)
    other, _ = init_model_state(mdef, seed=6)
    assert not np.array_equal(other["wte"]["embedding"][...], params["wte"]["embedding"][...])


def test_init_places_the_state_with_the_sharding_asked():
    """Built on the host's CPU backend, then placed (a GPU compiled GPT-2 small's jitted
    initializer for minutes): the arrays carry the requested sharding, or the default
    device without one."""
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    mdef = model_def(MODEL)
    mesh = Mesh(np.asarray(jax.devices()), ("data",))
    replicated = NamedSharding(mesh, PartitionSpec())
    params, _ = init_model_state(mdef, seed=5, sharding=replicated)
    for leaf in jax.tree.leaves(params):
        assert leaf.sharding == replicated
    default, _ = init_model_state(mdef, seed=5)
    for leaf, ref in zip(jax.tree.leaves(default), jax.tree.leaves(params), strict=True):
        assert leaf.devices() == {jax.devices()[0]}
        np.testing.assert_array_equal(leaf, ref)
