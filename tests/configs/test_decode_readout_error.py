"""experiments/decode_readout_error.py on the CPU: one seed's errors, each a small positive
fraction of max |y|, printed and written with the case and a summary."""

from __future__ import annotations

import json

from tests.configs.test_probes import run


def test_one_seed_writes_every_error_and_the_summary(tmp_path):
    done = run("experiments/decode_readout_error.py", "--seeds=1", f"--out={tmp_path}")
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads((tmp_path / "decode_readout_error.json").read_text())
    assert result["case"] == {"b": 4, "hq": 8, "hk": 8, "d": 16, "e": 128, "p": 4,
                              "gated": False, "prompt": 12, "steps": 3}
    (row,) = result["seeds"]
    names = ["spec", "state", "readout", "tiles_float32", "tiles_compensated"]
    assert list(row) == ["seed", *names]
    assert all(0 < row[name] < 1e-4 for name in names), row  # float32 rounding, not a bug
    assert result["summary"]["max"] == {name: row[name] for name in names}
    assert "seed   0 spec" in done.stdout
