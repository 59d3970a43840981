"""Launching the portable tier's kernels: `pl.pallas_call` with the tier's conventions.

On GPU a `pallas_call` lowers through Triton (docs/design.md §5.3); everywhere else it runs
in the Pallas interpreter, which is how CI tests the kernels on CPU. Also the small helpers
every kernel body uses: integer division of traced grid indices, the (batch, head) split of
a grid axis, and a matrix product with float32 accumulation.
"""

from __future__ import annotations

import warnings
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

# The one warning we silence: jax >= 0.11 emits it (DeprecationWarning) each time a
# pallas_call is lowered through Triton. Lowering happens when the caller's jit compiles,
# after our functions returned, so a filter around our call site cannot see it: the filter
# is process-wide, matching only this message and category, and (re)installed by each
# launch of a Triton kernel (a caller's warnings.catch_warnings may have dropped it).
TRITON_DEPRECATION = (r"The Pallas Triton backend is deprecated and will be removed in"
                      r" a future JAX version")


def ignore_triton_deprecation() -> None:
    for action, message, category, *_ in warnings.filters:
        if (action == "ignore" and category is DeprecationWarning
                and getattr(message, "pattern", None) == TRITON_DEPRECATION):
            return
    warnings.filterwarnings("ignore", message=TRITON_DEPRECATION, category=DeprecationWarning)


class LaunchPlan(NamedTuple):
    """The least `launch` reads of a plan, for kernels with no plan of their own: the
    interpreter or Triton, and Triton's pipelining depth."""

    interpret: bool
    stages: int = 1


def launch(kernel, *, plan, name: str, grid, in_specs, out_specs, out_shape, warps: int,
           stages: int | None = None, aliases: dict[int, int] | None = None):
    """pl.pallas_call with the tier's conventions (Triton on GPU, interpreter elsewhere).

    plan: any object with `interpret` and `stages` (a Plan, a PrefixPlan, a LaunchPlan); `stages`
    overrides plan.stages. aliases: {input index: output index} written in place.
    """
    interpret, params = plan.interpret, None
    if not interpret:
        from jax.experimental.pallas import triton as plt

        ignore_triton_deprecation()
        params = plt.CompilerParams(num_warps=warps, num_stages=stages or plan.stages)
    return pl.pallas_call(kernel, out_shape=out_shape, grid=grid, in_specs=in_specs,
                          out_specs=out_specs, interpret=interpret, name=name,
                          compiler_params=params, input_output_aliases=aliases or {})


def idiv(a, b):
    """a // b for non-negative traced ints (lax.div: jnp's floor division does not lower)."""
    a = jnp.asarray(a)
    return jax.lax.div(a, jnp.asarray(b, a.dtype))


def irem(a, b):
    """a % b for non-negative traced ints."""
    a = jnp.asarray(a)
    return jax.lax.rem(a, jnp.asarray(b, a.dtype))


def split_heads(bh, heads: int):
    """(batch, head) of a grid index over batch * heads."""
    return idiv(bh, heads), irem(bh, heads)


def dot(a, b, plan, *, trans_a: bool = False, trans_b: bool = False):
    """a @ b in float32 with operands cast to the plan's matmul dtype; optional transposes.

    plan: a `plan.Plan` (its mm_dtype and precision).
    """
    dims = (((0 if trans_a else 1,), (1 if trans_b else 0,)), ((), ()))
    return jax.lax.dot_general(a.astype(plan.mm_dtype), b.astype(plan.mm_dtype), dims,
                               precision=plan.precision, preferred_element_type=jnp.float32)
