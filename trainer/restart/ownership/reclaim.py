"""A lease holder cut off from the store, and back: the state machine, and the thread that drives it.

Availability first, never two writers. The states of a holder (trainer/restart/ownership/lease.py):
- online: it holds the lease within its deadline; the thread renews it every `ttl / 3` seconds.
- cut off (`since` set): the deadline passed unrenewed (the store did not answer, or the machine was
  paused), or the lease could not be taken at start. The lease's fence refuses every store write;
  training goes on with local checkpoints; the thread asks the store again every
  `min(ttl / 3, OFFLINE_RETRY_SECONDS)` seconds.
- back online: the store answers and the lease is still this attempt's (unchanged since its last
  renewal, or, never taken, free to take): it is taken as `generation + 1` and uploads resume with
  the newest local checkpoint (which the store's floor checks first: trainer/restart/store/safety.py).
- lost: another attempt took the lease meanwhile. `on_lost` ends the process at once with EXIT_BUSY
  (75), from whichever thread found it, so nothing it runs writes again.
- never taken (the store did not answer at start): the thread takes it with what is left of `--wait`
  (`wait_until`), outside `lease.lock` (waiting out a predecessor's ttl must not block `check` or
  `release`), and stops waiting when the lease is released. Held by another attempt even then: this
  attempt never wrote there, so it asks for the save-and-exit path (`on_outage`: a local checkpoint,
  EXIT_PREEMPTED), not 75: the holder may be a killed predecessor whose lease expires by itself.
Cut off for longer than `outage_seconds`, it asks once for the save-and-exit path (`on_outage`: a
local checkpoint, then EXIT_PREEMPTED, which supervisors restart).
- refused: a request failed with an error not known to be a fault of the moment (trainer/faults.py:
  credentials, permissions, a missing bucket, a full store...; anything unknown). Waiting changes nothing,
  so the thread stops and asks for the save-and-exit path once with that error (`on_refused`: a local
  checkpoint, then the error's exit code, 2 for a setting to fix), never retrying it as a blip for ever.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
from collections.abc import Callable
from typing import Any, Protocol

from trainer import exit_codes
from trainer.exit_codes import EXIT_BUSY
from trainer.faults import transient
from trainer.restart.books.clock import boot_clock, process_start
from trainer.restart.ownership.lease_object import LeaseLost
from trainer.restart.ownership.lock import RunBusy
from trainer.restart.store.lifecycle import Store
from trainer.urls import one_line

OFFLINE_RETRY_SECONDS = 5.0
"""While cut off: how often the lease thread asks the store again (at most; ttl / 3 when shorter)."""


class Holder(Protocol):
    """What the state machine drives: the lease (trainer/restart/ownership/lease.py)."""

    store: Store
    ttl: float
    message: Callable[[str], None]
    lost: str | None
    released: bool
    doing: str
    lock: threading.RLock

    @property
    def held(self) -> bool: ...

    @property
    def generation(self) -> int | None: ...

    def acquire(self, wait: float | None = None, stopping: threading.Event | None = None) -> None: ...

    def renew(self) -> None: ...

    def take_back(self) -> None: ...

    def lapsed(self) -> bool: ...

    def lose(self, why: str) -> Any: ...


class Keeper:
    """The holder's state (online or cut off) and the daemon thread that renews or reclaims."""

    def __init__(self, lease: Holder, outage_seconds: float) -> None:
        self.lease = lease
        self.outage_seconds = outage_seconds
        self.since: float | None = None
        """boot_clock() when cut off from the store; None while the lease may write."""
        self.reported = False
        self.on_outage: Callable[[str], object] = lambda why: None
        """Called once when the store stayed unreachable past `outage_seconds`, or the lease never taken is
        another's (train: save locally, exit 143)."""
        self.refused: BaseException | None = None
        """The error that ended renewing for good (not a fault of the moment), as the store's fault names it."""
        self.on_refused: Callable[[BaseException], object] = lambda error: self.ask_stop(str(error))
        """Called once with `refused` (train: save locally, exit with its code); by default the outage's stop path."""
        self.wait_until: float | None = None
        """boot_clock() until which the lease never taken may be waited for (`--wait`); None: no wait."""
        self.gave_up: str | None = None
        """Why this attempt stopped trying to take the lease (another attempt holds it): it writes nothing there."""
        self.stop_asked: str | None = None
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def cut_off(self) -> bool:
        return self.since is not None

    def cut(self, why: str) -> None:
        """Go (or stay) cut off: write nothing until the lease is taken back."""
        if self.since is None:
            self.since = boot_clock()
            self.lease.message(why)

    def ask_stop(self, why: str) -> None:
        """Ask once for the save-and-exit path (`on_outage`); one set later hears it too (`Lease.on_outage`)."""
        if not self.reported:
            self.reported = True
            self.stop_asked = why
            self.on_outage(why)

    def start(self) -> Keeper:
        """Renew (or, cut off, retry) in the background until `stop`."""
        self._thread = threading.Thread(target=self._loop, name="spotune-lease", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stopping.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5.0)

    def _loop(self) -> None:
        while not self._stopping.wait(self._interval()):
            try:
                self.tick()
            except LeaseLost:
                return  # on_lost already ran
            except Exception as e:
                if not transient(e):  # refused for good: retrying changes nothing (trainer/faults.py)
                    self._refuse(e)
                    return
                if not self.cut_off:  # a network blip: the next try (or the deadline) decides
                    self.lease.message(
                        f"spotune: renewing the lease of {self.lease.store.shown} failed ({one_line(e)}); retrying"
                    )
                    self.lease.lapsed()
                self._outage_check()

    def _refuse(self, e: BaseException) -> None:
        """End the attempt on an error that rerunning will not change: writing nothing more, saving locally,
        exiting with the error's code (StoreDenied: 2, naming the setting; a bug: 1)."""
        lease = self.lease
        self.refused = lease.store.fault(e, lease.doing) or e
        self.cut(
            f"spotune: the lease of {lease.store.shown} failed for good ({one_line(self.refused)}); writing nothing "
            "more there"
        )
        self.on_refused(self.refused)

    def _interval(self) -> float:
        ttl = self.lease.ttl
        return min(ttl / 3, OFFLINE_RETRY_SECONDS) if self.cut_off or not self.lease.held else ttl / 3

    def tick(self) -> None:
        """One step of the machine: renew when online; cut off, take the lease back if it is still
        this attempt's; never taken, take it (outside `lease.lock`). Raises LeaseLost when another attempt
        took it from this one, OSError-likes when unreachable."""
        lease = self.lease
        with lease.lock:
            if lease.lost is not None or lease.released:
                raise LeaseLost(lease.lost or "this attempt released the lease")
            if self.gave_up is not None:
                return
            if lease.held:
                if self.cut_off or lease.lapsed():
                    lease.take_back()
                    self._back()
                else:
                    lease.renew()
                return
        self._take()

    def _take(self) -> None:
        """The store answers (for the first time): take the lease with what is left of `--wait`, polling
        without `lease.lock` and stopping when the lease is released."""
        lease = self.lease
        left = 0.0 if self.wait_until is None else max(0.0, self.wait_until - boot_clock())
        try:
            lease.acquire(left, stopping=self._stopping)
        except RunBusy as e:
            self.gave_up = str(e)
            self.ask_stop(
                f"spotune: the lease of {lease.store.shown} could not be taken: {e}. This attempt never wrote "
                "there; saving locally and stopping (exit 143: the next attempt waits for the lease again)"
            )
            return
        with lease.lock:
            self._back()

    def _back(self) -> None:
        lease = self.lease
        if self.since is not None:
            lease.message(
                f"spotune: {lease.store.shown} answers again and the run's lease was still this attempt's; took it "
                f"back as generation {lease.generation}; uploads resume with the newest local checkpoint"
            )
        self.since = None

    def _outage_check(self) -> None:
        if self.since is None or self.reported:
            return
        if boot_clock() - self.since > self.outage_seconds:
            self.ask_stop(
                f"spotune: {self.lease.store.shown} has been unreachable for over {self.outage_seconds:g}s "
                "(checkpoint.store_outage_seconds)"
            )


def exit_busy(why: str) -> None:
    """Exit the whole process now, from whichever thread found the lease lost (no thread writes again).
    The code merges into the exit file as every rank's does (a rank 1 that ran out of memory stays 5)."""
    with contextlib.suppress(OSError):  # the code still reaches the launcher as the process's status
        exit_codes.record(EXIT_BUSY, since=process_start())
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(EXIT_BUSY)
