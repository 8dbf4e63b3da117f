"""`checkpoint.remote` for a run: connect, bring a fresh machine up to date, choose the resume
step on rank 0 for every rank, upload while training, flush on exit.

`run.py` holds one `RemoteRun` (or a disabled one when `checkpoint.remote` is null) and
calls it at five points: `connect` before anything is written locally, `resolve` instead of
the local-only `resolve_resume`, `submit` after each committed save, `metrics` for each
metrics row, and `finish` before the process exits. The loop never sees it.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import torch

from trainer.atomic import write_bytes
from trainer.exit_codes import EXIT_FINISHED, EXIT_PREEMPTED
from trainer.restart.checkpoint import MANIFEST, CheckpointError, CheckpointManager, resolve_resume
from trainer.restart.ledger import HEARTBEAT_FILE, LEDGER_FILE, read_rows
from trainer.restart.storage import Fence, Store, StoreError, StoreUnreachable, _short
from trainer.restart.uploader import RUN_FILES, Uploader
from trainer.urls import redact

T = TypeVar("T")

APPEND_ONLY = ("metrics.jsonl", LEDGER_FILE)
"""Run files that only ever grow: a longer copy in the store that starts with the local one is newer."""

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
        self.resumed: Path | None = None
        """Rank 0: the checkpoint this attempt resumes from (`resolve`), uploaded first if the store lacks it."""
        self.fence: Fence | None = None  # the run's lease (trainer/restart/lease.py), set by run.py

    # ------------------------------------------------------------------ start

    def connect(self) -> None:
        """Rank 0: check the store; on a machine without the run files, download them.

        Raises StoreUnreachable (naming the URL and the likely cause; exit 143) when the store is
        unreachable and no local checkpoint lets training go on; with one, warns and retries later.
        """
        if self.url is None or not self.is_main:
            return
        self.store = Store(self.url, self.options)
        if self.fence is not None:
            self.store.fence = self.fence
        try:
            self.store.check()
        except StoreError as e:
            local = CheckpointManager(self.run_dir / "checkpoints").committed()
            if not local and isinstance(e.__cause__, (PermissionError, FileNotFoundError)):
                raise  # no such bucket, or access denied: a setting to fix (exit 2), not a fault to wait out
            if not local:  # the store is down: a fault of the moment, a restart later may find it (exit 143)
                raise StoreUnreachable(f"{e}. No local checkpoint lets training start without it") from e
            self.message(f"spotune: {e}. Continuing from the local checkpoint {local[-1].name}; uploads will retry.")
            return
        self.reachable = True
        self.run_dir.mkdir(parents=True, exist_ok=True)
        fetch_run_files(self.store, self.run_dir)

    def resolve(self, resume_setting: str) -> tuple[Path | None, list[str]]:
        """The checkpoint every rank resumes from: chosen on rank 0 (local or remote, the newest
        that verifies) and broadcast with the digest of its files.

        Each node's disk is its own: a node that lacks that exact checkpoint (none, a corrupt
        copy, or a copy of the same step from an abandoned timeline) downloads it. When the
        store lacks it too (the last attempt was killed before its upload finished), rank 0
        uploads it first. Every rank learns of a failure and raises the same error, so no
        node waits forever in a collective for one that gave up.
        """
        root = self.run_dir / "checkpoints"
        notes: list[str] = []
        picked: tuple[int, str, str] | str | None = None  # (step, rank 0's path, digest), or rank 0's error
        if self.is_main:
            try:
                chosen, notes = self._choose(root, resume_setting)
                if chosen is not None:
                    picked = (CheckpointManager.step_of(chosen), str(chosen), files_digest(chosen))
            except Exception as e:
                _broadcast(f"{type(e).__name__}: {_short(e)}")  # the other ranks wait in the broadcast below
                raise
        picked = _broadcast(picked)
        if isinstance(picked, str):
            raise CheckpointError(f"rank 0 could not choose the checkpoint to resume from: {picked}")
        if picked is None:
            return None, notes
        step, rank0_path, digest = picked
        here = Path(rank0_path) if self.is_main else root / f"step-{step:06d}"
        self.resumed = here if self.is_main else None
        lacks = self.is_local_main and not self.is_main and not _holds(root, here, digest)
        lacking = [r for r, flag in enumerate(_gather(lacks)) if flag]
        if lacking:
            if self.url is None:
                raise CheckpointError(
                    f"rank 0 resumes from step {step} but the disk of rank(s) {', '.join(map(str, lacking))} lacks "
                    "it; put output_dir on a shared filesystem or set checkpoint.remote"
                )
            problem = self._publish(Path(rank0_path), step, digest, notes) if self.is_main else None
            problem = _broadcast(problem)
            if problem is None and lacks:
                problem = self._fetch(root, step, digest)
            problems = [p for p in _gather(problem) if p]
            if problems:
                raise StoreError(problems[0])
        if self.is_local_main and not self.is_main:  # one line per node: what it loaded
            self.message(f"spotune: rank {_rank()}: resuming from {here} at step {step} (chosen by rank 0)")
        return here, notes

    def _publish(self, path: Path, step: int, digest: str, notes: list[str]) -> str | None:
        """Rank 0: make sure the store holds `path` as step `step` for the nodes that lack it."""
        store = self.store
        if store is None or not self.reachable:
            return (
                f"rank 0 resumes from its local step {step}, other nodes lack it and checkpoint.remote="
                f"{redact(self.url or '')} was unreachable at start"
            )
        try:
            if step in store.committed() and _remote_digest(store, step) == digest:
                return None
            store.upload(path, step)
        except Exception as e:
            return f"uploading step {step} to {store.show_dir(step)} for the nodes that lack it failed: {_short(e)}"
        notes.append(
            f"uploaded {store.show_dir(step)} for the nodes that lack it (the last attempt stopped before its upload)"
        )
        return None

    def _fetch(self, root: Path, step: int, digest: str) -> str | None:
        """A node's local main: download step `step` from the store; None, or what went wrong."""
        store = Store(self.url or "", self.options)
        try:
            path = store.download(step, root)
        except Exception as e:
            return f"rank {_rank()}: downloading {store.show_dir(step)} failed: {_short(e)}"
        if files_digest(path) != digest:
            return f"rank {_rank()}: {store.show_dir(step)} is not the checkpoint rank 0 resumes from"
        self.message(f"spotune: rank {_rank()}: this node lacked step {step}; downloaded {store.show_dir(step)}")
        CheckpointManager(root, keep_last=self.keep_last).prune(protect=path)  # only rank 0 saves: no other prune
        return None

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
        # The checkpoint resumed from goes up first when the store lacks it (an earlier attempt saved it
        # while cut off, or stopped before its upload finished): a run with no step left to train still
        # leaves its last step in the store.
        if self.resumed is None:
            return
        step = CheckpointManager.step_of(self.resumed)
        if self.uploader.remote_step is None or step > self.uploader.remote_step:
            self.message(f"spotune: {self.store.shown} lacks step {step} (saved while cut off from it): uploading it")
            self.uploader.submit(step, self.resumed)

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

    def exit_code(self, code: int, final: Path) -> int:
        """`code`, or 143 for a finished run whose last checkpoint the store lacks: done here, not yet
        safe (a spot VM torn down after exit 0 takes the result with it); the supervisor then runs the
        same command, which uploads it first (`start_uploads`) and exits 0."""
        if code != EXIT_FINISHED or self.uploader is None or self.flushed:
            return code
        self.message(
            f"spotune: training finished ({final}), but {redact(self.url or '')} lacks its last checkpoint: "
            f"exit {EXIT_PREEMPTED}; run the same command again to upload it"
        )
        return EXIT_PREEMPTED

    def push_run_files(self, notice_seconds: float) -> None:
        """Before an early exit that saved no checkpoint (out of memory): the ledger row and the run files
        (the `auto` setting that ran out among them) reach the store, within the notice window."""
        self.finish(preempted=True, notice_seconds=notice_seconds)
        self.close()

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
    """Download the run files this machine lacks (a fresh VM), and the append-only ones of which
    it holds an older copy (a node that was rank 0 in an earlier attempt, since when another
    node's rank 0 has written on); returns their names.

    A heartbeat whose attempt already has its ledger row is dropped: the uploader sends the
    ledger before the heartbeat, so a kill between the two would otherwise count it twice.
    """
    fetched = []
    for name in RUN_FILES:
        local = run_dir / name
        if not local.exists():
            got = store.get(name, local)
        else:
            got = name in APPEND_ONLY and _continue(store, name, local)
        if got:
            fetched.append(name)
    beat = run_dir / HEARTBEAT_FILE
    if beat.exists():
        try:
            progress = json.loads(beat.read_text())
            key = (progress["attempt"], progress["pid"])
        except (ValueError, KeyError, TypeError):
            key = None  # an unreadable local one is left to Ledger.open, which warns
        counted = key is not None and any((r.get("attempt"), r.get("pid")) == key for r in read_rows(run_dir))
        if counted or (key is None and HEARTBEAT_FILE in fetched):
            beat.unlink()
            if HEARTBEAT_FILE in fetched:
                fetched.remove(HEARTBEAT_FILE)
    return fetched


