"""The implementation table (implementations.py): its keys, the public impl names, and the
row chosen for each platform, impl and need."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from sympow.attention import implementations as impls
from sympow.attention.api import make_config
from sympow.attention.pallas import plan as pallas_plan


def test_keys_are_the_rows_algorithm_and_backend():
    assert list(impls.IMPLEMENTATIONS) == [
        ("chunked", "mosaic_gpu"), ("attention", "mosaic_gpu"), ("chunked", "pallas"),
        ("attention", "pallas"), ("chunked", "xla"), ("attention", "xla"),
        ("attention", "reference"), ("recurrent", "reference")]
    for (algorithm, backend), row in impls.IMPLEMENTATIONS.items():
        assert (row.algorithm, row.backend) == (algorithm, backend)
    # The rows with a chunk (chunked) or block (blocked attention form) parameter.
    assert {key for key, row in impls.IMPLEMENTATIONS.items() if row.default_chunk_size} == {
        ("chunked", "mosaic_gpu"), ("chunked", "pallas"), ("chunked", "xla"),
        ("attention", "xla")}


def test_names_are_the_backends_and_algorithms_in_table_order():
    assert impls.IMPLS == ("mosaic_gpu", "pallas", "xla", "reference")
    assert impls.ALGORITHMS == ("chunked", "attention", "recurrent")


@pytest.mark.parametrize(("platform", "expected"), [
    ("gpu", ("mosaic_gpu", "pallas", "xla", "reference")),
    ("cpu", ("xla", "pallas", "reference")),
    ("tpu", ("xla", "reference")),
])
def test_available_impls_put_the_platform_default_first(platform, expected):
    assert impls.available_impls(platform) == expected


def test_kernel_rows_are_the_platform_bound_tiers():
    assert impls.kernel_rows("gpu") == (
        ("chunked", "mosaic_gpu"), ("attention", "mosaic_gpu"), ("chunked", "pallas"),
        ("attention", "pallas"))
    assert impls.kernel_rows("cpu") == (("chunked", "pallas"), ("attention", "pallas"))
    assert impls.kernel_rows("tpu") == ()


@pytest.mark.parametrize(("impl", "algorithm", "need_state", "platform", "key"), [
    (None, None, False, "gpu", ("chunked", "mosaic_gpu")),
    (None, None, False, "cpu", ("chunked", "xla")),
    (None, None, True, "cpu", ("chunked", "xla")),
    (None, "attention", False, "gpu", ("attention", "mosaic_gpu")),
    ("pallas", "attention", False, "gpu", ("attention", "pallas")),
    (None, "attention", False, "cpu", ("attention", "xla")),
    ("pallas", None, False, "cpu", ("chunked", "pallas")),
    ("xla", "attention", False, "cpu", ("attention", "xla")),
    ("reference", None, False, "cpu", ("attention", "reference")),
    ("reference", None, True, "gpu", ("recurrent", "reference")),
])
def test_select(impl, algorithm, need_state, platform, key):
    row = impls.select(impl, algorithm, need_state=need_state, platform=platform)
    assert (row.algorithm, row.backend) == key


def test_select_rejects_unknown_and_unavailable_choices():
    with pytest.raises(ValueError, match=r"impl must be one of \('mosaic_gpu', 'pallas', 'xla', "
                                         r"'reference'\) or None, got impl='triton'"):
        impls.select("triton")
    with pytest.raises(ValueError, match=r"impl='mosaic_gpu' is not available on backend "
                                         r"'cpu'"):
        impls.select("mosaic_gpu", platform="cpu")
    with pytest.raises(ValueError, match=r"algorithm must be one of \('chunked', 'attention', "
                                         r"'recurrent'\) or None, got algorithm='flash'"):
        impls.select(None, "flash")
    with pytest.raises(ValueError, match=r"impl='pallas' is not available on backend 'tpu'"):
        impls.select("pallas", platform="tpu")
    with pytest.raises(ValueError, match=r"impl='reference' with algorithm='chunked' is not "
                                         r"available on backend 'cpu'"):
        impls.select("reference", "chunked", platform="cpu")
    with pytest.raises(ValueError, match=r"impl='reference' with algorithm='chunked' is not "
                                         r"available on backend 'cpu'; available \(algorithm, "
                                         r"impl\): \[\('chunked', 'pallas'\), \('attention', "
                                         r"'pallas'\), \('chunked', 'xla'\)"):
        impls.select("reference", "chunked", need_state=True, platform="cpu")


def test_prefill_may_take_a_row_without_state():
    """A prefill on the attention form gets its state streamed (api.py), so need_state
    filters nothing; where no cost model decides, rows that return the state come first."""
    row = impls.select("xla", "attention", need_state=True, platform="cpu")
    assert (row.algorithm, row.backend) == ("attention", "xla")
    assert impls.select("reference", need_state=True, platform="cpu").algorithm == "recurrent"
    assert impls.select("reference", "attention", need_state=True,
                        platform="cpu").algorithm == "attention"


def test_make_config_fills_the_chunk_only_for_the_chunked_algorithm():
    config = make_config(100, 2, None, "pallas")
    assert (config.algorithm, config.backend) == ("chunked", "pallas")
    assert config.chunk_size == pallas_plan.default_chunk_size(100) == 128
    assert make_config(100, 2, 32, "xla").chunk_size == 32
    assert make_config(100, 2, 32, "reference").chunk_size is None
    assert make_config(300, 2, None, "xla", "attention").chunk_size == 128
    assert impls.lookup(make_config(100, 2, None, "reference", need_state=True)) is \
        impls.IMPLEMENTATIONS["recurrent", "reference"]


@pytest.mark.parametrize(("p", "d", "t", "platform", "need_state", "key"), [
    (2, 64, 1024, "gpu", False, ("attention", "mosaic_gpu")),
    (2, 64, 4096, "gpu", False, ("attention", "mosaic_gpu")),  # 16.7 vs 17.0 ms measured
    (2, 64, 8192, "gpu", False, ("attention", "mosaic_gpu")),  # the Hopper form: faster
    (2, 64, 16384, "gpu", False, ("chunked", "mosaic_gpu")),
    (2, 64, 65536, "gpu", False, ("chunked", "mosaic_gpu")),
    (4, 64, 65536, "gpu", False, ("attention", "mosaic_gpu")),
    (4, 64, 1024, "gpu", True, ("attention", "mosaic_gpu")),  # + the streamed state
    (4, 64, 1024, "cpu", True, ("attention", "xla")),
    (2, 64, 65536, "gpu", True, ("chunked", "mosaic_gpu")),  # its state comes free
    (2, 16, 37, "cpu", False, ("attention", "xla")),
    (2, 64, 65536, "cpu", False, ("chunked", "xla")),
])
def test_cost_model_chooses_the_algorithm(p, d, t, platform, need_state, key):
    row = impls.select(None, need_state=need_state, platform=platform, shape=(p, d, d, t))
    assert (row.algorithm, row.backend) == key


BENCHMARKS = Path(__file__).parents[2] / "docs" / "benchmark_data"
# The attention form as measured after its kernels stopped masking blocks below the diagonal;
# the chunked kernels (unchanged since) in the run before, same day and GPU type.
ATTENTION_RUN = BENCHMARKS / "h100_attention_form_masked_p2_h12_2026-11-23.json"
CHUNKED_RUN = BENCHMARKS / "h100_attention_form_p2_h12_2026-11-23.json"


HOPPER_RUN = BENCHMARKS / "h100_hopper_attention_form_p2_h12_2026-11-24.json"


def test_hopper_constant_reproduces_its_recorded_h100_run():
    """The Hopper form's constant gives its time at T = 16384 of the recorded run (B T =
    65536, H = 12, p = 2, d = e = 64) and orders it below the portable form at every T, as
    measured."""
    runs = {(r["impl"], r["t"]): r["fwd_bwd_ms"] / 1e3 for r in json.loads(HOPPER_RUN.read_text())}
    row = impls.IMPLEMENTATIONS["attention", "mosaic_gpu"]
    portable = impls.IMPLEMENTATIONS["attention", "pallas"]
    model = lambda r, t: r.cost(2, 64, 64, t, None) * 65536 * 12  # noqa: E731
    assert model(row, 16384) == pytest.approx(runs["mosaic_gpu:attention", 16384], rel=0.05)
    for t in (1024, 4096, 16384):
        assert runs["mosaic_gpu:attention", t] < runs["pallas:attention", t]
        assert model(row, t) < model(portable, t)


HOPPER_CHUNKED_RUN = BENCHMARKS / "h100_hopper_states_sweep_h12_2026-11-24.json"
HOPPER_CHUNK1024_RUN = BENCHMARKS / "h100_hopper_states_final_2026-11-24.json"


def test_hopper_state_constant_reproduces_its_recorded_h100_run():
    """The Hopper chunked row's constant gives its times at T = 65536 of the recorded run at
    its default chunk (1024; B T = 65536, H = 8 and 12, p = 2, d = e = 64, its square-layout
    state kernels) and orders it against the Hopper attention form as measured at every T."""
    rows = {name: impls.IMPLEMENTATIONS[name.split(":")[1], name.split(":")[0]]
            for name in ("mosaic_gpu:chunked", "mosaic_gpu:attention")}

    def model(name, t, h=12):
        chunk = rows[name].default_chunk_size(t, 2, 64) if name.endswith("chunked") else None
        return rows[name].cost(2, 64, 64, t, chunk) * 65536 * h

    for r in json.loads(HOPPER_CHUNK1024_RUN.read_text()):
        if r["t"] == 65536 and r["impl"] == "mosaic_gpu:chunked":
            assert model("mosaic_gpu:chunked", 65536, r["h"]) == pytest.approx(
                r["fwd_bwd_ms"] / 1e3, rel=0.05), r["h"]
    runs = {(r["impl"], r["t"]): r["fwd_bwd_ms"] / 1e3
            for r in json.loads(HOPPER_CHUNKED_RUN.read_text())}
    for t in (1024, 4096, 16384, 65536):
        faster = min(rows, key=lambda name: runs[name, t])
        assert min(rows, key=lambda name: model(name, t)) == faster, t
    # other shapes keep the portable layout and state constant (d = 32: the tiled F)
    portable = impls.IMPLEMENTATIONS["chunked", "pallas"]
    pairs = 512 / 2 * (32 + 64)
    assert (rows["mosaic_gpu:chunked"].cost(2, 32, 64, 4096, 512)
            - impls.HOPPER_ATTENTION_COST * pairs) == pytest.approx(
        portable.cost(2, 32, 64, 4096, 512) - impls.ATTENTION_COST * pairs)


def test_the_hopper_chunk_is_1024_only_where_its_square_states_run():
    chunk = impls.IMPLEMENTATIONS["chunked", "mosaic_gpu"].default_chunk_size
    assert [chunk(t, 2, 64) for t in (100, 1000, 4096, 65536)] == [128, 1024, 1024, 1024]
    assert [chunk(t, p, d) for t, p, d in ((65536, 2, 32), (65536, 4, 64), (65536, 2, None),
                                           (100, 2, 32))] == [512, 512, 512, 128]


def test_cost_constants_reproduce_the_recorded_h100_runs():
    """The constants are read off these runs (B T = 65536, H = 12, p = 2, d = e = 64): the
    model gives their times at T = 65536 and orders the two algorithms as measured at every
    T."""
    measured = {}
    for run, impl in ((ATTENTION_RUN, "pallas:attention"), (CHUNKED_RUN, "pallas:chunked")):
        measured.update({(r["impl"], r["t"]): r["fwd_bwd_ms"] / 1e3
                         for r in json.loads(run.read_text()) if r["impl"] == impl})
    rows = {"pallas:attention": impls.IMPLEMENTATIONS["attention", "pallas"],
            "pallas:chunked": impls.IMPLEMENTATIONS["chunked", "pallas"]}

    def model(name, t):
        return rows[name].cost(2, 64, 64, t, pallas_plan.default_chunk_size(t)) * 65536 * 12

    for name in rows:
        assert model(name, 65536) == pytest.approx(measured[name, 65536], rel=0.1), name
    for t in (1024, 4096, 16384, 65536):
        faster = min(rows, key=lambda name: measured[name, t])
        assert min(rows, key=lambda name: model(name, t)) == faster, t
