"""scripts/subset_store.py: the first rows of a store as a new store in the same layout (a small
random store of 4 + 2 documents)."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from scripts import subset_store
from scripts.build_austen_store import write_store
from sympow.data import LongCrawl64
from sympow.data.longcrawl64 import _ZarrArray
from sympow.data.verify import verify_store


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """A store of random GPT-2 ids: 4 train and 2 held-out documents, with attributes."""
    root = tmp_path_factory.mktemp("src")
    rng = np.random.default_rng(0)
    for split, n in (("train", 4), ("heldout", 2)):
        docs = rng.integers(0, 50257, size=(n, 65536), dtype=np.uint16)
        attributes = {"source": "random", "tokenizer": "gpt2", "eot": 50256,
                      "rows": [[split, i] for i in range(n)]}
        write_store(root / f"{split}.zarr", docs, attributes)
    return root


def _read(path, split):
    array = _ZarrArray(path / f"{split}.zarr", "auto")
    return array.read(range(array.shape[0]), range(array.shape[1]))


def test_subset_is_the_first_rows_in_the_same_layout(source, tmp_path):
    out = tmp_path / "small"
    summary = subset_store.subset(source, out, 2, 1, batch=1)  # batch 1: reads row by row
    assert (summary["train"]["docs"], summary["heldout"]["docs"]) == (2, 1)
    assert summary["train"]["tokens"] == 2 * 65536
    assert summary["total_bytes"] == summary["train"]["bytes"] + summary["heldout"]["bytes"] > 0
    for split, n in (("train", 2), ("heldout", 1)):
        np.testing.assert_array_equal(_read(out, split), _read(source, split)[:n])
        meta = json.loads((out / f"{split}.zarr" / ".zarray").read_text())
        src_meta = json.loads((source / f"{split}.zarr" / ".zarray").read_text())
        assert meta["shape"] == [n, 65536]
        for key in ("chunks", "dtype", "fill_value", "compressor", "zarr_format", "order"):
            assert meta[key] == src_meta[key], key
        attrs = json.loads((out / f"{split}.zarr" / ".zattrs").read_text())
        assert attrs == {"source": "random", "tokenizer": "gpt2", "eot": 50256,
                         "rows": [[split, i] for i in range(n)],
                         "subset_of": str(source.resolve()), "train_docs": 2,
                         "heldout_docs": 1}
    reports = verify_store(out)
    assert [r.shape for r in reports] == [(2, 65536), (1, 65536)]
    train = LongCrawl64(out, "train", 2, 65536, prefetch=0, vocab_size=50257)
    np.testing.assert_array_equal(train[0][1], _read(source, "train")[:2].astype(np.int32))


def test_cli_prints_the_summary(source, tmp_path, capsys):
    subset_store.main(["--src", str(source), "--out", str(tmp_path / "o"),
                       "--train_docs", "4", "--heldout_docs", "2"])
    summary = json.loads(capsys.readouterr().out)
    assert (summary["train"]["docs"], summary["heldout"]["docs"]) == (4, 2)
    np.testing.assert_array_equal(_read(tmp_path / "o", "train"), _read(source, "train"))


def test_errors_name_the_argument(source, tmp_path):
    out = tmp_path / "out"
    with pytest.raises(ValueError, match=r"train_docs: need 1 to 4 .* got 5"):
        subset_store.subset(source, out, 5, 1)
    with pytest.raises(ValueError, match=r"heldout_docs: need 1 to 2 .* got 0"):
        subset_store.subset(source, out, 1, 0)
    with pytest.raises(ValueError, match=r"train_docs: need 1 to 4 .* got 0"):
        subset_store.subset(source, out, 0, 1)
    with pytest.raises(ValueError, match=r"out: .* is the source store"):
        subset_store.subset(source, source, 1, 1)
    partial = tmp_path / "partial"
    shutil.copytree(source / "train.zarr", partial / "train.zarr")
    with pytest.raises(ValueError, match=r"src: .* is not a store \(no zarr v2 array heldout"):
        subset_store.subset(partial, out, 1, 1)
    with pytest.raises(ValueError, match=r"src: .* is not a store"):
        subset_store.subset(tmp_path / "missing", out, 1, 1)
    assert not out.exists()  # nothing written before the arguments are checked
