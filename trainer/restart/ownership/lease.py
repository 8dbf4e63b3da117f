"""One writer per run across machines: the lease object in `checkpoint.remote` as a lock, and the
fence every store write of its holder asks first.

Contract. At most one attempt writes a run's store at any moment, whatever the clocks, pauses and
outages. `<remote>/lease.json` names the attempt that may write the run (holder id, host, pid, run
directory, `generation`, `renewed_at`, `expires_at`, and for the ledger: when the process started,
its device count, device and price per hour, and the earlier attempts no ledger row books yet,
trainer/restart/books/handover.py). An
attempt takes it before it reads or writes anything else in the store:
- absent: created with `If-None-Match: *` (two machines racing: one wins);
- released, or held by this same run directory on this same host (the kernel lock of
  trainer/restart/ownership/lock.py, which this process holds, proves that holder is dead): replaced at once
  with `If-Match: <etag read>` and `generation + 1`;
- held by someone else: refused (RunBusy), or with `--wait` polled. It is taken over only once the
  object has not changed for the holder's `ttl` on the taker's own clock: machines' wall clocks
  may disagree, so the holder's `expires_at` is only a hint that the taker should look that long.

The holder fences itself: a local deadline on a clock that counts suspension (`clock.boot_clock`),
`ttl` minus a margin after the renewal was sent; every store write asks `check` first, and refuses
while the lease is cut off, lost or past its deadline. Commits (a manifest, the ledger) go through
`commit`: on stores that enforce conditions a conditional renewal right before the write, the
manifest with `If-None-Match: *`; elsewhere a re-read of the lease before and after. A refused
conditional write is checked against a re-read first (s3fs resends a PUT after a timeout: when the
first one landed, the refused resend is ours). Renewing in the background, going cut off and taking
the lease back are trainer/restart/ownership/reclaim.py's state machine.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn, TypeVar

from trainer.exit_codes import EXIT_BUSY
from trainer.restart import defaults
from trainer.restart.books.clock import boot_clock, process_start
from trainer.restart.books.handover import Handover
from trainer.restart.books.ledger import LEDGER_FILE
from trainer.restart.ownership import lease_object
from trainer.restart.ownership.lease_object import (
    LEASE_FILE,
    LeaseLost,
    busy_message,
    describe_lease,
    read_lease,
    ttl_of,
)
from trainer.restart.ownership.lock import RunBusy, _iso, last_step
from trainer.restart.ownership.reclaim import Keeper, exit_busy
from trainer.restart.store.conditional import Refused, conditional, read_object, write_object
from trainer.restart.store.errors import StoreOffline
from trainer.restart.store.lifecycle import Fence, Store

T = TypeVar("T")

POLL_SECONDS = 5.0

wall_clock: Callable[[], float] = time.time
"""The wall clock the lease object's times are written and compared on (`renewed_at`, `expires_at`, when it was
taken): one name, read at each call, so that a model of several machines runs the lease on its own clock as it
does `boot_clock` (tests/test_floor_model.py)."""

__all__ = ["Lease", "LeaseLost", "read_lease", "describe_lease"]


class Lease(Fence):
    """This attempt's claim on a run's remote prefix."""

    def __init__(
        self,
        store: Store,
        ttl: float,
        run_dir: Path,
        message: Callable[[str], None] = print,
        outage_seconds: float = defaults.STORE_OUTAGE_SECONDS,
    ) -> None:
        self.store = store
        self.ttl = ttl
        self.run_dir = run_dir
        self.message = message
        self.id = uuid.uuid4().hex
        self.host = socket.gethostname()
        self.process_start = process_start()
        self.world = int(os.environ.get("WORLD_SIZE", "1") or 1)
        self.body: dict[str, Any] | None = None
        self.etag: str | None = None
        self.deadline = 0.0
        self.acquired_at: float | None = None
        self.waited = 0.0
        self.requests = 0  # reads, writes and the probe: its cost on the store's bill
        self.doing = "write"
        """The kind of the last store request (`read` or `write`; the conditional probe writes): what a refusal
        at start names the permission of (trainer/restart/ownership/owner.py)."""
        self.on_lost: Callable[[str], None] = exit_busy
        self.lost: str | None = None
        self.released = False  # after `release`, an upload thread still running must not take it again
        self.no_attempt = False
        self.device: str | None = None
        self.price_per_hour: float | None = None
        """What this attempt runs on and its rate (set once known): a kill before its ledger opens is still
        booked with its device and cost by the next holder (trainer/restart/books/handover.py)."""
        """This process trained nothing (the run finished already): its release says so (`no_attempt`), and the
        next holder carries its chain but books no attempt for it (trainer/restart/books/handover.py)."""
        self.lock = threading.RLock()
        self.keeper = Keeper(self, outage_seconds)
        """Online or cut off, and the thread that renews or reclaims (trainer/restart/ownership/reclaim.py)."""
        self.handover = Handover()
        """The earlier attempts this one took the run from, for the ledger (trainer/restart/books/handover.py)."""
        self._attempted: tuple[dict[str, Any] | None, float] = (None, 0.0)  # the last body sent, and when
        self.margin = min(5.0, ttl * 0.1)
        """Seconds the holder stops writing before its lease could be taken: what the clocks' rates may differ by."""

    @property
    def held(self) -> bool:
        return self.body is not None

    @property
    def generation(self) -> int | None:
        return int(self.body["generation"]) if self.body else None

    @property
    def offline_since(self) -> float | None:
        """boot_clock() when cut off from the store; None while it may write."""
        return self.keeper.since

    @property
    def on_outage(self) -> Callable[[str], object]:
        return self.keeper.on_outage

    @on_outage.setter
    def on_outage(self, call: Callable[[str], object]) -> None:
        self.keeper.on_outage = call
        if self.keeper.stop_asked is not None:  # asked before the stop path was set up
            call(self.keeper.stop_asked)

    @property
    def previous(self) -> list[dict[str, Any]]:
        return self.handover.previous

    # ------------------------------------------------------------------ taking it

    def acquire(self, wait: float | None = None, stopping: threading.Event | None = None) -> None:
        """Take the lease, or raise RunBusy naming its live holder (after waiting `wait` seconds). Once
        `stopping` is set (the lease thread: the lease released) it stops waiting and raises LeaseLost."""
        stopping = stopping or threading.Event()
        started = boot_clock()
        deadline = started + (wait or 0.0)
        self.requests += 3 if self.store.conditional is None and hasattr(self.store.fs, "call_s3") else 0
        self.doing = "write"
        conditional(self.store)  # probed once, before the first conditional write relies on it
        watched: tuple[str | None, float] = (None, 0.0)  # the etag seen unchanged since when (our clock)
        alive = False  # seen to change: its holder renews
        said = False
        while True:
            current, etag = self._read()
            now = boot_clock()
            if etag != watched[0]:
                alive = watched[0] is not None
                watched = (etag, now)
            silent = now - watched[1]  # how long the object has not changed, by this machine's clock
            if current is None or self._may_take(current) or silent >= ttl_of(current, self.ttl):
                generation = int(current.get("generation", 0)) + 1 if current else 1
                if current is not None:
                    self.handover.took_over(current, self.id)
                try:
                    self._write(generation, etag if current else None, new=current is None)
                except Refused:
                    continue  # another machine wrote it between our read and write: look again
                self.acquired_at = wall_clock()
                self.waited = boot_clock() - started
                if current is not None and not current.get("released") and current.get("holder") != self.id:
                    self.message(
                        f"spotune: took over the lease of {self.store.shown}: {lease_object.takeover_reason(current, self.ttl, self.host, silent)}"
                    )
                return
            # The holder's own clock says it expired: look for one ttl (its renewals would show) before
            # refusing, however short `wait` is; a live holder renews every ttl / 3.
            hint = wall_clock() > float(current.get("expires_at", 0))
            observe = watched[1] + ttl_of(current, self.ttl) if hint and not alive else 0.0
            left = max(deadline, observe) - now
            if left <= 0:
                raise RunBusy(busy_message(self.store, current, wait))
            if not said:  # once: a --wait that says nothing looks like a hang
                said = True
                self.message(
                    f"spotune: waiting up to {left:.0f}s for the lease of {self.store.shown}, held by {describe_lease(current)}"
                )
            if stopping.wait(max(0.05, min(POLL_SECONDS, left, ttl_of(current, self.ttl) / 6))):
                raise LeaseLost("this attempt released the lease before it could take it")

    def _may_take(self, current: dict[str, Any]) -> bool:
        if current.get("released") or current.get("holder") == self.id:
            return True  # released, or our own create that s3fs resent after it landed
        # This directory's kernel lock is ours, so whoever held the lease from it on this host is dead.
        return current.get("host") == self.host and current.get("run_dir") == str(self.run_dir.resolve())

    def start(self) -> Lease:
        """Renew (or, cut off, retry) in the background until `release` (trainer/restart/ownership/reclaim.py)."""
        self.keeper.start()
        return self

    def offline(self, why: str, wait: float | None = None) -> None:
        """The store could not be reached to take the lease at start: write nothing until it is taken; the
        lease thread takes it, waiting at most `wait` more seconds (what is left of `--wait`) for a holder."""
        self.keeper.wait_until = None if wait is None else boot_clock() + wait
        self.keeper.cut(
            f"spotune: the lease of {self.store.shown} could not be taken ({why}); writing nothing there until it is"
        )

    # ------------------------------------------------------------------ holding it

    def renew(self) -> None:
        """Extend the held lease by `ttl`, conditional on nobody having replaced it. Raises LeaseLost when
        another attempt holds it, OSError-likes when unreachable. Cut off, `reclaim` takes it back instead."""
        with self.lock:
            if self.lost is not None or self.released:
                raise LeaseLost(self.lost or "this attempt released the lease")
            if self.keeper.cut_off or not self.held or self.lapsed():
                raise StoreOffline(f"{self.store.shown}: the lease is not held now; the lease thread takes it back")
            assert self.body is not None
            if not conditional(self.store):  # the documented fallback: look before a plain write
                self._confirm()
            try:
                self._write(int(self.body["generation"]), self.etag, new=False)
            except Refused:
                self._settle()

    def take_back(self) -> None:
        """Cut off and the store answers: write the lease as `generation + 1` if it is still this attempt's."""
        current, etag = self._read()
        if current is not None and (current.get("holder"), current.get("generation")) != (self.id, self.generation):
            self.lose(
                "another attempt took the run's lease while this one was cut off from the store (paused, or cut "
                f"off, past expiry): {describe_lease(current)}"
            )
        try:
            self._write((self.generation or 0) + 1, etag, new=current is None)
        except Refused:
            self._settle()  # our own PUT resent after it landed goes on; anyone else's write is a loss

    def _settle(self) -> None:
        """A conditional renewal was refused: ours if the object is the very body we sent (a resent PUT that
        landed, whose resend was refused), lost otherwise."""
        current, etag = self._read()
        body, sent = self._attempted
        if current != body:
            self.lose("another machine took the run's lease (this attempt was paused, or cut off, past expiry)")
        self.body, self.etag, self.deadline = body, etag, sent + self.ttl - self.margin

    def check(self) -> None:
        """Raise LeaseLost (after on_lost) or StoreOffline unless this attempt may write now; no request."""
        with self.lock:
            if self.lost is not None or self.released:
                raise LeaseLost(self.lost or "this attempt released the lease")
            if self.keeper.cut_off or not self.held or self.lapsed():
                raise StoreOffline(
                    f"{self.store.shown}: this attempt is cut off from the store (its lease is not confirmed); "
                    "nothing is written there until the lease is taken back"
                )

    def commit(self, write: Callable[[], T]) -> T:
        """Run a commit write only while this attempt holds the lease, and confirm it still did after."""
        with self.lock:
            self.check()
            if conditional(self.store):
                self.renew()  # conditional: proves the lease is ours and gives the write a full ttl
            else:
                self._confirm()
            result = write()
            if not conditional(self.store):
                self._confirm()
            self.lapsed()  # a write that outlasted the lease: the re-read after the outage decides
            return result

    def put_new(self, store: Store, local: Path, path: str) -> None:
        """A manifest: `If-None-Match: *` where enforced, so a step another writer committed is never overwritten."""
        if store.conditional is None:
            store.conditional = conditional(self.store)
        body = local.read_bytes()
        try:
            write_object(store, path, body, new=True)
        except Refused:
            got = read_object(store, path)
            if got is not None and got[0] == body:
                return  # our own PUT, resent by s3fs after the first one landed
            self.lose(f"{path} was committed by another writer meanwhile")

    def new_run(self) -> list[dict[str, Any]]:
        """`checkpoint.resume=never`: the earlier attempts this lease carries belong to the run set aside, not
        to the new one; returns them (for the old run's ledger) and carries them no more."""
        records, self.handover.previous = self.handover.previous, []
        return records

    def hand_over(self) -> list[dict[str, Any]]:
        """The records of earlier attempts for the ledger to book now (trainer/restart/books/handover.py)."""
        return self.handover.hand_over()

    def pushed(self, rel: str) -> None:
        self.handover.pushed(rel, LEDGER_FILE)

    def _confirm(self) -> None:
        current, _ = self._read()
        if current is None or current.get("holder") != self.id or current.get("generation") != self.generation:
            self.lose("the run's lease now names another holder")
        if self.lapsed():
            raise StoreOffline(f"{self.store.shown}: the lease lapsed during the write; it is confirmed again first")

    def lapsed(self) -> bool:
        """Whether the lease is not confirmed now: cut off, or its deadline passed (it goes cut off then:
        nothing is written until it is taken back)."""
        if self.held and not self.keeper.cut_off and boot_clock() > self.deadline:
            self.keeper.cut(
                f"spotune: the lease of {self.store.shown} was not renewed for over {self.ttl - self.margin:g}s "
                f"(paused, or cut off); writing nothing there until it is confirmed again, training goes on with "
                f"local checkpoints (at most checkpoint.store_outage_seconds={self.keeper.outage_seconds:g}s)"
            )
        return self.keeper.cut_off

    def lose(self, why: str) -> NoReturn:
        if self.lost is not None:
            raise LeaseLost(self.lost)
        self.lost = why
        self.message(
            f"spotune: lost the lease of {self.store.shown}: {why}. Stopping now without writing anything more "
            f"there; exit {EXIT_BUSY}. `spotune status {self.store.shown}` shows who holds the run."
        )
        self.on_lost(why)
        raise LeaseLost(why)

    # ------------------------------------------------------------------ letting go

    def release(self) -> None:
        """Stop renewing and mark the lease released (conditional), so the next attempt starts at once."""
        with self.lock:
            self.released = True
        self.keeper.stop()
        with self.lock:
            if not self.body or self.lost is not None or self.lapsed():
                return
            try:
                self._write(int(self.body["generation"]), self.etag, new=False, released=True)
            except Exception:  # it expires by itself; the next attempt waits at most ttl
                pass
            self.body = None

    # ------------------------------------------------------------------ the object

    def _read(self) -> tuple[dict[str, Any] | None, str | None]:
        self.requests += 1
        self.doing = "read"
        return read_lease(self.store)

    def _write(self, generation: int, if_match: str | None, *, new: bool, released: bool = False) -> None:
        sent = boot_clock()
        now = wall_clock()
        body = {
            "holder": self.id,
            "host": self.host,
            "pid": os.getpid(),
            "run_dir": str(self.run_dir.resolve()),
            "generation": generation,
            "started": _iso(self.acquired_at or now),
            "process_start": self.process_start,
            "world_size": self.world,
            "renewed_at": now,
            "expires_at": now if released else now + self.ttl,
            "ttl": self.ttl,
            "step": last_step(self.run_dir),
            "unbooked": self.handover.previous,
            "device": self.device,
            "price_per_hour": self.price_per_hour,
        }
        if released:
            body["released"] = True
            if self.no_attempt:
                body["no_attempt"] = True
        self.requests += 1
        self.doing = "write"
        self._attempted = (body, sent)
        etag = write_object(
            self.store, self.store.path(LEASE_FILE), json.dumps(body).encode(), if_match=if_match, new=new
        )
        self.body, self.etag = body, etag
        self.deadline = sent + self.ttl - self.margin
