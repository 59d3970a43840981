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


def test_summary_names_the_gaps_by_the_kernels_around_them():
    # One call (ns): "long" covers "short" (no gap after it), then the GPU idles 5 us
    # before "late" and 2 us before "later"; the gap is timed from the end of "long",
    # which ended last, not from "short".
    events = [("long", 0, 10_000), ("short", 1_000, 2_000), ("late", 15_000, 1_000),
              ("later", 18_000, 1_000)]
    summary = timing.summarize_kernels(events, calls=1, wall_s=1e-4)
    assert summary["idle_ms"] == pytest.approx(0.007)
    assert summary["idle"] == [
        {"after": "long", "before": "late", "count": 1.0, "total_us": 5.0},
        {"after": "late", "before": "later", "count": 1.0, "total_us": 2.0}]
    # two calls of the same sequence: the same pairs, per call, plus the gap between calls
    second = [(name, start + 100_000, duration) for name, start, duration in events]
    summary = timing.summarize_kernels(events + second, calls=2, wall_s=2e-4)
    assert summary["idle"][0] == {"after": "later", "before": "long", "count": 0.5,
                                  "total_us": 40.5}
    assert summary["idle"][1:] == [
        {"after": "long", "before": "late", "count": 1.0, "total_us": 5.0},
        {"after": "late", "before": "later", "count": 1.0, "total_us": 2.0}]


def test_time_by_source_takes_the_first_sources_file():
    kernels = [
        {"name": "fusion_a", "total_us": 5.0,
         "sources": ["rotary.py:89 < attention.py:193 jvp()/mul", "api.py:191 < x.py:1 add"]},
        {"name": "fusion_b", "total_us": 2.5, "sources": ["api.py:191 < attention.py:305 div"]},
        {"name": "fusion_c", "total_us": 1.0, "sources": ["rotary.py:69 jvp()/cos"]},
        {"name": "nvjet_gemm", "total_us": 9.0},
        {"name": "fusion_d", "total_us": 0.5, "sources": []}]
    assert timing.time_by_source(kernels) == [
        {"source": "(no source)", "total_us": 9.5, "kernels": 2},
        {"source": "rotary.py", "total_us": 6.0, "kernels": 2},
        {"source": "api.py", "total_us": 2.5, "kernels": 1}]


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


def test_run_calls_chains_a_steps_state_or_repeats_the_same_arguments():
    import jax
    import jax.numpy as jnp

    step = jax.jit(lambda state, inc: (state + inc, state * 2), donate_argnums=0)
    args = timing.run_calls(step, (jnp.float32(1.0), jnp.float32(3.0)), reps=4, chained=True)
    assert float(args[0]) == 13.0 and float(args[1]) == 3.0  # 1 + 4 x 3, the state passed on
    seen = []
    same = timing.run_calls(lambda x: seen.append(float(x)) or (x + 1, x), (jnp.float32(5.0),),
                            reps=3, chained=False)
    assert seen == [5.0, 5.0, 5.0] and float(same[0]) == 5.0


def _scaled(x):
    return x * 3.0  # the line hlo_kernels must name for the multiply


def test_hlo_kernels_name_the_shapes_lines_and_callers_of_a_fusion():
    import inspect

    import jax
    import jax.numpy as jnp

    def program(x, y):
        return jnp.sum(jnp.swapaxes(_scaled(x), 0, 1) @ y, axis=0)

    text = jax.jit(program).lower(jnp.ones((64, 32)), jnp.ones((64, 16))).compile().as_text()
    sources = timing.hlo_kernels(text)
    multiply_line = inspect.getsourcelines(_scaled)[1] + 1
    call_line = inspect.getsourcelines(program)[1] + 1
    here = "test_timing.py"
    fusions = [name for name, kernel in sources.items()
               if any(w.startswith(f"{here}:{multiply_line} ") for w in kernel["sources"])]
    assert fusions, sources
    multiply = sources[fusions[0]]
    # The multiply's frame chain goes up to its caller's line in `program`.
    assert any(w.startswith(f"{here}:{multiply_line} < {here}:{call_line}")
               for w in multiply["sources"]), multiply
    assert any(w.endswith("/mul") for w in multiply["sources"]), multiply
    assert multiply["shape"].startswith("f32[64,32]") and multiply["operands"] == [
        "f32[64,32]{1,0}"], multiply


