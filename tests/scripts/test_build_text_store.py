"""scripts/build_text_store.py: any folder or tarball of text files -> a LongCrawl64-layout
store that the loader reads unchanged (small generated inputs)."""

from __future__ import annotations

import tarfile

import numpy as np
import pytest

from scripts import build_text_store as builder
from sympow.data import EOT, LongCrawl64, gpt2_encoding


def _tree(root, files=12, lines=3000):
    """Files of distinct, recognizable text in nested folders (about 30k tokens each)."""
    for i in range(files):
        path = root / f"dir{i % 3}" / f"file{i:02d}.c"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("".join(f"int f{i}_{j}(void) {{ return {j}; }}\n" for j in range(lines)))
    (root / "dir0" / "skip.bin").write_bytes(b"\xff\xfe" * 100)
    return root


def test_folder_to_store_in_path_order(tmp_path):
    src = _tree(tmp_path / "src")
    stats = builder.build(src, tmp_path / "out", include=["*.c"], heldout=0.25)
    enc = gpt2_encoding()
    paths = sorted(p for p in src.rglob("*.c"))
    stream = np.concatenate([np.asarray(enc.encode_ordinary(p.read_text()) + [EOT])
                             for p in paths])
    n = len(stream) // 65536
    assert stats["files"] == 12 and stats["tokens"] == len(stream)
    assert (stats["train_docs"], stats["heldout_docs"]) == (n - round(n * 0.25), round(n * 0.25))
    assert stats["dropped_tokens"] == len(stream) - n * 65536
    train = LongCrawl64(tmp_path / "out", "train", 1, 65536, prefetch=0, vocab_size=50304)
    heldout = LongCrawl64(tmp_path / "out", "heldout", 1, 65536, prefetch=0)
    got = np.concatenate([train[k][1] for k in range(len(train))]
                         + [heldout[k][1] for k in range(len(heldout))])
    np.testing.assert_array_equal(got.reshape(-1), stream[: n * 65536])  # path order, no gaps


def test_tarball_and_bytes_tokenizer(tmp_path):
    src = _tree(tmp_path / "src", files=4)
    tarball = tmp_path / "src.tar.gz"
    with tarfile.open(tarball, "w:gz") as tar:
        tar.add(src, arcname="linux")
    stats = builder.build(tarball, tmp_path / "out", include=["*.c"], tokenizer="bytes")
    stream = np.concatenate([np.append(np.frombuffer(p.read_bytes(), np.uint8), 256)
                             for p in sorted(src.rglob("*.c"))])  # end-of-text 256 between
    n = len(stream) // 65536
    assert stats["tokens"] == len(stream) and stats["files"] == 4
    train = LongCrawl64(tmp_path / "out", "train", 1, 65536, prefetch=0, eot=256,
                        vocab_size=257)
    heldout = LongCrawl64(tmp_path / "out", "heldout", 1, 65536, prefetch=0)
    got = np.concatenate([train[k][1] for k in range(len(train))]
                         + [heldout[k][1] for k in range(len(heldout))])
    np.testing.assert_array_equal(got.reshape(-1), stream[: n * 65536])
    assert train[0][0][0, 0] == 256  # the byte store's end-of-text begins every window


def test_errors_name_the_argument(tmp_path):
    with pytest.raises(ValueError, match=r"src: .* is neither a folder nor a tarball"):
        builder.build(tmp_path / "missing", tmp_path / "out")
    src = _tree(tmp_path / "src", files=1, lines=10)
    with pytest.raises(ValueError, match=r"no files matched"):
        builder.build(src, tmp_path / "out", include=["*.py"])
    with pytest.raises(ValueError, match=r"need at least 2 \(one per split\)"):
        builder.build(src, tmp_path / "out", include=["*.c"])
    with pytest.raises(ValueError, match=r"heldout: need a fraction in \(0, 1\), got 1.5"):
        builder.build(src, tmp_path / "out", heldout=1.5)
    with pytest.raises(ValueError, match=r"tokenizer: 'bpe' not in"):
        builder.build(src, tmp_path / "out", tokenizer="bpe")
