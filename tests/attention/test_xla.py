"""The pure-JAX primitives (xla.py) through the public API: the shared suite for impl='xla'."""

from __future__ import annotations

from sympow.attention import xla
from tests.attention.suite import AttentionSuite


class TestXla(AttentionSuite):
    impl = "xla"
    algorithm = "chunked"


def test_default_chunk_size_covers_short_sequences_and_caps_at_64():
    assert [xla.default_chunk_size(t) for t in (1, 5, 8, 9, 63, 64, 65, 10_000)] == [
        8, 8, 8, 16, 64, 64, 64, 64]
