"""LongCrawl64 loader: rectangles of a [docs, 65536] uint16 zarr v2 token store.

Store layout (LongCrawl64 and ``data/austen`` alike): ``<path>/train.zarr`` and
``<path>/heldout.zarr``, each a zarr v2 array [docs, 65536] of uint16 GPT-2 token ids, chunks
(2048, 2048), Blosc lz4, fill 0, in a local directory store. LongCrawl64 has 6,609,334 train
and 52,131 held-out documents.

Batches are rectangles of ``docs_per_batch`` (B) documents by ``context_size`` (T) tokens. With
``n_blocks = docs // B``, batch k reads document block ``k % n_blocks`` (rows
``[b*B, (b+1)*B)``) at context window ``w = k // n_blocks`` (columns ``[w*T, (w+1)*T)``), so an
epoch sweeps every document at window 0, then window 1, ... The last ``docs % B`` documents
are never read. Stores whose column count is not 65536 are accepted as long as T divides it
(``len`` uses the actual column count); both shipped stores have exactly 65536 columns.

Each host (JAX process i of P) reads only rows ``[i*B/P, (i+1)*B/P)`` of every rectangle; the
global batch is the concatenation of the host shards in process order (e.g. via
``jax.make_array_from_process_local_data``).

Zarr silently returns fill zeros for a missing chunk file. The loader therefore checks that
every chunk file a rectangle touches exists before reading it and raises ``MissingChunkError``
otherwise; ``check_store`` checks the whole array up front. Given ``vocab_size``, every batch
is checked to hold only token ids below it (``TokenRangeError`` names the id, the file and
the position; a model would otherwise index past its embedding and train into NaN).

The format has no checksum: Blosc lz4 chunks carry no hash of their contents, so a flipped
byte either breaks decompression (an error when read) or decodes to different but valid
tokens, which nothing can detect. ``python -m sympow.data.verify PATH`` reads a whole store
once before a long run: every chunk present and decodable, every id below the vocabulary,
the layout above (``sympow.data.verify``).
"""

from __future__ import annotations

import importlib.util
import json
import os
import queue
import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np
from jaxtyping import Int32

EOT = 50256  # GPT-2 <|endoftext|>, the first input token of every window
SPLITS = ("train", "heldout")
BACKENDS = ("auto", "tensorstore", "zarr")
_CACHE_BYTES = 1 << 30  # tensorstore's decoded-chunk cache (64 chunks of 2048 x 2048 uint16)

Batch = tuple[Int32[np.ndarray, "B T"], Int32[np.ndarray, "B T"]]  # (inputs, labels)
Step = tuple[int, Int32[np.ndarray, "B T"], Int32[np.ndarray, "B T"]]  # (k, inputs, labels)


class MissingChunkError(FileNotFoundError):
    """A chunk file the loader needs is absent (zarr would have read it as zeros)."""


class TokenRangeError(ValueError):
    """A store holds a token id >= the model's vocabulary size."""


def token_range_error(block: np.ndarray, vocab_size: int, path: Path, rows: range,
                      cols: range) -> TokenRangeError | None:
    """The error for the first id >= vocab_size in ``block`` (uint16 [rows, cols] of the array
    at ``path``), or None if every id is below it."""
    if block.size == 0 or int(block.max()) < vocab_size:
        return None
    r, c = np.unravel_index(int(np.argmax(block >= vocab_size)), block.shape)
    count = int(np.count_nonzero(block >= vocab_size))
    return TokenRangeError(
        f"token id {int(block[r, c])} at document {rows.start + r}, column {cols.start + c} "
        f"of {path} is >= vocab_size {vocab_size} ({count} such ids in documents "
        f"[{rows.start}, {rows.stop}) x columns [{cols.start}, {cols.stop})): a corrupt chunk, "
        "or a store of another tokenizer (check data.path and model.vocab_size)")


