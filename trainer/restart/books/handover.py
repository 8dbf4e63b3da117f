"""The ledger hand-over between lease holders: every attempt that held the run gets its ledger row,
even one killed before any of its rows reached the store.

Contract. The attempt that takes the lease from another (`took_over`) carries, in its own lease
object (`unbooked`), a record of that holder and of the holders it still carried: when each
started, on how many devices, on what device at what price, its last sign of life (`attempt_record`). Its ledger books them at
open (`hand_over`: trainer/restart/books/ledger.py's `lost_attempts`, matched by `attempt_id`, so a record
whose attempt already has a row is not booked twice). The records leave the lease only once the
ledger that booked them is in the store (`pushed`): a kill before that leaves them to the next holder.
A holder that takes the lease only after its ledger opened (cut off at start) books the records it took
over before its next ledger upload (`late`). A holder that found the run finished books what it carries the same way and releases the lease as
`no_attempt`: it trained nothing, so the next holder carries its chain but no record of it.
At most `CHAIN_LIMIT` records travel (kills in a row before any ledger upload).
"""

from __future__ import annotations

from typing import Any

CHAIN_LIMIT = 32
"""Earlier attempts a lease carries for the ledger (kills in a row before any ledger upload)."""


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
        "device": lease.get("device"),
        "price_per_hour": lease.get("price_per_hour"),
    }


class Handover:
    """The earlier attempts one lease holder took the run from, until its ledger books them in the store."""

    def __init__(self) -> None:
        self.previous: list[dict[str, Any]] = []
        """Records (attempt_record) of earlier attempts, newest first; written into the lease as `unbooked`."""
        self._handed: set[Any] = set()  # attempt ids of `previous` the ledger has booked
        self._opened = False  # the ledger opened (`hand_over`): a record taken over later is booked by `late`

    def took_over(self, current: dict[str, Any], own_id: str) -> None:
        """The lease object `current` is being replaced by this attempt's: carry its holder and its chain.
        A holder that released it as `no_attempt` (it found the run finished and trained nothing) is no
        attempt to book; its chain still is."""
        if current.get("holder") != own_id:
            mine = [] if current.get("released") and current.get("no_attempt") else [attempt_record(current)]
            self.previous = [*mine, *current.get("unbooked", [])][:CHAIN_LIMIT]

    def hand_over(self) -> list[dict[str, Any]]:
        """The records of earlier attempts for the ledger to book now; they leave the lease once it is uploaded."""
        self._handed = {r.get("attempt_id") for r in self.previous}
        self._opened = True
        return list(self.previous)

    def late(self) -> list[dict[str, Any]]:
        """Records of attempts taken over after the ledger opened (the lease was taken late: the store did not
        answer at start), for the ledger to book before its next upload; else none would book them when this
        attempt finishes the run. Each record is handed once; it leaves the lease once that ledger is pushed."""
        if not self._opened:
            return []
        new = [r for r in self.previous if r.get("attempt_id") not in self._handed]
        self._handed |= {r.get("attempt_id") for r in new}
        return new

    def pushed(self, rel: str, ledger_file: str) -> None:
        """Run file `rel` reached the store: when it is the ledger, the records handed over are booked there."""
        if rel == ledger_file:
            self.previous = [r for r in self.previous if r.get("attempt_id") not in self._handed]
