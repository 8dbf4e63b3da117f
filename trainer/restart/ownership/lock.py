"""One writer per run directory on one machine: a kernel lock on `<output_dir>/.spotune.lock`.

`spotune train` takes it before it touches anything in the directory and holds it for its
whole life. It is `fcntl.flock` on an open file, so the kernel drops it the moment the process
dies, however it dies (SIGKILL, OOM killer): a stale lock cannot exist, and a rerun after a
kill takes over at once. A forked child (a DataLoader worker) would share the lock's open file
and keep it locked until it noticed its parent was gone (seconds: a rerun right after a SIGKILL
exited busy), so every fork closes the child's copy at once (`_close_in_forked_child`).

The file itself is never deleted (deleting it would let a second process lock a fresh inode
while the first still holds the old one); its content only names the current holder, for the
refusal message and `spotune status`.

A filesystem without `flock` (Lustre mounted without `-o flock`, some FUSE and NFS setups: the
call fails with ENOSYS, EOPNOTSUPP or ENOLCK) gets a weaker lock instead of a failed start: the
file's content names the holder, and a holder whose pid is alive on this host keeps the run; a
dead one's is taken over. It cannot see a holder on another machine (say so once; the remote
lease still fences a shared checkpoint.remote), so mounting with `-o flock` stays the fix.

Readers (`holder`, i.e. `spotune status`) never block: they probe with a shared lock that
fails at once when a writer holds the directory. Such a probe lasts microseconds, so `take`
retries for `PROBE_GRACE` seconds before it reports the directory busy.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import socket
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from trainer.exit_codes import EXIT_BUSY
from trainer.restart.books.ledger import HEARTBEAT_FILE

LOCK_FILE = ".spotune.lock"
PROBE_GRACE = 1.0
"""Seconds `take` retries a refused lock: a `holder` probe (a shared lock) may hold it that long at most."""
POLL_SECONDS = 0.5


_HELD: set[int] = set()
"""Descriptors of the locks this process holds now."""


def _close_in_forked_child() -> None:
    # Runs in the child of every os.fork (DataLoader and multiprocessing workers): the lock is this
    # process's, and it must end with it. Closing the child's copy leaves the parent's lock held.
    for fd in _HELD:
        with contextlib.suppress(OSError):
            os.close(fd)
    _HELD.clear()


os.register_at_fork(after_in_child=_close_in_forked_child)


class RunBusy(Exception):
    """Another process (or machine) holds the run; the message names it. Exit code EXIT_BUSY."""

    exit_code = EXIT_BUSY


def _iso(t: float) -> str:
    return datetime.fromtimestamp(t, tz=timezone.utc).isoformat(timespec="seconds")


def describe(info: dict[str, Any], run_dir: Path | None = None) -> str:
    """`pid 123 on host-a (spotune train, since 2026-01-01T00:00:00+00:00, step 40)`."""
    step = info.get("step")
    if step is None and run_dir is not None:
        step = last_step(run_dir)
    parts = [f"pid {info.get('pid', '?')} on {info.get('host', '?')}"]
    extra = [f"spotune {info.get('command', '?')}", f"since {info.get('started', '?')}"]
    if step is not None:
        extra.append(f"step {step}")
    return f"{parts[0]} ({', '.join(extra)})"


def last_step(run_dir: Path) -> int | None:
    """The holder's newest logged step, from its ledger heartbeat (None before its first step)."""
    try:
        step = json.loads((run_dir / HEARTBEAT_FILE).read_text()).get("last_step")
        return int(step) if step is not None else None
    except (OSError, ValueError, TypeError, AttributeError):
        return None


