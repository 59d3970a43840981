"""Builds the embedded Jane Austen token store ``data/austen`` (read by ``sympow.data``).

Source: the Debian package ``r-cran-janeaustenr`` (MIT-licensed R data package; the novels
themselves are public domain). Its ``data/Rdata.rdb`` is an R lazy-load database: one block
per dataset, each a 4-byte big-endian uncompressed length followed by a zlib stream of an
R-serialized character vector (one string per line of the novel). ``data/Rdata.rdx`` is the
gzip-compressed serialized index: a list whose ``variables`` element maps each dataset name to
its (byte offset, byte length) in the ``.rdb`` file.

Pipeline (deterministic, no network):
  1. ``read_novels``: unserialize the six character vectors (``unserialize`` below supports
     exactly what these files use) and join lines with "\\n" (blank lines = paragraph breaks).
  2. ``sympow.data.gpt2_encoding``: GPT-2 BPE as a ``tiktoken.Encoding``, built offline.
  3. ``novel_documents``: cut each novel's tokens into consecutive 65,536-token documents and
     DROP the partial remainder (every row is real, contiguous text; no padding tokens).
  4. ``write_store``: ``persuasion`` -> ``heldout.zarr``, the other five -> ``train.zarr``; zarr
     v2, [docs, 65536] uint16, chunks (2048, 2048), Blosc lz4 level 5 byte shuffle, fill 0.
     What was written is read back and compared.

From the repo root (needs dpkg-deb and the ``data`` extra; no network beyond apt):

  apt-get update && apt-get download r-cran-janeaustenr
  python scripts/build_austen_store.py --deb r-cran-janeaustenr_1.0.0-1_all.deb --out data/austen

(``--root DIR`` instead of ``--deb`` reads an already unpacked package.) The committed result
and its provenance are in ``data/austen`` and ``data/austen/README.md``.
"""

from __future__ import annotations

import argparse
import dataclasses
import gzip
import json
import os
import struct
import subprocess
import sys
import tempfile
import zlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # an uninstalled sympow

from sympow.data.austen import BYTES_EOT as AUSTEN_BYTES_EOT  # noqa: E402
from sympow.data.austen import DEFAULT_STORE  # noqa: E402
from sympow.data.tokenizer import gpt2_encoding  # noqa: E402

NOVELS = (
    "emma", "mansfieldpark", "northangerabbey", "persuasion", "prideprejudice",
    "sensesensibility",
)
HELDOUT_NOVELS = ("persuasion",)
DOC_LEN = 65536
CHUNKS = (2048, 2048)
RDB_RELPATH = "usr/lib/R/site-library/janeaustenr/data/Rdata"

# ----------------------------------------------------------------------------------------------
# A minimal R unserializer (XDR "X\n" format, versions 2 and 3).
# ----------------------------------------------------------------------------------------------

# SEXP type codes used here (R Internals, "Serialization formats").
_SYMSXP, _LISTSXP, _CHARSXP, _LGLSXP, _INTSXP, _STRSXP, _VECSXP = 1, 2, 9, 10, 13, 16, 19
_REFSXP, _NILVALUE_SXP = 255, 254
_VECTOR_KINDS = {_LGLSXP: "logical", _INTSXP: "integer", _STRSXP: "character", _VECSXP: "list"}
_NA_INTEGER = -(2**31)
_LATIN1_MASK, _BYTES_MASK = 1 << 2, 1 << 1  # CHARSXP encoding bits in the flags' "levels"


class RFormatError(ValueError):
    """The bytes are not an R serialization this module understands."""


@dataclasses.dataclass(frozen=True)
class RVector:
    """An R vector: ``kind`` in {character, integer, logical, list}; NA values are ``None``."""

    kind: str
    values: list[Any]
    attributes: dict[str, Any]


@dataclasses.dataclass(frozen=True)
class RSymbol:
    name: str


