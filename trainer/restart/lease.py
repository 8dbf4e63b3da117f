"""One writer per run across machines: a lease object in `checkpoint.remote`, with a fencing token.

`<remote>/lease.json` names the attempt that may write the run (holder id, host, pid, run
directory, `generation`, `renewed_at`, `expires_at`, and for the ledger: when the process
started, its device count, and the earlier attempts no ledger row books yet). An attempt takes
it before it reads or writes anything else in the store:
- absent: created with `If-None-Match: *` (two machines racing: one wins);
- released, or held by this same run directory on this same host (the kernel lock of
  trainer/restart/lock.py, which this process holds, proves that holder is dead): replaced at once
  with `If-Match: <etag read>` and `generation + 1`;
- held by someone else: refused (RunBusy), or with `--wait` polled. It is taken over only once the
  object has not changed for the holder's `ttl` on the taker's own clock: machines' wall clocks
  may disagree, so the holder's `expires_at` is only a hint that the taker should look that long.

A daemon thread renews it every `ttl / 3` seconds with `If-Match` on the etag it last wrote
(a thread, since one step of a large model can outlast the lease). The holder fences itself: a
local deadline on a clock that counts suspension (`clock.boot_clock`), `ttl` minus a margin
after the renewal was sent; every store write asks `check` first. Commits (a manifest, the ledger)
go through `commit`: on stores that enforce conditions a conditional renewal right before the
write, the manifest with `If-None-Match: *`; elsewhere a re-read of the lease before and after.

Availability first, never two writers. A holder whose deadline passes (the store is cut off, or the machine
was paused) goes offline: it writes nothing to the store and trains on with local checkpoints while the thread
retries. When the store answers, it re-reads the lease: still its own (unchanged since its last renewal) -> it
takes it back as `generation + 1` and the uploads resume with the newest local checkpoint; taken by another
attempt -> it exits EXIT_BUSY at once, having written nothing more. Offline longer than `outage_seconds`, it
asks for the save-and-exit path (`on_outage`: a local checkpoint, then EXIT_PREEMPTED, which supervisors
restart). A refused conditional write is checked against a re-read first (s3fs resends a PUT after a timeout:
when the first one landed, the refused resend is ours).
"""

from __future__ import annotations

import json
import os
import socket
import sys
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn, TypeVar

from trainer.config.schema import CheckpointConfig
from trainer.exit_codes import EXIT_BUSY, EXIT_FILE_ENV
from trainer.restart import lease_object
from trainer.restart.clock import boot_clock, process_start
from trainer.restart.conditional import Refused, conditional, read_object, write_object
from trainer.restart.lease_object import LEASE_FILE, attempt_record, busy_message, describe_lease, read_lease, ttl_of
from trainer.restart.lock import RunBusy, _iso, last_step
from trainer.restart.storage import Fence, Store, StoreOffline, _short

T = TypeVar("T")

POLL_SECONDS = 5.0
OFFLINE_RETRY_SECONDS = 5.0
"""While cut off: how often the lease thread asks the store again (at most; ttl / 3 when shorter)."""
CHAIN_LIMIT = 32
"""Earlier attempts a lease carries for the ledger (kills in a row before any ledger upload)."""


class LeaseLost(RunBusy):
    """This attempt no longer holds the run's lease; it must write nothing more."""


