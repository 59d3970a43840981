"""The Hopper tier's state primitives (p = 2, square layout) where a CPU can check them.

The kernels lower for CUDA to one Mosaic GPU kernel each; their plain-JAX definitions are
checked against phi written out; and with those definitions in the kernels' place, the
custom_vjps and the whole chunked algorithm on the tier's primitives are checked against
autodiff and the reference attention (outputs, the four gradients, the final state). The
kernels' own numbers need a Hopper GPU: experiments/gpu_check.py compares them with the
definitions there.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sympow.attention import chunked, reference, testing, xla
from sympow.attention.config import AttentionConfig
from sympow.attention.mosaic_gpu import (
    blocks,
    column_forms,
    gram,
    state_kernels,
    state_references,
    state_sums,
    state_walks,
    states,
    vjps,
)
from sympow.attention.mosaic_gpu import primitives as hopper
from sympow.attention.pallas.plan import tiled_layout
from tests.attention.mosaic_gpu.test_attention_kernels import lowered
from tests.attention.pallas.helpers import compiled

D = state_kernels.DIM
BF16, F32 = jnp.bfloat16, jnp.float32
CONFIG = AttentionConfig(p=2, algorithm="chunked", backend="mosaic_gpu", chunk_size=128,
                         interpret=True)


def phi(u):
    """u (x) u over the last axis, in the square layout (feature i d + j)."""
    return (u[..., :, None] * u[..., None, :]).reshape(*u.shape[:-1], -1)


@pytest.fixture
def definitions(monkeypatch):
    """The kernels' definitions in their place, and every problem taken as supported."""
    monkeypatch.setattr(state_sums, "rows_to_state", state_references.rows_to_state_reference)
    monkeypatch.setattr(state_kernels, "state_to_rows", state_references.state_to_rows_reference)
    monkeypatch.setattr(state_kernels, "row_gradients", state_references.row_gradients_reference)
    interpret_gram(monkeypatch)
    monkeypatch.setattr(states, "unsupported", lambda *_: None)


def interpret_gram(monkeypatch):
    """The gram sums' Triton kernel in the Pallas interpreter (the CPU's)."""
    monkeypatch.setattr(gram, "weighted_gram", functools.partial(gram.weighted_gram,
                                                                 interpret=True))


@pytest.mark.parametrize(("hq", "hk", "e", "col_dtype"), [(2, 2, 64, BF16), (4, 2, 128, BF16),
                                                        (2, 2, 64, F32)])
def test_the_kernels_lower_to_one_mosaic_gpu_kernel_each(hq, hk, e, col_dtype):
    b, n, c = 1, 2, 256
    rows = lowered(lambda *x: state_sums.rows_to_state(*x, kv_heads=hk),
                   ((b, hq, n, D, c), BF16), ((b, hq, n, D, c), col_dtype),
                   ((b, hq, n, c, e), BF16))
    assert rows.count("@mosaic_gpu") == 1
    assert f"tensor<{b}x{hk}x{n}x{D * D}x{e}xbf16>" in rows
    for transposed, (width, out) in ((False, (D, e)), (True, (e, D))):
        text = lowered(lambda *x, t=transposed: state_kernels.state_to_rows(*x, transposed=t),
                       ((b, hq, n, c, width), BF16), ((b, hq, n, D, c), col_dtype),
                       ((b, hk, n, D * D, e), BF16))
        assert text.count("@mosaic_gpu") == 1
        assert f"tensor<{b}x{hq}x{n}x{c}x{out}xf32>" in text
    # out_dtype=bf16 (the update side's da): the kernel's output itself, no cast after it
    text = lowered(lambda *x: state_kernels.state_to_rows(*x, transposed=False,
                                                          out_dtype=BF16),
                   ((b, hq, n, c, D), BF16), ((b, hq, n, D, c), col_dtype),
                   ((b, hk, n, D * D, e), BF16))
    assert text.count("@mosaic_gpu") == 1 and "stablehlo.convert" not in text
    assert f"-> tensor<{b}x{hq}x{n}x{c}x{e}xbf16>" in text
    grads = lowered(state_kernels.row_gradients, ((b, hq, n, c, e), BF16),
                    ((b, hq, n, c, D), BF16), ((b, hq, n, D, c), col_dtype),
                    ((b, hk, n, D * D, e), BF16))
    assert grads.count("@mosaic_gpu") == 1
    assert f"tensor<{b}x{hq}x{n}x{c}x{D}xbf16>, tensor<{b}x{hq}x{n}x{c}xf32>" in grads
    # with the normalizer's quadratic form: Z's parts by kv head, a weight per row
    normalizer = (((b, hk, n, 3 * D, D), BF16), ((b, hq, n, c), F32))
    text = lowered(lambda x, col, s, *z: state_kernels.state_to_rows(
        x, col, s, transposed=False, normalizer=state_kernels.Normalizer(*z)),
        ((b, hq, n, c, D), BF16), ((b, hq, n, D, c), col_dtype), ((b, hk, n, D * D, e), BF16),
        *normalizer)
    assert text.count("@mosaic_gpu") == 1
    assert f"tensor<{b}x{hq}x{n}x{c}x{e}xf32>, tensor<{b}x{hq}x{n}x{c}xf32>" in text
    text = lowered(lambda a, x, col, s, *z: state_kernels.row_gradients(
        a, x, col, s, normalizer=state_kernels.Normalizer(*z)),
        ((b, hq, n, c, e), BF16), ((b, hq, n, c, D), BF16), ((b, hq, n, D, c), col_dtype),
        ((b, hk, n, D * D, e), BF16), *normalizer)
    assert text.count("@mosaic_gpu") == 1
    assert f"tensor<{b}x{hq}x{n}x{c}x{D}xbf16>, tensor<{b}x{hq}x{n}x{c}xf32>" in text


def test_the_kernels_take_states_in_slots():
    """rows_to_state writes chunk n at slot n + slot_offset of `slots`; state_to_rows and
    row_gradients read it there; a slot count that cannot hold the chunks is refused."""
    b, hq, hk, n, c, e = 1, 2, 2, 2, 256, 64
    text = lowered(lambda *x: state_sums.rows_to_state(*x, kv_heads=hk, slots=n + 1,
                                                          slot_offset=1),
                   ((b, hq, n, D, c), BF16), ((b, hq, n, D, c), BF16), ((b, hq, n, c, e), BF16))
    assert text.count("@mosaic_gpu") == 1
    assert f"tensor<{b}x{hk}x{n + 1}x{D * D}x{e}xbf16>" in text
    for fn in (lambda *x: state_kernels.state_to_rows(*x[1:], transposed=False, slot_offset=1),
               lambda *x: state_kernels.row_gradients(*x, slot_offset=1)):
        text = lowered(fn, ((b, hq, n, c, e), BF16), ((b, hq, n, c, D), BF16),
                       ((b, hq, n, D, c), BF16), ((b, hk, n + 1, D * D, e), BF16))
        assert text.count("@mosaic_gpu") == 1
    rows, col = jnp.zeros((b, hq, n, c, D), BF16), jnp.zeros((b, hq, n, D, c), BF16)
    with pytest.raises(ValueError, match="states of 2 slots cannot hold 2 chunks from slot "
                                         "slot_offset=1"):
        state_kernels.state_to_rows(rows, col, jnp.zeros((b, hk, n, D * D, e), BF16),
                                    transposed=False, slot_offset=1)
    with pytest.raises(ValueError, match="states of 2 slots cannot hold 2 chunks from slot "
                                         "slot_offset=1"):
        state_references.rows_to_state_reference(jnp.swapaxes(rows, -1, -2), col,
                                              jnp.zeros((b, hq, n, c, e), BF16), kv_heads=hk,
                                              slots=n, slot_offset=1)


@pytest.fixture
def launch_grids(monkeypatch):
    """The grid of every state kernel launched (lowered) while the test runs, in order."""
    grids = []
    for module in (state_kernels, state_sums):
        monkeypatch.setattr(module, "launch", lambda *a, real=module.launch, **kw: grids.append(
            kw["grid"]) or real(*a, **kw))
    return grids


