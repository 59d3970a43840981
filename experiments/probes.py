"""What the Hopper probes share (probe_tma_reduce.py, probe_symmetric_blocks.py): a row per
check or measurement, printed as JSON as it is made, a failure recorded in its row instead
of ending the run, and the entry point that refuses anything but a Hopper GPU and writes
the rows under --out."""

import json
import sys
import traceback
from pathlib import Path


def attempt(row: dict, measure) -> dict:
    """row updated with measure()'s dict, or with the error it raised (ok False, its
    traceback on stderr); printed."""
    try:
        row.update(measure())
    except Exception as error:  # noqa: BLE001  (record what failed, go on)
        row.update(error=f"{type(error).__name__}: {str(error)[:300]}", ok=False)
        traceback.print_exc(file=sys.stderr)  # where it failed, for the log
    print(json.dumps(row), flush=True)
    return row


def against(got, want, tol: float = 1e-5) -> dict:
    """{max_rel_err, ok}: the largest |got - want| per the largest |want|, within tol."""
    import numpy as np

    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    err = float(np.max(np.abs(got - want)) / np.max(np.abs(want)))
    return {"max_rel_err": err, "ok": err < tol}


def hopper_main(script: str, out: str | None, *probes) -> None:
    """Run each probe (-> rows) after a row naming the device and jax; write the rows to
    `out`/<script>.json. Exits naming the reason on anything but a Hopper GPU."""
    import jax

    from sympow.attention.mosaic_gpu.vjps import not_hopper

    reason = not_hopper()
    if reason is not None:
        raise SystemExit(f"{script}.py needs a Hopper GPU: {reason}")
    rows = [dict(device=jax.devices()[0].device_kind, jax=jax.__version__)]
    for probe in probes:
        rows += probe()
    if out:
        Path(out).mkdir(parents=True, exist_ok=True)
        (Path(out) / f"{script}.json").write_text(json.dumps(rows, indent=1))
