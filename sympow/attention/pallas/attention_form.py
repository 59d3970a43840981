"""The attention form on the tier's attention kernels: one chunk that covers the sequence.

The chunked algorithm's intra-chunk attention (attention_kernels.py) is flash-style already:
a query block walks the key blocks up to the diagonal with an online row max in log space,
and its backward recomputes the weights from the saved row max, so nothing of size
[C, C] is stored. With C = T (one chunk) it is the whole attention form, with no phi and no
state: O(T) memory, any even p. Y = o / den then needs no inter-chunk terms.

Per score the kernels evaluate two transcendentals, log|Q_i . K_j| and one exp (softmax
needs the exp only): the power is taken in log space so that no power under- or overflows
whatever p and the norms (docs/design.md §4). The backward recomputes both. The weights
are invariant to the scales of q and k, but a logit carries a rounding of ulp(p log|s|):
~1e-7 of a weight at |s| <= 1, ~1e-5 at |s| ~ 1e30. So float32 runs, as the chunked driver,
on q and k divided by powers of two (|Q_i . K_j| <= 1); the Hopper tier's bf16 kernels take
them as given (a rounding far below bf16's at any scale; the divisions of q, k and dk and
the two norms were ~5 % of the form's time: docs/kernels.md), with the specification's domain:
each Q_i . K_j finite in float32.

Shapes the kernels do not take run padded: T to a power of two >= 16 (zero rows: zero keys
add nothing, causality keeps padded queries out of real rows), d and e to powers of two
>= 16 (zero columns change no score and no output). Beyond `plan.MAX_FORM_WIDTH` or for
other dtypes it falls back to the blocked pure-JAX form, with a logged reason.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable

import jax.numpy as jnp

from sympow.attention.blocked import blocked_attention, default_block_size
from sympow.attention.chunked import (
    from_chunks,
    gates_or_zeros,
    normalize_queries_and_keys,
    to_chunks,
)
from sympow.attention.config import AttentionConfig
from sympow.attention.pallas import vjps
from sympow.attention.pallas.plan import make_form_plan, padded_width
from sympow.attention.pallas.primitives import pad_to
from sympow.attention.reference import Keys, LogGates, Outputs, Queries, Values
from sympow.numerics import compute_dtype

logger = logging.getLogger(__name__)


@functools.lru_cache(maxsize=64)
def _log_fallback(reason: str) -> None:
    logger.warning("sympow impl='pallas', algorithm='attention' falls back to 'xla' for %s",
                   reason)


def attention_form(config: AttentionConfig, q: Queries, k: Keys, v: Values,
                   log_g: LogGates | None, attention=vjps.attention,
                   min_length: int = 16, in_tokens: Callable | None = None) -> Outputs:
    """Causal gated sympow attention, float32 [B, T, Hq, E]; see the module docstring.
    ``attention``: the attention primitive (plan, q, k, v, a) -> (o, den, m) (the Hopper
    tier passes its own); T runs padded to at least ``min_length`` rows. ``in_tokens``:
    plan -> a primitive (plan, q, k, v, a) -> y = o / den (0 where den = 0) that takes and
    gives the wide arrays in token layout [B, T, H, W], or None; where it gives one, they
    skip chunk layout (no transposes: the Hopper tier's kernels read and write the strided
    rows themselves, and divide), and y comes in that primitive's dtype."""
    t, d, e = q.shape[1], q.shape[-1], v.shape[-1]
    plan = make_form_plan(config.p, padded_width(d), padded_width(e),
                          max(min_length, padded_width(t)), jnp.dtype(q.dtype).name,
                          config.interpret)
    if isinstance(plan, str):
        _log_fallback(plan)
        return blocked_attention(q, k, v, log_g, p=config.p, block=default_block_size(t))
    token_primitive = in_tokens and in_tokens(plan)
    if not token_primitive:  # chunk layout (float32 too): |Q_i . K_j| <= 1, module docstring
        q, k, _ = normalize_queries_and_keys(q, k)
    ct = compute_dtype(q, k, v)
    log_g = gates_or_zeros(log_g, k, ct)
    a = to_chunks(log_g, 1, plan.c)  # [B, Hk, 1, C]; padded gates 0: no real decay changes
    q, k, v = (pad_to(x, -1, width) for x, width in ((q, plan.d), (k, plan.d), (v, plan.e)))
    if token_primitive:  # y [B, C, Hq, E]
        y = token_primitive(plan, *(pad_to(x, 1, plan.c) for x in (q, k, v)), a)
        return y[:, :t, :, :e]
    qc, kc, vc = (to_chunks(x, 1, plan.c) for x in (q, k, v))  # [B, H, 1, C, W]
    o, den, _ = attention(plan, qc, kc, vc, a)
    return from_chunks(vjps.normalized(plan, o, den), t)[..., :e]