class Lease(Fence):
    """This attempt's claim on a run's remote prefix."""

    def __init__(
        self,
        store: Store,
        ttl: float,
        run_dir: Path,
        message: Callable[[str], None] = print,
        outage_seconds: float = CheckpointConfig.store_outage_seconds,
    ) -> None:
        self.store = store
        self.ttl = ttl
        self.run_dir = run_dir
        self.message = message
        self.outage_seconds = outage_seconds
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
        self.on_lost: Callable[[str], None] = _exit_lost
        self.on_outage: Callable[[str], object] = lambda why: None
        """Called once when the store stayed unreachable past `outage_seconds` (train: save locally, exit 143)."""
        self.lost: str | None = None
        self.offline_since: float | None = None  # boot_clock() when cut off from the store; None while it may write
        self.outage_reported = False
        self.previous: list[dict[str, Any]] = []
        """Earlier attempts (attempt_record) this one took the run from, until its ledger reaches the store."""
        self.released = False  # after `release`, an upload thread still running must not take it again
        self._lock = threading.RLock()
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        self._handed: set[Any] = set()  # attempt ids of `previous` the ledger has booked
        self._attempted: tuple[dict[str, Any] | None, float] = (None, 0.0)  # the last body sent, and when
        self.margin = min(5.0, ttl * 0.1)
        """Seconds the holder stops writing before its lease could be taken: what the clocks' rates may differ by."""

    @property
    def held(self) -> bool:
        return self.body is not None

    # ------------------------------------------------------------------ taking it

    def acquire(self, wait: float | None = None) -> None:
        """Take the lease, or raise RunBusy naming its live holder (after waiting `wait` seconds)."""
        started = boot_clock()
        deadline = started + (wait or 0.0)
        self.requests += 3 if self.store.conditional is None and hasattr(self.store.fs, "call_s3") else 0
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
                if current is not None and current.get("holder") != self.id:
                    self.previous = [attempt_record(current), *current.get("unbooked", [])][:CHAIN_LIMIT]
                try:
                    self._write(generation, etag if current else None, new=current is None)
                except Refused:
                    continue  # another machine wrote it between our read and write: look again
                self.acquired_at = time.time()
                self.waited = boot_clock() - started
                if current is not None and not current.get("released") and current.get("holder") != self.id:
                    self.message(
                        f"spotune: took over the lease of {self.store.shown}: {lease_object.takeover_reason(current, self.ttl, self.host, silent)}"
                    )
                return
            # The holder's own clock says it expired: look for one ttl (its renewals would show) before
            # refusing, however short `wait` is; a live holder renews every ttl / 3.
            hint = time.time() > float(current.get("expires_at", 0))
            observe = watched[1] + ttl_of(current, self.ttl) if hint and not alive else 0.0
            left = max(deadline, observe) - now
            if left <= 0:
                raise RunBusy(busy_message(self.store, current, wait))
            if not said:  # once: a --wait that says nothing looks like a hang
                said = True
                self.message(
                    f"spotune: waiting up to {left:.0f}s for the lease of {self.store.shown}, held by {describe_lease(current)}"
                )
            time.sleep(max(0.05, min(POLL_SECONDS, left, ttl_of(current, self.ttl) / 6)))

    def _may_take(self, current: dict[str, Any]) -> bool:
        if current.get("released") or current.get("holder") == self.id:
            return True  # released, or our own create that s3fs resent after it landed
        # This directory's kernel lock is ours, so whoever held the lease from it on this host is dead.
        return current.get("host") == self.host and current.get("run_dir") == str(self.run_dir.resolve())

    def start(self) -> Lease:
        """Renew (or, cut off, retry) in the background until `release`."""
        self._thread = threading.Thread(target=self._renew_loop, name="spotune-lease", daemon=True)
        self._thread.start()
        return self

    def offline(self, why: str) -> None:
        """The store could not be reached to take the lease at start: write nothing until it is taken."""
        self.offline_since = self.offline_since or boot_clock()
        self.message(
            f"spotune: the lease of {self.store.shown} could not be taken ({why}); writing nothing there until it is"
        )

    # ------------------------------------------------------------------ holding it

    def _renew_loop(self) -> None:
        while not self._stopping.wait(self._interval()):
            try:
                self.renew()
            except LeaseLost:
                return  # on_lost already ran
            except Exception as e:  # a network blip: the next try (or the deadline) decides
                if self.offline_since is None:
                    self.message(f"spotune: renewing the lease of {self.store.shown} failed ({_short(e)}); retrying")
                    self._past_deadline()
                self._outage_check()

    def _interval(self) -> float:
        cut_off = self.offline_since is not None or not self.held
        return min(self.ttl / 3, OFFLINE_RETRY_SECONDS) if cut_off else self.ttl / 3

    def renew(self) -> None:
        """Extend the lease by `ttl`, conditional on nobody having replaced it; cut off, take it back
        if it is still ours. Raises LeaseLost when another attempt holds it, OSError-likes when unreachable."""
        with self._lock:
            if self.lost is not None or self.released:
                raise LeaseLost(self.lost or "this attempt released the lease")
            if self.offline_since is not None or not self.held or self._past_deadline():
                return self._reclaim()
            assert self.body is not None
            if not conditional(self.store):  # the documented fallback: look before a plain write
                self._confirm()
            try:
                self._write(int(self.body["generation"]), self.etag, new=False)
            except Refused:
                self._settle()
            return None

    def _reclaim(self) -> None:
        """The store answers again (or for the first time): take the lease back if nobody else took it."""
        if not self.held:
            try:
                self.acquire(None)
            except RunBusy as e:
                self._lost(str(e))
        else:
            current, etag = self._read()
            if current is not None and (current.get("holder"), current.get("generation")) != (self.id, self.generation):
                self._lost(
                    "another attempt took the run's lease while this one was cut off from the store (paused, or cut "
                    f"off, past expiry): {describe_lease(current)}"
                )
            try:
                self._write((self.generation or 0) + 1, etag, new=current is None)
            except Refused:
                self._settle()  # our own PUT resent after it landed goes on; anyone else's write is a loss
        if self.offline_since is not None:
            self.message(
                f"spotune: {self.store.shown} answers again and the run's lease was still this attempt's; took it "
                f"back as generation {self.generation}; uploads resume with the newest local checkpoint"
            )
        self.offline_since = None

    def _settle(self) -> None:
        """A conditional renewal was refused: ours if the object is the very body we sent (a resent PUT that
        landed, whose resend was refused), lost otherwise."""
        current, etag = self._read()
        body, sent = self._attempted
        if current != body:
            self._lost("another machine took the run's lease (this attempt was paused, or cut off, past expiry)")
        self.body, self.etag, self.deadline = body, etag, sent + self.ttl - self.margin

    def check(self) -> None:
        """Raise LeaseLost (after on_lost) or StoreOffline unless this attempt may write now; no request."""
        with self._lock:
            if self.lost is not None or self.released:
                raise LeaseLost(self.lost or "this attempt released the lease")
            if self.offline_since is not None or not self.held or self._past_deadline():
                raise StoreOffline(
                    f"{self.store.shown}: this attempt is cut off from the store (its lease is not confirmed); "
                    "nothing is written there until the lease is taken back"
                )

    def commit(self, write: Callable[[], T]) -> T:
        """Run a commit write only while this attempt holds the lease, and confirm it still did after."""
        with self._lock:
            self.check()
            if conditional(self.store):
                self.renew()  # conditional: proves the lease is ours and gives the write a full ttl
            else:
                self._confirm()
            result = write()
            if not conditional(self.store):
                self._confirm()
            self._past_deadline()  # a write that outlasted the lease: the re-read after the outage decides
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
            self._lost(f"{path} was committed by another writer meanwhile")

    def hand_over(self) -> list[dict[str, Any]]:
        """The records of earlier attempts for the ledger to book now; they leave the lease once it is uploaded."""
        self._handed = {r.get("attempt_id") for r in self.previous}
        return list(self.previous)

    def pushed(self, rel: str) -> None:
        if rel == "ledger.jsonl":  # the records handed over are booked in the store's ledger now
            self.previous = [r for r in self.previous if r.get("attempt_id") not in self._handed]

    def _confirm(self) -> None:
        current, _ = self._read()
        if current is None or current.get("holder") != self.id or current.get("generation") != self.generation:
            self._lost("the run's lease now names another holder")
        if self._past_deadline():
            raise StoreOffline(f"{self.store.shown}: the lease lapsed during the write; it is confirmed again first")

    @property
    def generation(self) -> int | None:
        return int(self.body["generation"]) if self.body else None

    def _past_deadline(self) -> bool:
        """Whether the lease lapsed (it goes offline then: nothing is written until it is taken back)."""
        if self.held and self.offline_since is None and boot_clock() > self.deadline:
            self.offline_since = boot_clock()
            self.message(
                f"spotune: the lease of {self.store.shown} was not renewed for over {self.ttl - self.margin:g}s "
                f"(paused, or cut off); writing nothing there until it is confirmed again, training goes on with "
                f"local checkpoints (at most checkpoint.store_outage_seconds={self.outage_seconds:g}s)"
            )
        return self.offline_since is not None

    def _outage_check(self) -> None:
        if self.offline_since is None or self.outage_reported:
            return
        if boot_clock() - self.offline_since > self.outage_seconds:
            self.outage_reported = True
            self.on_outage(
                f"spotune: {self.store.shown} has been unreachable for over {self.outage_seconds:g}s "
                "(checkpoint.store_outage_seconds)"
            )

    def _lost(self, why: str) -> NoReturn:
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
        self._stopping.set()
        with self._lock:
            self.released = True
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5.0)
        with self._lock:
            if not self.body or self.lost is not None or self.offline_since is not None or self._past_deadline():
                return
            try:
                self._write(int(self.body["generation"]), self.etag, new=False, released=True)
            except Exception:  # it expires by itself; the next attempt waits at most ttl
                pass
            self.body = None

    # ------------------------------------------------------------------ the object

    def _read(self) -> tuple[dict[str, Any] | None, str | None]:
        self.requests += 1
        return read_lease(self.store)

    def _write(self, generation: int, if_match: str | None, *, new: bool, released: bool = False) -> None:
        sent = boot_clock()
        now = time.time()
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
            "unbooked": self.previous,
        }
        if released:
            body["released"] = True
        self.requests += 1
        self._attempted = (body, sent)
        etag = write_object(
            self.store, self.store.path(LEASE_FILE), json.dumps(body).encode(), if_match=if_match, new=new
        )
        self.body, self.etag = body, etag
        self.deadline = sent + self.ttl - self.margin


def _exit_lost(why: str) -> None:
    """Exit the whole process now, from whichever thread found the lease lost (no thread writes again)."""
    path = os.environ.get(EXIT_FILE_ENV)
    if path and os.environ.get("RANK", "0") == "0":
        Path(path).write_text(f"{EXIT_BUSY}\n")
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(EXIT_BUSY)
