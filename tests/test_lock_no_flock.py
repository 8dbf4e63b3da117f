"""A run directory on a filesystem without flock (Lustre without -o flock: ENOSYS) still starts:
the lock falls back to the holder's pid on this host, said once, instead of exit 1."""

from __future__ import annotations

import errno
import fcntl
import json
import socket
import subprocess
from pathlib import Path

import pytest

from trainer.restart.ownership import lock


@pytest.fixture
def no_flock(monkeypatch: pytest.MonkeyPatch) -> None:
    def flock(fd: int, op: int) -> None:
        raise OSError(errno.ENOSYS, "Function not implemented")

    monkeypatch.setattr(fcntl, "flock", flock)
    lock._WARNED.clear()


def test_a_filesystem_without_flock_starts_and_says_why_once(
    tmp_path: Path, no_flock: None, capsys: pytest.CaptureFixture[str]
) -> None:
    with lock.RunLock.take(tmp_path, "train"):
        assert lock.holder(tmp_path) is None  # our own pid: not another holder
    with lock.RunLock.take(tmp_path, "train"):
        pass
    err = capsys.readouterr().err
    assert err.count("has no flock (ENOSYS") == 1 and "-o flock" in err


def test_a_live_holder_keeps_the_run_and_a_dead_one_does_not(tmp_path: Path, no_flock: None) -> None:
    other = subprocess.Popen(["sleep", "60"])
    try:
        info = {"pid": other.pid, "host": socket.gethostname(), "command": "train", "started": "earlier"}
        (tmp_path / lock.LOCK_FILE).write_text(json.dumps(info))
        with pytest.raises(lock.RunBusy, match=f"pid {other.pid}"):
            lock.RunLock.take(tmp_path, "train")
        assert (lock.holder(tmp_path) or {}).get("pid") == other.pid
    finally:
        other.kill()
        other.wait()
    with lock.RunLock.take(tmp_path, "train") as taken:  # its holder died: taken over at once
        assert taken.waited == 0.0
