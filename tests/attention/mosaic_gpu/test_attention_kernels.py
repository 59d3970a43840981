"""The Hopper attention kernels where a CPU can check them: each traces and lowers, through
Pallas' Mosaic GPU lowering, to one Mosaic GPU kernel for CUDA (jax lowers across platforms
without a GPU). Their numbers need a Hopper GPU: `experiments/gpu_check.py --only=primitives`
compares them with the portable kernels there (the Mosaic GPU interpreter cannot run a
wgmma whose A operand is in registers). The arithmetic the backward kernel rests on (dhead
from the dQ partial) and the assembly of its outputs are checked in plain JAX."""

from __future__ import annotations

import dataclasses
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sympow.attention.mosaic_gpu import attention_kernels, backward_kernel, blocks, weights

SHAPES = [
    (1, 2, 2, 1, 128, 64, 64, 2),  # one program: both warpgroups' diagonals
    (2, 6, 2, 3, 512, 64, 64, 2),  # grouped query heads, several chunks
    (1, 2, 1, 1, 1024, 128, 64, 4),  # wide keys, p = 4
    (1, 2, 2, 1, 256, 64, 128, 2),  # wide values
    (1, 2, 2, 1, 128, 128, 128, 2),  # wide keys and values: the most shared memory
]


def lowered(fn, *shapes):
    args = [jax.ShapeDtypeStruct(shape, dtype) for shape, dtype in shapes]
    return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def wide(b, h, n, c, w, tokens: bool = False):
    """A wide array's shape: chunk layout [B, H, N, C, W] or token layout [B, N C, H, W]."""
    return (b, n * c, h, w) if tokens else (b, h, n, c, w)


def operands(b, hq, hk, n, c, d, e, tokens: bool = False):
    bf16, f32 = jnp.bfloat16, jnp.float32
    return [(wide(b, hq, n, c, d, tokens), bf16), (wide(b, hk, n, c, d, tokens), bf16),
            (wide(b, hk, n, c, e, tokens), bf16),
            ((b, hk, n, c), f32), ((b, hk, n, c), f32), ((b, hk, n, c), f32)]


def tensor(shape, dtype: str) -> str:
    return "tensor<" + "x".join(map(str, shape)) + f"x{dtype}>"


LAYOUTS = pytest.mark.parametrize("tokens", [False, True], ids=["chunks", "tokens"])


@LAYOUTS
@pytest.mark.parametrize(("normalized", "o_dtype"),
                         [(False, None), (True, None), (False, jnp.bfloat16)],
                         ids=["o", "y", "o_bf16"])
@pytest.mark.parametrize(("b", "hq", "hk", "n", "c", "d", "e", "p"), SHAPES)
def test_the_forward_lowers_to_one_mosaic_gpu_kernel(b, hq, hk, n, c, d, e, p, tokens,
                                                     normalized, o_dtype):
    """The outputs: o (in q's layout; float32, or with normalized=True o / den in q's dtype,
    bf16, or in the o_dtype asked for), den, m and the row scales c [B, Hq, N, C], float32."""
    text = lowered(lambda *x: attention_kernels.attention_fwd(
        *x, p=p, normalized=normalized, o_dtype=o_dtype), *operands(b, hq, hk, n, c, d, e, tokens))
    assert text.count("stablehlo.custom_call @mosaic_gpu") == 1
    rows = tensor((b, hq, n, c), "f32")
    wide_dtype = "bf16" if normalized or o_dtype == jnp.bfloat16 else "f32"
    assert f"{tensor(wide(b, hq, n, c, e, tokens), wide_dtype)}, {rows}, {rows}, {rows}" in text


