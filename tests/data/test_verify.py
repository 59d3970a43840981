"""sympow.data.verify: a sound store passes; every kind of damage is found and named by file
(missing, truncated or garbled chunk files, ids past the vocabulary, a wrong layout); the
command's output and exit status."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import zarr

from sympow.data import AUSTEN_PATH
from sympow.data.verify import StoreError, main, verify_split, verify_store
from tests.data.helpers import COLS, pattern, write_store

BACKENDS = ["zarr", "tensorstore"]
CHUNKS = (2, 8192)  # 4 documents: 2 x 8 = 16 chunk files per split


@pytest.fixture
def store(tmp_path):
    """A sound 4-document train split and 2-document held-out split."""
    write_store(tmp_path / "train.zarr", 4, chunks=CHUNKS)
    write_store(tmp_path / "heldout.zarr", 2, chunks=CHUNKS)
    return tmp_path


def damage(root) -> dict[str, str]:
    """Damages four chunk files of train.zarr; returns key -> what verify must say."""
    train = root / "train.zarr"
    size = os.path.getsize(train / "0.1")
    with open(train / "0.1", "r+b") as f:  # truncated: the Blosc header promises more bytes
        f.truncate(size // 2)
    data = bytearray((train / "0.2").read_bytes())
    data[2:4] = b"\xff\xff"  # the Blosc header's flags and type size
    (train / "0.2").write_bytes(bytes(data))
    (train / "1.3").unlink()
    tokens = zarr.open_array(str(train), mode="r+", zarr_format=2)
    tokens[1, 5 * 8192 + 7] = 60000  # in chunk 0.5
    return {"0.1": "cannot be decoded", "0.2": "cannot be decoded",
            "1.3": "missing chunk file", "0.5": "token id 60000 at document 1, column 40967"}


@pytest.mark.parametrize("backend", BACKENDS)
def test_sound_stores_pass(store, backend):
    train, heldout = verify_store(store, backend=backend)
    assert train.ok and heldout.ok
    assert train.shape == (4, COLS) and train.chunks == CHUNKS and train.chunk_files == 16
    assert (train.min_id, train.max_id) == (0, int(pattern(range(4), range(COLS)).max()))
    assert "train.zarr: [4, 65536] uint16, chunks [2, 8192], 16 chunk files" in train.summary()
    assert train.summary().endswith(": ok")
    austen = verify_store(AUSTEN_PATH, backend=backend)
    assert [r.shape for r in austen] == [(11, COLS), (1, COLS)]
    assert all(r.max_id < 50257 for r in austen)


@pytest.mark.parametrize("backend", BACKENDS)
def test_damage_is_found_and_named_by_file(store, backend):
    expected = damage(store)
    with pytest.raises(StoreError) as raised:
        verify_store(store, backend=backend)
    assert isinstance(raised.value, ValueError)
    train, heldout = raised.value.reports
    assert heldout.ok and len(train.problems) == 4, train.problems
    for key, what in expected.items():
        (problem,) = [p for p in train.problems if f"train.zarr{os.sep}{key}" in p]
        assert what in problem, problem
        assert key in str(raised.value)
    assert train.chunk_files == 15  # 1.3 is gone


def test_layout_problems(tmp_path):
    zarr.create_array(store=str(tmp_path / "train.zarr"), shape=(4, 1024), dtype="int32",
                      zarr_format=2, fill_value=0)
    write_store(tmp_path / "heldout.zarr", 2, cols=6000, chunks=(2, 1000))
    train, heldout = _reports(tmp_path, context_size=2048)
    assert "has dtype int32, need uint16" in train.problems[0]
    assert heldout.notes == ["6000 columns, not LongCrawl64's 65536"]
    assert "context_size 2048 does not divide its 6000 columns" in heldout.problems[0]
    missing = verify_split(tmp_path / "valid.zarr")
    assert "no zarr v2 array" in missing.problems[0] and missing.summary().endswith("unreadable")


def _reports(path, **kwargs):
    with pytest.raises(StoreError) as raised:
        verify_store(path, **kwargs)
    return raised.value.reports


@pytest.mark.parametrize("kwargs, match", [
    (dict(splits=["valid"]), "splits: need a non-empty subset"),
    (dict(splits=[]), "splits: need a non-empty subset"),
    (dict(vocab_size=0), "vocab_size: need a positive int, got 0"),
    (dict(backend="hdf5"), "backend: 'hdf5'"),
])
def test_bad_arguments(store, kwargs, match):
    with pytest.raises(ValueError, match=match):
        verify_store(store, **kwargs)
    with pytest.raises(ValueError, match="path: .* is not a directory"):
        verify_store(store / "nope")


def test_command_output_and_exit_status(store, capsys):
    assert main([str(store)]) == 0
    out = capsys.readouterr().out
    assert "train.zarr: [4, 65536]" in out and out.rstrip().splitlines()[-1].startswith("store ok")
    damage(store)
    assert main([str(store), "--split", "train", "--vocab_size", "50304"]) == 1
    out = capsys.readouterr().out
    assert out.count("PROBLEM") == 4 and "heldout.zarr" not in out
    assert "store has 4 problem(s)" in out
    # The module runs as a command (python -m), with the same exit status.
    proc = subprocess.run([sys.executable, "-m", "sympow.data.verify", str(store)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and f"{store / 'train.zarr' / '1.3'}: missing" in proc.stdout
