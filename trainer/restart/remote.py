"""`checkpoint.remote` for a run: connect, bring a fresh machine up to date, choose the resume
step on rank 0 for every rank, upload while training, flush on exit.

`run.py` holds one `RemoteRun` (or a disabled one when `checkpoint.remote` is null) and
calls it at five points: `connect` before anything is written locally, `resolve` instead of
the local-only `resolve_resume`, `submit` after each committed save, `metrics` for each
metrics row, and `finish` before the process exits. The loop never sees it.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from trainer.restart.checkpoint import CheckpointError, CheckpointManager, resolve_resume
from trainer.restart.ledger import HEARTBEAT_FILE, read_rows
from trainer.restart.storage import Store, StoreError, _short
from trainer.restart.uploader import RUN_FILES, Uploader

FINISH_TIMEOUT = 600.0
"""Seconds a finished run waits for its last upload (a preempted one has checkpoint.notice_seconds)."""


class RemoteRun:
    """The remote side of one training process; every method is a no-op without a remote."""

    def __init__(
        self,
        url: str | None,
        storage_options: dict[str, Any],
        run_dir: Path,
        *,
        keep_last: int,
        is_main: bool,
        is_local_main: bool,
        message: Callable[[str], None] = print,
    ) -> None:
        self.url = url
        self.options = storage_options
        self.run_dir = run_dir
        self.keep_last = keep_last
        self.is_main = is_main
        self.is_local_main = is_local_main
        self.message = message
        self.store: Store | None = None
        self.reachable = False
        self.uploader: Uploader | None = None
        self.flushed = False

    # ------------------------------------------------------------------ start

    def connect(self) -> None:
        """Rank 0: check the store; on a machine without the run files, download them.

        Raises StoreError (naming the URL and the likely cause) when the store is unreachable
        and no local checkpoint lets training go on; with one, warns and keeps retrying later.
        """
        if self.url is None or not self.is_main:
            return
        self.store = Store(self.url, self.options)
        try:
            self.store.check()
        except StoreError as e:
            local = CheckpointManager(self.run_dir / "checkpoints").committed()
            if not local:
                raise
            self.message(f"spotune: {e}. Continuing from the local checkpoint {local[-1].name}; uploads will retry.")
            return
        self.reachable = True
        self.run_dir.mkdir(parents=True, exist_ok=True)
        fetch_run_files(self.store, self.run_dir)

    def resolve(self, resume_setting: str) -> tuple[Path | None, list[str]]:
        """The checkpoint every rank resumes from: chosen on rank 0 (local or remote, the newest
        that verifies), broadcast, downloaded by each node whose local disk lacks it."""
        root = self.run_dir / "checkpoints"
        notes: list[str] = []
        chosen: Path | None = None
        if self.is_main:
            chosen, notes = self._choose(root, resume_setting)
        step = _broadcast(CheckpointManager.step_of(chosen) if chosen is not None else -1)
        if step < 0:
            return None, notes
        if chosen is None:  # another rank's view: rank 0 chose a committed step
            chosen = root / f"step-{step:06d}"
            if self.is_local_main and (not chosen.is_dir() or CheckpointManager(root).verify(chosen)):
                if self.url is None:
                    raise CheckpointError(
                        f"rank 0 resumes from step {step} but {chosen} is not on this node's disk; put output_dir "
                        "on a shared filesystem or set checkpoint.remote"
                    )
                Store(self.url, self.options).download(step, root)  # a node with an empty local disk
            if torch.distributed.is_available() and torch.distributed.is_initialized():
                torch.distributed.barrier()
        elif torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.barrier()
        return chosen, notes

    def _choose(self, root: Path, resume_setting: str) -> tuple[Path | None, list[str]]:
        error: CheckpointError | None = None
        try:
            local, notes = resolve_resume(root, resume_setting)
        except CheckpointError as e:
            if not (self.reachable and resume_setting == "auto"):
                raise
            local, notes, error = None, [], e  # a good remote checkpoint may still save the run
        if not self.reachable or self.store is None:
            return local, notes
        store = self.store
        notes += [f"removed the unfinished upload {store.show_dir(s)}" for s in store.clean()]
        if resume_setting != "auto":
            after = CheckpointManager.step_of(local) if local is not None else -1
            moved = store.retire(after)
            if moved:
                notes.append(
                    f"checkpoint.resume={resume_setting}: set aside remote checkpoint(s) "
                    f"{', '.join(store.show_dir(s) for s in moved)} (manifest renamed to RETIRED-MANIFEST.json; kept)"
                )
            return local, notes
        local_step = CheckpointManager.step_of(local) if local is not None else -1
        for step in reversed(store.committed()):
            if step <= local_step:
                break
            try:
                path = store.download(step, root)
            except StoreError as e:
                notes.append(f"remote checkpoint {store.show_dir(step)} is corrupt, skipped: {e}")
                continue
            except Exception as e:
                notes.append(f"downloading {store.show_dir(step)} failed ({_short(e)}); skipped")
                continue
            notes.append(f"downloaded {store.show_dir(step)} (newer than any local checkpoint)")
            return path, notes
        if local is None and error is not None:
            raise error
        return local, notes

    # ------------------------------------------------------------------ while training

    def start_uploads(self, heartbeat_seconds: float = 60.0) -> None:
        """Rank 0, after the ledger is open: start the background uploader."""
        if self.store is None:
            return
        try:
            remote = self.store.committed() if self.reachable else []
        except Exception:
            remote = []
        self.uploader = Uploader(
            self.store, self.run_dir, self.keep_last, self.message, heartbeat_seconds=heartbeat_seconds
        ).start(remote[-1] if remote else None)

    def submit(self, step: int, checkpoint: Path) -> None:
        if self.uploader is not None:
            self.uploader.submit(step, checkpoint)

    def metrics(self) -> dict[str, Any]:
        return self.uploader.metrics() if self.uploader is not None else {}

    def finish(self, preempted: bool, notice_seconds: float) -> None:
        """Flush the last checkpoint upload before exit: within the notice window after a
        preemption. The run files follow in `close`, once the ledger row is written."""
        if self.uploader is None:
            return
        # A store that is failing right now gets the notice window only, so a dead endpoint cannot
        # hold a finished run for ten minutes; the local checkpoint stays either way.
        timeout = notice_seconds if preempted or self.uploader.failing else FINISH_TIMEOUT
        done = self.flushed = self.uploader.flush(timeout, run_files=False)
        safe = self.uploader.remote_step
        where = self.store.show_dir(safe) if self.store is not None and safe is not None else None
        if done:
            self.message(f"spotune: remote copy up to date: {where or 'no checkpoint'}")
        else:
            self.message(
                f"spotune: the upload did not finish within {timeout:g}s; the newest checkpoint safe remotely is "
                f"step {safe} ({where or 'none'}); the local one is step {self.uploader.local_step}"
            )

    def close(self) -> None:
        """Push the run files (with the ledger row this attempt just wrote) and stop uploading."""
        if self.uploader is None:
            return
        if self.flushed:  # else the store is failing: the next attempt pushes them
            self.uploader.flush(FINISH_TIMEOUT)
        self.uploader.stop()

    def stop(self) -> None:
        if self.uploader is not None:
            self.uploader.stop()


def fetch_run_files(store: Store, run_dir: Path) -> list[str]:
    """Download the run files this machine lacks (a fresh VM); returns their names.

    A heartbeat whose attempt already has its ledger row is dropped: the uploader sends the
    ledger before the heartbeat, so a kill between the two would otherwise count it twice.
    """
    fetched = [name for name in RUN_FILES if not (run_dir / name).exists() and store.get(name, run_dir / name)]
    beat = run_dir / HEARTBEAT_FILE
    if HEARTBEAT_FILE in fetched:
        try:
            progress = json.loads(beat.read_text())
            key = (progress["attempt"], progress["pid"])
        except (ValueError, KeyError, TypeError):
            key = None
        if key is None or any((r.get("attempt"), r.get("pid")) == key for r in read_rows(run_dir)):
            beat.unlink()
            fetched.remove(HEARTBEAT_FILE)
    return fetched


def _broadcast(step: int) -> int:
    """Rank 0's `step` on every rank (the resume step must be the same everywhere)."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return step
    box = [step]
    torch.distributed.broadcast_object_list(box, src=0)
    return int(box[0])
