"""sympow.train.workdir: the write probe (read-only folders, paths through a file) and the
workdir lock (exclusive across processes, released when its process dies, even by SIGKILL)."""

from __future__ import annotations

import os

import pytest

from sympow.train.workdir import LOCK_FILE, WorkdirLock, check_writable, probe_writable
from tests.train.helpers import lock_holder


def test_probe_creates_the_folder_and_leaves_nothing(tmp_path):
    probe_writable(tmp_path / "a" / "b")
    assert list((tmp_path / "a" / "b").iterdir()) == []


def test_unwritable_folders_raise_naming_them(tmp_path, make_read_only):
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match=r"workdir: cannot write to .*file/sub \(.*\); pick a "
                                         "writable --workdir"):
        check_writable(tmp_path / "file" / "sub")
    read_only = make_read_only(tmp_path / "ro")
    with pytest.raises(ValueError, match=r"checkpoints: cannot write to .*ro \(.*(Read-only|"
                                         r"Permission denied)"):
        check_writable(read_only, "checkpoints")
    with pytest.raises(OSError):
        probe_writable(read_only / "sub")


def test_the_lock_is_exclusive_until_released(tmp_path):
    with WorkdirLock(tmp_path) as lock:
        assert lock.held
        with pytest.raises(ValueError, match=rf"workdir: {tmp_path} is in use by another "
                                             rf"training process \(pid {os.getpid()} on "):
            WorkdirLock(tmp_path).acquire()
        assert lock.acquire() is lock  # taking it again from the holder is a no-op
    assert not lock.held
    WorkdirLock(tmp_path).acquire().release()


def test_a_killed_holder_does_not_block(tmp_path):
    with lock_holder(tmp_path) as child:
        with pytest.raises(ValueError, match=rf"in use by another training process \(pid "
                                             rf"{child.pid} on .*lock file .*{LOCK_FILE}\)"):
            WorkdirLock(tmp_path).acquire()
    assert (tmp_path / LOCK_FILE).read_text().startswith(f"pid {child.pid} ")  # stale file
    with WorkdirLock(tmp_path):
        assert (tmp_path / LOCK_FILE).read_text().startswith(f"pid {os.getpid()} ")
