"""Check a token store end to end before a long run: ``python -m sympow.data.verify PATH``.

The LongCrawl64 layout (``sympow.data.longcrawl64``) has no checksum, and training reads each
chunk only when its batch comes up, possibly days into a run. This reads every chunk of
``PATH/train.zarr`` and ``PATH/heldout.zarr`` once and checks:

- layout: a zarr v2 array, 2-D [docs, columns], uint16, at least one document; with
  ``--context_size T``, that T divides the column count (the loader's requirement);
- every chunk file is present (zarr would read a missing one as zeros);
- every chunk decodes to its full shape (a truncated or damaged file fails here);
- every token id is below ``--vocab_size`` (default 50257, GPT-2's; the models pad it to
  50304): an id past a model's vocabulary trains into NaN.

A flipped byte that still decodes (say, inside lz4's literal bytes) yields different but valid
tokens: nothing but a checksum of the original data can see that, and the format has none.

Prints one line per split and one per problem (the file and what is wrong); exits 0 if the
store is sound, 1 if not. ``verify_store`` is the same as a function (``StoreError``, a
ValueError naming every problem).

    python -m sympow.data.verify /path/to/longcrawl64 [--split train] [--vocab_size 50257]
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from sympow.data.longcrawl64 import BACKENDS, SPLITS, _chunk_keys, _ZarrArray, token_range_error

GPT2_VOCAB = 50257
STANDARD_COLUMNS = 65536  # LongCrawl64's document length
_PROGRESS_EVERY_S = 30.0


@dataclasses.dataclass
class SplitReport:
    """What ``verify_split`` found in one ``<split>.zarr``."""

    path: Path
    shape: tuple[int, int] | None = None
    chunks: tuple[int, int] | None = None
    chunk_files: int = 0
    bytes_on_disk: int = 0
    min_id: int | None = None
    max_id: int | None = None
    problems: list[str] = dataclasses.field(default_factory=list)
    notes: list[str] = dataclasses.field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    def summary(self) -> str:
        if self.shape is None:
            return f"{self.path.name}: unreadable"
        ids = f"ids {self.min_id}..{self.max_id}" if self.max_id is not None else "no ids read"
        status = "ok" if self.ok else f"{len(self.problems)} problem(s)"
        return (f"{self.path.name}: {list(self.shape)} uint16, chunks {list(self.chunks)}, "
                f"{self.chunk_files:,} chunk files ({self.bytes_on_disk / 1e6:,.1f} MB), "
                f"{self.shape[0] * self.shape[1]:,} tokens, {ids}: {status}")


class StoreError(ValueError):
    """A store failed ``verify_store``; ``reports`` holds every split's findings."""

    def __init__(self, reports: Sequence[SplitReport]):
        self.reports = list(reports)
        problems = [p for r in self.reports for p in r.problems]
        super().__init__(f"{len(problems)} problem(s): " + "; ".join(problems))


def _read_chunks(array: _ZarrArray, rows: range, col_chunks: range, report: SplitReport,
                 vocab_size: int) -> None:
    """Reads one chunk at a time (to name the file) and records what is wrong with each."""
    cw = array.chunks[1]
    for j in col_chunks:
        cols = range(j * cw, min((j + 1) * cw, array.shape[1]))
        key = _chunk_keys(rows, cols, array.chunks, array.separator)[0]
        if not (array.path / key).is_file():
            report.problems.append(f"{array.path / key}: missing chunk file (zarr would read "
                                   "it as zeros)")
            continue
        try:
            block = array.read(rows, cols)
        except Exception as error:  # each backend raises its own types for bad chunks
            text = str(error).strip().splitlines()[0][:300] if str(error).strip() else ""
            report.problems.append(f"{array.path / key}: cannot be decoded "
                                   f"({type(error).__name__}: {text})")
            continue
        if error := token_range_error(block, vocab_size, array.path / key, rows, cols):
            report.problems.append(str(error))
        _update_range(report, block)


def _update_range(report: SplitReport, block: np.ndarray) -> None:
    if block.size:
        lo, hi = int(block.min()), int(block.max())
        report.min_id = lo if report.min_id is None else min(report.min_id, lo)
        report.max_id = hi if report.max_id is None else max(report.max_id, hi)