class _Reader:
    """Reads one serialized object. Supported: NULL, symbols, pairlists (attribute lists),
    CHARSXP (incl. NA_STRING), logical/integer/character vectors and generic lists, each with
    attributes, and back-references to symbols. Anything else raises ``RFormatError``."""

    def __init__(self, data: bytes):
        self.data, self.pos, self.refs = data, 0, []

    def int(self) -> int:
        if self.pos + 4 > len(self.data):
            raise RFormatError(f"truncated R serialization at byte {self.pos}")
        (value,) = struct.unpack_from(">i", self.data, self.pos)
        self.pos += 4
        return value

    def bytes(self, n: int) -> bytes:
        if n < 0 or self.pos + n > len(self.data):
            raise RFormatError(f"bad byte length {n} at byte {self.pos}")
        out = self.data[self.pos : self.pos + n]
        self.pos += n
        return out

    def header(self) -> None:
        if self.bytes(2) != b"X\n":
            raise RFormatError("not an XDR R serialization (expected 'X\\n' header)")
        version = self.int()
        if version not in (2, 3):
            raise RFormatError(f"unsupported R serialization version {version}")
        self.int()  # R version that wrote the data
        self.int()  # minimal R version that can read it
        if version == 3:
            self.bytes(self.int())  # native encoding name, e.g. b"UTF-8"

    def length(self) -> int:
        n = self.int()
        if n == -1:  # long vector: two more ints, upper and lower 32 bits
            n = (self.int() << 32) + (self.int() & 0xFFFFFFFF)
        return n

    def item(self) -> Any:
        flags = self.int()
        sexptype, levels = flags & 0xFF, flags >> 12
        has_attr, has_tag = bool(flags & (1 << 9)), bool(flags & (1 << 10))
        if sexptype == _NILVALUE_SXP:
            return None
        if sexptype == _REFSXP:
            index = (flags >> 8) or self.int()
            return self.refs[index - 1]
        if sexptype == _SYMSXP:
            symbol = RSymbol(self.item())
            self.refs.append(symbol)
            return symbol
        if sexptype == _CHARSXP:
            return self.charsxp(levels, has_attr)
        if sexptype == _LISTSXP:
            return self.pairlist(has_attr, has_tag)
        if sexptype in _VECTOR_KINDS:
            values = self.vector_values(sexptype, self.length())
            attributes = self.attributes() if has_attr else {}
            return RVector(_VECTOR_KINDS[sexptype], values, attributes)
        raise RFormatError(f"unsupported SEXP type {sexptype} at byte {self.pos - 4}")

    def charsxp(self, levels: int, has_attr: bool) -> str | None:
        if has_attr:
            raise RFormatError("CHARSXP with attributes is not supported")
        n = self.int()
        if n == -1:
            return None  # NA_STRING
        raw = self.bytes(n)
        if levels & _BYTES_MASK:
            raise RFormatError("CHARSXP marked as raw bytes is not supported")
        return raw.decode("latin-1" if levels & _LATIN1_MASK else "utf-8")

    def vector_values(self, sexptype: int, n: int) -> list[Any]:
        if sexptype in (_LGLSXP, _INTSXP):
            ints = [self.int() for _ in range(n)]
            if sexptype == _LGLSXP:
                return [None if v == _NA_INTEGER else bool(v) for v in ints]
            return [None if v == _NA_INTEGER else v for v in ints]
        values = [self.item() for _ in range(n)]
        if sexptype == _STRSXP and not all(v is None or isinstance(v, str) for v in values):
            raise RFormatError("character vector element is not a CHARSXP")
        return values

    def pairlist(self, has_attr: bool, has_tag: bool) -> dict[str, Any]:
        """A tagged pairlist (how R stores attributes) as an ordered dict tag -> value."""
        if has_attr:
            self.attributes()  # attributes of a pairlist node: read and ignore
        tag = self.item() if has_tag else None
        if not isinstance(tag, RSymbol):
            raise RFormatError("only tagged pairlists (attribute lists) are supported")
        out = {tag.name: self.item()}
        rest = self.item()
        if rest is not None:
            if not isinstance(rest, dict):
                raise RFormatError("malformed pairlist tail")
            out.update(rest)
        return out

    def attributes(self) -> dict[str, Any]:
        attributes = self.item()
        if not isinstance(attributes, dict):
            raise RFormatError("attributes are not a tagged pairlist")
        return attributes


def unserialize(data: bytes) -> Any:
    """Unserializes one R object from XDR bytes (the payload of ``serialize``/``.rds``)."""
    reader = _Reader(data)
    reader.header()
    obj = reader.item()
    if reader.pos != len(data):
        raise RFormatError(f"{len(data) - reader.pos} trailing bytes after the R object")
    return obj


