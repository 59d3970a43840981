"""scripts/build_austen_store.py: the R unserializer on hand-built bytes, documents, the zarr
writer, and the whole command on a synthetic ``r-cran-janeaustenr`` package."""

import gzip
import json
import shutil
import struct
import subprocess
import zlib

import numpy as np
import pytest
import zarr

from scripts import build_austen_store as builder

A, SPACE_A = 64, 257  # GPT-2 ids of "a" and " a"


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


R_HEADER = b"X\n" + _r_int(2, 0, 0)


def _rdata(datasets):
    """(.rdx index, uncompressed; .rdb) of {name: lines}: the index is a list (variables,
    references, compressed), variables maps each name to its (offset, length) block."""
    rdb, offsets = b"", []
    for lines in datasets.values():
        payload = R_HEADER + _r_strsxp(lines)
        block = struct.pack(">I", len(payload)) + zlib.compress(payload)
        offsets.append(_r_int(13, 2, len(rdb), len(block)))
        rdb += block
    variables = _r_int(0x213, len(datasets)) + b"".join(offsets) + _r_names(list(datasets))
    index = (R_HEADER + _r_int(0x213, 3) + variables + _r_int(19, 0) + _r_int(10, 1, 1)
             + _r_names(["variables", "references", "compressed"], first=False))
    return index, rdb


@pytest.mark.parametrize("version", [2, 3])
def test_unserialize_strings(version):
    header = b"X\n" + _r_int(version, 0x40201, 0x30500)
    if version == 3:
        header += _r_int(5) + b"UTF-8"
    obj = builder.unserialize(header + _r_strsxp(["a", None, "é"], names=["x", "y", "z"]))
    assert obj.kind == "character"
    assert obj.values == ["a", None, "é"]
    assert obj.attributes["names"].values == ["x", "y", "z"]


def test_rdb_index_and_block():
    """An .rdx index (list: variables, references, compressed) and one zlib .rdb block."""
    index, block = _rdata({"novel": ["line one", "", "line three"]})
    offsets = builder.read_rdb_index(gzip.compress(index))
    assert offsets == {"novel": (0, len(block))}
    lines = builder.read_rdb_block(block, *offsets["novel"])
    assert lines.values == ["line one", "", "line three"]


def test_unserialize_errors():
    with pytest.raises(builder.RFormatError, match="XDR"):
        builder.unserialize(b"A\n" + _r_int(2, 0, 0))
    with pytest.raises(builder.RFormatError, match="version 4"):
        builder.unserialize(b"X\n" + _r_int(4, 0, 0))
    with pytest.raises(builder.RFormatError, match="SEXP type 14"):  # REALSXP
        builder.unserialize(R_HEADER + _r_int(14, 1) + b"\0" * 8)
    with pytest.raises(builder.RFormatError, match="trailing"):
        builder.unserialize(R_HEADER + _r_strsxp(["a"]) + b"\0")
    with pytest.raises(builder.RFormatError, match="truncated"):
        builder.unserialize(R_HEADER + _r_int(16, 2) + _r_char("a"))


def test_novel_documents_drop_the_tail():
    docs = builder.novel_documents(list(range(10)), doc_len=4)
    np.testing.assert_array_equal(docs, [[0, 1, 2, 3], [4, 5, 6, 7]])
    assert docs.dtype == np.uint16
    with pytest.raises(ValueError, match="uint16"):
        builder.novel_documents([0, 70000], doc_len=2)


def test_write_store_layout_and_verify(tmp_path):
    docs = (np.arange(3 * 4096).reshape(3, 4096) % 50257).astype(np.uint16)
    builder.write_store(tmp_path / "x.zarr", docs, {"rows": [["n", 0]]})
    meta = json.loads((tmp_path / "x.zarr" / ".zarray").read_text())
    assert (meta["shape"], meta["chunks"], meta["dtype"]) == ([3, 4096], [2048, 2048], "<u2")
    assert sorted(p.name for p in (tmp_path / "x.zarr").glob("0.*")) == ["0.0", "0.1"]
    np.testing.assert_array_equal(zarr.open_array(str(tmp_path / "x.zarr"), mode="r")[...], docs)
    (tmp_path / "x.zarr" / "0.1").unlink()
    with pytest.raises(ValueError, match=r"chunk files missing after write: \['0.1'\]"):
        builder.verify_store(tmp_path / "x.zarr", docs)


