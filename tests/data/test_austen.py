"""sympow.data.austen: the committed Austen store, read through the loader and the tokenizer.

Its contents are pinned by the sha256 digests of the uint16 arrays given in
data/austen/README.md.
"""

import hashlib
import json
from pathlib import Path

import pytest
import zarr

from sympow.data import AUSTEN_PATH, EOT, LongCrawl64, gpt2_encoding

COLS = 65536
AUSTEN = {  # split: (docs, start of the first row's text, sha256 of the uint16 array)
    "train": (11, "EMMA\n\nBy Jane Austen\n\n\n\n\nVOLUME I\n\n\n\nCHAPTER I\n\n\nEmma Woodhouse",
              "9ab02a9f389f9986a56c3cfa9d3fd96ccc94c727ade6408ff8fc9e7939079514"),
    "heldout": (1, "Persuasion\n\n\nby\n\nJane Austen\n\n(1818)\n\n\n\n\nChapter 1",
                "e952d5031f1804a372e6bec5bae5885055adc280254dc1627f115d1f73e27ecd"),
}


def test_store_is_the_checkouts_data_folder():
    assert AUSTEN_PATH == Path(__file__).resolve().parents[2] / "data" / "austen"


@pytest.mark.parametrize("split", AUSTEN)
def test_austen_store(split):
    docs, start, digest = AUSTEN[split]
    meta = json.loads((AUSTEN_PATH / f"{split}.zarr" / ".zarray").read_text())
    assert meta["zarr_format"] == 2 and meta["dtype"] == "<u2" and meta["fill_value"] == 0
    assert meta["shape"] == [docs, COLS] and meta["chunks"] == [2048, 2048]
    assert {k: meta["compressor"][k] for k in ("id", "cname", "clevel", "shuffle")} == {
        "id": "blosc", "cname": "lz4", "clevel": 5, "shuffle": 1}
    ds = LongCrawl64(AUSTEN_PATH, split, 1, 1024, process_index=0, process_count=1)
    assert ds.shape == (docs, COLS) and ds.check_store() == 32
    inputs, labels = ds[0]
    assert inputs[0, 0] == EOT
    assert gpt2_encoding().decode(labels[0].tolist()).startswith(start)
    assert labels.max() < EOT and (labels > 0).mean() > 0.99  # real tokens, no fill zeros
    array = zarr.open_array(str(AUSTEN_PATH / f"{split}.zarr"), mode="r")[...]
    assert hashlib.sha256(array.tobytes()).hexdigest() == digest  # as in data/austen/README.md
