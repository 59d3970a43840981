"""sympow.data.longcrawl64: rectangles, sweep order, process shards, prefetch, missing chunks,
invalid arguments; on small stores in the exact LongCrawl64 layout written here."""

import gc
import shutil
import threading
import time

import numpy as np
import pytest
import zarr

from sympow.data import EOT, LongCrawl64, MissingChunkError, TokenRangeError
from tests.data.helpers import COLS, pattern, write_store

TRAIN_DOCS, HELDOUT_DOCS = 8, 3
BACKENDS = ["zarr", "tensorstore"]


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


@pytest.mark.parametrize("prefetch", [0, 2])
def test_ids_beyond_the_vocabulary_raise(tmp_path, prefetch):
    tokens = pattern(range(4), range(COLS))  # all < 50000
    tokens[3, 5000] = 60000
    write_store(tmp_path / "train.zarr", 4, tokens=tokens)
    ds = make(tmp_path, dpb=2, ctx=4096, vocab_size=50304, prefetch=prefetch)
    np.testing.assert_array_equal(ds[0][1], tokens[:2, :4096])  # clean batches still read
    with pytest.raises(TokenRangeError, match=r"token id 60000 at document 3, column 5000 of "
                       r".*train.zarr is >= vocab_size 50304 \(1 such ids"):
        list(ds.iterate())  # batch 3 = rows 2-3 x columns 4096-8191
    assert issubclass(TokenRangeError, ValueError)
    assert make(tmp_path, dpb=2, ctx=4096)[3][1].max() == 60000  # no vocab_size: no check


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
        (dict(vocab_size=0), "vocab_size: need a positive int"),
        (dict(vocab_size=256), "vocab_size: 256 <= 50256, the end-of-text token"),
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


def test_eot_begins_the_inputs_and_bounds_the_vocabulary(store):
    """A store of another vocabulary names its end-of-text id (the byte corpus: 256)."""
    inputs, labels = make(store, dpb=2, ctx=4096, eot=256)[0]
    assert (inputs[:, 0] == 256).all() and (inputs[:, 1:] == labels[:, :-1]).all()
    assert (make(store, dpb=2, ctx=4096)[0][0][:, 0] == EOT).all()  # GPT-2's by default
    with pytest.raises(ValueError, match=r"vocab_size: 256 <= 256, the end-of-text token"):
        make(store, eot=256, vocab_size=256)
    for bad in (-1, 65536, 2.0, True):
        with pytest.raises(ValueError, match=r"eot: need an int id in \[0, 65536\)"):
            make(store, eot=bad)


def test_the_embedded_byte_corpus():
    """data/austen_bytes: the same novels as UTF-8 bytes (ids < 256), end-of-text 256."""
    from sympow.data import AUSTEN_BYTES_EOT, AUSTEN_BYTES_PATH, AUSTEN_BYTES_VOCAB

    ds = LongCrawl64(AUSTEN_BYTES_PATH, "heldout", 1, 2048, eot=AUSTEN_BYTES_EOT,
                     vocab_size=AUSTEN_BYTES_VOCAB, prefetch=0)
    inputs, labels = ds[0]
    assert labels.max() < 256 and inputs[0, 0] == AUSTEN_BYTES_EOT
    text = bytes(labels[0].astype(np.uint8)).decode("utf-8", errors="replace")
    assert "Sir Walter Elliot" in text  # Persuasion opens with him
    assert LongCrawl64(AUSTEN_BYTES_PATH, "train", 1, 65536, prefetch=0).shape[0] > 40
