"""The one timing rule of the GPU scripts (benchmark.py, profile_states.py,
model_benchmark.py) and the tracing and reading of jax.profiler traces (kernel_profile.py,
tune_decode_linear.py), and the attention benchmarks' inputs (benchmark.py, kernel_profile.py,
ncu_profile.py)."""

import statistics
import time


def attention_inputs(t: int, h: int, *, tokens: int = 65536, seed: int = 0, d: int = 64):
    """(q, k, v, log_g, ct) of the attention benchmarks: bf16 [tokens // t, t, h, d] standard
    normals (ct the output's cotangent) and float32 log gates log_sigmoid(3 + N(0, 1))
    [tokens // t, t, h] (gates near 0.95, as trained models' are)."""
    import jax
    import jax.numpy as jnp

    keys = jax.random.split(jax.random.PRNGKey(seed), 5)
    shape = (max(1, tokens // t), t, h, d)
    q, k, v, ct = (jax.random.normal(key, shape, jnp.bfloat16) for key in keys[:4])
    log_g = jax.nn.log_sigmoid(3.0 + jax.random.normal(keys[4], shape[:3], jnp.float32))
    return q, k, v, log_g, ct


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


def timed_pipelined(fn, *args, reps: int, warmup: int = 2) -> float:
    """Milliseconds a call of `reps` calls of fn(*args) dispatched back to back with one wait
    at the end (after `warmup` waited calls): the slower of the device's time and the
    host's dispatch a call (each call's dispatch overlaps the previous calls' work), plus
    the first dispatch and the last wait spread over `reps`. Where the device is the
    slower, as for long attention calls, this is near its time a call, as inside a training
    step; for small calls it can be the host's. `timed` waits for each call, so its time
    holds both (the chunked attention's 57 kernels on an H200, 2026-11-27: GPU busy 5.40 ms
    a call in a profile, 5.9-6.0 waited, 5.73 pipelined)."""
    import jax

    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    start = time.perf_counter()
    out = None
    for _ in range(reps):
        out = fn(*args)  # the previous output is dropped: one call's buffers at a time queued
    jax.block_until_ready(out)
    return (time.perf_counter() - start) / reps * 1e3


def call_in_turns(calls, *, rounds: int) -> None:
    """`rounds` rounds, each calling every (fn, args) of `calls` once, each call waited for."""
    import jax

    for _ in range(rounds):
        for fn, args in calls:
            jax.block_until_ready(fn(*args))


def timed_interleaved(calls, *, reps: int, warmup: int = 2) -> list[float]:
    """Median milliseconds of each (fn, args) of `calls`, timed in turns: each round calls
    every fn once (each ended by block_until_ready), `reps` rounds after `warmup`. Versions
    compared this way see the same clocks and the same machine state; timed one after the
    other (as `timed` in separate processes) their ratio also carries the machine's drift,
    which moved cuDNN's own fwd + bwd by up to 5 % within one device call and 35 % between
    calls on H200s (docs/benchmarks.md, 2026-11-26)."""
    import jax

    call_in_turns(calls, rounds=warmup)
    times = [[] for _ in calls]
    for _ in range(reps):
        for (fn, args), column in zip(calls, times, strict=True):
            start = time.perf_counter()
            jax.block_until_ready(fn(*args))
            column.append(time.perf_counter() - start)
    return [statistics.median(column) * 1e3 for column in times]


def kernel_times_interleaved(calls, *, reps: int, prefix: str, warmup: int = 1) -> list[float]:
    """Median GPU microseconds of the one kernel each (fn, args) of `calls` launches whose
    name starts with `prefix` (one a call: `per_call_durations` checks the count), from a
    jax.profiler trace of `reps` rounds in turns as `timed_interleaved` runs them: the
    kernel's own duration, without the host's dispatch and wait that a wall-clock time of
    one call also holds."""
    import tempfile

    import jax

    call_in_turns(calls, rounds=warmup)
    with tempfile.TemporaryDirectory() as trace_dir:
        with jax.profiler.trace(trace_dir):
            call_in_turns(calls, rounds=reps)
        events = kernel_events(trace_dir)
    return per_call_durations(events, calls=len(calls), reps=reps, prefix=prefix)


def per_call_durations(events: list[tuple[str, float, float]], *, calls: int, reps: int,
                       prefix: str) -> list[float]:
    """Median microseconds of each of `calls` calls made in turns for `reps` rounds, each
    launching one kernel named `prefix`...: the matching events in start order are call
    0, 1, ..., calls - 1, 0, 1, ... ValueError when their number is not calls x reps."""
    durations = [d for name, _, d in sorted(events, key=lambda e: e[1]) if name.startswith(prefix)]
    if len(durations) != calls * reps:
        raise ValueError(f"expected {calls} x {reps} kernels named {prefix}..., one a call; "
                         f"the trace has {len(durations)}")
    return [statistics.median(durations[i::calls]) / 1e3 for i in range(calls)]


def trace_kernels(fn, *args, reps: int, chained: bool = False
                  ) -> tuple[list[tuple[str, float, float]], float]:
    """(`kernel_events` of `reps` calls of fn(*args) under jax.profiler.trace, after a
    compiling call; the wall seconds of those calls). `chained`: as `run_calls` chains them
    (a training step's state passed on, one wait at the end)."""
    import tempfile

    import jax

    args = run_calls(fn, args, reps=1, chained=chained)
    with tempfile.TemporaryDirectory() as trace_dir:
        with jax.profiler.trace(trace_dir):
            start = time.perf_counter()
            run_calls(fn, args, reps=reps, chained=chained)
            wall_s = time.perf_counter() - start
        return kernel_events(trace_dir), wall_s


def gpu_us(fn, *args, reps: int) -> float:
    """Mean GPU microseconds of all the kernels of one call of fn(*args) (`trace_kernels`)."""
    events, _ = trace_kernels(fn, *args, reps=reps)
    return sum(duration for _, _, duration in events) / reps / 1e3


def matmul_rate(n: int = 8192, *, reps: int) -> dict:
    """The machine's measured bf16 matmul rate: XLA's [n, n] x [n, n] product with float32
    accumulation (cuBLAS on a GPU), as TFLOP/s of its kernels' GPU time (`gpu_us`: the base
    for kernel durations) and of a waited call's wall time (`timed`: the host's dispatch and
    wait in it too). ValueError off a GPU (`kernel_events`: the trace has no GPU plane)."""
    import jax
    import jax.numpy as jnp

    a = jax.random.normal(jax.random.PRNGKey(0), (n, n), jnp.bfloat16)
    product = jax.jit(lambda x: jnp.dot(x, x, preferred_element_type=jnp.float32))
    flop = 2 * n ** 3
    wall_ms = timed(product, a, reps=reps)
    kernel_us = gpu_us(product, a, reps=reps)
    return dict(matmul_n=n, matmul_tflops=flop / wall_ms / 1e9,
                matmul_kernel_tflops=flop / kernel_us / 1e6)


def run_calls(fn, args: tuple, *, reps: int, chained: bool) -> tuple:
    """Call fn(*args) `reps` times; return the arguments of a next call. Unchained: the same
    args each time, each call waited for. Chained (a step `(state, ...) -> (state, out)`,
    its state donated or not): each call gets the last call's state as its first argument
    and is dispatched at once, as a trainer runs its steps; one wait at the end."""
    import jax

    out = None
    for _ in range(reps):
        out = fn(*args)
        if chained:
            args = (out[0], *args[1:])
        else:
            jax.block_until_ready(out)
    jax.block_until_ready(out)
    return args


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
    slowest first; idle ms (the GPU's gaps between its first kernel and its last, which
    include the gaps between calls) and those gaps by the kernels around them ("after" the
    kernel that ended last, "before" the next to start), longest total first: a gap
    before a kernel that waited on the host shows as that pair's time."""
    busy_ns, end, last = 0.0, float("-inf"), None
    gaps: dict[tuple[str, str], list[float]] = {}
    for name, start, duration in sorted(events, key=lambda e: e[1]):
        if last is not None and start > end:  # the GPU idle from `end` until this kernel
            entry = gaps.setdefault((last, name), [0, 0.0])
            entry[0] += 1
            entry[1] += start - end
        busy_ns += max(0.0, start + duration - max(start, end))
        if start + duration >= end:
            end, last = start + duration, name
    totals: dict[str, list[float]] = {}
    for name, _, duration in events:
        entry = totals.setdefault(name, [0, 0.0])
        entry[0] += 1
        entry[1] += duration
    kernels = [{"name": name, "count": count / calls, "total_us": round(ns / calls / 1e3, 2)}
               for name, (count, ns) in totals.items()]
    kernels.sort(key=lambda k: -k["total_us"])
    idle = [{"after": previous, "before": following, "count": count / calls,
             "total_us": round(ns / calls / 1e3, 2)}
            for (previous, following), (count, ns) in gaps.items()]
    idle.sort(key=lambda g: -g["total_us"])
    return {"wall_ms": round(wall_s / calls * 1e3, 4), "kernels_per_call": len(events) / calls,
            "busy_ms": round(busy_ns / calls / 1e6, 4), "kernels": kernels,
            "idle_ms": round(sum(g["total_us"] for g in idle) / 1e3, 4), "idle": idle}


def time_by_source(kernels: list[dict]) -> list[dict]:
    """The kernels' time by the Python file of their most frequent operation's innermost
    frame ({"source": "rotary.py", "total_us", "kernels"}, longest first): XLA's kernels
    carry `hlo_kernels`' "sources"; the others (cuBLAS, cuDNN, Mosaic GPU, memsets) count
    under "(no source)". A fusion of several files' operations counts under its first."""
    totals: dict[str, list[float]] = {}
    for kernel in kernels:
        sources = kernel.get("sources") or []
        file = sources[0].split(" ", 1)[0].rsplit(":", 1)[0] if sources else "(no source)"
        entry = totals.setdefault(file, [0.0, 0])
        entry[0] += kernel["total_us"]
        entry[1] += 1
    rows = [{"source": file, "total_us": round(us, 2), "kernels": n}
            for file, (us, n) in totals.items()]
    return sorted(rows, key=lambda row: -row["total_us"])


def hlo_kernels(hlo_text: str, *, top: int = 4) -> dict[str, dict]:
    """For each instruction of an optimized HLO module that calls a computation (the fusions
    and wrapped ops a profile names as kernels): {"shape": its result type, "operands": its
    operands' types, "sources": where its operations come from in the Python source, as
    "file:line < caller:line op" (the innermost frame and up to two distinct callers), the
    `top` most frequent first, over the called computations recursively}, keyed by the name
    as the profiler spells it ("." as "_"). Inside a nested jit or custom_vjp the frames are
    those of the call; the op's scopes (an einsum's spec, transpose(jvp(...)) for a
    gradient) and the shapes say more there.

    Reads both metadata forms: `stack_frame_id=N` against the module's FileNames /
    FileLocations / StackFrames tables, and the older `source_file=... source_line=...`."""
    import re
    from collections import Counter

    tables: dict[str, dict[int, str]] = {}
    section = None
    computations: dict[str, list[str]] = {}
    current = None
    for line in hlo_text.splitlines():
        if line in ("FileNames", "FunctionNames", "FileLocations", "StackFrames"):
            section = line
            tables[section] = {}
            continue
        if section and re.match(r"^\d+ ", line):
            key, _, value = line.partition(" ")
            tables[section][int(key)] = value
            continue
        section = None
        header = re.match(r"^(?:ENTRY )?%?([\w.\-]+) .*\{$", line)
        if header:
            current = computations.setdefault(header.group(1), [])
        elif current is not None and line.strip() not in ("", "}"):
            current.append(line)

    def field(text: str, name: str) -> str | None:
        found = re.search(rf"\b{name}=(\d+)", text)
        return found.group(1) if found else None

    def location(frame: int) -> tuple[str, int | None]:
        entry = tables.get("StackFrames", {}).get(frame, "")
        loc = tables.get("FileLocations", {}).get(int(field(entry, "file_location_id") or -1), "")
        name = tables.get("FileNames", {}).get(int(field(loc, "file_name_id") or -1), '"?"')
        # The table's frame ids count from 1 and its parent ids from 0 (the printed form of
        # XLA's 0-based index: parent_frame_id=1 is frame 1's own parent, none is 0).
        parent = int(field(entry, "parent_frame_id") or 0) - 1
        parent = parent if 0 < parent < frame else None
        return f"{name.strip(chr(34)).rsplit('/', 1)[-1]}:{field(loc, 'line')}", parent

    def source(instruction: str) -> str | None:
        op = re.search(r'op_name="([^"]*)"', instruction)  # its last two scopes say most
        op = "/".join(op.group(1).split("/")[-2:]) if op else "?"
        frame = field(instruction, "stack_frame_id")
        if frame is not None:  # the innermost frame and up to two distinct callers
            chain, parent = [], int(frame)
            while parent is not None and len(chain) < 3:
                where, parent = location(parent)
                if where not in chain:
                    chain.append(where)
            return f"{' < '.join(chain)} {op}"
        file, line_no = (re.search(rf'{k}="?([^"\s,}}]*)', instruction)
                         for k in ("source_file", "source_line"))
        if file and line_no:
            return f"{file.group(1).rsplit('/', 1)[-1]}:{line_no.group(1)} {op}"
        return None

    def called(instruction: str) -> list[str]:
        return re.findall(r"\b(?:calls|to_apply)=%?([\w.\-]+)", instruction)

    def gather(name: str, counts: Counter, seen: set) -> None:
        if name in seen:
            return
        seen.add(name)
        for instruction in computations.get(name, []):
            where = source(instruction)
            if where:
                counts[where] += 1
            for callee in called(instruction):
                gather(callee, counts, seen)

    # name = type op(operands): the operands without their /*index=N*/ comments
    definition = re.compile(r"^\s*(?:ROOT )?%?([\w.\-]+) = (\(.*?\)|\S+) [\w\-]+\(([^)]*)\)")
    result = {}
    for lines in computations.values():
        defined = [(definition.match(re.sub(r"/\*.*?\*/", "", line)), line) for line in lines]
        types = {match.group(1): match.group(2) for match, _ in defined if match}
        for name, instruction in defined:
            callees = called(instruction)
            if not callees or not name:
                continue
            operands = [types.get(o.strip().lstrip("%"), "?")
                        for o in name.group(3).split(",") if o.strip()]
            counts: Counter = Counter()
            own = source(instruction)
            if own:
                counts[own] += 1
            for callee in callees:
                gather(callee, counts, set())
            result[name.group(1).replace(".", "_")] = {  # the profiler's form of the name
                "shape": name.group(2), "operands": operands,
                "sources": [where for where, _ in counts.most_common(top)]}
    return result
