"""A launcher that dies leaves no rank behind: torchrun starts its ranks in sessions of their own,
so a SIGKILL of torchrun alone reaches none of them. Each rank sees its parent gone (this watch),
the ranks agree on a step, save, and exit within seconds; the same command then resumes at once
(no 75). The drill with real torchrun ranks is test_kill_anywhere.py's two-process one, whose second
attempt loses its launcher."""

from __future__ import annotations

import os
import time

import pytest

from trainer.exit_codes import EXIT_PREEMPTED
from trainer.restart.signals import launcher


def test_watch_requests_the_stop_then_exits_by_the_deadline(monkeypatch: pytest.MonkeyPatch) -> None:
    asked: list[str] = []
    exited: list[int] = []
    watch = launcher.LauncherWatch(asked.append, deadline_seconds=0.2, poll_seconds=0.01, exit_now=exited.append)
    watch.start()
    time.sleep(0.1)
    assert asked == [] and exited == []  # the parent lives: nothing happens
    monkeypatch.setattr(os, "getppid", lambda: 1)  # re-parented to init: the launcher died
    assert watch.gone.wait(2.0)
    assert asked == [f"the launcher (pid {watch.parent}) is gone"]
    deadline = time.monotonic() + 2.0
    while not exited and time.monotonic() < deadline:
        time.sleep(0.01)
    assert exited == [EXIT_PREEMPTED]


def test_stopped_watch_does_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    asked: list[str] = []
    watch = launcher.LauncherWatch(asked.append, deadline_seconds=0.0, poll_seconds=0.01, exit_now=asked.append)
    watch.start().stop()
    monkeypatch.setattr(os, "getppid", lambda: 1)
    time.sleep(0.1)
    assert asked == [] and not watch.gone.is_set()
