"""Heuristics of the portable tier: what it supports and the block sizes of each problem.

`make_plan` is the one heuristics function: for (p, d, e, C, dtype) it returns a frozen
`Plan` of block sizes, warps and pipeline stages, each choice measured (docs/kernels.md), or
the reason the shape is unsupported (the primitives then fall back to the pure-JAX ones).

Support: p = 2 with d in {16, 32, 64, 128}; p = 4 with d in {16, 32}; any e <= 128 and any
chunk <= 1024 (run zero-padded to a power of two >= 16); bfloat16 or float32.

Feature layout: the state kernels use the tiled embedding of width `tile_width(d, p)`
(F = expanded_dim(d, p, tile)); per-chunk and prefix states are in that layout.
`tiled_layout` recognizes such an F (no tiled F of a supported d equals a tile=1 F).
"""

from __future__ import annotations

import dataclasses
import functools

import jax.numpy as jnp

from sympow.embedding import expanded_dim
from sympow.numerics import HIGHEST

SUPPORTED_D = {2: (16, 32, 64, 128), 4: (16, 32)}
SUPPORTED_E = (16, 32, 64, 128)
SUPPORTED_DTYPES = ("bfloat16", "float32")
MAX_CHUNK = 512  # the default chunk for long sequences (see default_chunk_size)
MAX_PADDED_CHUNK = 1024  # the largest chunk the kernels take


def default_chunk_size(length: int, cap: int = MAX_CHUNK) -> int:
    """The smallest power of two >= 16 covering `length`, at most `cap` (MAX_CHUNK).

    512 beat 256 on H100 at T=65536 (21.5 vs 22.7 ms fwd+bwd): the prefix sum and the
    state traffic halve while the intra-chunk attention doubles (docs/kernels.md).
    """
    return min(cap, max(16, 1 << max(0, length - 1).bit_length()))


def tile_width(d: int, p: int) -> int:
    """t with t^p = 256 features per tile: one [256, E] state tile is a full MMA operand."""
    return min(d, 16 if p == 2 else 4)


def _unsupported(p: int, d: int, e: int, c: int, dtype: str) -> str | None:
    if p not in SUPPORTED_D:
        return f"p={p} (supported: {sorted(SUPPORTED_D)})"
    if d not in SUPPORTED_D[p]:
        return f"d={d} with p={p} (supported: {SUPPORTED_D[p]})"
    if e not in SUPPORTED_E:
        return f"e={e} (supported: up to {SUPPORTED_E[-1]})"
    if dtype not in SUPPORTED_DTYPES:
        return f"dtype {dtype} (supported: {SUPPORTED_DTYPES})"
    if c > MAX_PADDED_CHUNK:
        return f"chunk_size={c} (supported: up to {MAX_PADDED_CHUNK})"
    return None