class RunLock:
    """The exclusive lock of one run directory, held until `release` (or process death)."""

    def __init__(self, run_dir: Path, fd: int, acquired_at: float, waited: float) -> None:
        self.run_dir = run_dir
        self._fd: int | None = fd
        self.acquired_at = acquired_at
        self.waited = waited
        """Seconds spent waiting for an earlier holder (`--wait`): not this attempt's device time."""

    @classmethod
    def take(cls, run_dir: Path | str, command: str, wait: float | None = None) -> RunLock:
        """Lock `run_dir` (created if missing) for `command`, or raise RunBusy naming the holder.

        `wait`: seconds to wait for the holder to end (None or 0: refuse at once).
        """
        run_dir = Path(run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        path = run_dir / LOCK_FILE
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        started = time.monotonic()
        deadline = started + max(PROBE_GRACE, wait or 0.0)
        try:
            said = False
            while not _try_lock(fd, fcntl.LOCK_EX):
                if time.monotonic() >= deadline:
                    raise RunBusy(busy_message(run_dir, wait))
                if wait and not said and time.monotonic() - started >= PROBE_GRACE:  # once: else it looks hung
                    said = True
                    info = holder(run_dir) or {}
                    print(
                        f"spotune: waiting up to {wait:g}s for {run_dir}, in use by {describe(info, run_dir)}",
                        file=sys.stderr,
                        flush=True,
                    )
                time.sleep(min(POLL_SECONDS, 0.05 if time.monotonic() - started < PROBE_GRACE else POLL_SECONDS))
        except BaseException:
            os.close(fd)
            raise
        _HELD.add(fd)
        now = time.time()
        info = {"pid": os.getpid(), "host": socket.gethostname(), "command": command, "started": _iso(now)}
        os.ftruncate(fd, 0)  # rewritten in place: the inode must stay the one every process locks
        os.pwrite(fd, (json.dumps(info) + "\n").encode(), 0)
        waited = time.monotonic() - started
        return cls(run_dir, fd, now, waited if waited > PROBE_GRACE else 0.0)

    def clock_start(self) -> float | None:
        """Where this attempt's ledger clock starts when it waited for the lock (None: at process start)."""
        return self.acquired_at if self.waited else None

    def release(self) -> None:
        if self._fd is None:
            return
        fd, self._fd = self._fd, None
        _HELD.discard(fd)
        try:
            os.ftruncate(fd, 0)  # nobody holds it now: `holder` reads an empty file
        finally:
            os.close(fd)  # closing the descriptor drops the flock

    def __enter__(self) -> RunLock:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


NO_FLOCK = frozenset({errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOLCK})
"""What flock fails with on a filesystem that has none."""
_WARNED: set[str] = set()


def _try_lock(fd: int, kind: int) -> bool:
    try:
        fcntl.flock(fd, kind | fcntl.LOCK_NB)
        return True
    except OSError as e:
        if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            return False
        if e.errno in NO_FLOCK:
            return _pid_lock(fd, e)
        raise


def _pid_lock(fd: int, err: OSError) -> bool:
    """The lock without flock: free unless the file names a live process on this host (not us)."""
    path = os.readlink(f"/proc/self/fd/{fd}") if os.path.exists(f"/proc/self/fd/{fd}") else f"fd {fd}"
    if path not in _WARNED:
        _WARNED.add(path)
        print(
            f"spotune: {path}: this filesystem has no flock ({errno.errorcode.get(err.errno or 0, err)}; Lustre "
            "without -o flock?): the run lock falls back to the holder's pid, seen on this host only. Mount it "
            "with -o flock (or localflock), or put output_dir on a local disk.",
            file=sys.stderr,
            flush=True,
        )
    info = _read_info(fd)
    if not info or info.get("host") != socket.gethostname() or info.get("pid") == os.getpid():
        return True
    try:
        os.kill(int(info["pid"]), 0)
    except ProcessLookupError:
        return True  # its holder died: what the kernel would have released
    except PermissionError:
        return False  # alive, another user's
    except (ValueError, TypeError, KeyError, OverflowError):
        return True  # no pid in it: nobody to wait for
    return False


def holder(run_dir: Path | str) -> dict[str, Any] | None:
    """Who holds `run_dir` now (pid, host, command, started, step), or None; never blocks."""
    run_dir = Path(run_dir)
    path = run_dir / LOCK_FILE
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return None
    try:
        if _try_lock(fd, fcntl.LOCK_SH):
            with contextlib.suppress(OSError):  # no flock here: nothing was taken
                fcntl.flock(fd, fcntl.LOCK_UN)
            return None
        info = _read_info(fd)
    finally:
        os.close(fd)
    info["step"] = last_step(run_dir)
    return info


def _read_info(fd: int) -> dict[str, Any]:
    try:
        info = json.loads(os.pread(fd, 4096, 0).decode() or "{}")
        return info if isinstance(info, dict) else {}
    except ValueError:  # the holder is rewriting it this instant
        return {}


def busy_message(run_dir: Path, wait: float | None) -> str:
    info = holder(run_dir) or {}
    waited = f" after waiting {wait:g}s" if wait else ""
    return (
        f"{run_dir} is in use by {describe(info, run_dir)}{waited}; one writer per run. "
        "Let it finish, stop it (SIGTERM saves a checkpoint), or rerun with --wait SECONDS to resume after it; "
        "`spotune status` shows who holds the run."
    )