def test_hlo_kernels_read_the_older_metadata_form():
    text = "\n".join([
        "%fused_a (p: f32[4]) -> f32[4] {",
        '  ROOT %m = f32[4]{0} multiply(%p, %p), metadata={op_name="jit(f)/mul" '
        'source_file="/x/model.py" source_line=12}',
        "}",
        "",
        "ENTRY %main (p: f32[4]) -> f32[4] {",
        "  %p = f32[4]{0} parameter(0)",
        "  ROOT %loop_multiply_fusion.2 = f32[4]{0} fusion(%p, /*index=1*/%p), kind=kLoop, "
        "calls=%fused_a",
        "}",
    ])
    assert timing.hlo_kernels(text) == {"loop_multiply_fusion_2": {
        "shape": "f32[4]{0}", "operands": ["f32[4]{0}"] * 2,
        "sources": ["model.py:12 jit(f)/mul"]}}


def test_timed_interleaved_calls_the_versions_in_turns():
    """Each round calls every version once, in order, after the warm-up rounds; one median
    per version."""
    import jax.numpy as jnp

    order = []

    def version(name):
        def fn(x):
            order.append(name)
            return jnp.asarray(x)
        return fn

    medians = timing.timed_interleaved([(version("a"), (1,)), (version("b"), (2,))],
                                       reps=3, warmup=1)
    assert order == ["a", "b"] * 4
    assert len(medians) == 2 and all(m >= 0 for m in medians)


def test_per_call_durations_assigns_kernels_in_turns_and_ignores_others():
    # Two calls in turns for three rounds (ns), out of start order in the list, with a
    # glue kernel between them that does not count.
    events = [("k_b", 3_000, 4_000), ("k_a", 0, 1_000), ("glue", 1_500, 500),
              ("k_a", 10_000, 3_000), ("k_b", 14_000, 6_000),
              ("k_a", 30_000, 2_000), ("k_b", 40_000, 5_000)]
    assert timing.per_call_durations(events, calls=2, reps=3, prefix="k_") == [2.0, 5.0]


def test_per_call_durations_refuses_a_count_that_is_not_calls_times_reps():
    events = [("k", 0, 1_000), ("k", 2_000, 1_000), ("k", 4_000, 1_000)]
    message = r"expected 2 x 2 kernels named k\.\.\., one a call; the trace has 3"
    with pytest.raises(ValueError, match=message):
        timing.per_call_durations(events, calls=2, reps=2, prefix="k")


def test_timed_pipelined_dispatches_every_call_and_waits_once(monkeypatch):
    import jax
    import jax.numpy as jnp

    calls, waits = [], []
    real_wait = jax.block_until_ready
    monkeypatch.setattr(jax, "block_until_ready", lambda x: waits.append(1) or real_wait(x))
    ms = timing.timed_pipelined(lambda x: calls.append(1) or x + 1, jnp.ones(3), reps=5,
                                warmup=2)
    assert ms >= 0 and len(calls) == 7 and len(waits) == 3  # two warm-ups, then one wait


def test_gpu_us_is_every_kernel_of_a_call_averaged_over_the_calls(monkeypatch):
    # three calls traced (ns): five kernels in all, 2 + 4 + 6 + 8 + 10 us
    events = [("a", 0, 2_000), ("b", 5_000, 4_000), ("a", 20_000, 6_000),
              ("b", 40_000, 8_000), ("a", 60_000, 10_000)]
    seen = {}

    def fake_trace(fn, *args, reps, chained=False):
        seen.update(args=args, reps=reps, chained=chained)
        return events, 0.5

    monkeypatch.setattr(timing, "trace_kernels", fake_trace)
    assert timing.gpu_us(len, "x", reps=3) == pytest.approx(30 / 3)
    assert seen == {"args": ("x",), "reps": 3, "chained": False}


def test_the_matmul_rate_refuses_a_trace_without_gpu_kernels():
    """On a CPU the product's trace has no GPU plane: the rate is refused with that reason,
    not a division by zero or a rate of nothing."""
    with pytest.raises(ValueError, match=r"has no /device:GPU plane \(not a GPU run\)"):
        timing.matmul_rate(64, reps=1)
