"""Embedded default corpus: Jane Austen's six novels as a LongCrawl64-layout token store.

``DEFAULT_STORE`` (exported as ``sympow.data.AUSTEN_PATH``) is the committed store
``data/austen`` of a source checkout (not part of an installed wheel): ``train.zarr`` holds
five novels and ``heldout.zarr`` Persuasion, GPT-2 tokens in 65,536-token documents, read with
``sympow.data.LongCrawl64``. It is built, deterministically and offline, by
``scripts/build_austen_store.py``; provenance, license and layout are in
``data/austen/README.md``.
"""

from __future__ import annotations

from pathlib import Path

DEFAULT_STORE = Path(__file__).resolve().parents[2] / "data" / "austen"
# The same novels at byte level (ids 0-255 the UTF-8 bytes, end-of-text 256), 65,536-byte
# documents: ``scripts/build_austen_store.py --bytes``; the CPU demo's corpus.
BYTES_STORE = Path(__file__).resolve().parents[2] / "data" / "austen_bytes"
BYTES_EOT, BYTES_VOCAB = 256, 257
