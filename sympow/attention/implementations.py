"""The one implementation table of the attention op: every (algorithm, backend) that exists.

Every caller reads this table: the API (`api.py`) to run a call, the layers to check their
`impl` argument, experiments/benchmark.py and experiments/gpu_check.py to pick what they
time and check. Keys are (algorithm, backend) (docs/design.md §5.1):

  algorithm  'chunked'   the chunked algorithm over four primitives (chunked.py), linear in T
             'attention' the attention form: O(T^2) time; O(T x block) memory in blocked.py,
                         O(T^2) in the reference
             'recurrent' the recurrence, one token at a time
  backend    'mosaic_gpu' the Hopper tier (sympow/attention/mosaic_gpu/): Mosaic GPU
                         kernels on sm90 GPUs (attention; the states for p = 2, d = 64), the
                         portable tier's elsewhere (a logged fallback)
             'pallas'    Pallas kernels (Triton on GPU, the interpreter elsewhere)
             'xla'       pure JAX, memory-conscious
             'reference' the specification forms (reference.py)

The public `impl=` argument names a backend and `algorithm=` an algorithm; either may be
None. Among the rows that match both and run on the platform — with `impl=None` the rows of
the first backend, in table order, that is a default on the platform — the one of least
estimated cost is used when the call's shape is known and more than one row has a cost
model, else the first in table order. `prefill` needs the final state too: a row that does
not return it gets it streamed (streaming.py), at the estimated cost of its state term, and
rows that return it come first where no cost model decides.

Cost model (seconds per token and head, fwd + bwd), constants measured on an H100 (jax
0.11.2, bf16, H = 12, d = e = 64, B T = 65,536; docs/benchmarks.md):

  attention form  ATTENTION_COST (T / 2) (d + e)     the causal (query, key) pairs
  chunked         STATE_COST F E + ATTENTION_COST (C / 2) (d + e)    states + chunk blocks

with F the state features of the row's layout and C its chunk. ATTENTION_COST is the
attention-form kernels' time at T = 65536 (237 ms); STATE_COST the rest of the chunked
kernels' time at T = 65536 (16.7 ms). The crossover for p = 2, d = e = 64 falls near
T = 4.5k (measured: 16.7 vs 17.0 ms at 4096, 60.6 vs 16.6 ms at 16384); at p = 4, d = 64
the chunked states (F = 992,256) put it beyond any context, so training takes the attention
form. The xla rows use the same constants: the ratio, not measured separately. The Hopper
rows take HOPPER_ATTENTION_COST for their attention kernels (measured the same way) and, for
p = 2, d = 64 (the square-layout state kernels, F = d^2, chunks of 1024), HOPPER_STATE_COST
read off the Hopper chunked row's time at T = 65536, H = 12 (14.00 ms); other shapes keep
the portable STATE_COST, layout and chunk. The Hopper attention form wins to about T = 9k
at p = 2, d = 64 (measured: 9.4 vs 15.4 ms at 4096, 28.7 vs 15.1 ms at 16384). The model
does not see the dtype: float32 calls run the portable kernels at the Hopper rows' estimate.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax

from sympow.attention import xla
from sympow.attention.blocked import blocked_attention, default_block_size
from sympow.attention.chunked import ChunkPrimitives, chunked_attention
from sympow.attention.config import AttentionConfig
from sympow.attention.mosaic_gpu import primitives as hopper
from sympow.attention.mosaic_gpu import states as hopper_states
from sympow.attention.pallas import attention_form as pallas_attention_form
from sympow.attention.pallas import plan as pallas_plan
from sympow.attention.pallas import primitives as pallas_primitives
from sympow.attention.reference import attention_form, recurrent_form
from sympow.embedding import expanded_dim

ANY_PLATFORM = None
ATTENTION_COST = 7.18e-14  # s per causal (query, key) pair and unit of d + e
# The Hopper tier's attention kernels, read off the same kind of run at T = 16384 (27.21 ms,
# docs/benchmarks.md "The Hopper tier").
HOPPER_ATTENTION_COST = 3.30e-14
STATE_COST = 1.13e-13  # s per state feature and value column, per token
# The Hopper state kernels (p = 2, d = 64, square layout), per executed feature
# (docs/benchmarks.md "The Hopper state kernels").
HOPPER_STATE_COST = 5.97e-14
HOPPER_SQUARE_CHUNK = 1024
# The streamed state builds each state once (one product per feature tile) where the
# chunked algorithm builds per-chunk states, sums them and reads them back per query.
# Reasoned from that, not measured: streaming.py has not been timed on a GPU yet.
STREAM_COST = STATE_COST / 2


def attention_cost(p: int, d: int, e: int, t: int, chunk: int | None,
                   pair_cost: float = ATTENTION_COST) -> float:
    """Estimated seconds per token and head of the attention form (module docstring), with
    pair_cost the attention kernels' constant."""
    return pair_cost * t / 2 * (d + e)