def test_rows_to_state_sums_several_chunks_a_program_when_asked(launch_grids):
    """chunks_per_program: the grid's chunk axis shrinks by it (each program walks that many
    chunks), the kernel still lowers to one Mosaic GPU kernel with the same output; a count
    that does not divide N is refused by name. (Its sums are checked on a GPU:
    `gpu_check.py --only=primitives --cases=states`, row S_chunks.)"""
    b, hq, hk, n, c, e = 1, 2, 2, 4, 256, 64
    shapes = (((b, hq, n, D, c), BF16), ((b, hq, n, D, c), BF16), ((b, hq, n, c, e), BF16))
    for per_program, chunk_axis in ((1, n), (2, n // 2), (4, 1)):
        text = lowered(lambda *x, k=per_program: state_sums.rows_to_state(
            *x, kv_heads=hk, slots=n + 1, slot_offset=1, chunks_per_program=k), *shapes)
        assert text.count("@mosaic_gpu") == 1
        assert f"tensor<{b}x{hk}x{n + 1}x{D * D}x{e}xbf16>" in text
        assert launch_grids[-1][:2] == (chunk_axis, b * hk)
    zeros = [jnp.zeros(shape, dtype) for shape, dtype in shapes]
    for bad in (0, 3):
        with pytest.raises(ValueError, match=f"chunks_per_program={bad} must divide the 4"):
            state_sums.rows_to_state(*zeros, kv_heads=hk, chunks_per_program=bad)


def test_rows_to_state_walks_up_to_four_chunks_a_program_by_default(launch_grids):
    """Without chunks_per_program, gcd(N, CHUNKS_PER_PROGRAM) chunks a program: 4 where N
    allows, else 2, else 1 (an odd N: one a program, as before)."""
    for n, chunk_axis in ((8, 2), (6, 3), (3, 3)):
        shapes = (((1, 2, n, D, 128), BF16), ((1, 2, n, D, 128), BF16), ((1, 2, n, 128, 64), BF16))
        lowered(lambda *x: state_sums.rows_to_state(*x, kv_heads=2), *shapes)
        assert launch_grids[-1][0] == chunk_axis


def _accumulators(monkeypatch) -> list[tuple[int, ...]]:
    """The accumulator shapes of every wgmma the kernels trace, in order."""
    shapes = []
    real = blocks.plgpu.wgmma
    monkeypatch.setattr(blocks.plgpu, "wgmma", lambda acc, a, b, real=real, **kw: shapes.append(
        tuple(acc.shape)) or real(acc, a, b, **kw))
    return shapes


@pytest.mark.parametrize("pipelined", [True, False])
def test_rows_to_state_sums_only_the_stored_rows_of_the_upper_layout(monkeypatch, launch_grids,
                                                                     pipelined):
    """upper=True at E = 64: each S_i summed transposed, [E, 64 - 16 t] for a warpgroup's
    feature t (one of each group of 16 i; in halves t = 0, 3 then 1, 2, so the halves carry
    equal products), 160 of the square products' 256 columns; the same four upper arrays
    out. square_products, and E = 128, keep the M = 64 products [64, E]."""
    shapes = _accumulators(monkeypatch)
    b, hq, hk, n, c = 1, 2, 2, 2, 256

    def run(e, **kw):
        shapes.clear()
        args = (((b, hq, n, D, c), BF16), ((b, hq, n, D, c), BF16), ((b, hq, n, c, e), BF16))
        text = lowered(lambda *x: state_sums.rows_to_state(
            *x, kv_heads=hk, upper=True, pipelined=pipelined, **kw), *args)
        assert text.count("@mosaic_gpu") == 1
        for group in range(D // state_walks.BLOCK):
            assert f"tensor<{b}x{hk}x{n}x16x{D - 16 * group}x{e}xbf16>" in text
        return list(shapes)

    by_groups = [(64, 64), (64, 16), (64, 48), (64, 32)] if pipelined else [
        (64, 64), (64, 48), (64, 32), (64, 16)]
    traced = run(64)
    assert traced == by_groups * (len(traced) // 4) and traced
    assert sum(cols for _, cols in by_groups) == 160
    assert set(run(64, square_products=True)) == {(64, 64)}
    assert set(run(128)) == {(64, 128)}


def test_rows_to_state_over_the_stored_rows_walks_more_chunks_a_program(launch_grids):
    """By groups, gcd(N, 16) chunks a program while the grid keeps 256 programs, else fewer
    (never fewer than gcd(N, 4), the square products' count)."""
    f = state_sums.default_chunks_per_program
    assert [f(64, 64, True), f(64, 64, False), f(16, 256, True), f(16, 64, True),
            f(24, 256, True), f(64, 8, True), f(3, 8, True)] == [16, 4, 16, 4, 8, 4, 1]
    c = 128
    for hk, n, upper, chunk_axis in ((8, 64, True, 4), (8, 64, False, 16), (1, 64, True, 16),
                                     (8, 16, True, 4)):
        shapes = (((1, hk, n, D, c), BF16), ((1, hk, n, D, c), BF16), ((1, hk, n, c, 64), BF16))
        lowered(lambda *x, u=upper, h=hk: state_sums.rows_to_state(*x, kv_heads=h, upper=u),
                *shapes)
        assert launch_grids[-1] == (chunk_axis, hk, 8)


def test_rows_to_state_checks_one_barrier_a_step_unless_asked(monkeypatch):
    """A step's xt, col and a blocks share one ring barrier (one check a step, not three);
    step_barriers=3 keeps a barrier each; any other count is refused by name."""
    groups = []
    real_scratch = state_kernels.Ring.scratch
    monkeypatch.setattr(state_kernels.Ring, "scratch", staticmethod(
        lambda specs, stages, ring_groups=None, arrivals=None: groups.append(ring_groups)
        or real_scratch(specs, stages, ring_groups, arrivals)))
    shapes = (((1, 2, 2, D, 256), BF16), ((1, 2, 2, D, 256), BF16), ((1, 2, 2, 256, 64), BF16))
    for step_barriers, expected in ((1, [(0, 1, 2)]), (3, None)):
        text = lowered(lambda *x, k=step_barriers: state_sums.rows_to_state(
            *x, kv_heads=2, step_barriers=k), *shapes)
        assert text.count("@mosaic_gpu") == 1
        assert groups[-1] == expected
    zeros = [jnp.zeros(shape, dtype) for shape, dtype in shapes]
    with pytest.raises(ValueError, match="step_barriers=2: 1"):
        state_sums.rows_to_state(*zeros, kv_heads=2, step_barriers=2)


def test_the_kernels_form_col_from_xt_and_w_where_given_columns(monkeypatch):
    """With `Columns` each kernel takes x^T and w = e^(2 ls) (one Mosaic GPU kernel, no
    product of XLA's forming col); rows_to_state's ring carries w on the step's one barrier
    (with step_barriers=3, on col's). As the tier runs them: over the stored upper rows,
    the upper blocks packed, whole blocks with the normalizer."""
    groups = []
    real_scratch = state_kernels.Ring.scratch
    monkeypatch.setattr(state_kernels.Ring, "scratch", staticmethod(
        lambda specs, stages, ring_groups=None, arrivals=None: groups.append(
            (ring_groups, arrivals)) or real_scratch(specs, stages, ring_groups, arrivals)))
    b, hq, hk, n, c, e = 1, 4, 2, 2, 256, 64
    xt, w = ((b, hq, n, D, c), BF16), ((b, hq, n, c), F32)
    w_type = f"tensor<{b}x{hq}x{n}x{c}xf32>"
    for upper, step_barriers, expected in ((True, 1, ([(0, 1, 2, 3)], [2 + 4 + 1])),
                                           (True, 3, ([(0,), (1, 3), (2,)], [1, 4 + 1, 1])),
                                           (False, 1, ([(0, 1, 2, 3)], None))):
        text = lowered(lambda xt, w, a, u=upper, k=step_barriers: state_sums.rows_to_state(
            xt, column_forms.Columns(xt, w), a, kv_heads=hk, upper=u, step_barriers=k),
            xt, w, ((b, hq, n, c, e), BF16))
        assert text.count("@mosaic_gpu") == 1 and w_type in text
        assert "stablehlo.multiply" not in text
        assert groups[-1] == expected
    upper = [(shape, BF16) for shape in state_walks.upper_shapes((b, hk, n + 1), D, e)]
    x, a = ((b, hq, n, c, D), BF16), ((b, hq, n, c, e), BF16)
    z = [((b, hk, n, 3 * D, D), BF16), ((b, hq, n, c), F32)]
    runs = [(lambda x, xt, w, *s: state_kernels.state_to_rows(
                x, column_forms.Columns(xt, w), s, transposed=False, slot_offset=1,
                upper=True, packed=True, pipelined=True), [x, xt, w, *upper]),
            (lambda a, x, xt, w, *rest: state_kernels.row_gradients(
                a, x, column_forms.Columns(xt, w), rest[:4], slot_offset=1,
                normalizer=state_kernels.Normalizer(*rest[4:])), [a, x, xt, w, *upper, *z])]
    for fn, shapes in runs:
        text = lowered(fn, *shapes)
        assert text.count("@mosaic_gpu") == 1 and w_type in text
        assert "stablehlo.multiply" not in text


def test_the_formed_columns_are_the_stored_ones_bit_for_bit(rng, monkeypatch):
    """col formed from x^T and e^(2 ls) as the kernels form it equals `states.columns`
    exactly; the tier passes `Columns` where col is bf16 (FORMED_COLUMNS), a stored col
    where it is float32 or FORMED_COLUMNS is off."""
    x = jnp.asarray(rng.normal(size=(1, 2, 3, 8, D)), BF16)
    ls = jnp.asarray(rng.uniform(-3.0, 0.0, size=(1, 2, 3, 8)), F32)
    monkeypatch.setattr(states, "FORMED_COLUMNS", True)
    formed = states.kernel_columns(x, ls)
    assert isinstance(formed, column_forms.Columns)
    np.testing.assert_array_equal(np.asarray(formed.xt), np.asarray(jnp.swapaxes(x, -1, -2)))
    got = column_forms.stored_columns(formed)
    assert got.dtype == BF16
    np.testing.assert_array_equal(np.asarray(got, np.float32),
                                  np.asarray(states.columns(x, ls), np.float32))
    monkeypatch.setattr(states, "FORMED_COLUMNS", False)
    assert states.kernel_columns(x, ls).dtype == BF16
    monkeypatch.setattr(states, "FORMED_COLUMNS", True)  # float32 col: stored
    monkeypatch.setattr(states, "COLUMNS_DTYPE", "float32")
    assert states.kernel_columns(x, ls).dtype == F32


def test_the_kernels_issue_their_steps_in_halves_where_asked(monkeypatch):
    """rows_to_state walks its steps in halves by default (pipelined=False: whole steps);
    state_to_rows and row_gradients when asked (pipelined=True), over the square blocks or
    the upper ones; each kernel still lowers to one Mosaic GPU kernel. A half is half a
    step's products: rows_to_state's (E = 64) two of its warpgroup's four features; the
    square state_to_rows' one of its two blocks S_i against each of its warpgroup's two
    row blocks; the upper one's blocks of one ring tile, one piece or two each."""
    walks = []
    real = state_kernels.products_in_halves

    def recording(ring, first_step, end, halves):
        sizes = []
        walks.append((first_step, end, sizes))

        def recorded(step, slot):
            return tuple((lambda build=build: sizes.append(len(build())) or build())
                         for build in halves(step, slot))
        return real(ring, first_step, end, recorded)

    for module in (state_kernels, state_sums):
        monkeypatch.setattr(module, "products_in_halves", recording)
    b, hq, hk, n, c, e = 1, 2, 2, 2, 256, 64
    x, a = ((b, hq, n, c, D), BF16), ((b, hq, n, c, e), BF16)
    xt, col, s = ((b, hq, n, D, c), BF16), ((b, hq, n, D, c), BF16), ((b, hk, n, D * D, e), BF16)
    runs = [(lambda *v, **kw: state_sums.rows_to_state(*v, kv_heads=hk, **kw), (xt, col, a)),
            (lambda *v, **kw: state_kernels.state_to_rows(*v, transposed=False, **kw),
             (x, col, s)),
            (state_kernels.row_gradients, (a, x, col, s))]
    # the walk's steps: rows_to_state's are traced (its chunks' loop), the others' a chunk
    ring_steps = [None, D // state_walks.BLOCKS_PER_STEP, D // state_walks.BLOCKS_PER_STEP]
    for (fn, shapes), steps, default in zip(runs, ring_steps, (True, False, False), strict=True):
        for pipelined in (False, True):
            walks.clear()
            kw = {} if pipelined == default else {"pipelined": pipelined}
            assert lowered(functools.partial(fn, **kw), *shapes).count("@mosaic_gpu") == 1
            assert len(walks) == (1 if pipelined else 0)  # one walk a chunk, traced once
            if pipelined:
                # the peeled first step and the loop's step: two halves of 2 products each
                assert walks[0][2] == [2, 2, 2, 2]
                if steps is not None:
                    assert walks[0][:2] == (0, steps)
    walks.clear()
    lowered(lambda *v: state_kernels.state_to_rows(*v, transposed=False, upper=True,
                                                   packed=True, pipelined=True), x, col, s)
    segments = state_walks.upper_segments(D, packed=True)
    assert [walk[:2] for walk in walks] == [(seg.first, seg.first + seg.steps)
                                            for seg in segments]
    # per half: per_tile blocks, each its pieces (2 below the last 16 rows i, then 1) for
    # both row blocks
    assert [walk[2] for walk in walks] == [[4] * 4, [4] * 4, [8] * 4, [8] * 4]


def test_the_kernels_in_halves_need_two_ring_slots():
    zeros = [jnp.zeros(shape, BF16) for shape in ((1, 2, 1, D, 128), (1, 2, 1, D, 128),
                                                   (1, 2, 1, 128, 64))]
    with pytest.raises(ValueError, match="stages=1: a ring needs a slot, and 2 with "
                                         "pipelined=True"):
        state_sums.rows_to_state(*zeros, kv_heads=2, stages=1)
    x, s = jnp.zeros((1, 2, 1, 128, D), BF16), jnp.zeros((1, 2, 1, D * D, 64), BF16)
    with pytest.raises(ValueError, match="stages=1"):
        state_kernels.state_to_rows(x, zeros[1], s, transposed=False, stages=1,
                                    pipelined=True)


@pytest.mark.parametrize("gradient", [False, True])
def test_state_to_rows_takes_several_chunks_a_program_when_asked(launch_grids, gradient):
    """chunks_per_program on state_to_rows and row_gradients: the grid's chunk axis shrinks
    by it and the call still lowers to one Mosaic GPU kernel of the same output; a count
    that does not divide N, or one over 1 with a normalizer (Z's parts are one chunk's), is
    refused by name. (Sums: `gpu_check.py --only=primitives --cases=states`, rows y_chunks
    and dx_chunks.)"""
    b, hq, hk, n, c, e = 1, 2, 2, 4, 256, 64
    x, a = ((b, hq, n, c, D), BF16), ((b, hq, n, c, e), BF16)
    col, s = ((b, hq, n, D, c), BF16), ((b, hk, n + 1, D * D, e), BF16)

    def call(*arrays, k, normalizer=None):
        if gradient:
            return state_kernels.row_gradients(*arrays, slot_offset=1, chunks_per_program=k,
                                               normalizer=normalizer)
        return state_kernels.state_to_rows(*arrays, transposed=False, slot_offset=1,
                                           chunks_per_program=k, normalizer=normalizer)

    shapes = (a, x, col, s) if gradient else (x, col, s)
    for per_program in (1, 2, 4):
        text = lowered(lambda *z, k=per_program: call(*z, k=k), *shapes)
        assert text.count("@mosaic_gpu") == 1
        assert f"tensor<{b}x{hq}x{n}x{c}x{D if gradient else e}x" in text
        assert launch_grids[-1][0] == n // per_program
    zeros = [jnp.zeros(shape, dtype) for shape, dtype in shapes]
    with pytest.raises(ValueError, match="chunks_per_program=3 must divide the 4"):
        call(*zeros, k=3)
    normalizer = state_kernels.Normalizer(jnp.zeros((b, hk, n, 3 * D, D), BF16),
                                          jnp.zeros((b, hq, n, c), F32))
    with pytest.raises(ValueError, match="chunks_per_program=2: a program takes one chunk "
                                         "with a normalizer"):
        call(*zeros, k=2, normalizer=normalizer)


@pytest.mark.parametrize("e, quadratic, stages", [(64, False, 5), (64, True, 4), (128, False, 3),
                                                  (128, True, 3)])
def test_state_to_rows_rings_are_as_deep_as_shared_memory_allows(monkeypatch, e, quadratic,
                                                                  stages):
    """state_to_rows' ring takes MAX_STAGES slots where they fit beside its own blocks:
    with the normalizer's parts at E = 64, 5 slots are over the H200's shared memory
    (241,800 > 232,448 bytes, measured 2026-11-27), so 4; at E = 128 three fit."""
    depths = []
    real_scratch = state_kernels.Ring.scratch
    monkeypatch.setattr(state_kernels.Ring, "scratch", staticmethod(
        lambda specs, depth, *a, **kw: depths.append(depth) or real_scratch(specs, depth, *a,
                                                                              **kw)))
    rows, col = ((1, 2, 1, 256, D), BF16), ((1, 2, 1, D, 256), BF16)
    shapes = [rows, col, ((1, 2, 1, D * D, e), BF16)]
    if quadratic:
        shapes += [((1, 2, 1, 3 * D, D), BF16), ((1, 2, 1, 256), F32)]
    lowered(lambda *x: state_kernels.state_to_rows(
        *x[:3], transposed=False,
        normalizer=state_kernels.Normalizer(*x[3:]) if quadratic else None), *shapes)
    assert depths[-1] == stages


def test_the_quadratic_form_takes_the_rows_not_a_transposed_product():
    x = jnp.zeros((1, 2, 1, 128, D), BF16)
    normalizer = state_kernels.Normalizer(jnp.zeros((1, 2, 1, 3 * D, D), BF16),
                                          jnp.zeros((1, 2, 1, 128), F32))
    with pytest.raises(ValueError, match="normalizer: the quadratic form takes the rows x"):
        state_kernels.state_to_rows(x, jnp.zeros((1, 2, 1, D, 128), BF16),
                                    jnp.zeros((1, 2, 1, D * D, 64), BF16), transposed=True,
                                    normalizer=normalizer)


def _upper_sum(c, x, s):
    """sum_ij c_i x_j S[(i, j)] [E] for one row's c, x [D] and a state s [D, D, E], summed
    as state_to_rows' `upper` kernel does: the pieces of `upper_pieces` of each block of
    16 rows i."""
    total = 0.0
    for lo in range(0, D, state_walks.BLOCK):
        for start, stop, weight in state_walks.upper_pieces(lo, D):
            block = s[lo:lo + state_walks.BLOCK, start:stop]  # [16 i, stop - start j, E]
            total = total + weight * np.einsum("i,j,ije->e", c[lo:lo + state_walks.BLOCK],
                                               x[start:stop], block)
    return total


def test_the_upper_pieces_are_the_weighted_sum_and_for_the_tier_the_square_one(rng):
    """The pieces' sum is the square sum with feature (i, j) weighted by `upper_weights`
    (the reference's upper=True) for any c, x and S, so the blocks left of the diagonal
    are never read; it is the square sum phi(u) S where S and c x^T are symmetric (c = x
    scaled: the tier's col), and not otherwise; the pieces cover 10 of the 16 blocks at
    D = 64 (62.5 % of the products)."""
    c, x, s = rng.normal(size=D), rng.normal(size=D), rng.normal(size=(D, D, 3))
    weights = np.asarray(state_references.upper_weights(), np.float64).reshape(D, D, 1)
    square = lambda c_, x_, s_: np.einsum("i,j,ije->e", c_, x_, s_)  # noqa: E731
    np.testing.assert_allclose(_upper_sum(c, x, s), square(c, x, weights * s), rtol=1e-10)
    symmetric = s + np.swapaxes(s, 0, 1)
    np.testing.assert_allclose(_upper_sum(0.3 * x, x, symmetric), square(0.3 * x, x, symmetric),
                               rtol=1e-10)
    assert not np.allclose(_upper_sum(c, x, symmetric), square(c, x, symmetric), rtol=1e-3)
    block = np.arange(D) // state_walks.BLOCK
    below = (block[:, None] > block[None, :])[..., None]
    assert np.all(_upper_sum(c, x, s * below) == 0.0) and np.any(square(c, x, s * below))
    covered = sum((stop - start) * state_walks.BLOCK for lo in range(0, D, state_walks.BLOCK)
                  for start, stop, _ in state_walks.upper_pieces(lo, D))
    assert covered == 10 * state_walks.BLOCK ** 2


@pytest.mark.parametrize(("e", "quadratic", "packed"), [(64, False, False), (64, True, False),
                                                      (128, False, False), (64, False, True),
                                                      (64, True, True), (128, True, True)])
def test_state_to_rows_over_the_upper_blocks_lowers_with_a_tile_a_block(monkeypatch, e,
                                                                         quadratic, packed):
    """upper=True: one Mosaic GPU kernel of the same outputs, its ring two [64, E] tiles a
    slot swizzled at 32 bytes (K = 16 slices), both on one barrier, which takes a copy per
    block a step (2; packed: up to 8, the last rows' blocks four to a tile); the transposed
    product, several chunks a program, packed without upper and an out_dtype other than
    float32 or bfloat16 are refused by name."""
    specs = []
    real_scratch = state_kernels.Ring.scratch
    monkeypatch.setattr(state_kernels.Ring, "scratch", staticmethod(
        lambda ring_specs, depth, groups=None, arrivals=None: specs.append(
            (ring_specs, groups, arrivals)) or real_scratch(ring_specs, depth, groups, arrivals)))
    b, hq, hk, n, c = 1, 4, 2, 2, 256
    shapes = [((b, hq, n, c, D), BF16), ((b, hq, n, D, c), BF16), ((b, hk, n + 1, D * D, e), BF16)]
    shapes += [((b, hk, n, 3 * D, D), BF16), ((b, hq, n, c), F32)] if quadratic else []
    text = lowered(lambda *x: state_kernels.state_to_rows(
        *x[:3], transposed=False, slot_offset=1, upper=True, packed=packed,
        normalizer=state_kernels.Normalizer(*x[3:]) if quadratic else None), *shapes)
    assert text.count("@mosaic_gpu") == 1
    assert f"tensor<{b}x{hq}x{n}x{c}x{e}xf32>" in text
    per_step = state_walks.BLOCKS_PER_STEP
    assert specs[-1] == ([blocks.tile(e, max_swizzle=32)] * per_step, [tuple(range(per_step))],
                         [8 if packed else per_step])
    zeros = [jnp.zeros(shape, dtype) for shape, dtype in shapes[:3]]
    with pytest.raises(ValueError, match="upper: the untransposed product one chunk a program "
                                         r"\(transposed=True"):
        state_kernels.state_to_rows(jnp.zeros((b, hq, n, c, e), BF16), *zeros[1:],
                                    transposed=True, slot_offset=1, upper=True)
    with pytest.raises(ValueError, match="chunks_per_program=2"):
        state_kernels.state_to_rows(*zeros, transposed=False, slot_offset=1, upper=True,
                                    chunks_per_program=2)
    with pytest.raises(ValueError, match="packed: the upper blocks' ring"):
        state_kernels.state_to_rows(*zeros, transposed=False, slot_offset=1, packed=True)
    with pytest.raises(ValueError, match="out_dtype must be float32 or bfloat16; got float16"):
        state_kernels.state_to_rows(*zeros, transposed=False, slot_offset=1,
                                    out_dtype=jnp.float16)


@pytest.mark.parametrize("packed", [False, True])
def test_the_upper_segments_place_every_block_once_in_its_tile(packed):
    """Over the segments' steps each S_i, i < 64, is placed once, with its rows j >= lo
    (lo = 16 (i // 16)); a step's blocks stack in their tiles without overlap within 64
    rows; the steps are consecutive from 0 (32 a chunk, packed 22), and a packed step
    holds at least half a square step's rows."""
    segments = state_walks.upper_segments(D, packed)
    placed, step = [], 0
    for seg in segments:
        assert seg.first == step
        for s in range(seg.first, seg.first + seg.steps):
            used = {}
            for u in range(seg.blocks):
                i, t, row = seg.place(s, u, D)
                assert i // state_walks.BLOCK * state_walks.BLOCK == seg.lo
                rows = set(range(row, row + D - seg.lo))
                assert max(rows) < D and not rows & used.get(t, set())
                used[t] = used.get(t, set()) | rows
                placed.append(i)
            assert sum(map(len, used.values())) >= (D if packed else D - seg.lo)
        step += seg.steps
    assert sorted(placed) == list(range(D))
    assert step == (22 if packed else 32)


@pytest.mark.parametrize("upper", [False, True])
def test_the_tier_reads_the_upper_blocks_where_it_multiplies_by_a_state(monkeypatch, rng,
                                                                        upper):
    """Both untransposed products of the tier (query_state's y, the update side's da) pass
    states.UPPER_BLOCKS, with their steps in halves (`pipelined`); row_gradients (which
    needs both triangles) does not take it. The same whether the states are stored
    square or in the upper layout (`upper`)."""
    calls = []
    monkeypatch.setattr(state_kernels, "state_to_rows", lambda *a, **kw: calls.append(kw)
                        or state_references.state_to_rows_reference(*a, **kw))
    monkeypatch.setattr(state_sums, "rows_to_state", state_references.rows_to_state_reference)
    monkeypatch.setattr(state_kernels, "row_gradients", state_references.row_gradients_reference)
    interpret_gram(monkeypatch)
    b, h, n, c, e = 1, 2, 2, 64, 16  # c: a multiple of gram.ROWS_PER_STEP
    x = jnp.asarray(rng.normal(size=(b, h, n, c, D)), BF16)
    ls = jnp.asarray(rng.uniform(-1.0, 0.0, size=(b, h, n, c)), F32)
    a = jnp.asarray(rng.normal(size=(b, h, n, c, e)), BF16)
    ct = jax.tree.map(jnp.ones_like, states.state_of_rows(x, ls, a, h, upper))
    jax.vjp(lambda *w: states.state_of_rows(*w, h, upper), x, ls, a)[1](ct)
    s, z = _symmetric_state(rng, b, h, n, e), _symmetric_normalizer(rng, b, h, n)
    states.rows_of_state(x, ls, states.stored(s, upper, values=True),
                         states.stored(z, upper, values=False))
    assert [kw["upper"] for kw in calls] == [states.UPPER_BLOCKS] * 2 and states.UPPER_BLOCKS
    assert [kw["packed"] for kw in calls] == [states.PACKED] * 2
    assert [kw["pipelined"] for kw in calls] == [states.UPPER_BLOCKS] * 2


def test_the_upper_layout_holds_each_pair_once_and_the_whole_blocks_come_back(rng):
    """The upper layout keeps S[(i, j)] for j >= 16 (i // 16): 62.5 % of the square entries,
    every unordered pair (i, j) at least once; square_of_upper gives the symmetric state
    back exactly, taking each entry left of a diagonal block from its mirror; the pieces a
    kernel reads a whole block S_j with (its held rows, one box of mirrors per group below
    j's) cover its rows once and hold exactly that block."""
    e = 3
    square = rng.normal(size=(2, D, D, e)).astype(np.float32)
    symmetric = jnp.asarray((square + np.swapaxes(square, 1, 2)).reshape(2, D * D, e), F32)
    arrays = state_references.upper_arrays(symmetric)
    assert [a.shape for a in arrays] == state_walks.upper_shapes((2,), D, e)
    assert sum(a.size for a in arrays) == 0.625 * symmetric.size
    np.testing.assert_array_equal(state_references.square_of_upper(arrays), symmetric)
    skewed = jnp.asarray(square.reshape(2, D * D, e), F32)  # not symmetric: whose entry?
    back = np.asarray(state_references.square_of_upper(state_references.upper_arrays(skewed)))
    for i, j in ((3, 40), (40, 3), (20, 17), (63, 0), (5, 5)):
        held = j >= state_walks.BLOCK * (i // state_walks.BLOCK)
        np.testing.assert_array_equal(back[:, i * D + j], square[:, i, j] if held
                                      else square[:, j, i])
    whole = np.asarray(state_references.square_of_upper(arrays)).reshape(2, D, D, e)
    for j in range(D):
        block = np.full((2, D, e), np.nan)
        for piece in state_walks.whole_block_pieces(j, D):
            source = arrays[piece.group]
            at = j - state_walks.BLOCK * piece.group
            rows = source[:, :, at] if piece.mirror else source[:, at]
            assert rows.shape[1] == piece.rows
            assert np.all(np.isnan(block[:, piece.first:piece.first + piece.rows]))
            block[:, piece.first:piece.first + piece.rows] = rows
        np.testing.assert_array_equal(block, whole[:, j])


def test_the_kernels_write_and_read_the_state_in_the_upper_layout(monkeypatch):
    """rows_to_state(upper=True) writes four arrays of the upper shapes; state_to_rows (over
    the upper blocks as the tier runs it, over whole blocks, transposed) and row_gradients
    take s as such a tuple, each one Mosaic GPU kernel of the outputs they give for a
    square s; the whole-block ring takes a step's copies (up to 8: two blocks of the last
    group, each its held rows and three boxes of mirrors) on one barrier. A tuple of other
    shapes, or several chunks a program, is refused by name."""
    arrivals = []
    real_scratch = state_kernels.Ring.scratch
    monkeypatch.setattr(state_kernels.Ring, "scratch", staticmethod(
        lambda specs, depth, groups=None, counts=None: arrivals.append(counts)
        or real_scratch(specs, depth, groups, counts)))
    b, hq, hk, n, c, e = 1, 4, 2, 2, 256, 64
    upper = [(shape, BF16) for shape in state_walks.upper_shapes((b, hk, n + 1), D, e)]
    text = lowered(lambda *x: state_sums.rows_to_state(*x, kv_heads=hk, slots=n + 1,
                                                          slot_offset=1, upper=True),
                   ((b, hq, n, D, c), BF16), ((b, hq, n, D, c), BF16), ((b, hq, n, c, e), BF16))
    assert text.count("@mosaic_gpu") == 1
    assert all(f"tensor<{'x'.join(map(str, shape))}xbf16>" in text for shape, _ in upper)
    x, a, col = ((b, hq, n, c, D), BF16), ((b, hq, n, c, e), BF16), ((b, hq, n, D, c), BF16)
    z = [((b, hk, n, 3 * D, D), BF16), ((b, hq, n, c), F32)]
    runs = [
        (lambda x, col, *s: state_kernels.state_to_rows(
            x, col, s, transposed=False, slot_offset=1, upper=True, packed=True,
            pipelined=True), [x, col, *upper], f"tensor<{b}x{hq}x{n}x{c}x{e}xf32>", [8]),
        (lambda x, col, *s: state_kernels.state_to_rows(x, col, s, transposed=False,
                                                        slot_offset=1),
         [x, col, *upper], f"tensor<{b}x{hq}x{n}x{c}x{e}xf32>", [8]),
        (lambda a, col, *s: state_kernels.state_to_rows(a, col, s, transposed=True,
                                                        slot_offset=1),
         [a, col, *upper], f"tensor<{b}x{hq}x{n}x{c}x{D}xf32>", [8]),
        (lambda a, x, col, *rest: state_kernels.row_gradients(
            a, x, col, list(rest[:4]), slot_offset=1,  # a list is taken as a tuple
            normalizer=state_kernels.Normalizer(*rest[4:])), [a, x, col, *upper, *z],
         f"tensor<{b}x{hq}x{n}x{c}x{D}xbf16>, tensor<{b}x{hq}x{n}x{c}xf32>", [8])]
    for fn, shapes, outputs, counts in runs:
        text = lowered(fn, *shapes)
        assert text.count("@mosaic_gpu") == 1
        assert outputs in text
        assert arrivals[-1] == counts
    stored = tuple(jnp.zeros(shape, dtype) for shape, dtype in upper)
    rows, cols = jnp.zeros(x[0], BF16), jnp.zeros(col[0], BF16)
    with pytest.raises(ValueError, match="s in the upper layout"):
        state_kernels.state_to_rows(rows, cols, stored[:3] + stored[2:3], transposed=False,
                                    slot_offset=1)
    with pytest.raises(ValueError, match="chunks_per_program=2: s in the upper layout"):
        state_kernels.state_to_rows(rows, cols, stored, transposed=False, slot_offset=1,
                                    chunks_per_program=2)


def test_the_columns_are_the_scaled_rows_transposed_in_bf16(rng):
    x = jnp.asarray(rng.normal(size=(1, 2, 3, 8, D)), BF16)
    ls = jnp.asarray(rng.uniform(-2.0, 0.0, size=(1, 2, 3, 8)), F32)
    col = states.columns(x, ls)
    assert col.dtype == BF16 and col.shape == (1, 2, 3, D, 8)
    want = np.swapaxes(np.asarray(x, np.float64) * np.exp(2.0 * np.asarray(ls, np.float64))[
        ..., None], -1, -2)
    np.testing.assert_allclose(np.asarray(col, np.float64), want, rtol=2 ** -8, atol=0)


def test_the_definitions_are_the_products_with_phi(rng, monkeypatch):
    b, hq, hk, n, c, e = 1, 4, 2, 2, 8, 16
    x = jnp.asarray(rng.normal(size=(b, hq, n, c, D)), F32)
    ls = jnp.asarray(rng.uniform(-1.0, 0.0, size=(b, hq, n, c)), F32)
    a = jnp.asarray(rng.normal(size=(b, hq, n, c, e)), F32)
    monkeypatch.setattr(states, "COLUMNS_DTYPE", "float32")  # the definitions are exact
    col = states.columns(x, ls)
    u = x * jnp.exp(ls)[..., None]
    per_kv = lambda y: y.reshape(b, hk, hq // hk, *y.shape[2:]).sum(axis=2)  # noqa: E731
    hi = jax.lax.Precision.HIGHEST
    want = per_kv(jnp.einsum("bhncf,bhnce->bhnfe", phi(u), a, precision=hi))
    got = state_references.rows_to_state_reference(jnp.swapaxes(x, -1, -2), col, a, kv_heads=hk)
    assert testing.rel_err(got, want) < 2 ** -8  # the state is stored in bf16
    s = jnp.asarray(want, F32)  # symmetric in (i, j)
    s_q = jnp.repeat(s, hq // hk, axis=1)
    y = state_references.state_to_rows_reference(x, col, s, transposed=False)
    assert testing.rel_err(y, jnp.einsum("bhncf,bhnfe->bhnce", phi(u), s_q, precision=hi)) < 1e-6
    # transposed: the row gradient of phi(u) . (S a) is 2 e^ls col-weighted S_j^T a products
    g = state_references.state_to_rows_reference(a, col, s, transposed=True)
    grad = jax.grad(lambda x: jnp.sum(phi(x * jnp.exp(ls)[..., None])
                                      * jnp.einsum("bhnfe,bhnce->bhncf", s_q, a, precision=hi)))
    assert testing.rel_err(2 * g, grad(x)) < 1e-5
    # row_gradients: that gradient in bf16 and its row sums against x (the ls cotangent)
    dx, dls = state_references.row_gradients_reference(a, x, col, s)
    assert dx.dtype == BF16 and testing.rel_err(dx.astype(F32), grad(x)) < 2 ** -8
    grad_ls = jax.grad(lambda ls: jnp.sum(phi(x * jnp.exp(ls)[..., None]) * jnp.einsum(
        "bhnfe,bhnce->bhncf", s_q, a, precision=hi)))(ls)
    assert testing.rel_err(dls, grad_ls) < 1e-5


def _symmetric_state(rng, b, hk, n, e):
    rows = jnp.asarray(rng.normal(size=(b, hk, n, 16, D)), F32)
    return jnp.einsum("bhncf,bhnce->bhnfe", phi(rows),
                      jnp.asarray(rng.normal(size=(b, hk, n, 16, e)), F32)).astype(BF16)


def _symmetric_normalizer(rng, b, hk, n):
    """z [B, Hk, N, D^2] float32: a sum of phi of random rows, symmetric in (i, j)."""
    return jnp.sum(phi(jnp.asarray(rng.normal(size=(b, hk, n, 16, D)), F32)), axis=3)


def test_the_parts_of_z_sum_to_z(rng):
    z = _symmetric_normalizer(rng, 1, 2, 3) * jnp.exp(jnp.asarray(rng.normal(size=(D * D,)), F32))
    parts = states.z_parts(z)
    assert parts.dtype == BF16 and parts.shape == (1, 2, 3, 3 * D, D)
    total = np.asarray(parts, np.float64).reshape(1, 2, 3, 3, D * D).sum(axis=3)
    np.testing.assert_allclose(total, np.asarray(z, np.float64), rtol=2 ** -23, atol=0)


def test_the_quadratic_form_is_phi_against_z_and_its_gradient(rng, monkeypatch):
    """den_r = w_r x_r^T Z x_r is c_r phi(u_r) . z for w = c e^(2 ls); row_gradients adds its
    gradient (and its share of the ls cotangent) to the state's."""
    b, hq, hk, n, c, e = 1, 4, 2, 2, 8, 16
    x = jnp.asarray(rng.normal(size=(b, hq, n, c, D)), F32)
    ls = jnp.asarray(rng.uniform(-1.0, 0.0, size=(b, hq, n, c)), F32)
    a = jnp.asarray(rng.normal(size=(b, hq, n, c, e)), F32)
    factor = jnp.asarray(rng.normal(size=(b, hq, n, c)), F32)  # c_r: a cotangent, say
    monkeypatch.setattr(states, "COLUMNS_DTYPE", "float32")  # the definitions are exact
    col = states.columns(x, ls)
    s = _symmetric_state(rng, b, hk, n, e).astype(F32)
    z = _symmetric_normalizer(rng, b, hk, n)
    normalizer = state_kernels.Normalizer(states.z_parts(z), factor * jnp.exp(2.0 * ls))
    repeat = lambda y: jnp.repeat(y, hq // hk, axis=1)  # noqa: E731
    hi = jax.lax.Precision.HIGHEST

    def form(x, ls):  # sum_r phi(u_r) . (S a_r) + c_r phi(u_r) . z
        f = phi(x * jnp.exp(ls)[..., None])
        state = jnp.einsum("bhnfe,bhnce->bhncf", repeat(s), a, precision=hi)
        return jnp.sum(f * state) + jnp.sum(factor * jnp.sum(f * repeat(z)[:, :, :, None], -1))

    y, den = state_references.state_to_rows_reference(x, col, s, transposed=False,
                                                   normalizer=normalizer)
    want = factor * jnp.sum(phi(x * jnp.exp(ls)[..., None]) * repeat(z)[:, :, :, None], -1)
    assert testing.rel_err(den, want) < 1e-6
    assert testing.rel_err(y, state_references.state_to_rows_reference(
        x, col, s, transposed=False)) == 0
    dx, dls = state_references.row_gradients_reference(a, x, col, s, normalizer=normalizer)
    grad_x, grad_ls = jax.grad(form, argnums=(0, 1))(x, ls)
    assert testing.rel_err(dx.astype(F32), grad_x) < 2 ** -8  # dx leaves in bf16
    assert testing.rel_err(dls, grad_ls) < 1e-5


@pytest.mark.usefixtures("definitions")
@pytest.mark.parametrize(("upper", "formed"), [(False, False), (True, False), (True, True)])
def test_the_custom_vjps_are_the_derivatives_of_the_definitions(rng, monkeypatch, upper, formed):
    """Square or in the upper layout (`upper`: states and their cotangents alike, a stored
    entry's cotangent that of the symmetric square's entry); col stored or formed in the
    kernels (`formed`: states.FORMED_COLUMNS)."""
    monkeypatch.setattr(states, "FORMED_COLUMNS", formed)
    b, hq, hk, n, c, e = 1, 4, 2, 2, 64, 16  # c: a multiple of gram.ROWS_PER_STEP
    x = jnp.asarray(rng.normal(size=(b, hq, n, c, D)), BF16)
    ls = jnp.asarray(rng.uniform(-1.0, 0.0, size=(b, hq, n, c)), F32)
    a = jnp.asarray(rng.normal(size=(b, hq, n, c, e)), BF16)
    s = _symmetric_state(rng, b, hk, n, e)
    z = _symmetric_normalizer(rng, b, hk, n)
    repeat = lambda y: jnp.repeat(y, hq // hk, axis=1)  # noqa: E731
    per_kv = lambda y: y.reshape(b, hk, hq // hk, *y.shape[2:]).sum(axis=2)  # noqa: E731

    def stored(state):  # (S, z) square -> the layout under test
        return (states.stored(state[0], upper, values=True),
                states.stored(state[1], upper, values=False))

    def square(state):  # ... and back
        return ((states.square(state[0], values=True), states.square(state[1], values=False))
                if upper else tuple(state))

    def by_autodiff(f, args, ct):
        return jax.vjp(f, *args)[1](ct)

    def close(got, want):
        for x_, y_ in zip(got, want, strict=True):
            assert testing.rel_err(x_.astype(F32), y_.astype(F32)) < 1e-2  # bf16 cotangents

    def state_definition(x, ls, a):  # (S, z) of the grouped rows, by chunk
        u = x.astype(F32) * jnp.exp(ls)[..., None]
        return (state_references.rows_to_state_reference(
            jnp.swapaxes(x, -1, -2), states.columns(x, ls), a, kv_heads=hk),
            per_kv(jnp.sum(phi(u), axis=3)))

    def with_nan_slot(arrays, *, first: bool):  # one more chunk slot, of NaN: a read shows
        def pad(y):
            nan = jnp.full_like(y[:, :, :1], jnp.nan)
            return jnp.concatenate([nan, y] if first else [y, nan], axis=2)
        return jax.tree.map(pad, arrays)

    # state_of_rows: chunk n at slot n + 1, slot 0 neither written nor read; the cotangents
    # a state gets are symmetric
    got = states.state_of_rows(x, ls, a, hk, upper)
    assert [y.shape[2] for y in jax.tree.leaves(got)] == [n + 1] * (8 if upper else 2)
    close([y[:, :, 1:] for y in square(got)], state_definition(x, ls, a))
    cotangent = (_symmetric_state(rng, b, hk, n, e), _symmetric_normalizer(rng, b, hk, n))
    close(by_autodiff(lambda *w: states.state_of_rows(*w, hk, upper), (x, ls, a),
                      with_nan_slot(stored(cotangent), first=True)),
          by_autodiff(state_definition, (x, ls, a), cotangent))

    def rows_definition(x, ls, s, z):  # (phi(u) S, phi(u) . z)
        u = x.astype(F32) * jnp.exp(ls)[..., None]
        return (state_references.state_to_rows_reference(x, states.columns(x, ls), s,
                                                      transposed=False),
                jnp.sum(phi(u) * repeat(z)[:, :, :, None], axis=-1))

    # rows_of_state: chunk n reads slot n, of N or of N + 1 slots (the last unread); the
    # cotangents in the layout of the state; y in the combine's partials' dtype (bf16)
    y, den = states.rows_of_state(x, ls, *stored((s, z)))
    assert (y.dtype, den.dtype) == (jnp.dtype(states.PARTIALS_DTYPE), F32) == (BF16, F32)
    dy = (jnp.asarray(rng.normal(size=(b, hq, n, c, e)), BF16),
          jnp.asarray(rng.normal(size=(b, hq, n, c)), F32))
    want = by_autodiff(rows_definition, (x, ls, s, z), (dy[0].astype(F32), dy[1]))
    grads = by_autodiff(states.rows_of_state, (x, ls, *stored((s, z))), dy)
    assert jax.tree.structure(grads[2:]) == jax.tree.structure(stored((s, z)))
    close([*grads[:2], *square(grads[2:])], want)
    grads = by_autodiff(states.rows_of_state, (x, ls, *with_nan_slot(stored((s, z)),
                                                                      first=False)), dy)
    assert [y.shape[2] for y in jax.tree.leaves(grads[2:])] == [n + 1] * (8 if upper else 2)
    assert not any(np.any(np.asarray(y[:, :, n])) for y in jax.tree.leaves(grads[3]))  # z's
    close([*grads[:2], *(y[:, :, :n] for y in square(grads[2:]))], want)  # last: no cotangent
    # the forward values too: the normalizer against phi written out
    close(states.rows_of_state(x, ls, *stored((s, z))), rows_definition(x, ls, s, z))
    close(states.rows_of_state(x, ls, *with_nan_slot(stored((s, z)), first=False)),
          rows_definition(x, ls, s, z))


def _mild(log_g):
    """Gates whose products over a chunk of 128 stay near 1 (testing's fall to ~e^-25 there):
    the state carried into the next chunk, and g_last's cotangent with it, then count."""
    return log_g / 64


def _forward_and_grads(f, args, dy):
    y, vjp = jax.vjp(f, *args)
    return (y, *vjp(dy))


@pytest.mark.usefixtures("definitions")
@pytest.mark.parametrize(("hq", "hk", "e", "gated", "upper"), [
    (4, 2, 32, True, True), (1, 1, 64, False, True), (2, 1, 100, True, True),
    (4, 2, 32, True, False), (2, 1, 100, True, False)])
def test_the_chunked_algorithm_on_the_tiers_states_is_the_reference(monkeypatch, rng, hq, hk,
                                                                     e, gated, upper):
    """gold (the reference, float32 inputs) / ref (bf16 inputs) / test (the tier's
    primitives, bf16, the states stored in the upper layout or square): ||gold - test|| <=
    K ||gold - ref|| + ATOL ||gold|| for y and every gradient, T = 300 over chunks of 128
    (the last one partial), e padded to 64 or 128 inside."""
    monkeypatch.setattr(states, "STORED_UPPER", upper)
    b, t = 1, 300
    q, k, v, log_g, dy = testing.inputs(
        testing.Case(t=t, d=D, e=e, hq=hq, hk=hk, b=b, chunk=128, gating=gated), rng)
    args = (q, k, v) + ((log_g,) if gated else ())

    def test_fn(q, k, v, *log_g):
        return chunked.chunked_attention(q, k, v, *(log_g or (None,)), p=2, chunk_size=128,
                                         primitives=hopper.primitives(CONFIG))[0]

    def reference_fn(q, k, v, *log_g):
        return reference.attention_form(q, k, v, *(log_g or (None,)), 2)

    bf16 = lambda xs: tuple(x.astype(BF16) if x.ndim == 4 else x for x in xs)  # noqa: E731
    test = compiled(lambda *x: _forward_and_grads(test_fn, x, dy))(*bf16(args))
    ref = compiled(lambda *x: _forward_and_grads(reference_fn, x, dy))(*bf16(args))
    gold = compiled(lambda *x: _forward_and_grads(reference_fn, x, dy))(*args)
    for x_, y_, z_ in zip(test, ref, gold, strict=True):
        x_, y_, z_ = (np.asarray(w, np.float64) for w in (x_, y_, z_))
        assert np.all(np.isfinite(x_))
        bound = testing.K_BF16 * np.linalg.norm(z_ - y_) + testing.ATOL_BF16 * np.linalg.norm(z_)
        assert np.linalg.norm(z_ - x_) <= bound, (np.linalg.norm(z_ - x_), bound)


@pytest.mark.usefixtures("definitions")
@pytest.mark.parametrize("upper", [False, True])
def test_the_final_state_is_the_symmetric_layout_every_tier_returns(monkeypatch, rng, upper):
    """Its values, and the gradients of a loss on it alone (through the prefix sums' g_last
    cotangent, which counts each pair the upper layout stores once twice)."""
    monkeypatch.setattr(states, "STORED_UPPER", upper)
    q, k, v, log_g, _ = testing.inputs(testing.Case(t=200, d=D, e=64, hq=2, hk=2, b=1), rng)
    args = (q.astype(BF16), k.astype(BF16), v.astype(BF16), _mild(log_g))
    weights = [jnp.asarray(rng.normal(size=shape), F32)
               for shape in ((1, 2, D * (D + 1) // 2, 64), (1, 2, D * (D + 1) // 2))]

    def final_and_grads(primitives):
        def final(*x):
            return chunked.chunked_attention(*x, p=2, chunk_size=128, primitives=primitives)[1]

        def loss(*x):  # the final state alone
            return sum(jnp.sum(w * y) for w, y in zip(weights, final(*x), strict=True))
        return compiled(lambda *x: (final(*x), jax.grad(loss, argnums=(1, 2, 3))(*x)))(*args)

    (final, grads), (want, want_grads) = (final_and_grads(hopper.primitives(CONFIG)),
                                          final_and_grads(xla.PRIMITIVES))
    for x_, y_ in zip(final, want, strict=True):
        assert x_.shape == y_.shape  # [B, Hk, F1, E], [B, Hk, F1] with F1 = d (d + 1) / 2
        assert testing.rel_err(x_, y_) < 2 ** -7  # bf16 per-chunk states against float32
    for x_, y_ in zip(grads, want_grads, strict=True):  # dk, dv, dlog_g
        assert testing.rel_err(x_.astype(F32), y_.astype(F32)) < 2 ** -6


@pytest.mark.parametrize("slotted", [False, True])
def test_the_prefix_sums_of_the_upper_layout_are_those_of_the_square_one(rng, slotted):
    """The same sums entry by entry, the same final state, and the same cotangents: s's and
    z's in their layout, g_last's counting each pair the upper layout stores once twice."""
    b, hk, n, e = 1, 2, 3, 16
    s = _symmetric_state(rng, b, hk, n + slotted, e)
    z = _symmetric_normalizer(rng, b, hk, n + slotted)
    g_last = jnp.asarray(np.log(rng.uniform(0.3, 1.0, size=(b, hk, n))), F32)
    cts = [jnp.asarray(rng.normal(size=shape), F32) for shape in (
        (b, hk, n + slotted, D * D, e), (b, hk, n + slotted, D * D),
        (b, hk, D * (D + 1) // 2, e), (b, hk, D * (D + 1) // 2))]
    # symmetric, as every state cotangent of the tier; s_in's in s's dtype
    cts[:2] = [_symmetrized(cts[0]).astype(BF16), _symmetrized(cts[1])]

    def sums_and_grads(upper):  # square in and out, through the tier's conversions
        def sums(s, z, g_last):
            out = states.prefix_sum(CONFIG, *_stored((s, z), upper), g_last)
            return (*_square_of(out[:2], upper), *out[2:])
        out, vjp = jax.vjp(sums, s, z, g_last)
        return out, vjp(tuple(cts))

    (got, got_grads), (want, want_grads) = (compiled(functools.partial(sums_and_grads, u))()
                                            for u in (True, False))
    for x_, y_ in zip((*got, *got_grads), (*want, *want_grads), strict=True):
        np.testing.assert_allclose(np.asarray(x_, np.float64), np.asarray(y_, np.float64),
                                   rtol=1e-5, atol=1e-5 * float(np.max(np.abs(y_))))
    # the upper layout's four arrays in one launch each way, as the square layout's one
    launches = testing.pallas_calls(lambda: sums_and_grads(True))
    assert [call.params["name"] for call in launches] == ["sympow_prefix_sum",
                                                          "sympow_prefix_sum_bwd"]
    features = sum(16 * (D - lo) for lo in range(0, D, 16))  # 2,560: 62.5 % of D^2
    assert features == 5 * D * D // 8
    assert [call.params["grid_mapping"].grid for call in launches] == [
        (features // states.PREFIX_FEATURE_BLOCK, b * hk)] * 2  # at most 16 features a program


def test_the_prefix_sum_takes_the_tiers_block_stages_and_warps(monkeypatch, rng):
    """states.PREFIX_FEATURE_BLOCK, PREFIX_STAGES and PREFIX_WARPS reach the kernels' plan."""
    for name, value in (("PREFIX_FEATURE_BLOCK", 8), ("PREFIX_STAGES", 3),
                        ("PREFIX_WARPS", 2)):
        monkeypatch.setattr(states, name, value)
    plans, prefix_sum = [], states.portable.prefix_sum
    monkeypatch.setattr(states.portable, "prefix_sum",
                        lambda plan, *args: plans.append(plan) or prefix_sum(plan, *args))
    b, hk, n, e = 1, 1, 2, 16
    s, z = _stored((_symmetric_state(rng, b, hk, n + 1, e),
                    _symmetric_normalizer(rng, b, hk, n + 1)), True)
    states.prefix_sum(CONFIG, s, z, jnp.zeros((b, hk, n), F32))
    assert [(plan.bf, plan.stages, plan.warps, plan.slotted) for plan in plans] == [
        (8, 3, 2, True)]


def _symmetrized(y):
    """[B, Hk, slots, D^2(, E)] made symmetric in (i, j) by the mean with its mirror."""
    square = y.reshape(*y.shape[:3], D, D, *y.shape[4:])
    return (0.5 * (square + jnp.swapaxes(square, 3, 4))).reshape(y.shape)


def _stored(state, upper: bool):
    """(S, z) of the square layout as the tier stores them."""
    return (states.stored(state[0], upper, values=True),
            states.stored(state[1], upper, values=False))


def _square_of(state, upper: bool):
    """(S, z) in the square layout from the tier's stored one."""
    if not upper:
        return tuple(state)
    return states.square(state[0], values=True), states.square(state[1], values=False)


def test_the_final_gather_takes_the_mean_of_each_pair_and_its_mirror():
    rows, mirrors, scale = states._final_gather(4)
    pairs = [(r // 4, r % 4) for r in rows]
    assert pairs == [(i, j) for i in range(4) for j in range(i, 4)]
    assert [(m // 4, m % 4) for m in mirrors] == [(j, i) for i, j in pairs]
    np.testing.assert_allclose(scale, [1.0 if i == j else np.sqrt(2) for i, j in pairs],
                               rtol=1e-6)


def test_the_square_layout_is_told_by_its_features():
    assert states.is_square(D * D, 2)
    assert not states.is_square(D * D, 4)
    assert tiled_layout(D * D, 2) is None  # no portable layout has d^2 features


@pytest.mark.parametrize(("changes", "shape", "reason"), [
    ({"interpret": True}, (64, 64, 128, "bfloat16"), "the interpreter"),
    ({"p": 4}, (64, 64, 128, "bfloat16"), r"p=4 \(the square layout is p = 2\)"),
    ({}, (64, 64, 128, "float32"), r"dtype float32 \(supported: bfloat16\)"),
    ({}, (32, 64, 128, "bfloat16"), r"d=32, e=64 \(supported: d = 64, e <= 128\)"),
    ({}, (64, 256, 128, "bfloat16"), r"d=64, e=256"),
    ({}, (64, 64, 64, "bfloat16"), r"chunk 64 \(supported: multiples of 128\)"),
])
def test_unsupported_names_the_reason(monkeypatch, changes, shape, reason):
    monkeypatch.setattr(vjps, "_compute_capability", lambda: vjps.HOPPER)
    config = dataclasses.replace(CONFIG, **{"interpret": False, **changes})
    assert re.search(reason, states.unsupported(config, *shape) or "")
    monkeypatch.setattr(vjps, "_compute_capability", lambda: "8.0")
    assert states.unsupported(dataclasses.replace(CONFIG, interpret=False), 64, 64, 128,
                              "bfloat16") == "GPU compute capability 8.0 (supported: 9.0)"


def test_off_a_hopper_gpu_the_portable_states_run_and_it_says_why(rng, caplog):
    q, k, v, log_g, _ = testing.inputs(testing.Case(t=40, d=16, e=16, b=1, chunk=16), rng)
    vjps.log_fallback.cache_clear()
    config = dataclasses.replace(CONFIG, chunk_size=16)
    with caplog.at_level(logging.WARNING):
        got = compiled(lambda *x: chunked.chunked_attention(
            *x, p=2, chunk_size=16, primitives=hopper.primitives(config))[0])(q, k, v, log_g)
    portable = dataclasses.replace(config, backend="pallas")
    from sympow.attention.pallas import primitives as pallas_primitives
    want = compiled(lambda *x: chunked.chunked_attention(
        *x, p=2, chunk_size=16, primitives=pallas_primitives.primitives(portable))[0])(
        q, k, v, log_g)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    assert "the state kernels of the portable tier run for the interpreter" in caplog.text
    assert blocks.TILE_ROWS == 128
