"""Who may write a run: `spotune train` holds its directory's lock and (with `checkpoint.remote`)
the remote's lease for its whole life; `spotune status --break-lease` breaks a lease by hand (who
holds a run now is trainer/report/status.py's to say).

`take` (also a `with` block: released when it ends) is what each attempt of `run.train` starts with: the local
lock first (trainer/restart/ownership/lock.py), then the lease (trainer/restart/ownership/lease.py), both
before the attempt touches the directory or the store, both released when it returns or raises.
`spotune train` takes its first attempt's before it imports torch (trainer/cli/train.py): a start that is
refused (another attempt holds the run, a store that refuses writes) answers in a second. A store that refuses the first lease request for
good (trainer/faults.py: anything not known to be a fault of the moment) ends the attempt here with
StoreDenied (exit 2), naming the setting; one that does not answer lets it start cut off. Only the job's main
process (RANK 0, or no torchrun) takes them: the other ranks write nothing the main rank does
not coordinate.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trainer.faults import transient
from trainer.restart import defaults
from trainer.restart.ownership.lease import LEASE_FILE, Lease, describe_lease, read_lease
from trainer.restart.ownership.lock import RunBusy, RunLock
from trainer.restart.store.conditional import Refused, write_object
from trainer.restart.store.lifecycle import Store
from trainer.urls import one_line

if TYPE_CHECKING:
    from trainer.config import RunConfig


def _say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


@dataclass
class Holding:
    """What `take` took: nothing on ranks other than the main one. `release` gives both back (once)."""

    lock: RunLock | None = None
    lease: Lease | None = None
    seconds: float = 0.0
    """Wall seconds `take` spent getting the run after any wait for it: the store's lease requests (the
    ledger books them as phase `store`; a wait belongs to the holder it waited on)."""
    released: bool = False
    """After `release`: this process no longer holds the run, and no attempt may start on it."""

    def clock_start(self) -> float | None:
        """Where this attempt's ledger clock starts: when it got the run, if it had to wait for it
        (the waiting overlapped the previous holder, whose own row counts that time)."""
        starts = [
            t
            for t in (
                self.lock.clock_start() if self.lock else None,
                self.lease.acquired_at if self.lease and self.lease.waited > 1.0 else None,
            )
            if t is not None
        ]
        return max(starts) if starts else None

    def __enter__(self) -> Holding:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def release(self) -> None:
        """The lease first (marked released, so the next attempt starts at once), then the lock."""
        lease, lock = self.lease, self.lock
        self.lease, self.lock, self.released = None, None, True
        try:
            if lease is not None:
                lease.release()
        finally:
            if lock is not None:
                lock.release()


def take(
    run_dir: str | Path,
    remote: str | None,
    storage_options: dict[str, Any],
    lease_seconds: float,
    wait: float | None = None,
    command: str = "train",
    outage_seconds: float = defaults.STORE_OUTAGE_SECONDS,
) -> Holding:
    """Take `run_dir` (and the lease of `remote`) until `Holding.release` (or the end of a `with` block on it);
    raises RunBusy naming the holder."""
    if os.environ.get("RANK", "0") != "0":
        return Holding()
    started = time.monotonic()
    lock = RunLock.take(run_dir, command, wait)
    lease = None
    try:
        if remote is not None:
            store = Store(remote, storage_options)
            lease = Lease(store, lease_seconds, Path(run_dir), message=_say, outage_seconds=outage_seconds)
            left = None if wait is None else max(0.0, wait - (time.monotonic() - started))
            try:
                lease.acquire(left)  # its first request is a real write (the conditional probe, or the lease)
            except RunBusy:
                raise
            except Exception as e:
                if not transient(e):  # the store refused for good (exit 2, naming the setting), or a bug
                    store.raise_fault(e, lease.doing)  # the request refused: the probe or lease written, or read
                # Unreachable now: RemoteRun.connect decides whether training may start; if it does,
                # the lease thread takes the lease once the store answers (or stops the run).
                lease.offline(one_line(e), None if wait is None else max(0.0, wait - (time.monotonic() - started)))
            lease.start()
    except BaseException:  # refused: nothing was taken (a lease not acquired has nothing to release)
        lock.release()
        raise
    holding = Holding(lock, lease)
    got = holding.clock_start()  # after a wait: when it got the run
    holding.seconds = time.time() - got if got is not None else time.monotonic() - started
    return holding


def take_run(cfg: RunConfig, wait: float | None, command: str = "train") -> Holding:
    """`take` with a run's settings: its output_dir, and its store's lease (`checkpoint.*`)."""
    ck = cfg.checkpoint
    return take(cfg.output_dir, ck.remote, ck.storage_options, ck.lease_seconds, wait, command, ck.store_outage_seconds)


# ---------------------------------------------------------------------------- spotune status --break-lease


def break_lease(remote: str, storage_options: dict[str, Any] | None = None) -> str:
    """Mark the lease of `remote` released with a higher generation (conditional on the lease read),
    so the next attempt takes it at once; a live holder then fails its next renewal and exits."""
    store = Store(remote, storage_options or {})
    lease, etag = read_lease(store)
    if lease is None:
        return f"{store.shown}: no lease to break"
    broken = {
        **lease,
        "generation": int(lease.get("generation", 0)) + 1,
        "released": True,
        "expires_at": time.time(),
        "broken_by": f"pid {os.getpid()} on {socket.gethostname()} (spotune status --break-lease)",
    }

    try:
        write_object(store, store.path(LEASE_FILE), json.dumps(broken).encode(), if_match=etag)
    except Refused:
        return f"{store.shown}: the lease changed while breaking it (renewed?); run `spotune status` again"
    return f"{store.shown}: broke the lease of {describe_lease(lease)}"
