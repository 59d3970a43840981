"""CSV tables written and read by evaluation (``contextwise.csv``) and sweeps (``sweep.csv``).

One format for both: a header row, then one row per record; floats (numpy floats included)
with 6 decimals, ``None`` as an empty cell (e.g. past the end of a shorter curve).
"""

from __future__ import annotations

import csv
import os
from collections.abc import Iterable, Sequence
from pathlib import Path


def _cell(value) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{value:.6f}"
    return str(value)


def write_csv(path: str | os.PathLike, header: Sequence[str],
              rows: Iterable[Sequence]) -> Path:
    """Writes ``header`` and ``rows`` (each as long as the header); returns the path."""
    path = Path(path)
    with path.open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(header)
        for row in rows:
            if len(row) != len(header):
                raise ValueError(f"{path}: row of {len(row)} cells for {len(header)} columns")
            writer.writerow([_cell(v) for v in row])
    return path


def read_csv(path: str | os.PathLike) -> tuple[list[str], list[list[str]]]:
    """(header, rows) of a CSV file, every cell a string (empty cells as "")."""
    with Path(path).open(newline="") as f:
        rows = list(csv.reader(f))
    if not rows:
        raise ValueError(f"{path}: empty CSV file (no header)")
    return rows[0], rows[1:]
