"""The lease object of `checkpoint.remote` as others see it: reading it, describing its holder,
and the record of the attempt that held it (for the ledger of the attempt that takes it over).
The lease itself (taking, renewing, fencing) is trainer/restart/lease.py."""

from __future__ import annotations

import json
import time
from typing import Any

from trainer.restart.conditional import read_object
from trainer.restart.storage import Store

LEASE_FILE = "lease.json"


def read_lease(store: Store) -> tuple[dict[str, Any] | None, str | None]:
    """The lease object and its etag (a digest of its bytes where the store has no etag)."""
    got = read_object(store, store.path(LEASE_FILE))
    if got is None:
        return None, None
    return json.loads(got[0]), got[1]


def attempt_record(lease: dict[str, Any]) -> dict[str, Any]:
    """What the ledger needs of the attempt that held `lease`: its start, machine and last sign of life."""
    return {
        "attempt_id": lease.get("holder"),
        "host": lease.get("host"),
        "pid": lease.get("pid"),
        "process_start": lease.get("process_start"),
        "world_size": lease.get("world_size", 1),
        "last_seen": lease.get("renewed_at"),
        "renew_every": float(lease.get("ttl", 0.0)) / 3,
        "step": lease.get("step"),
        "released": bool(lease.get("released")),
    }


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
