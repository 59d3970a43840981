"""Fixtures of the sympow.train tests: directories that cannot be written, and the training
logger's records."""

from __future__ import annotations

import logging
import os
import subprocess

import pytest


@pytest.fixture
def make_read_only():
    """``make_read_only(path)`` creates the directory ``path`` and makes it unwritable for this
    process: mode 555, or for root (whom modes do not stop) a read-only tmpfs mounted there.
    Skips the test where root may not mount. Undone at teardown."""
    undo = []

    def make(path):
        path.mkdir(parents=True, exist_ok=True)
        if os.geteuid() != 0:
            path.chmod(0o555)
            undo.append(lambda: path.chmod(0o755))
            return path
        try:
            mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs",
                                      str(path)], capture_output=True, text=True)
        except FileNotFoundError:
            pytest.skip("root without a mount command: cannot make a read-only directory")
        if mounted.returncode != 0:
            pytest.skip(f"root may not mount a read-only tmpfs: {mounted.stderr.strip()}")
        # Lazily: a checkpointer's background thread may still hold the directory open at
        # teardown, and a plain umount then fails with "target is busy" (seen once in CI).
        undo.append(lambda: subprocess.run(["umount", "-l", str(path)], check=True))
        return path

    yield make
    for step in reversed(undo):
        step()


@pytest.fixture
def train_log(caplog):
    """caplog for the 'sympow.train' logger, also after ``setup_logging`` stopped it from
    propagating to the root logger (where caplog listens)."""
    logger = logging.getLogger("sympow.train")
    logger.addHandler(caplog.handler)
    caplog.set_level(logging.INFO, logger="sympow.train")
    try:
        yield caplog
    finally:
        logger.removeHandler(caplog.handler)
