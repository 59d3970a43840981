"""Device mesh and batches: the deterministic loader as global arrays sharded over 'data'.

Training batch k of a run is loader index ``k mod len(loader)`` (epochs wrap around), so the
data position is the step count alone and a resumed run reads exactly the batches the
uninterrupted run would have read. Each JAX process reads only its rows
(``LongCrawl64`` shards by ``jax.process_index()``); the rows are assembled into one global
array with ``jax.make_array_from_process_local_data``.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from sympow.data import AUSTEN_PATH, EOT, LongCrawl64

DATA_AXIS = "data"


def make_mesh(devices=None) -> Mesh:
    """1-D mesh over all devices (of all processes), axis 'data'."""
    devices = jax.devices() if devices is None else devices
    return Mesh(np.asarray(devices), (DATA_AXIS,))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())


def batch_sharded(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec(DATA_AXIS))


def open_loader(data, split: str, docs_per_batch: int, context_size: int, *,
                vocab_size: int | None = None, sharded: bool = True) -> LongCrawl64:
    """A ``LongCrawl64`` on ``data.path``; ``sharded=False`` reads whole rectangles on every
    process (for replicated evaluation batches). ``vocab_size`` (the model's): every batch is
    checked to hold only ids below it."""
    kwargs = {} if sharded else {"process_index": 0, "process_count": 1}
    try:
        return LongCrawl64(data.path, split, docs_per_batch, context_size,
                           prefetch=int(data.get("prefetch", 2)),
                           backend=data.get("backend", "auto"), vocab_size=vocab_size,
                           eot=int(data.get("eot", EOT)), **kwargs)
    except ValueError as error:
        hint = ""
        if "documents in" in str(error) and str(data.path) == str(AUSTEN_PATH):
            hint = (" -- the embedded Austen store is tiny (11 train, 1 held-out documents): "
                    "use the config's ':runlocal' arg, or point at LongCrawl64 with "
                    "--config.data.path=/path/to/longcrawl64")
        raise ValueError(f"{error}{hint}") from error


def train_batches(ds: LongCrawl64, start: int, stop: int) -> Iterator[tuple[int, np.ndarray,
                                                                             np.ndarray]]:
    """(step, inputs, labels) for steps [start, stop), step k reading loader index k mod len."""
    n = len(ds)
    k = start
    while k < stop:
        base = (k // n) * n  # first step of this epoch
        end = min(stop, base + n)
        for index, inputs, labels in ds.iterate(k - base, end - base):
            yield base + index, inputs, labels
        k = end


def global_batch(local: np.ndarray, sharding: NamedSharding, global_rows: int) -> jax.Array:
    """This process's rows [B / P, T] -> the global [B, T] array with ``sharding``."""
    shape = (global_rows, *local.shape[1:])
    return jax.make_array_from_process_local_data(sharding, local, shape)


def check_divisible(docs_per_batch: int, mesh: Mesh, microbatches: int = 1) -> None:
    n = mesh.size
    if docs_per_batch % (n * microbatches):
        raise ValueError(
            f"data.docs_per_batch: {docs_per_batch} must be divisible by the number of devices "
            f"({n}) times microbatches ({microbatches}); "
            f"nearest valid: {max(1, docs_per_batch // (n * microbatches)) * n * microbatches}")


def window_loader_length(length: int, columns: int = 65536) -> int:
    """The loader context to read windows of ``length`` tokens: the smallest power of two >=
    length (it divides the store's 65536 columns); windows are cropped to ``length``."""
    if not 1 <= length <= columns:
        raise ValueError(f"eval length: {length} not in [1, {columns}]")
    return min(columns, 1 << math.ceil(math.log2(length)))