@dataclasses.dataclass(frozen=True)
class Plan:
    """Static, hashable settings of one problem shape (built by `make_plan`).

    p, d, e, c: power, key dim, value dim, chunk. dtype: input dtype name ('bfloat16' or
    'float32'). mm: dtype name of the matrix-product operands and of the states between
    kernels. tile: width t of the tiled embedding (F = n_tiles * t^p).
    attn_bq / attn_bk: query / key block of the intra-chunk attention kernels.
    state_br / state_be: row block and value-column block of the rows -> state kernel;
    query_br / query_split: row block of the phi(x) S kernels (query_state forward, the
    update_state backward's dV), and the number of parts their phi tiles are built in (the
    first factor's slice split: [query_br, tp / split]).
    grad_br: row block of the kernels back through phi (dQ, dK).
    warps_*: Triton num_warps per kernel family; stages: num_stages of the rows -> state
    kernel; attn_stages / rows_stages: of the attention and state -> rows kernels.
    interpret: run in the Pallas interpreter (off GPU).
    """

    p: int
    d: int
    e: int
    c: int
    dtype: str
    mm: str
    tile: int
    attn_bq: int
    attn_bk: int
    state_br: int
    query_br: int
    query_split: int
    grad_br: int
    state_be: int
    warps_attn: int
    warps_state: int
    stages: int
    attn_stages: int
    rows_stages: int
    interpret: bool

    @property
    def tile_features(self) -> int:
        return self.tile ** self.p

    @property
    def n_tiles(self) -> int:
        return expanded_dim(self.d, self.p, self.tile) // self.tile_features

    @property
    def features(self) -> int:
        return expanded_dim(self.d, self.p, self.tile)

    @property
    def window(self) -> int:
        """Width of the x slice one factor of a tile is selected from (an MMA's K >= 16)."""
        return max(self.tile, 16)

    @property
    def mm_dtype(self):
        """Operand dtype of the matrix products (accumulation is always float32)."""
        return jnp.dtype(self.mm)

    @property
    def dden_in_kernel_order(self) -> bool:
        """Whether den's cotangent is formed by the attention kernels' own product
        (`attention_kernels.row_dots`) and kept out of their products' accumulator, so that
        it cancels their do . v exactly: float32 products (bf16 kernels round do and v, and
        take XLA's dden)."""
        return self.mm_dtype == jnp.float32

    @property
    def precision(self):
        # float32 operands: ask for true fp32 products (Triton's default would be tf32).
        return HIGHEST if self.mm_dtype == jnp.float32 else None


@dataclasses.dataclass(frozen=True)
class PrefixPlan:
    """Static settings of the prefix-sum kernels: feature block bf, warps, stages, interpret;
    slotted: the states in N + 1 slots, summed in place (`prefix_kernels`)."""

    bf: int
    warps: int
    stages: int
    interpret: bool
    slotted: bool = False


def matmul_dtype(p: int, dtype: str):
    """Operand dtype of the kernels' matrix products (accumulation is always float32): the
    input dtype for p = 2; float32 from p = 4 on, where a phi feature is a product of p
    factors and bf16 operands put the gate gradients 3-4x further from the float32 result
    than rounding the inputs to bf16 does (the shared suite's bf16 test, p = 4)."""
    return jnp.dtype(jnp.float32 if p >= 4 else dtype)


def attn_rows(d: int, e: int, itemsize: int) -> int:
    """Rows of the attention kernels' blocks: 64, or 32 where two 64-row tiles of k and v
    would pass the 160 KB `_stages` budgets for pipelining."""
    return 64 if 2 * 64 * (d + e) * itemsize <= (160 << 10) else 32


