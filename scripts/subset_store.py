"""Copies the first documents of a LongCrawl64-layout store into a new, smaller store.

The subset is itself a store in the same layout (zarr v2 [docs, columns] uint16, chunks
(2048, 2048), Blosc lz4, written and read back by ``scripts/build_austen_store.write_store``),
so ``sympow.data.LongCrawl64`` and ``python -m sympow.data.verify`` read it unchanged: a way to
carry a store to a machine without network (64 MiB of files per call). Rows ``[0, N)`` of
``train.zarr`` and ``[0, M)`` of ``heldout.zarr`` are read through the repo's reader (chunk
files checked, tensorstore or zarr) ``--batch`` documents at a time. Each split's attributes
are the source's ``.zattrs`` plus ``subset_of`` (the source folder), ``train_docs`` and
``heldout_docs``; a per-row ``rows`` list (as in ``data/austen``) is cut to the kept rows.

    python scripts/subset_store.py --src /tmp/linux_store --out data/linux_small \
        --train_docs 512 --heldout_docs 16
    python -m sympow.data.verify data/linux_small

Prints a JSON summary: documents, tokens and bytes on disk per split, and the total bytes.
Needs the ``data`` extra (zarr, to write).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # an uninstalled sympow

from scripts.build_austen_store import write_store  # noqa: E402
from sympow.data.longcrawl64 import SPLITS, _ZarrArray  # noqa: E402


def _bytes_on_disk(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def subset(src: str | Path, out: str | Path, train_docs: int, heldout_docs: int, *,
           backend: str = "auto", batch: int = 256) -> dict[str, Any]:
    """Writes the first ``train_docs`` / ``heldout_docs`` documents of the store ``src`` as
    the store ``out``; returns the summary (see the module docstring)."""
    src, out = Path(src), Path(out)
    for split in SPLITS:
        if not (src / f"{split}.zarr" / ".zarray").is_file():
            raise ValueError(f"src: {src} is not a store (no zarr v2 array {split}.zarr; need "
                             f"{' and '.join(f'{s}.zarr' for s in SPLITS)})")
    if out.resolve() == src.resolve():
        raise ValueError(f"out: {out} is the source store; choose another folder")
    if batch < 1:
        raise ValueError(f"batch: need a positive number of documents, got {batch}")
    wanted = {"train": train_docs, "heldout": heldout_docs}
    arrays = {split: _ZarrArray(src / f"{split}.zarr", backend) for split in SPLITS}
    for split, n in wanted.items():
        count = arrays[split].shape[0]
        if not isinstance(n, (int, np.integer)) or not 1 <= n <= count:
            raise ValueError(f"{split}_docs: need 1 to {count} (the documents in "
                             f"{split}.zarr), got {n!r}")
    summary: dict[str, Any] = {"src": str(src), "out": str(out)}
    for split, n in wanted.items():
        array = arrays[split]
        columns = array.shape[1]
        docs = np.empty((n, columns), dtype=np.uint16)
        for start in range(0, n, batch):
            rows = range(start, min(start + batch, n))
            docs[rows.start:rows.stop] = array.read(rows, range(columns))
        zattrs = src / f"{split}.zarr" / ".zattrs"
        attributes = json.loads(zattrs.read_text()) if zattrs.is_file() else {}
        rows_attr = attributes.get("rows")
        if isinstance(rows_attr, list) and len(rows_attr) == array.shape[0]:
            attributes["rows"] = rows_attr[:n]
        attributes.update({"subset_of": str(src.resolve()), "train_docs": int(train_docs),
                           "heldout_docs": int(heldout_docs)})
        path = out / f"{split}.zarr"
        write_store(path, docs, attributes)  # writes, then reads back and compares
        summary[split] = {"docs": n, "tokens": docs.size, "bytes": _bytes_on_disk(path)}
    summary["total_bytes"] = sum(summary[split]["bytes"] for split in SPLITS)
    return summary


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--src", required=True, help="store folder (train.zarr, heldout.zarr)")
    parser.add_argument("--out", required=True, help="output folder for the subset store")
    parser.add_argument("--train_docs", type=int, required=True,
                        help="keep the first N training documents")
    parser.add_argument("--heldout_docs", type=int, required=True,
                        help="keep the first M held-out documents")
    parser.add_argument("--batch", type=int, default=256,
                        help="documents read per call (the whole subset is held in memory)")
    parser.add_argument("--backend", default="auto", choices=("auto", "tensorstore", "zarr"))
    args = parser.parse_args(argv)
    print(json.dumps(subset(args.src, args.out, args.train_docs, args.heldout_docs,
                            backend=args.backend, batch=args.batch), indent=1))


if __name__ == "__main__":
    main()
