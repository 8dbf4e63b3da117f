"""`checkpoint.remote` for a run: connect, bring a fresh machine up to date, choose the resume
step on rank 0 for every rank, upload while training, flush on exit.

`run.py` holds one `RemoteRun` (or a disabled one when `checkpoint.remote` is null) and
calls it at these points: `connect` before anything is written locally, `resolve` instead of
the local-only `resolve_resume`, `start_uploads` once the ledger is open, `submit` after each
committed save, `metrics` for each metrics row, `finish` before the process exits, `close` after
the ledger row, `exit_code` for the code every rank exits with, and `push_run_files` before an
early exit that saved nothing (out of memory). The loop never sees it.

`connect` and `resolve` are collective: what rank 0 meets (the store refusing these credentials,
or not answering) is raised alike on every rank (trainer/restart/agree.py), so the ranks exit with
one code. Every write goes through the store's fence (the lease) and floor (the rule of
trainer/restart/store/safety.py, which `resolve` sets up through trainer/restart/remote/choose.py).

The parts it calls, each its own module: a resume request applied once (new_run.py `apply`), the run
files a machine fetches (run_files.py), the choice (choose.py), the several-node copies (nodes.py), the
background uploads (uploader.py). What stays here is the order of an attempt's calls and its verdicts:
the exit reason and code every rank ends with.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from trainer.exit_codes import EXIT_ERROR, EXIT_FINISHED, EXIT_PREEMPTED, code_for
from trainer.restart import agree, defaults
from trainer.restart.books.handover import Handover
from trainer.restart.books.ledger import HEARTBEAT_FILE, LEDGER_FILE, recover_killed
from trainer.restart.local.checkpoint import CheckpointError, CheckpointManager
from trainer.restart.ownership.lease_object import Follower
from trainer.restart.remote import new_run as new_run_module
from trainer.restart.remote.choose import choose, retrying
from trainer.restart.remote.nodes import Copies, Directory, directory_of, files_digest, holds
from trainer.restart.remote.run_files import fetch_run_files
from trainer.restart.remote.uploader import RAN_OUT_FILE, Uploader
from trainer.restart.store.errors import StoreDenied, StoreUnreachable
from trainer.restart.store.lifecycle import Fence, Store
from trainer.restart.store.safety import Floor
from trainer.urls import one_line, redact

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
        retry_seconds: float = defaults.STORE_RETRY_SECONDS,
        outage_seconds: float = defaults.STORE_OUTAGE_SECONDS,
    ) -> None:
        self.url = url
        self.options = storage_options
        self.run_dir = run_dir
        self.keep_last = keep_last
        self.is_main = is_main
        self.is_local_main = is_local_main
        self.message = message
        self.budget = min(retry_seconds, outage_seconds)
        """Seconds a start retries a store fault before exit 143 (checkpoint.store_retry_seconds)."""
        self.store: Store | None = None
        self.reachable = False
        self.uploader: Uploader | None = None
        self.flushed = False
        self.resumed: Path | None = None
        """Rank 0: the checkpoint this attempt resumes from (`resolve`), uploaded first if the store lacks it."""
        self.fence: Fence | None = None  # the run's lease (trainer/restart/ownership/lease.py), set by run.py
        self.floor = Floor()
        """What this attempt may take out of sight in the store (trainer/restart/store/safety.py); on_ahead set by process.py."""
        self.on_violation: Callable[[str], object] = lambda why: None
        """What the uploader calls when the rule refused one of its writes (a bug): process.py asks for the stop."""
        self._booking = threading.Lock()
        self.request = new_run_module.Request()
        """checkpoint.resume as given, and whether this start applies it (`connect`; trainer/restart/remote/new_run.py)."""
        self.refused: BaseException | None = None
        """What the store answered a background thread (the uploader, the lease's) that rerunning will not change
        (trainer/faults.py): the run stops, and exits with its code (`exit_code`)."""
        self.on_refused: Callable[[str, int], object] = lambda why, code: None
        """Asks for the stop when `refused` is set (process.py: save locally, then exit with `code`)."""
        self.holder: str | None = None
        """The lease holder id of this attempt, on every rank: another rank writes only under it (`push_run_files`)."""

    # ------------------------------------------------------------------ start

    def connect(
        self, request: new_run_module.Request | None = None, set_aside_here: Callable[[str], None] | None = None
    ) -> None:
        """Collective. Rank 0 checks the store (list, and a probe write and delete) and, on a machine
        without the run files, downloads them (this disk's ledger and metrics rows merged with the store's).

        Every rank raises StoreDenied (exit 2) when the store refuses these credentials or has no such
        bucket, and StoreUnreachable (exit 143) when it does not answer for `budget` seconds and no local
        checkpoint lets training start; with one, rank 0 warns and goes on cut off (the floor reads the
        store before the first write). `request` (checkpoint.resume) applies once, in one step once the store
        answered (trainer/restart/remote/new_run.py `apply`, with `set_aside_here`: this disk's part), then on
        every node whose disk is not rank 0's; a store that does not answer then stops the attempt (exit 143)
        before anything moved."""
        self.request = request or new_run_module.Request()
        if self.is_main:
            try:
                self._connect_main(set_aside_here)
            except Exception as e:
                agree.broadcast((agree.failure(e), None, None))  # the other ranks wait in the broadcast below
                raise
        mine = (self.request.rerun is not None, self.request.new_run, directory_of(self.run_dir))
        problem, self.holder, agreed = agree.broadcast((None, getattr(self.fence, "id", None), mine))
        agree.raise_failure([problem], prefix="rank 0 could not connect to the store: ")
        rerun, folder, directory = agreed
        if not self.is_main:
            self.request.rerun = {"rank 0": "a rerun"} if rerun else None
            if set_aside_here is not None and folder is not None and directory_of(self.run_dir) != directory:
                try:  # this node's own disk (not rank 0's): its old checkpoints and files go aside too
                    set_aside_here(folder)
                except OSError as e:  # its old checkpoints stay; a resume still checks each copy's digest
                    self.message(f"spotune: rank {agree.rank()}: could not set this node's old run aside: {e}")

    def _connect_main(self, set_aside_here: Callable[[str], None] | None) -> None:
        """Rank 0: the store reached (or none used), the request applied once (`new_run.apply`, called here
        only), the run files this machine lacks fetched."""
        request, run_dir = self.request, self.run_dir
        here = [set_aside_here] if set_aside_here is not None else []  # once: a retry finds nothing here
        store: Store | None = None
        local: list[Path] = []
        if self.url is not None:
            store = self.store = Store(self.url, self.options)
            store.floor = self.floor
            self.floor.new_timeline = request.folder is not None
            if self.fence is not None:
                store.fence = self.fence
            local = CheckpointManager(run_dir / "checkpoints").committed()

        def files() -> tuple[list[bytes | None], list[bytes | None]]:  # the run's last attempt, here or in the store
            ledgers, beats = new_run_module.local_files(run_dir)
            if store is None:
                return ledgers, beats
            return [*ledgers, store.read_run_file(LEDGER_FILE)], [*beats, store.read_run_file(HEARTBEAT_FILE)]

        def reach() -> None:
            if store is not None:
                store.check()
            new_run_module.apply(request, store, files, here.pop() if here else None, self.message)
            if store is not None:
                run_dir.mkdir(parents=True, exist_ok=True)
                fetch_run_files(store, run_dir)

        if store is None:  # no checkpoint.remote: this disk alone
            reach()
            return
        try:
            retrying("reaching", 0.0 if local else self.budget, reach, self.message, store)
        except StoreDenied:
            raise  # a setting to fix: waiting changes nothing (exit 2)
        except StoreUnreachable as e:
            # this disk alone may show a rerun, whose timeline goes on cut off like auto's
            request.decide(*new_run_module.local_files(run_dir), self.message)
            self.floor.new_timeline = self.floor.new_timeline and request.rerun is None
            if request.new_run is not None:  # a new run sets the store's checkpoints aside first
                raise StoreUnreachable(
                    f"{e}. checkpoint.resume=never sets the old run aside in the store too; nothing was moved "
                    "(exit 143: rerun once the store answers)"
                ) from e
            if not local:  # a fault of the moment, and nothing to train from without the store (exit 143)
                raise StoreUnreachable(f"{e}. No local checkpoint lets training start without it") from e
            self.message(f"spotune: {e}. Continuing from the local checkpoint {local[-1].name}; uploads will retry.")
            return
        self.reachable = True

    def resolve(self, resume_setting: str) -> tuple[Path | None, list[str]]:
        """The checkpoint every rank resumes from: chosen on rank 0 (local or remote, the newest
        that verifies: trainer/restart/remote/choose.py) and broadcast with the digest of its files.

        Each rank restores its run's own `step-XXXXXX`, except for a `checkpoint.resume=` path outside
        output_dir/checkpoints: every rank that can read that very directory (those of rank 0's node)
        restores it, the others their step of that number. Each node's disk is its own: a node that
        lacks that exact checkpoint (none, a corrupt copy, or a copy of the same step from an
        abandoned timeline) downloads it. When the store lacks it too (the last attempt was killed
        before its upload finished), rank 0 uploads it first. Every rank learns of a failure and raises the same error class, so no
        node waits forever in a collective for one that gave up, and every rank exits alike.
        """
        root = self.run_dir / "checkpoints"
        notes: list[str] = []
        picked: tuple[int, str, str, Directory | None] | None = None  # (step, rank 0's path, digest, directory)
        chosen: Path | None = None
        if self.is_main:
            try:
                chosen, notes = choose(
                    root, resume_setting, self.store, self.reachable, budget=self.budget, message=self.message
                )
                if chosen is not None:
                    step = CheckpointManager.step_of(chosen)
                    # A path outside the run's checkpoints (checkpoint.resume=<path>) is named by its directory:
                    # the ranks that can read that very one (rank 0's node) restore it; the others, their step.
                    outside = chosen.absolute() != (root / chosen.name).absolute()
                    directory = directory_of(chosen) if outside else None
                    picked = (step, str(chosen.absolute()), files_digest(chosen), directory)
            except Exception as e:
                agree.broadcast((None, agree.failure(e)))  # the other ranks wait in the broadcast below
                raise
        picked, failed = agree.broadcast((picked, None))
        agree.raise_failure([failed], prefix="rank 0 could not choose the checkpoint to resume from: ")
        if picked is None:
            return None, notes
        step, rank0_path, digest, directory = picked
        same = self.is_main or (directory is not None and directory_of(Path(rank0_path)) == directory)
        here = (chosen or Path(rank0_path)) if same else root / f"step-{step:06d}"
        self.resumed = here if self.is_main else None
        lacks = self.is_local_main and not same and not holds(root, here, digest)
        lacking = [r for r, flag in enumerate(agree.gather(lacks)) if flag]
        if lacking:
            if self.url is None:
                raise CheckpointError(
                    f"rank 0 resumes from step {step} but the disk of rank(s) {', '.join(map(str, lacking))} lacks "
                    "it; put output_dir on a shared filesystem or set checkpoint.remote"
                )
            store = self.store if self.reachable else None
            copies = Copies(self.url, self.options, store, self.is_main, self.budget, self.keep_last, self.message)
            copies.bring(Path(rank0_path), root, step, digest, lacks, notes)
        if self.is_local_main and not self.is_main:  # one line per node: what it loaded
            self.message(f"spotune: rank {agree.rank()}: resuming from {here} at step {step} (chosen by rank 0)")
        return here, notes

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
            self.store,
            self.run_dir,
            self.keep_last,
            self.message,
            heartbeat_seconds=heartbeat_seconds,
            on_violation=self.on_violation,
            before_run_files=self.book_late,
            on_refused=self.refuse,
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

    def book_late(self) -> list[dict[str, Any]]:
        """Rank 0, before each push of the run files: book the attempts this attempt's lease took over after its
        ledger opened (the lease taken late, trainer/restart/books/handover.py `late`), so each paid attempt has its
        row even when this attempt finishes the run and nobody takes the lease after it. Returns the rows."""
        handover = getattr(self.fence, "handover", None)
        with self._booking:  # the upload thread and the final flush both push the run files
            late = handover.late() if isinstance(handover, Handover) else []
            if not late:
                return []
            return recover_killed(self.run_dir, late, before=getattr(self.fence, "acquired_at", None), leftover=False)

    def refuse(self, error: BaseException) -> None:
        """A background thread met `error`, which rerunning will not change: the first is kept, and the run is
        asked to stop (a local checkpoint saved), to exit with its code (`exit_code`)."""
        if self.refused is None:
            self.refused = error
            self.on_refused(f"spotune: {error}", code_for(error))

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

    def exit_reason(self, reason: str) -> str:
        """The exit reason this attempt's ledger row books: `error` when the safety rule refused one of the
        uploader's writes (the attempt exits 1, `exit_code`) or the store refused a background thread for good
        (`refused`: exit 2); the stop either asked for looks like a preemption to the loop. `preempted` for a
        run that trained to its last step on a disk the store was found ahead of (`Floor.ahead`: another machine
        trained further meanwhile): this disk's branch is not the run's, which the next attempt continues from
        the store's newest; booked `finished`, the row said the run was done while the attempt exited 143 and
        it was not (`status` reads the last row). Else the loop's `reason`. Rank 0 knows; other ranks write no
        row."""
        if self.refused is not None or (self.uploader is not None and self.uploader.violation is not None):
            return "error"
        if reason == "finished" and self.floor.ahead is not None:
            return "preempted"
        return reason

    def exit_code(self, code: int, final: Path) -> int:
        """Collective. `code`; the code of what the store refused a background thread for good (`refused`: 2
        for a setting to fix); or 1 when the safety rule refused one of the uploader's writes (a bug in
        spotune: a requeue would meet it again; the local checkpoint is saved), or 143 for a finished run
        whose last checkpoint the store lacks: done here, not yet safe (a spot VM torn down after exit 0
        takes the result with it); the supervisor then runs the same command, which uploads it first
        (`start_uploads`) and exits 0; or, where the store was found ahead of this disk (`Floor.ahead`),
        continues from the store's newest. Rank 0 (the uploader's) decides for every rank, so every rank exits
        with the code alike."""
        if self.url is None:
            return code
        verdict = code
        if self.is_main and self.refused is not None:
            verdict = code_for(self.refused)
            self.message(f"spotune: {self.refused}: exit {verdict}")
        elif self.is_main and self.uploader is not None:
            if self.uploader.violation is not None:
                verdict = EXIT_ERROR
                self.message(f"spotune: {self.uploader.violation}: exit {EXIT_ERROR}")
            elif code == EXIT_FINISHED and self.floor.ahead is not None:
                verdict = EXIT_PREEMPTED  # nothing here is to upload: the rerun continues from the store's newest
                self.message(
                    f"spotune: training finished on this disk ({final}), but {redact(self.url or '')} is ahead of "
                    f"it (another machine trained further): exit {EXIT_PREEMPTED}; run the same command again to "
                    "continue from the store's newest checkpoint"
                )
            elif code == EXIT_FINISHED and not self.flushed:
                verdict = EXIT_PREEMPTED
                self.message(
                    f"spotune: training finished ({final}), but {redact(self.url or '')} lacks its last checkpoint: "
                    f"exit {EXIT_PREEMPTED}; run the same command again to upload it"
                )
        return agree.broadcast(verdict)

    def push_run_files(self, notice_seconds: float) -> None:
        """Before an early exit that saved no checkpoint (out of memory), from the rank that ran out: on
        rank 0 the ledger row and the run files reach the store within the notice window; on another
        rank, the `auto` setting that ran out (RAN_OUT_FILE), under this attempt's lease, so a fresh
        machine does not choose it again."""
        if self.is_main:
            self.finish(preempted=True, notice_seconds=notice_seconds)
            self.close()
            return
        if self.url is None or self.holder is None:
            return
        store = Store(self.url, self.options)
        store.fence = Follower(store, self.holder)
        try:
            store.put(self.run_dir / RAN_OUT_FILE, RAN_OUT_FILE)
        except Exception as e:  # the next attempt on this disk still reads it; a fresh one may choose it again
            self.message(f"spotune: rank {agree.rank()}: could not push {RAN_OUT_FILE} to {store.shown}: {one_line(e)}")

    def close(self) -> None:
        """Push the run files (with the ledger row this attempt just wrote) and stop uploading."""
        if self.uploader is None:
            return
        # The store may have come back after `finish` gave up waiting (the report and the row took a while):
        # the last step uploaded since counts as flushed, so a finished run does not exit 143 for nothing.
        self.flushed = self.flushed or self.uploader.caught_up()
        if self.flushed:  # else the store is failing: the next attempt pushes them
            self.uploader.flush(FINISH_TIMEOUT)
        self.uploader.stop()

    def stop(self) -> None:
        if self.uploader is not None:
            self.uploader.stop()