@LAYOUTS
@pytest.mark.parametrize(("b", "hq", "hk", "n", "c", "d", "e", "p"), SHAPES)
def test_the_backward_lowers_to_one_mosaic_gpu_kernel(b, hq, hk, n, c, d, e, p, tokens):
    f32 = jnp.float32
    text = lowered(lambda *x: backward_kernel.attention_bwd(*x, p=p),
                   *operands(b, hq, hk, n, c, d, e, tokens), ((b, hq, n, c), f32),
                   ((b, hq, n, c), f32), (wide(b, hq, n, c, e, tokens), jnp.bfloat16),
                   ((b, hq, n, c), f32))
    assert text.count("stablehlo.custom_call @mosaic_gpu") == 1
    assert "stablehlo.custom_call @__gpu$xla.gpu.triton" not in text  # dq a cast, dhead a scale
    blocks_ = c // blocks.ROWS
    columns = -(-blocks_ * (hq // hk) // blocks.ROWS) * blocks.ROWS
    # its operands end with the float32 dQ its reductions add into (zeros, aliased, in q's
    # layout), in chunk layout then q . dQ_off per query (also reduced); its outputs: dk, dv
    # (the inputs' layout), dtail, in token layout the diagonal blocks' dQ partials (in
    # chunk layout no second array of q's size: they are reduced into dQ too), the
    # diagonal blocks' dl (bf16, keys as rows), the pair totals
    dq = tensor(wide(b, hq, n, c, d, tokens), "f32")
    rows = tensor((b, hq, n, c), "f32")
    assert (f"{dq}) -> (" if tokens else f"{dq}, {rows}) -> (") in text
    assert (f"{tensor(wide(b, hk, n, c, d, tokens), 'bf16')}, "
            f"{tensor(wide(b, hk, n, c, e, tokens), 'bf16')}, "
            f"{tensor((b, hk, n, c), 'f32')}, {dq + ', ' if tokens else ''}"
            f"{tensor((b, hq, n, c, blocks.ROWS), 'bf16')}, "
            f"{tensor((b, hk, n, blocks_, columns), 'f32')}") in text


def test_the_backward_reduces_into_zeros_computed_from_the_output_cotangent():
    """The reductions' targets (dQ; in chunk layout q . dQ_off) are `numerics.zeros_of_call`
    of do: XLA merged twelve layers' jnp.zeros into one constant and copied it before each
    kernel, and zeros of q (ready in the forward) it filled before the forward's state
    passes, 128 MiB alive through the whole state backward at T = 65,536, H = 8
    (docs/kernels.md)."""
    shapes = [*operands(1, 2, 2, 1, 256, 64, 64), ((1, 2, 1, 256), jnp.float32),
              ((1, 2, 1, 256), jnp.float32), ((1, 2, 1, 256, 64), jnp.bfloat16),
              ((1, 2, 1, 256), jnp.float32)]
    jaxpr = jax.make_jaxpr(lambda *x: backward_kernel.attention_bwd(*x, p=2))(
        *[jax.ShapeDtypeStruct(shape, dtype) for shape, dtype in shapes]).jaxpr
    producer = {v: eqn for eqn in jaxpr.eqns for v in eqn.outvars}
    # the reductions' targets: dQ and, in chunk layout, q . dQ_off per query
    targets = [eqn.invars[0] for eqn in jaxpr.eqns if eqn.primitive.name == "new_ref"]
    assert len(targets) == 2
    for target in targets:
        assert producer[target].primitive.name == "broadcast_in_dim"
        ancestors, todo = set(), [target]
        while todo:
            eqn = producer.get(todo.pop())
            inputs = [] if eqn is None else [v for v in eqn.invars
                                             if isinstance(v, jax.extend.core.Var)]
            todo += [v for v in inputs if v not in ancestors]
            ancestors.update(inputs)
        assert jaxpr.invars[8] in ancestors and jaxpr.invars[0] not in ancestors  # do, not q


def test_a_wide_array_is_in_one_of_two_layouts():
    assert blocks.in_tokens(jnp.zeros((1, 256, 2, 64))) and blocks.heads_of(
        jnp.zeros((1, 256, 2, 64))) == 2
    assert not blocks.in_tokens(jnp.zeros((1, 3, 1, 256, 64))) and blocks.heads_of(
        jnp.zeros((1, 3, 1, 256, 64))) == 3
    with pytest.raises(ValueError, match=r"\[B, H, N, C, W\] or \[B, T, H, W\]; got \(256, 64\)"):
        blocks.in_tokens(jnp.zeros((256, 64)))


def test_the_backward_takes_a_ring_of_one_slot_per_compute_warpgroup():
    shapes = operands(1, 2, 2, 1, 128, 64, 64) + [
        ((1, 2, 1, 128), jnp.float32)] * 2 + [((1, 2, 1, 128, 64), jnp.bfloat16),
                                              ((1, 2, 1, 128), jnp.float32)]
    with pytest.raises(ValueError, match="stages must be 2"):
        lowered(lambda *x: backward_kernel.attention_bwd(*x, p=2, stages=3), *shapes)


def test_o_is_float32_or_in_the_inputs_dtype():
    with pytest.raises(ValueError, match="o_dtype must be float32 or q's bfloat16; got float16"):
        jax.eval_shape(lambda *x: attention_kernels.attention_fwd(*x, p=2, o_dtype=jnp.float16),
                       *(jax.ShapeDtypeStruct(*spec) for spec in operands(1, 2, 2, 1, 128, 64, 64)))


def test_the_shapes_they_take_are_whole_programs():
    assert blocks.TILE_ROWS == blocks.COMPUTE_WGS * blocks.ROWS
    assert blocks.ROWS == 64  # one wgmma M per warpgroup
    assert blocks.WIDTHS == (64, 128)


def test_bf16_parts_hold_float32(rng):
    x = jnp.asarray(rng.normal(size=(64, 64)) * 10.0 ** rng.integers(-8, 8, size=(64, 64)),
                    jnp.float32)
    parts = blocks.bf16_parts(x)
    assert [p.dtype for p in parts] == [jnp.bfloat16] * 3
    total = sum(np.asarray(p, np.float64) for p in parts)
    np.testing.assert_array_less(np.abs(total - np.asarray(x, np.float64)),
                                 2.0 ** -26 * np.abs(np.asarray(x, np.float64)) + 1e-45)
    low, middle, high = (np.abs(np.asarray(p, np.float64)) for p in parts)
    assert np.all(low <= middle) and np.all(middle <= high)  # smallest first


@LAYOUTS
def test_the_backward_outputs_assemble_into_the_gate_pieces(rng, tokens):
    """`backward_kernel.assemble` against definitions from one random ds (dl = ds s / p):
    the kernel's layouts (in chunk layout dQ reduced over every block up to the diagonal
    and q . dQ_off per query; in token layout dQ_off and the diagonal blocks' partials;
    each diagonal block's dl in bf16 with keys as rows, the pair totals by key block
    and query-block-major columns, grouped query heads) give dq, dhead (dl over earlier
    blocks' keys), the straddle sums (to bf16 accuracy) and the pair totals [I, J]; in
    token layout dq stays in it and dhead comes in chunk layout."""
    from sympow.attention import chunked

    b, hk, groups, n, c, d, p = 1, 2, 3, 2, 192, 64, 2
    hq, rows = hk * groups, blocks.ROWS
    nb = c // rows
    q = jnp.asarray(rng.normal(size=(b, hq, n, c, d)) / 8, jnp.float32)
    k = jnp.asarray(rng.normal(size=(b, hk, n, c, d)) / 8, jnp.float32)
    kq = jnp.repeat(k, groups, axis=1)
    s = jnp.einsum("bhnid,bhnjd->bhnij", q, kq, precision="highest")
    causal = np.arange(c)[:, None] >= np.arange(c)[None, :]
    ds = jnp.where(causal, jnp.asarray(rng.normal(size=s.shape), jnp.float32), 0.0)
    dl = ds * s / p
    block = np.arange(c) // rows
    earlier = block[:, None] > block[None, :]
    partial = lambda mask: jnp.einsum("bhnij,bhnjd->bhnid", jnp.where(mask, ds, 0.0), kq,  # noqa: E731
                                      precision="highest")
    in_pairs = dl.reshape(b, hq, n, nb, rows, nb, rows)
    diag_tiles = jnp.stack([in_pairs[:, :, :, i, :, i, :] for i in range(nb)], axis=3)
    diagonal = jnp.swapaxes(diag_tiles, -1, -2).reshape(b, hq, n, c, rows)  # keys as rows
    totals = in_pairs.sum(axis=(-3, -1))  # [b, hq, n, I, J]
    by_key = totals.reshape(b, hk, groups, n, nb, nb).transpose(0, 1, 3, 5, 4, 2)
    by_key = by_key.reshape(b, hk, n, nb, nb * groups)  # [J, I * R + head]
    by_key = jnp.pad(by_key, [(0, 0)] * 4 + [(0, rows - nb * groups)], constant_values=7.0)

    def layout(x):  # [B, Hq, N, C, D] -> [B, N C, Hq, D] in token layout
        return jnp.moveaxis(x, 1, 3).reshape(b, n * c, hq, d) if tokens else x

    if tokens:
        dq_sum, apart = partial(earlier), layout(partial(block[:, None] == block[None, :]))
    else:
        dq_sum = partial(causal)
        apart = jnp.einsum("bhnid,bhnid->bhni", q, partial(earlier), precision="highest")
    dq, dhead, ddiag, pairs = backward_kernel.assemble(
        layout(q), layout(dq_sum), apart, diagonal.astype(jnp.bfloat16), by_key, p=p)
    dq = jnp.moveaxis(dq.reshape(b, n, c, hq, d), 3, 1) if tokens else dq
    close = lambda x, y: np.testing.assert_allclose(  # noqa: E731
        np.asarray(x), np.asarray(y), rtol=2e-4, atol=2e-4 * float(jnp.abs(y).max()))
    close(dq, partial(causal))
    close(dhead, jnp.where(earlier, dl, 0.0).sum(axis=-1))
    straddle = chunked.diagonal_straddle(diag_tiles).reshape(b, hq, n, c)
    np.testing.assert_allclose(np.asarray(ddiag), np.asarray(straddle), rtol=2.0 ** -7,
                               atol=2.0 ** -7 * float(jnp.abs(straddle).max()))
    close(pairs, totals)


def test_the_straddle_sums_are_one_product(rng):
    """`backward_kernel.straddle_sums` of diagonal tiles dl [keys j, queries i] in bf16
    (each tile's entries (j, i) times the 0/1 matrix [j < k <= i]): `chunked.diagonal_straddle`
    (sum_{i >= k > j} dl_ij) to bf16 accuracy, per block of ROWS; one dot_general, whose
    output is [.., C] float32. With the mask moved by one (j <= k) the check fails."""
    from sympow.attention import chunked

    rows, nb = blocks.ROWS, 3
    k, i = np.arange(rows)[:, None], np.arange(rows)[None, :]
    dl = jnp.asarray(np.where(k <= i, rng.normal(size=(2, 3, 1, nb, rows, rows)), 0.0),
                     jnp.float32)  # [.., block, keys j, queries i]
    want = np.asarray(chunked.diagonal_straddle(jnp.swapaxes(dl, -1, -2)), np.float64)
    diagonal = dl.reshape(2, 3, 1, nb * rows, rows).astype(jnp.bfloat16)
    got = np.asarray(backward_kernel.straddle_sums(diagonal)).reshape(want.shape)
    assert np.linalg.norm(got - want) / np.linalg.norm(want) <= 2.0 ** -8
    eqns = jax.make_jaxpr(backward_kernel.straddle_sums)(diagonal).eqns
    dots = [e for e in eqns if e.primitive.name == "dot_general"]
    assert len(dots) == 1 and dots[0].outvars[0].aval.shape == (2, 3, 1, nb, rows)
    # the same arithmetic with the 0/1 matrix's diagonal included (j <= k): far outside
    before = jnp.einsum("kj,...ji->...ki", jnp.asarray(i <= k, jnp.bfloat16),
                        dl.astype(jnp.bfloat16), preferred_element_type=jnp.float32)
    wrong = np.asarray(jnp.where(jnp.asarray(i >= k), before, 0.0).sum(axis=-1))
    assert np.linalg.norm(wrong - want) / np.linalg.norm(want) > 2.0 ** -8


@pytest.mark.parametrize("p", [2, 4])
def test_dhead_is_q_dot_the_dq_partial_over_p(rng, p):
    """The one-pass backward forms dhead_i (dl summed over a block's keys) as q_i . (ds^T
    K)_i / p, from the dQ partial it reduces anyway: dl_ij = ds_ij s_ij / p for the
    kernel's own (w, ds / dw) (`weights.power_terms`) with s = K Q^T. With ds rounded to
    bf16 for the tensor cores the sum keeps ~bf16 accuracy against the sum of the
    float32 dl; with an inconsistent ds (p - 1 in place of p) the check fails."""
    rows, d = blocks.ROWS, 64
    q = jnp.asarray(rng.normal(size=(rows, d)) / d ** 0.5, jnp.bfloat16)
    k = jnp.asarray(rng.normal(size=(rows, d)) / d ** 0.5, jnp.bfloat16)
    s = jnp.einsum("jd,id->ji", k, q, preferred_element_type=jnp.float32)  # [keys, queries]
    scale = 1.0 / jnp.abs(s).max(axis=0)
    factor = jnp.exp2(-jnp.abs(jnp.asarray(rng.normal(0.0, 2.0, size=(rows, rows)),
                                           jnp.float32)))
    w, dsdw = weights.power_terms(s, (factor,), scale[None, :], p * scale[None, :], p)
    dw = jnp.asarray(rng.normal(size=(rows, rows)), jnp.float32)
    dl, ds = w * dw, (dsdw * dw).astype(jnp.bfloat16)
    want = np.asarray(dl.sum(axis=0), np.float64)  # per query, over the keys
    for power, ok in ((p, True), (p - 1, False)):
        partial = jnp.einsum("ji,jd->id", ds, k, preferred_element_type=jnp.float32)
        got = np.asarray(jnp.einsum("id,id->i", q.astype(jnp.float32), partial) / power)
        error = np.linalg.norm(got - want) / np.linalg.norm(want)
        assert (error <= 2.0 ** -8) == ok, (power, error)


def _logits(s, row_decay, tail, p):
    """p log2|s_ij| + row_i + tail_j (log2 units), float64: the exact path's logits."""
    with np.errstate(divide="ignore"):
        return p * np.log2(np.abs(s)) + row_decay[:, None] + tail[None, :]


@pytest.mark.parametrize("p", [2, 4])
def test_separable_weights_are_the_exact_weights_against_a_bounded_shift(rng, p):
    """Off the diagonal the forward builds w_ij = exp2(l_ij - m_i) from a row factor and a
    column factor (`weights.separable_weights`, the kernel's own arithmetic in
    plain JAX): the same weights as exp2 of the exact logits against the shift it returns,
    and that shift is at least the exact running max and above it by at most the block's
    tail spread (so no weight loses range). Rows of zero scores get no weight."""
    rows = blocks.ROWS
    s = rng.normal(size=(rows, rows)) * np.exp(rng.normal(0.0, 2.0, size=(rows, 1)))
    s[3] = 0.0  # a row with nothing to attend in this block
    s[5, ::2] = 0.0
    gates = -np.abs(rng.normal(0.0, 0.15, size=rows))  # log gates of the key block, log2 units
    tail = np.concatenate([np.cumsum(gates[::-1])[::-1][1:], [0.0]])  # sum over k > j
    row_decay = -np.abs(rng.normal(0.0, 20.0, size=rows))  # head + mid
    m_old = np.where(rng.random(rows) < 0.3, -np.inf, rng.normal(0.0, 10.0, size=rows))
    w, m_new = weights.separable_weights(
        jnp.asarray(s, jnp.float32), jnp.asarray(np.abs(s).max(axis=1), jnp.float32),
        jnp.asarray(row_decay, jnp.float32), jnp.asarray(np.exp2(tail), jnp.float32),
        jnp.asarray(m_old, jnp.float32), p)
    w, m_new = np.asarray(w, np.float64), np.asarray(m_new, np.float64)
    logits = _logits(s, row_decay, tail, p)
    exact_max = np.maximum(m_old, logits.max(axis=1))
    has_weight = np.isfinite(exact_max)
    assert np.all(m_new[has_weight] >= exact_max[has_weight] - 1e-4)
    assert np.all(m_new[has_weight] <= exact_max[has_weight] - tail[0] + 1e-4)
    assert m_new[3] == np.float32(m_old[3])  # no bound from a row of zeros
    shift = np.where(np.isfinite(m_new), m_new, 0.0)
    want = np.exp2(logits - shift[:, None])
    assert np.all(w <= 1.0 + 1e-6) and np.all(w[3] == 0.0) and np.all(w[5, ::2] == 0.0)
    np.testing.assert_allclose(w, want, rtol=2e-5 * p, atol=1e-30)


def test_separable_weights_need_the_bound_on_the_spread():
    """The kernel takes the exp2 path for blocks whose gates sum below -SEPARABLE_SPREAD:
    with a spread far beyond it, the shift the separable path returns sits that far above
    the exact max (the weights would lose their range), which is why the bound exists."""
    rows = blocks.ROWS
    s = np.ones((rows, rows))
    s[:, 0] = 1e20  # the largest scores, 2^66 over the rest, on the most decayed key
    tail = np.concatenate([[-200.0], np.zeros(rows - 1)])
    _, m_new = weights.separable_weights(
        jnp.asarray(s, jnp.float32), jnp.asarray(np.abs(s).max(axis=1), jnp.float32),
        jnp.zeros(rows), jnp.asarray(np.exp2(tail), jnp.float32),
        jnp.full(rows, -jnp.inf), 2)
    exact_max = _logits(s, np.zeros(rows), tail, 2).max(axis=1)
    assert np.all(np.asarray(m_new) - exact_max > weights.SEPARABLE_SPREAD)


@pytest.mark.parametrize("p", [2, 4])
def test_the_backward_factors_are_the_capped_exponential(rng, p):
    """The backward's decay factor off the diagonal, exp2 of the row part (capped) times
    exp2 of the column part, in `weights.power_terms`' order: the same (w, ds / dw) as the one
    capped exp2 of the whole exponent wherever the row part is under the cap."""
    rows = blocks.ROWS
    s = rng.normal(size=(rows, rows))
    scale = 1.0 / np.abs(s).max(axis=1)
    row_part = rng.normal(0.0, 30.0, size=rows)  # head + mid - shift
    tail = -np.abs(rng.normal(0.0, 5.0, size=rows))
    as32 = lambda x: jnp.asarray(x, jnp.float32)  # noqa: E731
    by_rows = lambda x: as32(x)[:, None]  # noqa: E731
    exact = weights.power_terms(
        as32(s), (weights.capped_exp2(as32(row_part[:, None] + tail[None, :])),),
        by_rows(scale), by_rows(p * scale), p)
    split = weights.power_terms(
        as32(s), (by_rows(weights.capped_exp2(as32(row_part))),
                  as32(np.exp2(tail))[None, :]), by_rows(scale), by_rows(p * scale), p)
    # the one-exponential form rounds row + tail (|.| up to ~128) to float32 first: a few
    # ulp of the exponent, 2^-24 x 128 each, are its relative error
    rtol = 4 * 2.0 ** -24 * 128
    for got, want in zip(split, exact, strict=True):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=rtol, atol=0)


def test_load_passes_an_index_only_to_a_plgpu_load_that_requires_one(monkeypatch):
    """blocks.load takes a whole shared-memory ref in a layout: jax 0.10's plgpu.load needs
    the empty index, 0.11's deprecates passing any (a DeprecationWarning a kernel load)."""
    calls = []

    def requires_index(src, idx, *, layout=None, optimized=True):
        calls.append(("required", src, idx, layout))

    def optional_index(src, idx=None, *, layout=None, optimized=True):
        calls.append(("optional", src, idx, layout))

    for fake in (requires_index, optional_index):
        monkeypatch.setattr(blocks.plgpu, "load", fake)
        blocks.load("ref", blocks.COL_VECTOR)
    assert calls == [("required", "ref", (), blocks.COL_VECTOR),
                     ("optional", "ref", None, blocks.COL_VECTOR)]


def test_a_ring_has_one_barrier_per_group_and_slot_that_each_copy_of_the_group_arrives_on():
    specs = [blocks.tile(64), blocks.tile(128), blocks.VECTOR]
    arrays, loaded, freed = blocks.Ring.scratch(specs, 3, groups=[(0, 2), (1,)])
    assert [a.shape for a in arrays] == [(3, 64, 64), (3, 64, 128), (3, 64)]
    # plgpu.Barrier keeps its count of barriers as a shape; one arrival per copy
    assert [(b.num_arrivals, b.num_barriers) for b in loaded] == [(2, (3,)), (1, (3,))]
    assert (freed.num_arrivals, freed.num_barriers) == (blocks.COMPUTE_WGS, (3,))
    _, per_array, _ = blocks.Ring.scratch(specs, 2)
    assert [(b.num_arrivals, b.num_barriers) for b in per_array] == [(1, (2,))] * 3
    assert blocks.Ring.of(arrays, loaded, freed, [(0, 2), (1,)]).groups == ((0, 2), (1,))
    assert blocks.Ring.of(arrays, (None,) * 3, freed).groups == ((0,), (1,), (2,))


def test_a_ring_barrier_can_take_more_arrivals_than_its_arrays():
    specs = [blocks.tile(64), blocks.tile(64), blocks.VECTOR]
    _, loaded, _ = blocks.Ring.scratch(specs, 2, groups=[(0, 1), (2,)], arrivals=[8, 1])
    assert [b.num_arrivals for b in loaded] == [8, 1]
    for arrivals in ([8], [1, 1], [8, 0]):
        with pytest.raises(ValueError, match="arrivals: one count per barrier group"):
            blocks.Ring.scratch(specs, 2, groups=[(0, 1), (2,)], arrivals=arrivals)


def test_a_ring_fill_makes_up_a_step_with_fewer_copies_by_plain_arrivals(monkeypatch):
    """A step's copies (one per array, or a list of (source, rows) pieces into a slot's
    rows) each arrive on their group's barrier; a group with fewer copies than its
    arrivals gets plain arrivals for the rest, so every step completes the phase; more
    copies than arrivals is refused. (The primitives are recorded in place of the
    kernel's: the bookkeeping is plain Python.)"""
    events = []

    class Slots:  # a [stages, ...] scratch ref: .at[slot] and .at[slot, rows]
        shape = (3,)

        def __init__(self, name):
            self.name = name

        @property
        def at(self):
            return self

        def __getitem__(self, index):
            return (self.name, index)

    def loop(lower, upper):
        return lambda body: [body(step) for step in range(lower, upper)]

    fake = types.SimpleNamespace(
        copy_gmem_to_smem=lambda src, dst, bar: events.append(("copy", src, dst, bar)),
        barrier_arrive=lambda bar: events.append(("arrive", bar)),
        barrier_wait=lambda bar: events.append(("wait", bar)))
    monkeypatch.setattr(blocks, "plgpu", fake)
    monkeypatch.setattr(blocks.pl, "when", lambda cond: (lambda fn: fn() if cond else None))
    monkeypatch.setattr(blocks.pl, "loop", loop)
    monkeypatch.setattr(blocks.lax, "rem", lambda a, b: a % b)
    ring = blocks.Ring((Slots("a"), Slots("b")), (Slots("loaded"),), Slots("freed"),
                       ((0, 1),), (4,))
    ring.fill(4, lambda step: ([(f"a{step}.0", "rows0"), (f"a{step}.1", "rows1")], f"b{step}"))
    by_step = [[e for e in events if e[0] != "wait" and e[-1] == ("loaded", step % 3)]
               for step in range(3)]
    assert by_step[1] == [("copy", "a1.0", ("a", (1, "rows0")), ("loaded", 1)),
                          ("copy", "a1.1", ("a", (1, "rows1")), ("loaded", 1)),
                          ("copy", "b1", ("b", 1), ("loaded", 1)),
                          ("arrive", ("loaded", 1))]  # three copies and one plain arrival
    assert [e for e in events if e[0] == "wait"] == [("wait", ("freed", 0))]  # step 3's slot
    assert sum(e[0] == "arrive" for e in events) == 4  # one a step
    crowded = blocks.Ring((Slots("a"),), (Slots("loaded"),), Slots("freed"), ((0,),), (1,))
    with pytest.raises(ValueError, match="ring group 0: 2 copies a step, more than its "
                                         "barrier's 1 arrivals"):
        crowded.fill(1, lambda step: ([("x", "rows0"), ("y", "rows1")],))


@pytest.fixture
def recorded_halves(monkeypatch):
    """products_in_halves' primitives recorded in place of the kernel's (the bookkeeping
    is plain Python): (events, ring of 2 slots, halves(step, slot) whose first half is
    feature 0 and second features 1 and 2, each a product (acc_t, op{step}.{t}, b{slot}))."""
    events = []

    def keep(values):
        events.append(("keep", values))
        return values

    def loop(lower, upper, body, carry):
        for step in range(lower, upper):
            carry = body(step, carry)
        return carry

    fake = types.SimpleNamespace(
        wgmma=lambda acc, operand, b: events.append(("wgmma", acc, operand, b)),
        wgmma_wait=lambda n: events.append(("wait", n)),
        barrier_arrive=lambda bar: events.append(("release", bar)))
    monkeypatch.setattr(blocks, "plgpu", fake)
    monkeypatch.setattr(blocks.lax, "rem", lambda a, b: a % b)
    monkeypatch.setattr(blocks.lax, "fori_loop", loop)
    monkeypatch.setattr(blocks.lax, "optimization_barrier", keep)

    class Freed:  # the ring's freed barriers: .at[slot]
        at = {slot: f"freed{slot}" for slot in range(2)}

    ring = blocks.Ring((types.SimpleNamespace(shape=(2,)),), ("loaded",), Freed, ((0,),), (1,))

    def halves(step, slot):
        def half(ts):
            def build():
                events.append(("build", step, ts))
                return [(f"acc{t}", f"op{step}.{t}", f"b{slot}") for t in ts]
            return build
        return half((0,)), half((1, 2))

    return events, ring, halves


def _issued(step, ts):
    return [("build", step, ts)] + [("wgmma", f"acc{t}", f"op{step}.{t}", f"b{step % 2}")
                                    for t in ts]


def _ops(step, ts):
    return [f"op{step}.{t}" for t in ts]


def test_products_in_halves_builds_each_half_while_the_other_runs(recorded_halves):
    """Each step: its first half built and issued, a wait that leaves it running (so the
    last step's second half is done: the wait's count is the first half's size), that
    half kept alive past the wait and its slot released, the second half built and issued,
    a wait leaving it running (the first half done: the second half's size), both kept
    alive past it; after the last step a full wait and its slot released. Every slot is
    released once, after the products that read it; a walk of one step too."""
    events, ring, halves = recorded_halves
    first, second = (0,), (1, 2)
    blocks.products_in_halves(ring, 4, 7, halves)
    expected = []
    for step in range(4, 7):
        expected += _issued(step, first) + [("wait", 1)]
        if step > 4:
            expected += [("keep", (_ops(step - 1, second), _ops(step, first))),
                         ("release", f"freed{(step - 1) % 2}")]
        expected += _issued(step, second) + [("wait", 2),
                                             ("keep", (_ops(step, first), _ops(step, second)))]
    expected += [("wait", 0), ("keep", _ops(6, second)), ("release", "freed0")]
    assert events == expected
    events.clear()
    blocks.products_in_halves(ring, 3, 4, halves)
    assert events == (_issued(3, first) + [("wait", 1)] + _issued(3, second)
                      + [("wait", 2), ("keep", (_ops(3, first), _ops(3, second))),
                         ("wait", 0), ("keep", _ops(3, second)), ("release", "freed1")])


def test_products_in_halves_needs_two_slots_a_step_and_both_halves(recorded_halves):
    events, ring, halves = recorded_halves
    with pytest.raises(ValueError, match="at least one step; got steps 4 .. 3"):
        blocks.products_in_halves(ring, 4, 4, halves)
    one_slot = dataclasses.replace(ring, arrays=(types.SimpleNamespace(shape=(1,)),))
    with pytest.raises(ValueError, match="a ring of 2 slots or more; got 1"):
        blocks.products_in_halves(one_slot, 0, 2, halves)
    with pytest.raises(ValueError, match="each half of a step needs a product"):
        blocks.products_in_halves(ring, 0, 2, lambda step, slot: (lambda: [], lambda: []))


@pytest.mark.parametrize("groups", [[(0, 1)], [(0, 1), (1, 2)], [(0, 1, 2, 3)], [(0, 1), (),
                                                                                 (2,)]])
def test_ring_groups_must_split_the_arrays(groups):
    specs = [blocks.tile(64), blocks.tile(64), blocks.VECTOR]
    with pytest.raises(ValueError, match="ring groups must split the array indices 0..2"):
        blocks.Ring.scratch(specs, 2, groups=groups)


def test_a_ring_needs_a_barrier_ring_per_group():
    arrays, loaded, freed = blocks.Ring.scratch([blocks.VECTOR, blocks.VECTOR], 2)
    with pytest.raises(ValueError, match="1 barrier groups need as many barrier rings; got 2"):
        blocks.Ring.of(arrays, loaded, freed, [(0, 1)])



def test_programs_that_read_the_same_blocks_are_neighbours_on_the_grid(monkeypatch):
    """The last grid axis (CUDA's x, dispatched fastest) is the one whose programs share
    their streamed blocks: a chunk's tiles in the attention kernels, a state's feature
    groups in rows_to_state, a chunk's row tiles in state_to_rows; then the heads (a GQA
    group's heads share k and v, or the state), then the chunks."""
    from sympow.attention.mosaic_gpu import state_kernels, state_sums

    grids = {}
    for module in (attention_kernels, backward_kernel, state_kernels, state_sums):
        real = module.launch
        monkeypatch.setattr(module, "launch", lambda *a, real=real, **kw: grids.__setitem__(
            kw["name"], list(zip(kw["grid_names"], kw["grid"], strict=True))) or real(*a, **kw))
    b, hq, hk, n, c, d, e = 1, 4, 2, 2, 256, 64, 64
    f32, bf16 = jnp.float32, jnp.bfloat16
    shapes = operands(b, hq, hk, n, c, d, e, False)
    lowered(lambda *x: attention_kernels.attention_fwd(*x, p=2), *shapes)
    lowered(lambda *x: backward_kernel.attention_bwd(*x, p=2), *shapes, ((b, hq, n, c), f32),
            ((b, hq, n, c), f32), (wide(b, hq, n, c, e, False), bf16), ((b, hq, n, c), f32))
    lowered(lambda *x: state_sums.rows_to_state(*x, kv_heads=hk, chunks_per_program=1),
            ((b, hq, n, d, c), bf16), ((b, hq, n, d, c), bf16), ((b, hq, n, c, e), bf16))
    lowered(lambda *x: state_kernels.state_to_rows(*x, transposed=False),
            ((b, hq, n, c, d), bf16), ((b, hq, n, d, c), bf16), ((b, hk, n, d * d, e), bf16))
    tiles = c // blocks.TILE_ROWS
    assert grids == {  # (axis, size) from the slowest to the fastest
        "sympow_attention_fwd": [("chunk", n), ("bh", b * hq), ("tile", tiles)],
        "sympow_attention_bwd": [("chunk", n), ("bh", b * hk), ("tile", tiles)],
        "sympow_states_rows_to_state": [("chunk", n), ("bh", b * hk), ("features", 8)],
        "sympow_states_state_to_rows": [("chunk", n), ("bh", b * hq), ("tile", 1)],
    }