def _continue(store: Store, name: str, local: Path) -> bool:
    """Replace `local` by the store's copy when that copy continues it (starts with its bytes);
    a local copy with rows the store lacks is kept (this node wrote them last)."""
    try:
        source = store.run_file(name)  # the copy of the newest generation (trainer/restart/generations.py)
        if source is None or store.fs.size(source) <= local.stat().st_size:
            return False
        remote = store.fs.cat_file(source)
    except FileNotFoundError:
        return False
    if not remote.startswith(local.read_bytes()):
        return False
    write_bytes(local, remote)
    return True


def files_digest(checkpoint: Path) -> str:
    """sha256 over a committed checkpoint's manifest entries (every file's size and sha256): equal
    digests, equal bytes. The manifest's own timestamp is left out."""
    files = json.loads((checkpoint / MANIFEST).read_text())["files"]
    return hashlib.sha256(json.dumps(files, sort_keys=True).encode()).hexdigest()


def _remote_digest(store: Store, step: int) -> str:
    files = json.loads(store.fs.cat_file(store.step_path(step, MANIFEST)))["files"]
    return hashlib.sha256(json.dumps(files, sort_keys=True).encode()).hexdigest()


def _holds(root: Path, path: Path, digest: str) -> bool:
    """Whether this node's disk has the exact checkpoint rank 0 chose, and it verifies."""
    try:
        return path.is_dir() and files_digest(path) == digest and not CheckpointManager(root).verify(path)
    except (OSError, ValueError, KeyError, TypeError):
        return False


def _distributed() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def _rank() -> int:
    return torch.distributed.get_rank() if _distributed() else 0


def _broadcast(value: T) -> T:
    """Rank 0's `value` on every rank (the resume step must be the same everywhere)."""
    if not _distributed():
        return value
    box = [value]
    torch.distributed.broadcast_object_list(box, src=0)
    return box[0]


def _gather(value: T) -> list[T]:
    """Every rank's `value`, in rank order, on every rank."""
    if not _distributed():
        return [value]
    out: list[Any] = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(out, value)
    return out
