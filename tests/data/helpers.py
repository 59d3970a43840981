"""Shared by the data tests (and the trainer's data-error tests): small zarr v2 stores in the
exact LongCrawl64 layout, holding a known pattern of tokens."""

from __future__ import annotations

import numcodecs
import numpy as np
import zarr

COLS = 65536


def pattern(rows, cols):
    """The token the test stores hold at (doc, column): (doc * 7 + column) % 50000."""
    return (np.asarray(rows)[:, None] * 7 + np.asarray(cols)[None, :]) % 50000


def write_store(path, docs, cols=COLS, chunks=(2048, 2048), separator=".", dtype="uint16",
                tokens=None):
    """A LongCrawl64-layout zarr v2 array holding ``tokens`` (default: ``pattern``)."""
    array = zarr.create_array(
        store=str(path), shape=(docs, cols), chunks=chunks, dtype=dtype, fill_value=0,
        zarr_format=2, compressors=numcodecs.Blosc(cname="lz4", clevel=5, shuffle=1),
        chunk_key_encoding={"name": "v2", "separator": separator},
        config={"write_empty_chunks": True},
    )
    array[...] = (pattern(range(docs), range(cols)) if tokens is None else tokens).astype(dtype)