def read_rdb_index(rdx: bytes) -> dict[str, tuple[int, int]]:
    """Parses an ``.rdx`` file: dataset name -> (offset, length) of its block in the ``.rdb``."""
    index = unserialize(gzip.decompress(rdx) if rdx[:2] == b"\x1f\x8b" else zlib.decompress(rdx))
    fields = _named_list(index, "Rdata.rdx")
    compressed = fields["compressed"].values
    if compressed != [True]:
        raise RFormatError(f"only zlib-compressed .rdb blocks are supported, got {compressed}")
    variables = _named_list(fields["variables"], "Rdata.rdx variables")
    return {name: tuple(v.values) for name, v in variables.items()}


def _named_list(obj: Any, what: str) -> dict[str, Any]:
    if not isinstance(obj, RVector) or obj.kind != "list" or "names" not in obj.attributes:
        raise RFormatError(f"{what} is not a named list")
    return dict(zip(obj.attributes["names"].values, obj.values, strict=True))


def read_rdb_block(rdb: bytes, offset: int, length: int) -> Any:
    """Unserializes one ``.rdb`` block: 4-byte big-endian raw length, then a zlib stream."""
    block = rdb[offset : offset + length]
    (raw_len,) = struct.unpack(">I", block[:4])
    raw = zlib.decompress(block[4:])
    if len(raw) != raw_len:
        raise RFormatError(f"block at {offset}: {len(raw)} bytes, header says {raw_len}")
    return unserialize(raw)


def read_novels(package_root: str | os.PathLike) -> dict[str, str]:
    """Reads the six novels from an unpacked ``r-cran-janeaustenr`` tree.

    Returns:
      ``{name: text}`` in alphabetical order; each text is the novel's lines joined by "\\n".
    """
    base = Path(package_root) / RDB_RELPATH
    index = read_rdb_index(base.with_suffix(".rdx").read_bytes())
    if tuple(index) != NOVELS:
        raise RFormatError(f"expected datasets {NOVELS}, found {tuple(index)}")
    rdb = base.with_suffix(".rdb").read_bytes()
    novels = {}
    for name, (offset, length) in index.items():
        lines = read_rdb_block(rdb, offset, length)
        if not isinstance(lines, RVector) or lines.kind != "character":
            raise RFormatError(f"{name}: expected a character vector")
        if any(line is None for line in lines.values):
            raise RFormatError(f"{name}: NA lines are not expected in a novel")
        novels[name] = "\n".join(lines.values)
    return novels


# ----------------------------------------------------------------------------------------------
# Documents and the zarr store.
# ----------------------------------------------------------------------------------------------


def novel_documents(tokens: Sequence[int], doc_len: int = DOC_LEN) -> np.ndarray:
    """Cuts a token sequence into consecutive documents, dropping the partial remainder.

    Returns:
      uint16 [len(tokens) // doc_len, doc_len].
    """
    n_docs = len(tokens) // doc_len
    array = np.asarray(tokens[: n_docs * doc_len], dtype=np.int64)
    if array.size and (array.min() < 0 or array.max() > np.iinfo(np.uint16).max):
        raise ValueError("token ids do not fit in uint16")
    return array.astype(np.uint16).reshape(n_docs, doc_len)


def write_store(path: str | os.PathLike, docs: np.ndarray, attributes: dict[str, Any]) -> None:
    """Writes ``docs`` [N, 65536] uint16 as a LongCrawl64-layout zarr v2 array and verifies it."""
    import numcodecs
    import zarr

    blosc = numcodecs.Blosc(cname="lz4", clevel=5, shuffle=numcodecs.Blosc.SHUFFLE)
    array = zarr.create_array(
        store=str(path), shape=docs.shape, chunks=CHUNKS, dtype="uint16", fill_value=0,
        zarr_format=2, compressors=blosc, attributes=attributes, overwrite=True,
        config={"write_empty_chunks": True},
    )
    array[...] = docs
    verify_store(path, docs)


