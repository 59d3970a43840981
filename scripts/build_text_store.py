"""Builds a LongCrawl64-layout store from any collection of text files (a folder or a tarball).

The files are read in sorted path order, each decoded as UTF-8 (undecodable bytes replaced),
tokenized (GPT-2 BPE, or raw bytes), and joined into one stream with end-of-text between
files; the stream is cut into consecutive documents of 65,536 tokens and the partial
remainder dropped, so every row is real, contiguous text and neighbouring files (a source
tree's directory, a book's chapters) share documents: long-range structure survives. The last
``--heldout`` fraction of the documents (a contiguous region of the sorted paths, so no file
is in both splits) is ``heldout.zarr``, the rest ``train.zarr``; both are written and read back
as ``scripts/build_austen_store.py`` does, and ``sympow.data.LongCrawl64`` reads them
unchanged.

    python scripts/build_text_store.py --src linux-source-6.12.tar.xz --out /data/linux \
        --include '*.c,*.h,*.S,*.rst,*.txt,Kconfig*,Makefile*' --heldout 0.02
    python -m sympow.data.verify /data/linux

Needs the ``data`` extra. ``--tokenizer bytes`` gives ids 0-255 with end-of-text 256
(vocabulary 257), like ``data/austen_bytes``.
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import sys
import tarfile
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # an uninstalled sympow

from scripts.build_austen_store import BYTE_EOT, DOC_LEN, novel_documents, write_store  # noqa: E402
from sympow.data.longcrawl64 import EOT  # noqa: E402
from sympow.data.tokenizer import gpt2_encoding  # noqa: E402

TOKENIZERS = ("gpt2", "bytes")


def text_files(src: str | Path, include: Sequence[str] = ("*",)) -> Iterator[tuple[str, bytes]]:
    """(relative path, bytes) of every regular file under a folder or in a tarball whose name
    matches one of the ``include`` patterns, in sorted path order."""
    src = Path(src)
    matches = lambda name: any(fnmatch.fnmatch(Path(name).name, p) for p in include)  # noqa: E731
    if src.is_dir():
        for path in sorted(p for p in src.rglob("*") if p.is_file()):
            rel = path.relative_to(src).as_posix()
            if matches(rel):
                yield rel, path.read_bytes()
    elif src.is_file() and tarfile.is_tarfile(src):
        with tarfile.open(src) as tar:
            members = sorted((m for m in tar.getmembers() if m.isfile() and matches(m.name)),
                             key=lambda m: m.name)
            for member in members:
                yield member.name, tar.extractfile(member).read()
    else:
        raise ValueError(f"src: {src} is neither a folder nor a tarball")


def tokenize(files: Iterator[tuple[str, bytes]], tokenizer: str) -> tuple[np.ndarray, dict]:
    """The stream of token ids (end-of-text between files) and counts of files and bytes."""
    if tokenizer not in TOKENIZERS:
        raise ValueError(f"tokenizer: {tokenizer!r} not in {TOKENIZERS}")
    encode, eot = ((gpt2_encoding().encode_ordinary, EOT) if tokenizer == "gpt2"
                   else (lambda text: list(text.encode("utf-8")), BYTE_EOT))
    pieces, n_files, n_bytes = [], 0, 0
    for _, data in files:
        text = data.decode("utf-8", errors="replace")
        pieces.append(np.asarray(encode(text) + [eot], np.uint16))
        n_files, n_bytes = n_files + 1, n_bytes + len(data)
    if not n_files:
        raise ValueError("no files matched (check --src and --include)")
    return np.concatenate(pieces), {"files": n_files, "bytes": n_bytes}


def build(src: str | Path, out_dir: str | Path, *, include: Sequence[str] = ("*",),
          tokenizer: str = "gpt2", heldout: float = 0.01) -> dict[str, Any]:
    """Writes ``train.zarr`` and ``heldout.zarr`` under ``out_dir``; returns the statistics."""
    if not 0 < heldout < 1:
        raise ValueError(f"heldout: need a fraction in (0, 1), got {heldout!r}")
    stream, stats = tokenize(text_files(src, include), tokenizer)
    docs = novel_documents(stream, DOC_LEN)  # [N, 65536]; the partial tail dropped
    if len(docs) < 2:
        raise ValueError(f"src: {len(stream)} tokens make {len(docs)} documents of {DOC_LEN}; "
                         "need at least 2 (one per split)")
    n_heldout = min(max(1, round(len(docs) * heldout)), len(docs) - 1)
    stats.update(tokens=int(stream.size), dropped_tokens=int(stream.size - docs.size),
                 train_docs=len(docs) - n_heldout, heldout_docs=n_heldout, tokenizer=tokenizer)
    attributes = {"source": str(src), "tokenizer": tokenizer, "include": list(include),
                  "doc_len": DOC_LEN, "eot": EOT if tokenizer == "gpt2" else BYTE_EOT}
    for split, part in (("train", docs[:-n_heldout]), ("heldout", docs[-n_heldout:])):
        write_store(Path(out_dir) / f"{split}.zarr", part, attributes)
    return stats


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--src", required=True, help="a folder or a tarball of text files")
    parser.add_argument("--out", required=True, help="output folder (train.zarr, heldout.zarr)")
    parser.add_argument("--include", default="*",
                        help="comma-separated file-name patterns (default: every file)")
    parser.add_argument("--tokenizer", default="gpt2", choices=TOKENIZERS)
    parser.add_argument("--heldout", type=float, default=0.01,
                        help="fraction of the documents held out (the last ones)")
    args = parser.parse_args(argv)
    stats = build(args.src, args.out, include=args.include.split(","),
                  tokenizer=args.tokenizer, heldout=args.heldout)
    print(json.dumps(stats, indent=1))


if __name__ == "__main__":
    main()
