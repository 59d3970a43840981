"""The one timing rule of the GPU scripts (benchmark.py, profile_states.py)."""

import statistics
import time


def timed(fn, *args, reps: int, warmup: int = 2) -> float:
    """Median milliseconds of `reps` calls of fn(*args), each ended by block_until_ready,
    after `warmup` calls (the first compiles)."""
    import jax

    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)