def verify_store(path: str | os.PathLike, docs: np.ndarray) -> None:
    """Re-opens a written store and checks its metadata, chunk files and contents."""
    import zarr

    meta = json.loads((Path(path) / ".zarray").read_text())
    expected = {"zarr_format": 2, "shape": list(docs.shape), "chunks": list(CHUNKS),
                "dtype": "<u2", "fill_value": 0}
    for key, value in expected.items():
        if meta[key] != value:
            raise ValueError(f"{path}: .zarray {key} = {meta[key]!r}, expected {value!r}")
    codec = meta["compressor"]
    if (codec["id"], codec["cname"], codec["clevel"], codec["shuffle"]) != ("blosc", "lz4", 5, 1):
        raise ValueError(f"{path}: unexpected compressor {codec}")
    rows, cols = (-(-s // c) for s, c in zip(docs.shape, CHUNKS, strict=True))
    missing = [f"{r}.{c}" for r in range(rows) for c in range(cols)
               if not (Path(path) / f"{r}.{c}").is_file()]
    if missing:
        raise ValueError(f"{path}: chunk files missing after write: {missing}")
    if not np.array_equal(zarr.open_array(str(path), mode="r")[...], docs):
        raise ValueError(f"{path}: contents read back differ from what was written")


# Byte-level stores: ids 0-255 are the UTF-8 bytes of the text, 256 the end-of-text id that
# begins every window's inputs (configs set data.eot = BYTE_EOT, model.vocab_size = 257).
BYTE_EOT = AUSTEN_BYTES_EOT


def build(package_root: str | os.PathLike, out_dir: str | os.PathLike, *,
          level: str = "gpt2") -> dict[str, Any]:
    """Tokenizes the novels and writes ``train.zarr`` and ``heldout.zarr`` under ``out_dir``.

    level: 'gpt2' (GPT-2 BPE) or 'bytes' (the UTF-8 bytes, vocabulary 256 + BYTE_EOT: the
    CPU demo's corpus, whose output layer is 200x smaller).

    Returns:
      Per-novel statistics: characters, tokens, documents, dropped tail tokens, split.
    """
    if level not in ("gpt2", "bytes"):
        raise ValueError(f"level: {level!r} not in ('gpt2', 'bytes')")
    encode = (gpt2_encoding().encode_ordinary if level == "gpt2"
              else lambda text: list(text.encode("utf-8")))
    novels = read_novels(package_root)
    stats: dict[str, Any] = {}
    splits: dict[str, list[tuple[str, np.ndarray]]] = {"train": [], "heldout": []}
    for name, text in novels.items():
        tokens = encode(text)
        docs = novel_documents(tokens)
        split = "heldout" if name in HELDOUT_NOVELS else "train"
        n_tokens = len(tokens)
        stats[name] = {"chars": len(text), "tokens": n_tokens, "docs": len(docs),
                       "dropped_tokens": n_tokens - docs.size, "split": split}
        if len(docs) == 0:
            raise ValueError(f"{name} has fewer than {DOC_LEN} tokens")
        splits[split].append((name, docs))
    for split, parts in splits.items():
        rows = [[name, i] for name, docs in parts for i in range(len(docs))]
        attributes = {"source": "Debian r-cran-janeaustenr (Rdata.rdb)", "tokenizer": level,
                      "rows": rows, "doc_len": DOC_LEN}
        if level == "bytes":
            attributes["eot"] = BYTE_EOT
        docs = np.concatenate([d for _, d in parts])
        write_store(Path(out_dir) / f"{split}.zarr", docs, attributes)
    return stats


def extract_deb(deb: str | os.PathLike, dest: str | os.PathLike) -> Path:
    """Unpacks a ``.deb`` with ``dpkg-deb -x`` (no installation); returns ``dest``."""
    subprocess.run(["dpkg-deb", "-x", str(deb), str(dest)], check=True)
    return Path(dest)


def main(argv: Sequence[str] | None = None) -> None:
    """CLI: ``--deb FILE.deb`` (or ``--root DIR`` already unpacked) ``--out data/austen``."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--deb", help="r-cran-janeaustenr .deb from `apt-get download`")
    source.add_argument("--root", help="directory where the .deb was unpacked (dpkg-deb -x)")
    parser.add_argument("--out", default=str(DEFAULT_STORE), help="output folder")
    parser.add_argument("--bytes", action="store_true",
                        help="byte-level ids (vocabulary 256, end-of-text 256) instead of GPT-2")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        root = extract_deb(args.deb, tmp) if args.deb else Path(args.root)
        stats = build(root, args.out, level="bytes" if args.bytes else "gpt2")
    print(json.dumps(stats, indent=1))
    total = sum(s["tokens"] for s in stats.values())
    kept = sum(s["docs"] for s in stats.values()) * DOC_LEN
    print(f"total tokens {total}, stored {kept} in {kept // DOC_LEN} docs of {DOC_LEN}")


if __name__ == "__main__":
    main()