def _stages(tile_bytes: int) -> int:
    """Software-pipelining depth whose buffers fit in 160 KB of the 227 KB of shared memory
    of an H100 (d = e = 128 asked for 330 KB at 3 stages), leaving room for the operands."""
    return max(1, min(3, (160 << 10) // tile_bytes))


@functools.lru_cache(maxsize=256)
def make_plan(p: int, d: int, e: int, c: int, dtype: str, interpret: bool) -> Plan | str:
    """The one heuristics function: block sizes for a problem of the chunked algorithm, or the
    reason it is unsupported."""
    reason = _unsupported(p, d, e, c, dtype)
    if reason is not None:
        return reason
    return _plan(p, d, e, c, dtype, matmul_dtype(p, dtype).name, interpret)


MAX_FORM_WIDTH = 256  # the widest d and e of the attention form (a [64, 256] f32 tile)


@functools.lru_cache(maxsize=256)
def make_form_plan(p: int, d: int, e: int, t: int, dtype: str, interpret: bool) -> Plan | str:
    """Plan of the attention form on the attention kernels (`attention_form.py`): one chunk
    of t rows (a power of two >= 16), any even p, d and e powers of two up to 256, matrix
    products in the input dtype (the scores of bf16 inputs at bf16 operands stayed within the
    shared suite's bound at p = 4: 1.4x ref's error, measured with the per-primitive split).
    The state fields are those of `make_plan`; no state kernel runs on this plan."""
    if dtype not in SUPPORTED_DTYPES:
        return f"dtype {dtype} (supported: {SUPPORTED_DTYPES})"
    if max(d, e) > MAX_FORM_WIDTH:
        return f"d={d}, e={e} (supported: up to {MAX_FORM_WIDTH})"
    return _plan(p, d, e, t, dtype, dtype, interpret)


def _plan(p: int, d: int, e: int, c: int, dtype: str, mm: str, interpret: bool) -> Plan:
    """Block sizes, warps and stages; each choice bounds the float32 register tiles of a kernel
    to about 64 KB per program."""
    itemsize = jnp.dtype(dtype).itemsize
    return Plan(
        p=p, d=d, e=e, c=c, dtype=dtype, mm=mm, tile=tile_width(d, p),
        # Attention: [bq, bk] scores plus [bq, e] accumulator; 64 x 64 keeps both small for
        # d, e <= 128 and gives C / 64 query blocks of parallelism per chunk. 32 rows where
        # one stage of 64-row k and v tiles would not fit in shared memory (float32 with
        # d = e = 256 asked for 256 KB of the H100's 227 KB).
        attn_bq=min(c, attn_rows(d, e, itemsize)), attn_bk=min(c, attn_rows(d, e, itemsize)),
        # rows -> state: [256, br] phi^T per step into a [256, be] accumulator. br = 128 was
        # slower on H100 (update_state fwd 4.1 vs 2.4 ms at T=65536, H=8; docs/kernels.md).
        state_br=min(c, 64),
        # Split E above 64 columns: the [256, be] f32 accumulator stays at 64 KB.
        state_be=min(e, 64),
        # phi(x) S (query fwd, dV): 128 rows halve the state reads per row; half tiles
        # [128, 128] keep phi at 64 KB: query fwd 2.17 vs 3.00 ms (64 rows, whole tiles) on
        # H200; [256, 64] tiles: 2.34 ms. E = 128 keeps 64 rows ([rows, E] f32 at 32 KB).
        query_br=min(c, 128 if e <= 64 else 64), query_split=2,
        # dQ, dK (one [rows, d] accumulator): 128 rows halve the state reads per row (query
        # bwd 2.4 vs 3.1 ms at 64 on H200). dK and dV in one kernel, two accumulators, ran
        # at 64 rows only (128 spilled: 15.5 vs 3.4 ms).
        grad_br=min(c, 128),
        warps_attn=4,
        # 8 warps: 256 threads share the [256, 64] float32 tiles (64 registers each); 4 warps
        # were slower for every state kernel (H200, fwd+bwd of each primitive, measured
        # before the dK / dV split: update 5.0 vs 4.8 ms, query 11.4 vs 4.7).
        warps_state=8,
        # 3 stages: 2-15% faster than 2 on every kernel, within noise on none worse; fewer
        # where 3 copies of a loop's tiles would not fit in shared memory (d or e = 128).
        stages=3,
        # k and v (q and dO) tiles
        attn_stages=_stages(2 * attn_rows(d, e, itemsize) * (d + e) * itemsize),
        # One [256, E] state tile (matmul dtype) per step.
        rows_stages=_stages(tile_width(d, p) ** p * e * jnp.dtype(mm).itemsize),
        interpret=interpret,
    )


def prefix_plan(f: int, interpret: bool, slotted: bool = False) -> PrefixPlan:
    """Feature block: the largest power of two <= 64 dividing F ([bf, E] f32 per step)."""
    bf = 1
    while bf < 64 and f % (2 * bf) == 0:
        bf *= 2
    return PrefixPlan(bf=bf, warps=4, stages=2, interpret=interpret, slotted=slotted)


def padded_width(e: int) -> int:
    """Value width the kernels run at: the next power of two >= 16 (zero columns are exact)."""
    return max(16, 1 << (e - 1).bit_length())


@functools.lru_cache(maxsize=64)
def tiled_layout(f: int, p: int) -> tuple[int, int] | None:
    """(d, tile) if F is the kernel layout's F of a supported d, else None."""
    for d in SUPPORTED_D.get(p, ()):
        if expanded_dim(d, p, tile_width(d, p)) == f:
            return d, tile_width(d, p)
    return None
