"""Tests for sympow.data: the LongCrawl64 loader, the R unserializer, the Austen store."""

import gc
import gzip
import hashlib
import json
import shutil
import struct
import threading
import time
import zlib

import numcodecs
import numpy as np
import pytest
import zarr

from sympow.data import AUSTEN_PATH, EOT, LongCrawl64, MissingChunkError, austen, gpt2_encoding

COLS = 65536
TRAIN_DOCS, HELDOUT_DOCS = 8, 3
BACKENDS = ["zarr", "tensorstore"]


def pattern(rows, cols):
    """The token the test stores hold at (doc, column): (doc * 7 + column) % 50000."""
    return (np.asarray(rows)[:, None] * 7 + np.asarray(cols)[None, :]) % 50000


def write_store(path, docs, cols=COLS, chunks=(2048, 2048), separator=".", dtype="uint16"):
    """A LongCrawl64-layout zarr v2 array holding ``pattern``."""
    array = zarr.create_array(
        store=str(path), shape=(docs, cols), chunks=chunks, dtype=dtype, fill_value=0,
        zarr_format=2, compressors=numcodecs.Blosc(cname="lz4", clevel=5, shuffle=1),
        chunk_key_encoding={"name": "v2", "separator": separator},
        config={"write_empty_chunks": True},
    )
    array[...] = pattern(range(docs), range(cols)).astype(dtype)


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """8 train and 3 held-out documents of 65536 tokens, the exact LongCrawl64 layout."""
    root = tmp_path_factory.mktemp("longcrawl64")
    write_store(root / "train.zarr", TRAIN_DOCS)
    write_store(root / "heldout.zarr", HELDOUT_DOCS)
    return root


@pytest.fixture(scope="module")
def small_chunks(tmp_path_factory):
    """10 documents with chunks (3, 1000) and '/' keys: rectangles straddle chunk edges."""
    root = tmp_path_factory.mktemp("small_chunks")
    write_store(root / "train.zarr", 10, chunks=(3, 1000), separator="/")
    return root


def make(path, split="train", dpb=2, ctx=4096, **kwargs):
    kwargs.setdefault("process_index", 0)
    kwargs.setdefault("process_count", 1)
    return LongCrawl64(path, split, dpb, ctx, **kwargs)