def hopper_attention_cost(p: int, d: int, e: int, t: int, chunk: int | None) -> float:
    return attention_cost(p, d, e, t, chunk, HOPPER_ATTENTION_COST)


def streamed_state_cost(p: int, d: int, e: int) -> float:
    """Estimated seconds per token and head of streaming the state after a prompt (for
    `prefill` on a row without one, streaming.py), in the units of the other estimates:
    STREAM_COST F E with F of the tile=1 layout."""
    return STREAM_COST * expanded_dim(d, p) * e


def chunked_cost(features: Callable[[int, int], int], pair_cost: float = ATTENTION_COST,
                 state_cost: float = STATE_COST) -> Callable[..., float]:
    """The chunked algorithm's estimate, with F = features(d, p) of the row's layout,
    pair_cost its intra-chunk attention kernels' constant and state_cost its state
    kernels'."""
    def cost(p: int, d: int, e: int, t: int, chunk: int | None) -> float:
        return state_cost * features(d, p) * e + pair_cost * (chunk or t) / 2 * (d + e)
    return cost


def _tiled_features(d: int, p: int) -> int:
    return expanded_dim(d, p, pallas_plan.tile_width(d, p))


def _by_length(chunk_size: Callable[[int], int]) -> Callable[[int, int, int | None], int]:
    return lambda t, p, d: chunk_size(t)


def hopper_chunk_size(t: int, p: int, d: int | None) -> int:
    """The Hopper chunked row's default chunk: up to HOPPER_SQUARE_CHUNK where its
    square-layout state kernels run (p = 2, d = 64: 9.84 vs 10.04 ms and 2.17 vs 2.80 GiB
    at T = 65536, H = 8, against chunks of 512), else the portable tier's."""
    if hopper_states.square_layout(p, d):
        return pallas_plan.default_chunk_size(t, cap=HOPPER_SQUARE_CHUNK)
    return pallas_plan.default_chunk_size(t)


_hopper_square_cost = chunked_cost(lambda d, p: d * d, HOPPER_ATTENTION_COST, HOPPER_STATE_COST)
_hopper_tiled_cost = chunked_cost(_tiled_features, HOPPER_ATTENTION_COST)


def hopper_chunked_cost(p: int, d: int, e: int, t: int, chunk: int | None) -> float:
    """The Hopper chunked row's estimate: its square-layout state kernels where they run
    (p = 2, d = 64), else the portable state kernels; its attention kernels either way."""
    cost = _hopper_square_cost if hopper_states.square_layout(p, d) else _hopper_tiled_cost
    return cost(p, d, e, t, chunk)


@dataclasses.dataclass(frozen=True)
class Implementation:
    """One row of the table.

    run(config, q, k, v, log_g) -> (y float32 [B, T, Hq, E], final state or None).
    platforms: the JAX backends it runs on (None: all). default_on: those on which
    impl=None may choose it. has_state: `run` returns the recurrent state after the last
    token (what `prefill` needs). default_chunk_size(T, p, d): the chunk (chunked algorithm)
    or block (blocked attention form) when the caller gives none (d None: not known); None
    for rows without one.
    cost(p, d, e, T, chunk): estimated seconds per token and head (None: no model).
    """

    algorithm: str
    backend: str
    run: Callable
    platforms: tuple[str, ...] | None = ANY_PLATFORM
    default_on: tuple[str, ...] | None = ()
    has_state: bool = False
    default_chunk_size: Callable[[int, int, int | None], int] | None = None
    cost: Callable[..., float] | None = None

    def runs_on(self, platform: str) -> bool:
        return self.platforms is ANY_PLATFORM or platform in self.platforms

    def is_default_on(self, platform: str) -> bool:
        return self.default_on is ANY_PLATFORM or platform in self.default_on


def _chunked(primitives: Callable[[AttentionConfig], ChunkPrimitives]) -> Callable:
    def run(config: AttentionConfig, q, k, v, log_g):
        return chunked_attention(q, k, v, log_g, p=config.p, chunk_size=config.chunk_size,
                                 primitives=primitives(config))
    return run


def _pallas_attention_form(config: AttentionConfig, q, k, v, log_g):
    return pallas_attention_form.attention_form(config, q, k, v, log_g), None


def _hopper_attention_form(config: AttentionConfig, q, k, v, log_g):
    return hopper.attention_form(config, q, k, v, log_g), None


def _blocked(config: AttentionConfig, q, k, v, log_g):
    return blocked_attention(q, k, v, log_g, p=config.p, block=config.chunk_size), None


def _attention_form(config: AttentionConfig, q, k, v, log_g):
    return attention_form(q, k, v, log_g, config.p), None


def _recurrent_form(config: AttentionConfig, q, k, v, log_g):
    return recurrent_form(q, k, v, log_g, config.p)