# Tokens of each synthetic novel: "a a a ..." is one token per word (A, then SPACE_A).
EXTRA = {"emma": 65536 + 5, "mansfieldpark": 7, "northangerabbey": 0, "persuasion": 3,
         "prideprejudice": 11, "sensesensibility": 1}


def _package(root):
    """An unpacked r-cran-janeaustenr tree whose novels are one line of 65536 + EXTRA words."""
    index, rdb = _rdata({name: ["a" + " a" * (65536 + extra - 1)]
                         for name, extra in EXTRA.items()})
    base = root / builder.RDB_RELPATH
    base.parent.mkdir(parents=True)
    base.with_suffix(".rdx").write_bytes(gzip.compress(index))
    base.with_suffix(".rdb").write_bytes(rdb)
    return root


def _check_built_store(out):
    train = zarr.open_array(str(out / "train.zarr"), mode="r")
    heldout = zarr.open_array(str(out / "heldout.zarr"), mode="r")
    first = np.full(65536, SPACE_A)
    first[0] = A
    # emma fills two rows (its second continues its first), every other novel one.
    np.testing.assert_array_equal(train[...], [first, np.full(65536, SPACE_A)] + [first] * 4)
    np.testing.assert_array_equal(heldout[...], [first])
    assert train.attrs["rows"] == [["emma", 0], ["emma", 1], ["mansfieldpark", 0],
                                   ["northangerabbey", 0], ["prideprejudice", 0],
                                   ["sensesensibility", 0]]
    assert heldout.attrs["rows"] == [["persuasion", 0]] and train.attrs["doc_len"] == 65536


def test_command_on_an_unpacked_package(tmp_path, capsys):
    builder.main(["--root", str(_package(tmp_path / "pkg")), "--out", str(tmp_path / "out")])
    _check_built_store(tmp_path / "out")
    printed = capsys.readouterr().out
    stats = json.loads(printed[:printed.rindex("}") + 1])
    assert stats["emma"] == {"chars": 2 * (131072 + 5) - 1, "tokens": 131072 + 5, "docs": 2,
                             "dropped_tokens": 5, "split": "train"}
    assert stats["persuasion"]["split"] == "heldout" and stats["persuasion"]["docs"] == 1
    total = 6 * 65536 + sum(EXTRA.values())
    assert f"total tokens {total}, stored {7 * 65536} in 7 docs of 65536" in printed


@pytest.mark.skipif(shutil.which("dpkg-deb") is None, reason="needs dpkg-deb")
def test_command_on_a_deb(tmp_path):
    root = _package(tmp_path / "pkg")
    (root / "DEBIAN").mkdir()
    (root / "DEBIAN" / "control").write_text(
        "Package: r-cran-janeaustenr\nVersion: 1.0.0-1\nArchitecture: all\n"
        "Maintainer: test <test@example.org>\nDescription: synthetic test package\n")
    deb = tmp_path / "janeaustenr.deb"
    subprocess.run(["dpkg-deb", "--build", str(root), str(deb)], check=True,
                   capture_output=True)
    builder.main(["--deb", str(deb), "--out", str(tmp_path / "out")])
    _check_built_store(tmp_path / "out")


def test_byte_level_store(tmp_path):
    """--bytes: ids are the UTF-8 bytes of the text (vocabulary 256), documents of 65,536
    bytes, the end-of-text id 256 recorded in the attributes."""
    out = tmp_path / "out"
    builder.main(["--root", str(_package(tmp_path / "pkg")), "--out", str(out), "--bytes"])
    heldout = zarr.open_array(str(out / "heldout.zarr"), mode="r")
    assert heldout.attrs["tokenizer"] == "bytes" and heldout.attrs["eot"] == builder.BYTE_EOT
    docs = np.asarray(heldout[...])
    assert docs.shape[1] == 65536 and docs.max() < 256
    assert bytes(docs[0, :7].astype(np.uint8)) == b"a a a a"  # the synthetic novels' words
    assert len(docs) == 2  # Persuasion: 2 x 65,539 - 1 bytes, the partial remainder dropped
    with pytest.raises(ValueError, match=r"level: 'bpe' not in \('gpt2', 'bytes'\)"):
        builder.build(tmp_path / "pkg", out, level="bpe")
