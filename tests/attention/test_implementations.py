"""The implementation table (implementations.py): its keys, the public impl names, and the
row chosen for each platform, impl and need."""

from __future__ import annotations

import pytest

from sympow.attention import implementations as impls
from sympow.attention.api import make_config
from sympow.attention.pallas import plan as pallas_plan


def test_keys_are_the_rows_algorithm_and_backend():
    assert list(impls.IMPLEMENTATIONS) == [
        ("chunked", "pallas"), ("chunked", "xla"), ("attention", "reference"),
        ("recurrent", "reference")]
    for (algorithm, backend), row in impls.IMPLEMENTATIONS.items():
        assert (row.algorithm, row.backend) == (algorithm, backend)
        # Rows with a chunk heuristic are exactly the chunked ones.
        assert (row.default_chunk_size is not None) == (algorithm == "chunked")


def test_impl_names_are_the_backends_in_table_order():
    assert impls.IMPLS == ("pallas", "xla", "reference")


@pytest.mark.parametrize(("platform", "expected"), [
    ("gpu", ("pallas", "xla", "reference")),
    ("cpu", ("xla", "pallas", "reference")),
    ("tpu", ("xla", "reference")),
])
def test_available_impls_put_the_platform_default_first(platform, expected):
    assert impls.available_impls(platform) == expected


def test_kernel_impls_are_the_platform_bound_tiers():
    assert impls.kernel_impls("gpu") == impls.kernel_impls("cpu") == ("pallas",)
    assert impls.kernel_impls("tpu") == ()


@pytest.mark.parametrize(("impl", "need_state", "platform", "key"), [
    (None, False, "gpu", ("chunked", "pallas")),
    (None, False, "cpu", ("chunked", "xla")),
    (None, True, "cpu", ("chunked", "xla")),
    ("pallas", False, "cpu", ("chunked", "pallas")),
    ("reference", False, "cpu", ("attention", "reference")),
    ("reference", True, "gpu", ("recurrent", "reference")),
])
def test_select(impl, need_state, platform, key):
    row = impls.select(impl, need_state=need_state, platform=platform)
    assert (row.algorithm, row.backend) == key


def test_select_rejects_unknown_and_unavailable_impls():
    with pytest.raises(ValueError, match=r"impl must be one of \('pallas', 'xla', 'reference'\) "
                                         r"or None, got impl='mosaic_gpu'"):
        impls.select("mosaic_gpu")
    with pytest.raises(ValueError, match=r"impl='pallas' is not available on backend 'tpu'"):
        impls.select("pallas", platform="tpu")


def test_make_config_fills_the_chunk_only_for_the_chunked_algorithm():
    config = make_config(100, 2, None, "pallas")
    assert (config.algorithm, config.backend) == ("chunked", "pallas")
    assert config.chunk_size == pallas_plan.default_chunk_size(100) == 128
    assert make_config(100, 2, 32, "xla").chunk_size == 32
    assert make_config(100, 2, 32, "reference").chunk_size is None
    assert impls.lookup(make_config(100, 2, None, "reference", need_state=True)) is \
        impls.IMPLEMENTATIONS["recurrent", "reference"]
