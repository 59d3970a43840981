"""Building the GPT of a config and splitting it into (graphdef, params, rest) for pure steps.

Steps and evaluation are plain ``jax.jit`` functions of nnx states: the graph definition is
static (closed over) and the parameters travel as an ``nnx.State`` pytree, so a step compiles
once and its inputs and outputs can be sharded and checkpointed like any pytree.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from sympow.layers import GPT, GPTConfig

DTYPES = {"bfloat16": jnp.bfloat16, "float32": jnp.float32, "float16": jnp.float16}


def gpt_config(model: Mapping[str, Any]):
    """``GPTConfig`` from ``config.model`` (dtype names such as ``'bfloat16'`` become dtypes)."""
    kwargs = dict(model)
    for key in ("dtype", "param_dtype"):
        if isinstance(kwargs.get(key), str):
            if kwargs[key] not in DTYPES:
                raise ValueError(f"model.{key}: {kwargs[key]!r} not in {sorted(DTYPES)}")
            kwargs[key] = DTYPES[kwargs[key]]
    known = {f.name for f in dataclasses.fields(GPTConfig)}
    unknown = sorted(set(kwargs) - known)
    if unknown:
        raise ValueError(f"model: unknown GPTConfig field(s) {unknown}; known: {sorted(known)}")
    return GPTConfig(**kwargs)


@dataclasses.dataclass(frozen=True)
class ModelDef:
    """The static half of a model: its graph definition and abstract (params, rest) states.

    ``rest`` holds every non-``nnx.Param`` variable (empty for the GPT, which keeps no
    buffers or RNG streams); it is carried through steps and checkpoints all the same.
    """

    graphdef: Any
    abstract_params: Any
    abstract_rest: Any
    model_config: Any

    def merge(self, params, rest):
        return nnx.merge(self.graphdef, params, rest)

    def apply(self, params, rest, tokens):
        """Logits float32 [B, T, V] for int32 tokens [B, T] (and the possibly updated rest)."""
        model = self.merge(params, rest)
        logits = model(tokens)
        _, _, new_rest = nnx.split(model, nnx.Param, ...)
        return logits.astype(jnp.float32), new_rest

    @property
    def num_params(self) -> int:
        return sum(int(x.size) for x in jax.tree.leaves(self.abstract_params))


def model_def(model: Mapping[str, Any]) -> ModelDef:
    """Traces the model's construction abstractly (no memory) to get its graphdef."""
    cfg = gpt_config(model)
    abstract = nnx.eval_shape(lambda: GPT(cfg, rngs=nnx.Rngs(0)))
    graphdef, params, rest = nnx.split(abstract, nnx.Param, ...)
    return ModelDef(graphdef, params, rest, cfg)


def init_model_state(mdef: ModelDef, seed: int, sharding=None):
    """(params, rest) of a fresh model with ``seed``, placed with ``sharding`` (None: the
    default device).

    Built by the host's CPU backend, then placed: issue 14 reports XLA:GPU compiling GPT-2
    small's jitted initializer for minutes on an H100 (a "very slow compile" of
    ``jit_init``; not yet re-measured with this change), while the CPU backend compiles it
    in about 5 s (2-core CPU). Every process builds the
    same values from ``seed`` on its own CPU, so placing them with a global sharding is
    consistent across hosts.
    """
    def init():
        model = GPT(mdef.model_config, rngs=nnx.Rngs(seed))
        _, params, rest = nnx.split(model, nnx.Param, ...)
        return params, rest

    with jax.default_device(jax.devices("cpu")[0]):
        host = jax.jit(init)()
    return jax.device_put(host, sharding if sharding is not None else jax.devices()[0])
