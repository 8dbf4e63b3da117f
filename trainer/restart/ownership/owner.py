"""Who may write a run: `spotune train` holds its directory's lock and (with `checkpoint.remote`)
the remote's lease for its whole life; `spotune status --break-lease` breaks a lease by hand (who
holds a run now is trainer/report/status.py's to say).

`hold` is what `run.train` wraps itself in: the local lock first (trainer/restart/ownership/lock.py),
then the lease (trainer/restart/ownership/lease.py), both before the attempt touches the directory or
the store, both released when it returns or raises. A store that refuses the first lease request for
good (trainer/faults.py: anything not known to be a fault of the moment) ends the attempt here with
StoreDenied (exit 2), naming the setting; one that does not answer lets it start cut off. Only the job's main
process (RANK 0, or no torchrun) takes them: the other ranks write nothing the main rank does
not coordinate.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainer.faults import transient
from trainer.restart import defaults
from trainer.restart.ownership.lease import LEASE_FILE, Lease, describe_lease, read_lease
from trainer.restart.ownership.lock import RunBusy, RunLock
from trainer.restart.store.conditional import Refused, write_object
from trainer.restart.store.lifecycle import Store
from trainer.urls import one_line


def _say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


@dataclass
class Holding:
    """What `hold` took: nothing on ranks other than the main one."""

    lock: RunLock | None = None
    lease: Lease | None = None

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


@contextlib.contextmanager
def hold(
    run_dir: str | Path,
    remote: str | None,
    storage_options: dict[str, Any],
    lease_seconds: float,
    wait: float | None = None,
    command: str = "train",
    outage_seconds: float = defaults.STORE_OUTAGE_SECONDS,
) -> Iterator[Holding]:
    """Hold `run_dir` (and the lease of `remote`) for the block; raises RunBusy naming the holder."""
    if os.environ.get("RANK", "0") != "0":
        yield Holding()
        return
    started = time.monotonic()
    with RunLock.take(run_dir, command, wait) as lock:
        lease = None
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
        try:
            yield Holding(lock, lease)
        finally:
            if lease is not None:
                lease.release()


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
