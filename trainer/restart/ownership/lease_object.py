"""The lease object of `checkpoint.remote` as others see it: reading it, describing its holder, and
writing under it from another rank of the holder's attempt (`Follower`). The lease itself (taking,
renewing, fencing) is trainer/restart/ownership/lease.py; its records of earlier attempts, trainer/restart/books/handover.py."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any, TypeVar

from trainer.restart.ownership.lock import RunBusy
from trainer.restart.store.conditional import read_object
from trainer.restart.store.lifecycle import Fence, Store

T = TypeVar("T")

LEASE_FILE = "lease.json"


class LeaseLost(RunBusy):
    """This attempt no longer holds the run's lease; it must write nothing more."""


def read_lease(store: Store) -> tuple[dict[str, Any] | None, str | None]:
    """The lease object and its etag (a digest of its bytes where the store has no etag)."""
    got = read_object(store, store.path(LEASE_FILE))
    if got is None:
        return None, None
    return json.loads(got[0]), got[1]


def describe_lease(lease: dict[str, Any]) -> str:
    """One line: who holds it, since when, how fresh, and when it expires."""
    left = float(lease.get("expires_at", 0)) - time.time()
    state = (
        "released" if lease.get("released") else f"expires in {left:.0f}s" if left > 0 else f"expired {-left:.0f}s ago"
    )
    step = f", step {lease['step']}" if lease.get("step") is not None else ""
    return (
        f"pid {lease.get('pid')} on {lease.get('host')} (generation {lease.get('generation')}, since "
        f"{lease.get('started')}{step}, renewed {time.time() - float(lease.get('renewed_at', 0)):.0f}s ago, {state})"
    )


def busy_message(store: Store, lease: dict[str, Any] | None, wait: float | None) -> str:
    waited = f" after waiting {wait:g}s" if wait else ""
    who = describe_lease(lease) if lease else "another attempt"
    return (
        f"{store.shown} is held by {who}{waited}; one writer per run. Rerun with --wait SECONDS to resume once its "
        f"lease ends, or, if that machine is certainly gone, `spotune status {store.shown} --break-lease`."
    )


def ttl_of(lease: dict[str, Any] | None, default: float) -> float:
    """The holder's own ttl: its deadline is measured on it."""
    return float((lease or {}).get("ttl", default))


def takeover_reason(old: dict[str, Any], ttl: float, host: str, silent: float) -> str:
    """Why a lease held by `old` may be taken: silent past its ttl, or its holder is gone from here."""
    if silent >= ttl_of(old, ttl):
        return (
            f"generation {old.get('generation')} ({old.get('host')}, pid {old.get('pid')}) had not changed for "
            f"{silent:.0f}s on this machine's clock (its ttl: {ttl_of(old, ttl):g}s)"
        )
    return f"its holder ran in this directory on this host ({host}, pid {old.get('pid')}) and is gone"


class Follower(Fence):
    """The fence of a rank other than the lease holder's, writing a run file for its attempt (the `auto`
    setting that ran out of memory on that rank): a write goes through only while the lease still names
    the attempt (`holder`, the lease id rank 0 shared at connect), under the lease's generation."""

    def __init__(self, store: Store, holder: str) -> None:
        self.store = store
        self.holder = holder
        self._generation: int | None = None

    @property
    def generation(self) -> int | None:
        return self._generation

    def check(self) -> None:
        lease, _ = read_lease(self.store)
        if lease is None or lease.get("holder") != self.holder or lease.get("released"):
            raise RunBusy(f"{self.store.shown}: the lease no longer names this attempt; nothing is written")
        self._generation = int(lease.get("generation", 0))

    def commit(self, write: Callable[[], T]) -> T:
        self.check()
        return write()
