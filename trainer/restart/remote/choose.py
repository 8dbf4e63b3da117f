"""Rank 0's choice of the checkpoint to resume from, local or in `checkpoint.remote`, and what it
promises the store (trainer/restart/store/safety.py): the step chosen and the committed steps seen are
recorded on the store's `Floor` before anything is written there.

- `auto`: the newest checkpoint that verifies, on this disk or in the store (downloaded). Only a
  remote checkpoint whose bytes disagree with its manifest (`Corrupt`) is skipped, and only once a second
  download into a fresh directory agrees (one read can be this machine's fault: bad RAM, a bad disk or
  tmpfs). A checkpoint found corrupt is retired (renamed, kept: trainer/restart/store/safety.py), never
  deleted; when every remote checkpoint newer than the local ones is corrupt and no local one verifies,
  the attempt stops with CheckpointError (exit 2) naming them, as the local rule does. A fault of the
  moment while listing or downloading (trainer/faults.py `transient`: the network, 5xx, throttling, a broken
  transfer) is retried with backoff for `budget` seconds, then ends the attempt with StoreUnreachable
  (exit 143) before it trains: training from an older step would throw newer paid-for steps away. Anything
  else the store answers is StoreDenied (exit 2, naming the setting); this machine's full disk or a bug
  ends it with its own code.
- `never` or a checkpoint path: a new timeline, which the user asked for. The store's newer
  checkpoints are retired (renamed, kept); that needs the store readable, so a store that does not
  answer is a fault of the moment here too.
- The store unreachable at start (`reachable` False, a local checkpoint exists): the local newest,
  and the floor reads the store before the first write (an attempt on a stale disk stops there).
  When no local checkpoint verifies, the store may hold one that does: StoreUnreachable (exit 143).
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from trainer.atomic import publish_dir, temp_sibling
from trainer.faults import transient
from trainer.restart.local.checkpoint import CheckpointError, CheckpointManager, resolve_resume
from trainer.restart.store.errors import StoreError, StoreUnreachable
from trainer.restart.store.lifecycle import Store
from trainer.restart.store.verify import Corrupt
from trainer.urls import one_line

T = TypeVar("T")

MAX_DELAY = 30.0
"""Longest wait between two tries of a store request at start."""


def retrying(
    what: str,
    budget: float,
    fn: Callable[[], T],
    message: Callable[[str], None],
    store: Store,
    then: str = "",
    action: str = "read",
) -> T:
    """`fn()`, tried again with backoff (1 s, doubling, at most MAX_DELAY) while it fails with a fault
    of the moment (trainer/faults.py `transient`: the network, 5xx, throttling, a store that does not answer,
    the lease cut off), for `budget` seconds; then StoreUnreachable (exit 143), its message ending with `then`.
    Anything else propagates at once: what the store refused for good as StoreDenied (exit 2, naming the
    setting `action` needs), spotune's own errors with their codes (a checkpoint that does not verify, a
    breach of the rule, a checkpoint that cannot be resumed as asked), this machine's full or refused disk
    and bugs as they came (1)."""
    deadline = time.monotonic() + budget
    delay = 1.0
    while True:
        try:
            return fn()
        except Exception as e:
            if not transient(e):
                store.raise_fault(e, action)
            fault: Exception = e
        left = deadline - time.monotonic()
        if left <= 0:
            said = str(fault) if isinstance(fault, StoreError) else f"{type(fault).__name__}: {one_line(fault)}"
            over = f" (tried for {budget:g}s)" if budget > 0 else ""
            raise StoreUnreachable(f"{what} {store.shown} failed: {said}{over}{then}") from fault
        wait = min(delay, left)
        message(
            f"spotune: {what} {store.shown} failed ({type(fault).__name__}: {one_line(fault)}); retrying in {wait:.0f}s"
        )
        time.sleep(wait)
        delay = min(delay * 2, MAX_DELAY)


def choose(
    root: Path,
    resume_setting: str,
    store: Store | None,
    reachable: bool,
    *,
    budget: float,
    message: Callable[[str], None],
) -> tuple[Path | None, list[str]]:
    """The checkpoint rank 0 resumes from (None: step 0) and the notes worth logging; the floor of
    `store` records the choice."""
    error: CheckpointError | None = None
    try:
        local, notes = resolve_resume(root, resume_setting)
    except CheckpointError as e:
        if store is None or resume_setting != "auto":
            raise
        if not reachable:  # the store may hold good checkpoints: read it once it answers
            raise StoreUnreachable(
                f"{e}\ncheckpoint.remote={store.shown} did not answer at start and may hold a checkpoint that "
                "verifies; stopping before training from step 0 (exit 143: rerun once the store answers)"
            ) from e
        local, notes, error = None, [], e  # a good remote checkpoint may still save the run
    if store is None:
        return local, notes
    local_step = CheckpointManager.step_of(local) if local is not None else None
    if not reachable:
        if resume_setting != "auto":
            raise StoreUnreachable(
                f"checkpoint.resume={resume_setting} starts a new timeline, which sets the newer checkpoints of "
                f"{store.shown} aside first, and the store did not answer; rerun once it does (exit 143)"
            )
        store.floor.choose(local_step, None, generation=store.fence.generation)  # read before the first write
        return local, notes

    def remote() -> tuple[Path | None, list[str]]:
        return _choose_remote(root, resume_setting, store, local_step, error)

    then = "; stopping before training from an older checkpoint (exit 143: rerun once the store answers)"
    chosen, remote_notes = retrying("reading the checkpoints of", budget, remote, message, store, then)
    return chosen if chosen is not None else local, notes + remote_notes


def _choose_remote(
    root: Path, resume_setting: str, store: Store, local_step: int | None, error: CheckpointError | None
) -> tuple[Path | None, list[str]]:
    """The store's part of `choose`: None means the local choice stands. The store is cleaned once the
    floor recorded the choice (what it saw committed then is what `clean` may not delete), under the lease
    generation of the listing (one made without the lease is read again before the first write)."""
    generation = store.fence.generation
    committed = store.committed()
    if resume_setting != "auto":
        after = local_step if local_step is not None else -1
        store.floor.choose(local_step, committed, new_timeline=True, generation=generation)
        notes = _clean(store)
        moved = store.retire(after)
        if moved:
            notes.append(
                f"checkpoint.resume={resume_setting}: set aside remote checkpoint(s) above step {max(after, 0)}, "
                f"kept as {', '.join(f'{store.shown}/checkpoints/{name}' for name in moved)}"
            )
        return None, notes
    notes = []
    corrupt: dict[int, Corrupt] = {}
    for step in reversed(committed):
        if local_step is not None and step <= local_step:
            break
        try:
            path = download_confirmed(store, step, root, notes)
        except Corrupt as e:  # the one reason to skip a checkpoint; a fault of the moment is retried by the caller
            notes.append(f"remote checkpoint {store.show_dir(step)} is corrupt (read twice), skipped: {e}")
            corrupt[step] = e
            continue
        store.floor.choose(step, committed, corrupt=corrupt, generation=generation)
        notes.append(f"downloaded {store.show_dir(step)} (newer than any local checkpoint)")
        return path, notes + _retire_corrupt(store, step, corrupt) + _clean(store)
    if local_step is None and (error is not None or corrupt):
        if not corrupt:
            raise error or CheckpointError("no checkpoint verifies")
        found = "\n  ".join(f"step {step}: {e}" for step, e in sorted(corrupt.items()))
        raise CheckpointError(
            f"every checkpoint of checkpoint.remote={store.shown} ({sorted(corrupt)}) is corrupt, each read twice "
            f"into a fresh directory:\n  {found}\n"
            + (f"and no local checkpoint verifies: {error}\n" if error is not None else "and there is no local one; ")
            + "nothing was changed in the store. If this machine's memory or disk is at fault, run on another "
            "machine; to start over from an older checkpoint set checkpoint.resume=<path>, or "
            "checkpoint.resume=never for step 0 (the corrupt ones are then retired: renamed, kept)"
        )
    store.floor.choose(local_step, committed, corrupt=corrupt, generation=generation)
    return None, notes + _retire_corrupt(store, local_step if local_step is not None else -1, corrupt) + _clean(store)


def download_confirmed(store: Store, step: int, root: Path, notes: list[str]) -> Path:
    """`store.download(step, root)`, its Corrupt verdict confirmed before anyone acts on it: a second
    download into a fresh directory (`step-XXXXXX.tmp-confirm-*`, which a kill leaves to `clean_stale`) must
    find it corrupt too. One read that fails its hash can be this machine's fault (bad RAM, a bad disk or
    tmpfs); a second that verifies is used."""
    try:
        return store.download(step, root)
    except Corrupt as first:
        fresh = temp_sibling(root / f"step-{step:06d}", "confirm")
        try:
            second = store.download(step, fresh)
            notes.append(
                f"remote checkpoint {store.show_dir(step)} read corrupt once ({first}), then verified when "
                "downloaded again into a fresh directory: used (check this machine's memory and disk)"
            )
            final = root / second.name
            publish_dir(second, final)
            return final
        finally:
            shutil.rmtree(fresh, ignore_errors=True)


def _retire_corrupt(store: Store, resumed: int, corrupt: dict[int, Corrupt]) -> list[str]:
    """Retire (rename, keep) the checkpoints found corrupt above the step resumed from: left committed, a
    newer lease generation's first commit would make them late writes (the generation rule)."""
    if not corrupt:
        return []
    moved = store.retire(resumed, only=set(corrupt))
    return [
        f"retired the corrupt remote checkpoint(s) {sorted(corrupt)}: kept as "
        f"{', '.join(f'{store.shown}/checkpoints/{name}' for name in moved)}, never resumed from"
    ]


def _clean(store: Store) -> list[str]:
    return [f"removed the unfinished upload {store.show_dir(s)}" for s in store.clean()]