# Table order is preference order.
IMPLEMENTATIONS: dict[tuple[str, str], Implementation] = {
    (row.algorithm, row.backend): row for row in (
        # The Hopper tier: GPU only (its own kernels need sm90; elsewhere it logs and runs
        # the portable tier's).
        Implementation("chunked", "mosaic_gpu", _chunked(hopper.primitives),
                       platforms=("gpu",), default_on=("gpu",), has_state=True,
                       default_chunk_size=hopper_chunk_size, cost=hopper_chunked_cost),
        Implementation("attention", "mosaic_gpu", _hopper_attention_form,
                       platforms=("gpu",), default_on=("gpu",), cost=hopper_attention_cost),
        # The kernels run on GPU, and on CPU in the interpreter (for tests, never a default).
        Implementation("chunked", "pallas", _chunked(pallas_primitives.primitives),
                       platforms=("gpu", "cpu"), default_on=("gpu",), has_state=True,
                       default_chunk_size=_by_length(pallas_plan.default_chunk_size),
                       cost=chunked_cost(_tiled_features)),
        Implementation("attention", "pallas", _pallas_attention_form,
                       platforms=("gpu", "cpu"), default_on=("gpu",), cost=attention_cost),
        Implementation("chunked", "xla", _chunked(lambda config: xla.PRIMITIVES),
                       default_on=ANY_PLATFORM, has_state=True,
                       default_chunk_size=_by_length(xla.default_chunk_size),
                       cost=chunked_cost(expanded_dim)),
        Implementation("attention", "xla", _blocked, default_on=ANY_PLATFORM,
                       default_chunk_size=_by_length(default_block_size), cost=attention_cost),
        Implementation("attention", "reference", _attention_form),
        Implementation("recurrent", "reference", _recurrent_form, has_state=True),
    )
}

# The values of the public `impl=` and `algorithm=` arguments, in table order.
IMPLS: tuple[str, ...] = tuple(dict.fromkeys(backend for _, backend in IMPLEMENTATIONS))
ALGORITHMS: tuple[str, ...] = tuple(dict.fromkeys(alg for alg, _ in IMPLEMENTATIONS))


def available_impls(platform: str | None = None) -> tuple[str, ...]:
    """Backends usable on `platform` (default: JAX's default backend): defaults first."""
    platform = platform or jax.default_backend()
    rows = [row for row in IMPLEMENTATIONS.values() if row.runs_on(platform)]
    ordered = sorted(rows, key=lambda row: not row.is_default_on(platform))  # stable
    return tuple(dict.fromkeys(row.backend for row in ordered))


def kernel_rows(platform: str | None = None) -> tuple[tuple[str, str], ...]:
    """Keys of the kernel tiers' rows (rows tied to some platforms) that run on `platform`:
    what the GPU runner checks and the benchmark times by default."""
    platform = platform or jax.default_backend()
    return tuple(key for key, row in IMPLEMENTATIONS.items()
                 if row.platforms is not ANY_PLATFORM and row.runs_on(platform))



def check_impl(impl: str | None, algorithm: str | None = None) -> None:
    """ValueError unless impl and algorithm are None or names of the table."""
    if impl is not None and impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS} or None, got impl={impl!r}")
    if algorithm is not None and algorithm not in ALGORITHMS:
        raise ValueError(f"algorithm must be one of {ALGORITHMS} or None, got "
                         f"algorithm={algorithm!r}")


def select(impl: str | None, algorithm: str | None = None, *, need_state: bool = False,
           platform: str | None = None, shape: tuple[int, int, int, int] | None = None,
           chunk_size: int | None = None) -> Implementation:
    """The row that runs a call: see the module docstring. shape: (p, d, e, T) of the call,
    for the cost model; need_state: the call is a `prefill`. ValueError naming impl and
    algorithm (and the platform) when no row fits."""
    check_impl(impl, algorithm)
    platform = platform or jax.default_backend()
    rows = [row for row in IMPLEMENTATIONS.values()
            if (row.is_default_on(platform) if impl is None else row.backend == impl)
            and algorithm in (None, row.algorithm) and row.runs_on(platform)]
    rows = [row for row in rows if row.backend == rows[0].backend] if rows else rows
    if need_state:  # rows that return the state first (the spec's recurrent form for 'reference')
        rows.sort(key=lambda row: not row.has_state)
    modelled = [row for row in rows if row.cost is not None]
    if shape is not None and len(modelled) > 1:
        p, d, e, t = shape

        def cost(row: Implementation) -> float:
            chunk = chunk_size or (row.default_chunk_size and row.default_chunk_size(t, p, d))
            streamed = 0.0 if row.has_state or not need_state else streamed_state_cost(p, d, e)
            return row.cost(p, d, e, t, chunk) + streamed

        return min(modelled, key=cost)  # the first of equal costs
    if rows:
        return rows[0]
    what = f"impl={impl!r}" + ("" if algorithm is None else f" with algorithm={algorithm!r}")
    rows = [key for key, row in IMPLEMENTATIONS.items() if row.runs_on(platform)]
    raise ValueError(f"{what} is not available on backend {platform!r}; "
                     f"available (algorithm, impl): {rows}")


def lookup(config: AttentionConfig) -> Implementation:
    """The row a resolved config names."""
    return IMPLEMENTATIONS[config.algorithm, config.backend]