def verify_split(path: str | Path, *, vocab_size: int = GPT2_VOCAB, backend: str = "auto",
                 context_size: int | None = None, log=None) -> SplitReport:
    """Checks one zarr array (e.g. ``PATH/train.zarr``) end to end; see the module docstring.

    Reads a row of chunks at a time (one call, decoded in parallel by tensorstore) and falls
    back to one chunk at a time where that row has a problem, to name the file.
    """
    report = SplitReport(Path(path))
    try:
        array = _ZarrArray(report.path, backend)
    except (ValueError, OSError) as error:
        report.problems.append(str(error))
        return report
    docs, columns = array.shape
    report.shape, report.chunks = (docs, columns), array.chunks
    if docs == 0 or columns == 0:
        report.problems.append(f"{report.path}: shape {list(array.shape)} holds no tokens")
        return report
    if columns != STANDARD_COLUMNS:
        report.notes.append(f"{columns} columns, not LongCrawl64's {STANDARD_COLUMNS}")
    if context_size is not None and (columns % context_size or context_size > columns):
        report.problems.append(f"{report.path}: context_size {context_size} does not divide "
                               f"its {columns} columns")
    ch, cw = array.chunks
    col_chunks = range(-(-columns // cw))
    t_last = time.monotonic()
    for i in range(-(-docs // ch)):
        rows = range(i * ch, min((i + 1) * ch, docs))
        keys = _chunk_keys(rows, range(columns), array.chunks, array.separator)
        present = [k for k in keys if (array.path / k).is_file()]
        report.chunk_files += len(present)
        report.bytes_on_disk += sum((array.path / k).stat().st_size for k in present)
        try:
            if len(present) < len(keys):
                raise LookupError("missing chunk files")
            block = array.read(rows, range(columns))
            if token_range_error(block, vocab_size, array.path, rows, range(columns)):
                raise LookupError("ids out of range")
            _update_range(report, block)
        except Exception:  # find and name each bad chunk of this row
            _read_chunks(array, rows, col_chunks, report, vocab_size)
        if log is not None and time.monotonic() - t_last > _PROGRESS_EVERY_S:
            t_last = time.monotonic()
            log(f"  {report.path.name}: {rows.stop:,}/{docs:,} documents read")
    return report


def verify_store(path: str | Path, *, splits: Sequence[str] = SPLITS,
                 vocab_size: int = GPT2_VOCAB, backend: str = "auto",
                 context_size: int | None = None, log=None) -> list[SplitReport]:
    """``verify_split`` of ``PATH/<split>.zarr`` for each split; raises StoreError (a
    ValueError naming each file and what is wrong with it) if any check fails."""
    unknown = sorted(set(splits) - set(SPLITS))
    if unknown or not splits:
        raise ValueError(f"splits: need a non-empty subset of {SPLITS}, got {list(splits)}")
    if not isinstance(vocab_size, int) or vocab_size <= 0:
        raise ValueError(f"vocab_size: need a positive int, got {vocab_size!r}")
    if backend not in BACKENDS:
        raise ValueError(f"backend: {backend!r} not in {BACKENDS}")
    if not Path(path).is_dir():
        raise ValueError(f"path: {path} is not a directory")
    reports = [verify_split(Path(path) / f"{split}.zarr", vocab_size=vocab_size,
                            backend=backend, context_size=context_size, log=log)
               for split in splits]
    if not all(r.ok for r in reports):
        raise StoreError(reports)
    return reports


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m sympow.data.verify",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("path", help="folder holding train.zarr and heldout.zarr")
    parser.add_argument("--split", choices=[*SPLITS, "all"], default="all")
    parser.add_argument("--vocab_size", type=int, default=GPT2_VOCAB,
                        help="every id must be below this (default: GPT-2's 50257)")
    parser.add_argument("--context_size", type=int, default=None,
                        help="also check that this training context divides the columns")
    parser.add_argument("--backend", choices=BACKENDS, default="auto")
    args = parser.parse_args(argv)
    splits = SPLITS if args.split == "all" else (args.split,)
    say = lambda text: print(text, flush=True)  # noqa: E731
    say(f"verify {Path(args.path).resolve()} (vocab_size {args.vocab_size})")
    t0 = time.monotonic()
    try:
        reports = verify_store(args.path, splits=splits, vocab_size=args.vocab_size,
                               backend=args.backend, context_size=args.context_size, log=say)
    except StoreError as error:
        reports = error.reports
    except ValueError as error:  # an argument, not the store
        parser.error(str(error))
    for report in reports:
        say("  " + report.summary())
        for note in report.notes:
            say(f"    note: {note}")
        for problem in report.problems:
            say(f"    PROBLEM {problem}")
    bad = sum(len(r.problems) for r in reports)
    elapsed = time.monotonic() - t0
    say(f"store ok ({elapsed:.1f} s)" if not bad else
        f"store has {bad} problem(s) ({elapsed:.1f} s)")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
