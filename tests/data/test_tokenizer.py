"""sympow.data.tokenizer: the offline GPT-2 BPE against known GPT-2 token ids."""

import shutil

import pytest

from sympow.data import EOT, gpt2_encoding, tokenizer


def test_gpt2_encoding_offline():
    enc = gpt2_encoding()
    assert enc.encode("Hello world") == [15496, 995]
    assert enc.encode("<|endoftext|>", allowed_special="all") == [EOT]
    assert enc.n_vocab == 50257
    text = "It is a truth universally acknowledged, that a single man..."
    assert enc.decode(enc.encode(text)) == text


def test_byte_map_is_gpt2s():
    """GPT-2 writes a space as 'Ġ' (U+0120) and a newline as 'Ċ' (U+010A) in its vocabulary;
    printable ASCII maps to itself; all 256 bytes are covered once."""
    table = tokenizer._gpt2_char_to_byte()
    assert table["\u0120"] == ord(" ") and table["\u010a"] == ord("\n")
    assert table["A"] == ord("A") and table["!"] == ord("!")
    assert sorted(table.values()) == list(range(256))


def test_tampered_bpe_file_is_refused(tmp_path, monkeypatch):
    encoder, vocab = tokenizer._bpe_files()
    copy = tmp_path / "vocab.bpe"
    shutil.copy(vocab, copy)
    with copy.open("a") as f:
        f.write("x y\n")
    monkeypatch.setattr(tokenizer, "_bpe_files", lambda: (encoder, copy))
    with pytest.raises(ValueError, match="sha256 differs"):
        gpt2_encoding()
