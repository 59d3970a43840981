"""The one timing rule of the GPU scripts (benchmark.py, profile_states.py,
model_benchmark.py) and the tracing and reading of jax.profiler traces (kernel_profile.py,
tune_decode_linear.py)."""

import statistics
import time


def timed_call(fn, *args, reps: int, warmup: int = 1):
    """(median seconds, last result) of `reps` calls of fn(*args), each ended by
    block_until_ready, after `warmup` calls (the first compiles). One result is alive at a
    time: each is dropped before the next call (16 KV caches of 64k tokens take 38 GB)."""
    import jax

    out = None
    for _ in range(warmup):
        del out
        out = jax.block_until_ready(fn(*args))
    times = []
    for _ in range(reps):
        del out
        start = time.perf_counter()
        out = jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return statistics.median(times), out


def timed(fn, *args, reps: int, warmup: int = 2) -> float:
    """Median milliseconds of `reps` calls of fn(*args) after `warmup` (`timed_call`)."""
    return timed_call(fn, *args, reps=reps, warmup=warmup)[0] * 1e3


def trace_kernels(fn, *args, reps: int) -> tuple[list[tuple[str, float, float]], float]:
    """(`kernel_events` of `reps` calls of fn(*args) under jax.profiler.trace, after a
    compiling call; the wall seconds of those calls)."""
    import tempfile

    import jax

    jax.block_until_ready(fn(*args))
    with tempfile.TemporaryDirectory() as trace_dir:
        with jax.profiler.trace(trace_dir):
            start = time.perf_counter()
            for _ in range(reps):
                jax.block_until_ready(fn(*args))
            wall_s = time.perf_counter() - start
        return kernel_events(trace_dir), wall_s


def kernel_events(trace_dir: str) -> list[tuple[str, float, float]]:
    """(name, start ns, duration ns) of every kernel a GPU ran in the jax.profiler trace
    written under trace_dir (the events of its /device:GPU planes' stream lines).
    ValueError when the trace holds no GPU plane (a CPU run has none)."""
    from pathlib import Path

    from jax.profiler import ProfileData

    paths = sorted(Path(trace_dir).rglob("*.xplane.pb"))
    if not paths:
        raise ValueError(f"no *.xplane.pb trace under {trace_dir}")
    events, lines = [], []
    for plane in ProfileData.from_file(str(paths[-1])).planes:
        if not plane.name.startswith("/device:GPU"):
            continue
        for line in plane.lines:
            lines.append(line.name)
            if line.name.startswith("Stream"):
                events += [(e.name, e.start_ns, e.duration_ns) for e in line.events]
    if not lines:
        raise ValueError(f"the trace under {trace_dir} has no /device:GPU plane (not a GPU run)")
    if not events:
        raise ValueError(f"no kernel on the GPU planes' stream lines; their lines: {lines}")
    return events


def summarize_kernels(events: list[tuple[str, float, float]], *, calls: int,
                      wall_s: float) -> dict:
    """Per call: wall ms, kernels launched, busy ms (the union of the kernels' intervals:
    overlapping kernels count once) and each kernel name's count and total microseconds,
    slowest first."""
    busy_ns, end = 0.0, float("-inf")
    for _, start, duration in sorted(events, key=lambda e: e[1]):
        busy_ns += max(0.0, start + duration - max(start, end))
        end = max(end, start + duration)
    totals: dict[str, list[float]] = {}
    for name, _, duration in events:
        entry = totals.setdefault(name, [0, 0.0])
        entry[0] += 1
        entry[1] += duration
    kernels = [{"name": name, "count": count / calls, "total_us": round(ns / calls / 1e3, 2)}
               for name, (count, ns) in totals.items()]
    kernels.sort(key=lambda k: -k["total_us"])
    return {"wall_ms": round(wall_s / calls * 1e3, 4), "kernels_per_call": len(events) / calls,
            "busy_ms": round(busy_ns / calls / 1e6, 4), "kernels": kernels}
