"""A run's workdir: one training process at a time (a lock), and writable before training.

``WorkdirLock`` holds an exclusive ``fcntl.flock`` on ``<workdir>/.lock`` while a run trains,
so that a second ``train`` on the same workdir (another shell, a scheduler's retry) refuses
with an error naming the process that holds it, instead of both writing checkpoints and
metrics. The kernel releases a flock when its process dies (even on SIGKILL), so a lock
file left by a dead run never blocks: only a live holder does. The file itself stays (it
records the last holder); deleting it while held would let a third process lock a new file.
In a multi-host run process 0 takes the lock for all. On NFS, Linux implements flock with
byte-range locks that the server arbitrates, so it holds across machines there too.

``probe_writable`` creates, syncs and removes a one-byte file: unlike ``os.access`` (which
answers True for root) it also sees read-only mounts. A disk that fills up later is caught
where the checkpoint is written (``sympow.train.checkpoint``).
"""

from __future__ import annotations

import datetime
import fcntl
import os
import socket
import tempfile
from pathlib import Path

LOCK_FILE = ".lock"


def probe_writable(directory: str | os.PathLike) -> None:
    """Creates ``directory`` (and parents) if needed and writes, syncs and deletes a probe file
    in it; raises the OSError of whichever step fails."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=directory, prefix=".write-probe-") as probe:
        probe.write(b"0")
        probe.flush()
        os.fsync(probe.fileno())


def check_writable(directory: str | os.PathLike, what: str = "workdir") -> None:
    """``probe_writable`` as a ValueError naming ``what`` (the argument) and the directory."""
    try:
        probe_writable(directory)
    except OSError as error:
        raise ValueError(f"{what}: cannot write to {Path(directory).resolve()} ({error}); "
                         "pick a writable --workdir") from error


class WorkdirLock:
    """Exclusive lock of a workdir for one training process (see the module docstring).

    ``acquire`` raises ValueError naming the workdir and the holder when another process (or
    another ``WorkdirLock`` in this one) holds it; ``release`` (or leaving the ``with``
    block) frees it.
    """

    def __init__(self, workdir: str | os.PathLike):
        self.path = Path(workdir).resolve() / LOCK_FILE
        self._fd: int | None = None

    @property
    def held(self) -> bool:
        return self._fd is not None

    def acquire(self) -> WorkdirLock:
        if self._fd is not None:
            return self
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 512, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise ValueError(
                f"workdir: {self.path.parent} is in use by another training process "
                f"({holder}; lock file {self.path}); wait for it to finish or stop it, or "
                "use another --workdir") from None
        except BaseException:
            os.close(fd)
            raise
        # Who holds it, for the error above (the lock itself is the flock, not this text).
        since = datetime.datetime.now().isoformat(timespec="seconds")
        info = f"pid {os.getpid()} on {socket.gethostname()} since {since}\n".encode()
        os.ftruncate(fd, 0)
        os.pwrite(fd, info, 0)
        self._fd = fd
        return self

    def release(self) -> None:
        if self._fd is None:
            return
        fd, self._fd = self._fd, None
        try:
            fcntl.flock(fd, fcntl.LOCK_UN)
        finally:
            os.close(fd)

    def __enter__(self) -> WorkdirLock:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()
