"""Hardware counters of the attention kernels: run the cases under Nsight Compute, then read
its report back into a per-kernel summary.

  XLA_PYTHON_CLIENT_PREALLOCATE=false \
  ncu --clock-control none -k regex:'sympow|cudnn' --section SpeedOfLight \
      --section ComputeWorkloadAnalysis --section WarpStateStats --section SchedulerStats \
      --section Occupancy --section LaunchStats -o /tmp/attn \
      python3 experiments/ncu_profile.py --cases=mosaic_gpu:attention:16384:12,cudnn::16384:12
  ncu --import /tmp/attn.ncu-rep --csv --page raw > $OUT/attn.csv
  python3 experiments/ncu_profile.py --summarize=$OUT/attn.csv --out=$OUT

Cases `impl:algorithm:T:H` (impl 'cudnn' for jax.nn.dot_product_attention's cuDNN kernels,
algorithm empty for the automatic choice): bf16, B x T = 65,536, d = e = 64, sympow p = 2
with gating, the benchmark's inputs (`timing.attention_inputs`); each case's forward +
backward is compiled and run once, so ncu sees every kernel of it once. `--clock-control
none` leaves the GPU's clocks as they are (the device notes ask it; ncu's default locks
them to base). XLA_PYTHON_CLIENT_PREALLOCATE=false: with XLA's pool preallocated (75 % of
the GPU), Nsight Compute 2025.3.1 segfaulted in its kernel replay or failed to allocate
(H100, 2026-12-07); without it the attention form's cases profile. The chunked call's
cases still segfault before their first kernel is profiled (docs/kernels.md).

The summary (ncu_profile.json under --out) keeps per kernel: its duration, the SM and
memory speed-of-light percentages, the tensor pipe's and the issue slots' busy share, the
achieved occupancy, registers per thread, and the warp stall reasons per issued
instruction, largest first: what a kernel waits on, which the jax profiler cannot say.
"""

import csv
import io
import json
import re
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from absl import app, flags  # noqa: E402
from timing import attention_inputs  # noqa: E402  (experiments/timing.py, beside this script)

_CASES = flags.DEFINE_list("cases", [], "cases impl:algorithm:T:H to run once each")
_SUMMARIZE = flags.DEFINE_string("summarize", None, "an `ncu --csv --page raw` report to read")
_STALLS = flags.DEFINE_integer("stalls", 6, "stall reasons kept per kernel")
_OUT = flags.DEFINE_string("out", None, "directory for ncu_profile.json (--summarize)")

# (summary key, metric name) in the order printed; a metric the report lacks is left out.
METRICS = (
    ("duration_us", "gpu__time_duration.sum"),
    ("sm_pct", "sm__throughput.avg.pct_of_peak_sustained_elapsed"),
    ("memory_pct", "gpu__compute_memory_throughput.avg.pct_of_peak_sustained_elapsed"),
    ("dram_pct", "dram__throughput.avg.pct_of_peak_sustained_elapsed"),
    ("tensor_pct", "sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_active"),
    ("issue_active_pct", "smsp__issue_active.avg.pct_of_peak_sustained_active"),
    ("warps_active_pct", "sm__warps_active.avg.pct_of_peak_sustained_active"),
    ("eligible_warps", "smsp__warps_eligible.avg.per_cycle_active"),
    ("registers", "launch__registers_per_thread"),
    ("shared_kib", "launch__shared_mem_per_block_dynamic"),
)
STALL = re.compile(r"^smsp__average_warps_issue_stalled_(\w+)_per_issue_active\.ratio$")
# Units as ncu 2025.3 spells them (ms, Kbyte), and the long forms of other versions.
SCALE = {"duration_us": {"ns": 1e-3, "nsecond": 1e-3, "us": 1.0, "usecond": 1.0, "ms": 1e3,
                         "msecond": 1e3},
         "shared_kib": {"byte": 1 / 1024, "Kbyte": 1000 / 1024, "KB": 1000 / 1024,
                        "Kibyte": 1.0, "KiB": 1.0}}


def number(text: str) -> float | None:
    """A report cell as a float (ncu writes thousands separators), or None for text."""
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return None


def summarize(report: str, *, stalls: int = 6) -> list[dict]:
    """Per kernel of an `ncu --csv --page raw` report (a header row, a units row, one row
    per profiled launch): name, grid and block, METRICS in the summary's units and the
    `stalls` largest stall reasons (warps stalled per issued instruction). ValueError for a
    report with no kernel rows."""
    rows = list(csv.reader(io.StringIO(report)))
    header_at = next((i for i, row in enumerate(rows) if "Kernel Name" in row), None)
    if header_at is None or len(rows) < header_at + 3:
        raise ValueError("no kernel rows in the report (a header with 'Kernel Name', a units "
                         "row and at least one launch are needed)")
    header, units = rows[header_at], rows[header_at + 1]
    column = {name: i for i, name in enumerate(header)}
    kernels = []
    for row in rows[header_at + 2:]:
        if len(row) != len(header):
            continue  # a trailing message line, not a launch
        entry = {"name": row[column["Kernel Name"]],
                 "grid": row[column["Grid Size"]] if "Grid Size" in column else "",
                 "block": row[column["Block Size"]] if "Block Size" in column else ""}
        for key, metric in METRICS:
            if metric in column and (value := number(row[column[metric]])) is not None:
                entry[key] = round(value * SCALE.get(key, {}).get(units[column[metric]], 1.0), 3)
        reasons = [(STALL.match(name).group(1), value) for name, i in column.items()
                   if STALL.match(name) and (value := number(row[i])) is not None]
        reasons.sort(key=lambda r: -r[1])
        entry["stalls"] = {name: round(value, 3) for name, value in reasons[:stalls]}
        kernels.append(entry)
    if not kernels:
        raise ValueError("no kernel rows in the report")
    return kernels


def run_case(spec: str) -> None:
    """Compiles and runs the case's forward + backward once."""
    import jax

    import sympow

    impl, algorithm, t, h = spec.split(":")
    q, k, v, log_g, ct = attention_inputs(int(t), int(h))
    if impl == "cudnn":
        def attention(q, k, v, log_g):
            return jax.nn.dot_product_attention(q, k, v, implementation="cudnn",
                                                is_causal=True)
    else:
        def attention(q, k, v, log_g):
            return sympow.sympow_attention(q, k, v, log_g, p=2, impl=impl,
                                           algorithm=algorithm or None)

    @jax.jit
    def fwd_bwd(q, k, v, log_g, ct):
        y, vjp = jax.vjp(attention, q, k, v, log_g)
        return vjp(ct.astype(y.dtype))

    jax.block_until_ready(fwd_bwd(q, k, v, log_g, ct))
    print(f"ran {spec}", flush=True)


def main(argv):
    del argv
    for spec in _CASES.value:
        run_case(spec)
    if _SUMMARIZE.value:
        kernels = summarize(Path(_SUMMARIZE.value).read_text(), stalls=_STALLS.value)
        for k in kernels:
            print(f"{k['name'][:70]:70} " + " ".join(
                f"{key}={k[key]}" for key, _ in METRICS if key in k))
            print(f"{'':8}stalls {k['stalls']}")
        if _OUT.value:
            out = Path(_OUT.value)
            out.mkdir(parents=True, exist_ok=True)
            (out / "ncu_profile.json").write_text(json.dumps(
                {"date": time.strftime("%Y-%m-%d"), "report": _SUMMARIZE.value,
                 "kernels": kernels}, indent=1))


if __name__ == "__main__":
    app.run(main)
