"""A rank whose launcher died: the same save-and-exit as a preemption, then an exit by a deadline.

torchrun (and `accelerate launch`, which runs it) starts every rank in a process session of its
own, so what ends the launcher alone (kill -9, the OOM killer choosing it, a supervisor that kills
the launcher's process group) reaches no rank: they trained on to the end, holding the GPU and
the run's lock, and the next attempt exited 75 (busy). `LauncherWatch` polls the parent pid from a
daemon thread; when the launcher is gone it asks for the one stop path (`Preemption.request`:
every rank agrees on a step, saves a checkpoint, exits 143). Every rank watches its own launcher,
so the ranks of a node see it together, within one poll.

A rank whose partner died with the launcher would wait in the next collective until its timeout;
so `deadline_seconds` after the request a rank still alive exits at once (`os._exit`) with the
same code. Nothing is lost that a rerun needs: checkpoints commit atomically (the newest
committed one is resumed) and the kernel drops the run lock (a `flock`) with the process.

Why polling and not `prctl(PR_SET_PDEATHSIG)`: the death signal fires when the parent *thread*
that started the rank ends, not the parent process, and torchrun starts ranks from whichever of
its threads runs the agent; a poll of `os.getppid()` (the rank is re-parented to init or a
subreaper when the launcher dies) every half second costs nothing and is exact.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable

from trainer.exit_codes import EXIT_PREEMPTED

LAUNCHER_ENV = "TORCHELASTIC_RUN_ID"
"""Set by torchrun (and so by `accelerate launch`) in every rank it starts."""
POLL_SECONDS = 0.5
MIN_DEADLINE_SECONDS = 60.0
"""The hard exit comes `max(checkpoint.notice_seconds, this)` after the launcher died: time for the
step in flight and its save, short of the minutes a stuck collective would hold the GPU."""


def launched() -> bool:
    """Whether this process is a rank that torchrun started (its parent is the launcher)."""
    return bool(os.environ.get(LAUNCHER_ENV))


class LauncherWatch:
    """Polls the parent pid; `request(reason)` once it changes, a hard exit `deadline_seconds` later."""

    def __init__(
        self,
        request: Callable[[str], object],
        deadline_seconds: float,
        poll_seconds: float = POLL_SECONDS,
        exit_now: Callable[[int], object] = os._exit,
    ) -> None:
        self.parent = os.getppid()
        self.request = request
        self.deadline_seconds = deadline_seconds
        self.poll_seconds = poll_seconds
        self.exit_now = exit_now
        self.gone = threading.Event()
        """Set when the launcher was found gone."""
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> LauncherWatch:
        if self.parent <= 1:  # already orphaned (or init's child): nothing to watch
            return self
        self._thread = threading.Thread(target=self._run, name="spotune-launcher-watch", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop polling. A deadline already running stays: the process must still end by it."""
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.wait(self.poll_seconds):
            if os.getppid() != self.parent:
                break
        else:
            return
        self.gone.set()
        self.request(f"the launcher (pid {self.parent}) is gone")
        deadline = time.monotonic() + self.deadline_seconds
        while time.monotonic() < deadline:
            time.sleep(min(self.poll_seconds, max(0.0, deadline - time.monotonic())))
        print(
            f"spotune: still running {self.deadline_seconds:g}s after the launcher died (a rank that died with it "
            f"holds a collective); exiting {EXIT_PREEMPTED}: the next attempt resumes from the newest checkpoint",
            file=sys.stderr,
            flush=True,
        )
        self.exit_now(EXIT_PREEMPTED)
