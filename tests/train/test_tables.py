"""sympow.train.tables: the one CSV format of evaluation and sweep tables."""

from __future__ import annotations

import math

import numpy as np
import pytest

from sympow.train import tables


def test_cells_and_round_trip(tmp_path):
    rows = [[1, 0.5, np.float64(2.0) / 3, None, "x"], [2, math.nan, 1e-9, "", "a,b"]]
    path = tables.write_csv(tmp_path / "t.csv", ["i", "f", "g", "none", "s"], rows)
    assert path.read_text().splitlines() == [
        "i,f,g,none,s", "1,0.500000,0.666667,,x", '2,nan,0.000000,,"a,b"']
    header, body = tables.read_csv(path)
    assert header == ["i", "f", "g", "none", "s"]
    assert body == [["1", "0.500000", "0.666667", "", "x"], ["2", "nan", "0.000000", "", "a,b"]]


def test_ragged_rows_and_empty_files_raise(tmp_path):
    with pytest.raises(ValueError, match="row of 1 cells for 2 columns"):
        tables.write_csv(tmp_path / "t.csv", ["a", "b"], [[1]])
    (tmp_path / "empty.csv").write_text("")
    with pytest.raises(ValueError, match="no header"):
        tables.read_csv(tmp_path / "empty.csv")