def expected(k, docs, dpb, ctx, index=0, count=1):
    """(inputs, labels) of batch k computed from the pattern, independently of the loader."""
    blocks = docs // dpb
    block, window = k % blocks, k // blocks
    local = dpb // count
    rows = range(block * dpb + index * local, block * dpb + (index + 1) * local)
    labels = pattern(rows, range(window * ctx, (window + 1) * ctx))
    inputs = np.concatenate([np.full((local, 1), EOT), labels[:, :-1]], axis=1)
    return inputs, labels


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("split, docs", [("train", TRAIN_DOCS), ("heldout", HELDOUT_DOCS)])
@pytest.mark.parametrize("dpb, ctx", [(2, 4096), (3, 65536), (1, 1024)])
def test_rectangles(store, backend, split, docs, dpb, ctx):
    ds = make(store, split, dpb, ctx, backend=backend)
    assert ds.backend == backend
    assert len(ds) == (docs // dpb) * (COLS // ctx)
    for k in sorted({0, 1, docs // dpb, len(ds) // 2 + 1, len(ds) - 1} & set(range(len(ds)))):
        inputs, labels = ds[k]
        assert inputs.dtype == labels.dtype == np.int32
        assert inputs.shape == labels.shape == (dpb, ctx)
        want_inputs, want_labels = expected(k, docs, dpb, ctx)
        np.testing.assert_array_equal(labels, want_labels)
        np.testing.assert_array_equal(inputs, want_inputs)
        assert (inputs[:, 0] == EOT).all()


def test_sweep_order_is_blocks_then_windows(store):
    ds = make(store, dpb=2, ctx=16384)  # 4 blocks x 4 windows
    firsts = [int(labels[0, 0]) for _, _, labels in ds.iterate()]
    # label[0, 0] = (first doc of block * 7 + first column of window) % 50000
    assert firsts == [(b * 2 * 7 + w * 16384) % 50000 for w in range(4) for b in range(4)]


def test_straddles_chunks(small_chunks):
    ds = make(small_chunks, dpb=5, ctx=2048)  # rows 0-4 / 5-9 cut row chunks of 3
    assert len(ds) == 2 * 32
    for k in (0, 1, 7, 63):
        np.testing.assert_array_equal(ds[k][1], expected(k, 10, 5, 2048)[1])


@pytest.mark.parametrize("count", [2, 4])
def test_process_shards_tile_the_rectangle(store, count):
    full = make(store, dpb=4, ctx=8192)
    for k in (0, 1, 5, len(full) - 1):
        shards = [make(store, dpb=4, ctx=8192, process_index=i, process_count=count)[k]
                  for i in range(count)]
        for part, whole in zip(zip(*shards, strict=True), full[k], strict=True):
            assert part[0].shape == (4 // count, 8192)
            np.testing.assert_array_equal(np.concatenate(part), whole)
        np.testing.assert_array_equal(shards[1][1], expected(k, TRAIN_DOCS, 4, 8192, 1, count)[1])


def test_default_process_is_jax(store):
    ds = LongCrawl64(store, "train", 2, 4096)
    assert (ds.process_index, ds.process_count) == (0, 1)


@pytest.mark.parametrize("prefetch", [0, 1, 3])
def test_resume_equals_indexing(store, prefetch):
    ds = make(store, dpb=2, ctx=16384, prefetch=prefetch)
    steps = list(ds.iterate(start=5))
    assert [k for k, _, _ in steps] == list(range(5, len(ds)))
    for k, inputs, labels in steps:
        np.testing.assert_array_equal(inputs, ds[k][0])
        np.testing.assert_array_equal(labels, ds[k][1])
    assert [k for k, _, _ in ds.iterate(start=3, stop=6)] == [3, 4, 5]
    assert list(ds.iterate(start=len(ds))) == []


def _prefetch_threads():
    return [t for t in threading.enumerate() if t.name == "LongCrawl64-prefetch"]


def _wait_no_threads(timeout=5.0):
    deadline = time.monotonic() + timeout
    while _prefetch_threads() and time.monotonic() < deadline:
        time.sleep(0.01)
    return not _prefetch_threads()


def test_prefetch_matches_sync(store):
    sync = make(store, dpb=2, ctx=16384, prefetch=0)
    ahead = make(store, dpb=2, ctx=16384, prefetch=2)
    for (k0, x0, y0), (k1, x1, y1) in zip(sync.iterate(), ahead.iterate(), strict=True):
        assert k0 == k1
        np.testing.assert_array_equal(x0, x1)
        np.testing.assert_array_equal(y0, y1)
    assert _wait_no_threads()


def test_prefetch_propagates_errors(store):
    ds = make(store, dpb=2, ctx=16384, prefetch=2)
    read = ds._array.read

    def failing(rows, cols):
        if cols.start == 16384:  # window 1: batches 4..7
            raise OSError("disk on fire")
        return read(rows, cols)

    ds._array.read = failing
    seen = []
    with pytest.raises(OSError, match="disk on fire"):
        for k, _, _ in ds.iterate():
            seen.append(k)
    assert seen == [0, 1, 2, 3]
    assert _wait_no_threads()


def test_prefetch_early_exit_and_gc(store):
    ds = make(store, dpb=1, ctx=2048, prefetch=2)
    gen = ds.iterate()
    next(gen)
    gen.close()
    assert _wait_no_threads()
    gen = ds.iterate(start=3)
    assert next(gen)[0] == 3
    del gen
    gc.collect()
    assert _wait_no_threads()
    for k, _, _ in ds.iterate():
        if k == 2:
            break
    gc.collect()
    assert _wait_no_threads()


def test_index_errors(store):
    ds = make(store)
    for k in (-1, len(ds), len(ds) + 5):
        with pytest.raises(IndexError, match="out of range"):
            ds[k]
    with pytest.raises(IndexError, match="start"):
        ds.iterate(start=len(ds) + 1)
    with pytest.raises(IndexError, match="stop"):
        ds.iterate(start=2, stop=1)


@pytest.mark.parametrize("root_fixture, key, k", [
    ("store", "0.3", 3 * 4),  # dpb 2, ctx 2048: window 3 starts at batch 3 * 4 blocks
    ("small_chunks", "1/2", None),
])
@pytest.mark.parametrize("backend", BACKENDS)
def test_missing_chunk_raises(request, tmp_path, root_fixture, key, k, backend):
    root = tmp_path / "copy"
    shutil.copytree(request.getfixturevalue(root_fixture), root)
    (root / "train.zarr" / key).unlink()
    ds = make(root, dpb=2, ctx=2048, backend=backend)
    if k is None:  # chunk (1, 2): rows 3-5, columns 2000-2999 -> block 1 or 2, window 0 or 1
        k = 1 * ds.num_blocks + 1
    ds[0]  # untouched rectangles still read
    with pytest.raises(MissingChunkError, match=f"{key}'] in .*train.zarr"):
        ds[k]
    with pytest.raises(MissingChunkError, match=key):
        list(make(root, dpb=2, ctx=2048, prefetch=2).iterate())
    with pytest.raises(MissingChunkError, match=f"missing 1 chunk file.*{key}"):
        ds.check_store()


def test_check_store_counts_chunks(store, small_chunks):
    assert make(store).check_store() == 32
    assert make(small_chunks).check_store() == 4 * 66


def test_invalid_arguments(store, tmp_path):
    cases = [
        (dict(split="valid"), "split"),
        (dict(dpb=0), "docs_per_batch: need a positive int"),
        (dict(dpb=9), r"docs_per_batch: 9 > 8 .*\[8, 65536\]"),
        (dict(ctx=3000), r"context_size: 3000 .*65536"),
        (dict(ctx=2 * COLS), "context_size"),
        (dict(dpb=3, process_count=2), "divisible by process_count 2"),
        (dict(process_index=2, process_count=2), "process_index"),
        (dict(prefetch=-1), "prefetch"),
        (dict(backend="hdf5"), "backend"),
    ]
    for kwargs, match in cases:
        with pytest.raises(ValueError, match=match):
            make(store, **kwargs)
    with pytest.raises(ValueError, match="path: .* is not a directory"):
        make(tmp_path / "nope")
    with pytest.raises(ValueError, match="path: no zarr v2 array"):
        make(tmp_path)


@pytest.mark.parametrize("shape, dtype, match", [
    ((2, 8, 8), "uint16", "need 2-D"),
    ((4, 1024), "int32", "need uint16"),
])
def test_bad_store_layout(tmp_path, shape, dtype, match):
    zarr.create_array(store=str(tmp_path / "train.zarr"), shape=shape, dtype=dtype,
                      zarr_format=2, fill_value=0)
    with pytest.raises(ValueError, match=match):
        make(tmp_path, dpb=1, ctx=512)


def test_smaller_store_columns(tmp_path):
    write_store(tmp_path / "train.zarr", 4, cols=4096, chunks=(2, 1024))
    ds = make(tmp_path, dpb=2, ctx=1024)
    assert len(ds) == 2 * 4
    np.testing.assert_array_equal(ds[5][1], pattern(range(2, 4), range(2048, 3072)))


# ---- the R unserializer, on hand-built bytes ----------------------------------------------


def _r_int(*values):
    return b"".join(struct.pack(">i", v) for v in values)


def _r_char(text, flags=0x00040009):  # CHARSXP, UTF-8 flag
    if text is None:
        return _r_int(0x00000009, -1)
    raw = text.encode()
    return _r_int(flags, len(raw)) + raw


def _r_names(names, first=True):
    """Attribute pairlist (tag = symbol "names", value = STRSXP, then NULL); later uses of the
    symbol are back-references (REFSXP 255 with index 1 packed in the flags)."""
    symbol = _r_int(1) + _r_char("names") if first else _r_int(0x1FF)
    return _r_int(0x402) + symbol + _r_strsxp(names) + _r_int(254)


def _r_strsxp(values, names=None):
    flags = 0x10 | (0x200 if names else 0)
    out = _r_int(flags, len(values)) + b"".join(_r_char(v) for v in values)
    return out + (_r_names(names) if names else b"")


@pytest.mark.parametrize("version", [2, 3])
def test_unserialize_strings(version):
    header = b"X\n" + _r_int(version, 0x40201, 0x30500)
    if version == 3:
        header += _r_int(5) + b"UTF-8"
    obj = austen.unserialize(header + _r_strsxp(["a", None, "é"], names=["x", "y", "z"]))
    assert obj.kind == "character"
    assert obj.values == ["a", None, "é"]
    assert obj.attributes["names"].values == ["x", "y", "z"]


def test_rdb_index_and_block():
    """An .rdx index (list: variables, references, compressed) and one zlib .rdb block."""
    header = b"X\n" + _r_int(2, 0, 0)
    payload = header + _r_strsxp(["line one", "", "line three"])
    block = struct.pack(">I", len(payload)) + zlib.compress(payload)
    variables = _r_int(0x213, 1) + _r_int(13, 2, 0, len(block)) + _r_names(["novel"])
    index = (header + _r_int(0x213, 3) + variables + _r_int(19, 0) + _r_int(10, 1, 1)
             + _r_names(["variables", "references", "compressed"], first=False))
    offsets = austen.read_rdb_index(gzip.compress(index))
    assert offsets == {"novel": (0, len(block))}
    lines = austen.read_rdb_block(block, *offsets["novel"])
    assert lines.values == ["line one", "", "line three"]


def test_unserialize_errors():
    header = b"X\n" + _r_int(2, 0, 0)
    with pytest.raises(austen.RFormatError, match="XDR"):
        austen.unserialize(b"A\n" + _r_int(2, 0, 0))
    with pytest.raises(austen.RFormatError, match="version 4"):
        austen.unserialize(b"X\n" + _r_int(4, 0, 0))
    with pytest.raises(austen.RFormatError, match="SEXP type 14"):  # REALSXP
        austen.unserialize(header + _r_int(14, 1) + b"\0" * 8)
    with pytest.raises(austen.RFormatError, match="trailing"):
        austen.unserialize(header + _r_strsxp(["a"]) + b"\0")
    with pytest.raises(austen.RFormatError, match="truncated"):
        austen.unserialize(header + _r_int(16, 2) + _r_char("a"))


def test_novel_documents_drop_the_tail():
    docs = austen.novel_documents(list(range(10)), doc_len=4)
    np.testing.assert_array_equal(docs, [[0, 1, 2, 3], [4, 5, 6, 7]])
    assert docs.dtype == np.uint16


# ---- the committed Austen store and the offline tokenizer -----------------------------------


def test_gpt2_encoding_offline():
    enc = gpt2_encoding()
    assert enc.encode("Hello world") == [15496, 995]
    assert enc.encode("<|endoftext|>", allowed_special="all") == [EOT]
    assert enc.n_vocab == 50257
    text = "It is a truth universally acknowledged, that a single man..."
    assert enc.decode(enc.encode(text)) == text


AUSTEN = {  # split: (docs, start of the first row's text, sha256 of the uint16 array)
    "train": (11, "EMMA\n\nBy Jane Austen\n\n\n\n\nVOLUME I\n\n\n\nCHAPTER I\n\n\nEmma Woodhouse",
              "9ab02a9f389f9986a56c3cfa9d3fd96ccc94c727ade6408ff8fc9e7939079514"),
    "heldout": (1, "Persuasion\n\n\nby\n\nJane Austen\n\n(1818)\n\n\n\n\nChapter 1",
                "e952d5031f1804a372e6bec5bae5885055adc280254dc1627f115d1f73e27ecd"),
}


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
