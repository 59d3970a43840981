"""experiments/timing.py: the kernel summary of a profiler trace (busy time as the union of
kernel intervals, counts and totals per call) and the refusal of a trace without a GPU."""

from __future__ import annotations

import importlib.util

import pytest

from tests.train.helpers import CONFIGS

SPEC = importlib.util.spec_from_file_location(
    "timing", CONFIGS.parent / "experiments" / "timing.py")
timing = importlib.util.module_from_spec(SPEC)
SPEC.loader.exec_module(timing)


def test_summary_counts_overlaps_once_and_divides_by_calls():
    # Two calls (ns); "a" runs twice per call, "b" once, overlapping the second "a".
    events = [("a", 0, 10_000), ("a", 20_000, 10_000), ("b", 25_000, 30_000),
              ("a", 100_000, 10_000), ("a", 120_000, 10_000), ("b", 125_000, 30_000)]
    summary = timing.summarize_kernels(events, calls=2, wall_s=2e-3)
    # busy per call: [0, 10] + [20, 55] us = 45 us
    assert summary["busy_ms"] == pytest.approx(0.045)
    assert summary["wall_ms"] == pytest.approx(1.0)
    assert summary["kernels_per_call"] == 3
    assert summary["kernels"] == [{"name": "b", "count": 1.0, "total_us": 30.0},
                                  {"name": "a", "count": 2.0, "total_us": 20.0}]


def test_summary_orders_slowest_first():
    events = [("fast", 0, 1000), ("slow", 2000, 5000), ("fast", 8000, 1000)]
    kernels = timing.summarize_kernels(events, calls=1, wall_s=1e-5)["kernels"]
    assert [k["name"] for k in kernels] == ["slow", "fast"]
    assert [k["total_us"] for k in kernels] == [5.0, 2.0]


def test_cpu_trace_has_no_gpu_plane(tmp_path):
    import jax
    import jax.numpy as jnp

    f = jax.jit(lambda x: jnp.sin(x).sum())
    f(jnp.ones(8)).block_until_ready()
    with jax.profiler.trace(str(tmp_path)):
        f(jnp.ones(8)).block_until_ready()
    with pytest.raises(ValueError, match="no /device:GPU plane"):
        timing.kernel_events(str(tmp_path))


def test_missing_trace_is_named(tmp_path):
    with pytest.raises(ValueError, match="no \\*.xplane.pb trace"):
        timing.kernel_events(str(tmp_path))


def test_timed_call_counts_calls_and_returns_the_last_result():
    import jax.numpy as jnp

    calls = []

    def fn(x):
        calls.append(x)
        return jnp.asarray(len(calls))

    seconds, out = timing.timed_call(fn, 7, reps=3, warmup=2)
    assert len(calls) == 5 and int(out) == 5 and seconds >= 0
    assert timing.timed(fn, 7, reps=1, warmup=0) >= 0 and len(calls) == 6