def _chunk_keys(rows: range, cols: range, chunks: tuple[int, int], sep: str) -> list[str]:
    """Zarr v2 keys ("r.c" or "r/c") of every chunk touched by rows x cols (non-empty ranges)."""
    row_chunks = range(rows.start // chunks[0], (rows.stop - 1) // chunks[0] + 1)
    col_chunks = range(cols.start // chunks[1], (cols.stop - 1) // chunks[1] + 1)
    return [f"{r}{sep}{c}" for r in row_chunks for c in col_chunks]


class _ZarrArray:
    """Read-only zarr v2 array [docs, columns] with chunk-existence checks on every read."""

    def __init__(self, path: Path, backend: str):
        self.path = path
        meta = self._metadata(path)
        self.shape = tuple(meta["shape"])
        self.chunks = tuple(meta["chunks"])
        self.separator = meta.get("dimension_separator") or "."
        self._seen: set[str] = set()  # chunk keys already known to exist
        self._lock = threading.Lock()
        self.backend = _resolve_backend(backend)
        self._array = _open(path, self.backend)

    @staticmethod
    def _metadata(path: Path) -> dict:
        zarray = path / ".zarray"
        if not zarray.is_file():
            raise ValueError(f"path: no zarr v2 array at {path} (missing {zarray.name})")
        meta = json.loads(zarray.read_text())
        if meta.get("zarr_format") != 2:
            raise ValueError(f"path: {path} is zarr_format {meta.get('zarr_format')}, need 2")
        if len(meta["shape"]) != 2:
            raise ValueError(f"path: {path} has shape {meta['shape']}, need 2-D [docs, tokens]")
        dtype = np.dtype(meta["dtype"])
        if dtype.kind != "u" or dtype.itemsize != 2:
            raise ValueError(f"path: {path} has dtype {dtype}, need uint16")
        return meta

    def check_chunks(self, rows: range, cols: range, *, recheck: bool = False) -> int:
        """Raises MissingChunkError naming every absent chunk file under rows x cols.

        Chunks already found are cached unless ``recheck``. Returns the number checked.
        """
        keys = [k for k in _chunk_keys(rows, cols, self.chunks, self.separator)
                if recheck or k not in self._seen]
        if len(keys) > 64 and self.separator == ".":  # one listing beats many stat calls
            present = set(os.listdir(self.path))
            missing = [k for k in keys if k not in present]
        else:
            missing = [k for k in keys if not (self.path / k).is_file()]
        if missing:
            more = f" and {len(missing) - 20} more" if len(missing) > 20 else ""
            raise MissingChunkError(
                f"missing {len(missing)} chunk file(s) {missing[:20]}{more} in {self.path} "
                f"(rows [{rows.start}, {rows.stop}), columns [{cols.start}, {cols.stop})); "
                "zarr would read them as zeros")
        with self._lock:
            self._seen.update(keys)
        return len(keys)

    def read(self, rows: range, cols: range) -> np.ndarray:
        """Returns the uint16 block [len(rows), len(cols)] after checking its chunk files."""
        self.check_chunks(rows, cols)
        index = (slice(rows.start, rows.stop), slice(cols.start, cols.stop))
        if self.backend == "tensorstore":
            return np.asarray(self._array[index].read().result())
        return np.asarray(self._array[index])


def _resolve_backend(backend: str) -> str:
    if backend not in BACKENDS:
        raise ValueError(f"backend: {backend!r} not in {BACKENDS}")
    installed = [b for b in BACKENDS[1:] if importlib.util.find_spec(b) is not None]
    if backend == "auto":
        if not installed:
            raise ImportError("LongCrawl64 needs tensorstore or zarr>=3 (pip install sympow[data])")
        return installed[0]
    if backend not in installed:
        raise ImportError(f"backend={backend!r} requested but {backend} is not installed")
    return backend


def _open(path: Path, backend: str):
    if backend == "tensorstore":
        import tensorstore as ts

        # Consecutive batches read the same (2048, 2048) chunks (one row chunk holds 2048 / B
        # document blocks), so keep decoded chunks in a bounded cache.
        spec = {"driver": "zarr", "kvstore": {"driver": "file", "path": str(path)},
                "context": {"cache_pool": {"total_bytes_limit": _CACHE_BYTES}}}
        return ts.open(spec, read=True, write=False).result()
    import zarr

    return zarr.open_array(str(path), mode="r", zarr_format=2)


class LongCrawl64:
    """Rectangle batches of a LongCrawl64-layout store, sharded by JAX process.

    Args:
      path: folder holding ``train.zarr`` and ``heldout.zarr``.
      split: ``'train'`` or ``'heldout'``.
      docs_per_batch: B, documents per (global) batch; divisible by ``process_count``.
      context_size: T, tokens per window; divides the store's column count (65536).
      process_index, process_count: this host's shard; default ``jax.process_index()`` and
        ``jax.process_count()``.
      prefetch: batches ``iterate`` reads ahead in a background thread (0: no thread).
      backend: ``'tensorstore'``, ``'zarr'`` or ``'auto'`` (the first of these installed).
      vocab_size: if given, every batch must hold ids below it (``TokenRangeError``); it must
        exceed ``eot``, the first input of every window.
      eot: the id that begins every window's inputs: GPT-2's end-of-text ``EOT`` (50256) by
        default; a store of another vocabulary names its own (the byte-level corpus: 256).

    ``ds[k]`` returns ``(inputs, labels)``, both int32 [B / process_count, T] (int32 rather
    than uint32 so they feed embedding lookups and losses directly; ids are < 2**16):
    labels are the window's tokens, inputs the window shifted right by one with ``eot`` in
    column 0.
    """

    def __init__(self, path: str | os.PathLike, split: str, docs_per_batch: int,
                 context_size: int, *, process_index: int | None = None,
                 process_count: int | None = None, prefetch: int = 2, backend: str = "auto",
                 vocab_size: int | None = None, eot: int = EOT):
        if split not in SPLITS:
            raise ValueError(f"split: {split!r} not in {SPLITS}")
        _check_positive(docs_per_batch=docs_per_batch, context_size=context_size)
        if not isinstance(eot, (int, np.integer)) or isinstance(eot, bool) or not 0 <= eot < 2**16:
            raise ValueError(f"eot: need an int id in [0, 65536), got {eot!r}")
        if vocab_size is not None:
            _check_positive(vocab_size=vocab_size)
            if vocab_size <= eot:
                raise ValueError(f"vocab_size: {vocab_size} <= {eot}, the end-of-text token "
                                 "that begins every window's inputs")
        if not isinstance(prefetch, int) or prefetch < 0:
            raise ValueError(f"prefetch: need an int >= 0, got {prefetch!r}")
        self.process_index, self.process_count = _process(process_index, process_count)
        if docs_per_batch % self.process_count:
            raise ValueError(f"docs_per_batch: {docs_per_batch} is not divisible by "
                             f"process_count {self.process_count}")
        if not Path(path).is_dir():
            raise ValueError(f"path: {path} is not a directory")
        self.path, self.split = Path(path), split
        self.docs_per_batch, self.context_size, self.prefetch = (
            docs_per_batch, context_size, prefetch)
        self.vocab_size, self.eot = vocab_size, int(eot)
        self._array = _ZarrArray(self.path / f"{split}.zarr", backend)
        docs, columns = self._array.shape
        if context_size > columns or columns % context_size:
            raise ValueError(f"context_size: {context_size} does not divide the store's "
                             f"{columns} columns (shape {list(self._array.shape)})")
        if docs_per_batch > docs:
            raise ValueError(f"docs_per_batch: {docs_per_batch} > {docs} documents in "
                             f"{split} (shape {list(self._array.shape)})")
        self.num_blocks = docs // docs_per_batch
        self.num_windows = columns // context_size
        self.local_docs = docs_per_batch // self.process_count

    @property
    def shape(self) -> tuple[int, int]:
        """Shape [docs, columns] of the underlying store."""
        return self._array.shape

    @property
    def backend(self) -> str:
        return self._array.backend

    def __len__(self) -> int:
        return self.num_blocks * self.num_windows

    def rectangle(self, k: int) -> tuple[range, range]:
        """This host's rows and the window's columns for batch k."""
        if not isinstance(k, (int, np.integer)) or not 0 <= k < len(self):
            raise IndexError(f"batch index {k} out of range [0, {len(self)})")
        block, window = int(k) % self.num_blocks, int(k) // self.num_blocks
        row0 = block * self.docs_per_batch + self.process_index * self.local_docs
        col0 = window * self.context_size
        return range(row0, row0 + self.local_docs), range(col0, col0 + self.context_size)

    def __getitem__(self, k: int) -> Batch:
        """Batch k as ``(inputs, labels)``, int32 [B / process_count, T] each."""
        rows, cols = self.rectangle(k)
        block = self._array.read(rows, cols)  # uint16 [B, T]
        if self.vocab_size is not None and (
                error := token_range_error(block, self.vocab_size, self._array.path, rows, cols)):
            raise error
        labels = block.astype(np.int32)  # [B, T]
        inputs = np.empty_like(labels)  # [B, T]
        inputs[:, 0] = self.eot
        inputs[:, 1:] = labels[:, :-1]
        return inputs, labels

    def iterate(self, start: int = 0, stop: int | None = None) -> Iterator[Step]:
        """Yields ``(k, inputs, labels)`` for k in [start, stop), equal to ``(k, *self[k])``.

        Resume from step k with ``iterate(start=k)``. With ``prefetch > 0`` a background thread
        reads up to ``prefetch`` batches ahead; its exceptions are re-raised here, and closing
        or dropping the generator stops the thread.
        """
        stop = len(self) if stop is None else stop
        if not 0 <= start <= stop <= len(self):  # raised here, not at the first next()
            raise IndexError(f"iterate: need 0 <= start {start} <= stop {stop} <= {len(self)}")
        steps = range(start, stop)
        if self.prefetch == 0:
            return ((k, *self[k]) for k in steps)
        return _prefetched(self, steps, self.prefetch)

    def __iter__(self) -> Iterator[Step]:
        return self.iterate()

    def check_store(self) -> int:
        """Checks that every chunk file of the split exists; returns the number of chunks."""
        docs, columns = self._array.shape
        return self._array.check_chunks(range(docs), range(columns), recheck=True)

    def __repr__(self) -> str:
        return (f"LongCrawl64({str(self.path)!r}, {self.split!r}, docs_per_batch="
                f"{self.docs_per_batch}, context_size={self.context_size}, process="
                f"{self.process_index}/{self.process_count}, shape={list(self.shape)}, "
                f"backend={self.backend!r})")


def _check_positive(**values: int) -> None:
    for name, value in values.items():
        if not isinstance(value, (int, np.integer)) or value <= 0:
            raise ValueError(f"{name}: need a positive int, got {value!r}")


def _process(index: int | None, count: int | None) -> tuple[int, int]:
    """This host's (process_index, process_count), defaulting to JAX's."""
    if index is None or count is None:
        import jax

        index = jax.process_index() if index is None else index
        count = jax.process_count() if count is None else count
    _check_positive(process_count=count)
    if not 0 <= index < count:
        raise ValueError(f"process_index: {index} not in [0, process_count={count})")
    return int(index), int(count)


_DONE = object()


def _prefetched(ds: LongCrawl64, steps: range, depth: int) -> Iterator[Step]:
    """Runs ``ds[k]`` for k in steps on a daemon thread, ``depth`` batches ahead."""
    buffer: queue.Queue = queue.Queue(maxsize=depth)
    stopping = threading.Event()

    def put(item) -> bool:  # False once the consumer has gone away
        while not stopping.is_set():
            try:
                buffer.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def produce() -> None:
        try:
            for k in steps:
                if not put((k, *ds[k])):
                    return
            put(_DONE)
        except BaseException as error:  # handed to the consumer, re-raised there
            put(error)

    thread = threading.Thread(target=produce, name="LongCrawl64-prefetch", daemon=True)
    thread.start()
    try:
        while (item := buffer.get()) is not _DONE:
            if isinstance(item, BaseException):
                raise item
            yield item
    finally:
        stopping.set()
        thread.join(timeout=5.0)
