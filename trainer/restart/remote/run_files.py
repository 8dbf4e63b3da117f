"""The run files a machine fetches at start (a fresh VM lacks them; a disk that comes back after others
trained lacks their rows): downloaded, or merged into this disk's append-only ones, and a killed attempt
found only through the store's heartbeat booked, once (attempts told apart by id).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from trainer.atomic import write_bytes
from trainer.restart.books.ledger import HEARTBEAT_FILE, attempt_key, read_rows, recover_killed
from trainer.restart.remote.uploader import RUN_FILES
from trainer.restart.store.generations import APPEND_ONLY, merged_rows
from trainer.restart.store.lifecycle import Store


def fetch_run_files(store: Store, run_dir: Path) -> list[str]:
    """Download the run files this machine lacks (a fresh VM), and merge the store's rows into the
    append-only ones it holds (a node that was rank 0 in an earlier attempt, since when another
    node's rank 0 has written on, or a disk that comes back after others trained); returns their names.

    A heartbeat whose attempt already has its ledger row is dropped: the uploader sends the
    ledger before the heartbeat, so a kill between the two would otherwise count it twice. A disk that
    holds its own heartbeat does not take the store's, so the store's (another machine's attempt, killed
    after this disk's: the disks diverged) is booked here and now, unless its attempt has a row; attempts
    are told apart by id (ledger.attempt_key), never by number.
    """
    fetched = []
    beat = run_dir / HEARTBEAT_FILE
    theirs = _heartbeat(store.read_run_file(HEARTBEAT_FILE)) if beat.exists() else None
    for name in RUN_FILES:
        local = run_dir / name
        if not local.exists():
            got = store.get(name, local)
        else:
            got = name in APPEND_ONLY and _continue(store, name, local)
        if got:
            fetched.append(name)
    rows = {attempt_key(r) for r in read_rows(run_dir)}
    if beat.exists():
        try:
            key: tuple[Any, ...] | None = attempt_key(json.loads(beat.read_text()))
        except (ValueError, TypeError, AttributeError):
            key = None  # an unreadable local one is left to Ledger.open, which warns
        if (key is not None and key in rows) or (key is None and HEARTBEAT_FILE in fetched):
            beat.unlink()
            if HEARTBEAT_FILE in fetched:
                fetched.remove(HEARTBEAT_FILE)
        # Another attempt's heartbeat, and no live holder can own it: this attempt holds the lease (or none is used).
        if theirs is not None and attempt_key(theirs) != key and getattr(store.fence, "held", True):
            recover_killed(run_dir, heartbeats=[theirs], leftover=False)
    return fetched


def _heartbeat(raw: bytes | None) -> dict[str, Any] | None:
    """A heartbeat read from the store, or None (none there, or unreadable: nothing to book from it)."""
    try:
        progress = json.loads(raw) if raw else None
    except ValueError:
        return None
    return progress if isinstance(progress, dict) else None


def _continue(store: Store, name: str, local: Path) -> bool:
    """Merge the store's rows of `name` (every generation's copy) into `local`: each row once, this disk's
    rows that the store lacks kept after the store's (a node that wrote them last, or a diverged disk).
    True when `local` changed. Nothing is dropped on either side, so the next push loses no row."""
    remote = store.read_run_file(name)
    if remote is None:
        return False
    mine = local.read_bytes()
    merged = merged_rows([remote, mine])
    if merged == mine:
        return False
    write_bytes(local, merged)
    return True
