"""Background upload of committed checkpoints: one thread, at most one upload in flight.

The training loop only pays for `submit`, which hard-links the committed checkpoint's files
into a staging directory (microseconds; local pruning can then delete the original while
it uploads) and returns. A save that arrives while an upload runs takes the one pending
slot; a pending save it replaces is never uploaded and is counted in `uploads_skipped`, so
the queue is bounded by design. An unreachable store (a fault of the moment, trainer/faults.py) is
retried with backoff while training goes on; anything else (credentials, permissions, a full store, an
unknown error) stops the uploads and asks the run to stop (`on_refused`: saved locally, exit 2 for a
setting to fix), never retried for ever. Nothing local is ever deleted because the remote failed.

The metrics rows go up before each checkpoint is committed (its manifest uploaded), so the store
never holds checkpoint N without the rows up to step N: the rows are flushed before the save, and a
machine killed right after the commit loses none (the resumed run does not log those steps again).
After each checkpoint the run files follow (ledger, its heartbeat, metrics, config), so a
machine that starts on an empty `output_dir` continues the run's totals, and the heartbeat
is pushed on its own every `heartbeat_seconds` so the time of a machine that vanishes
between checkpoints is still counted.
"""

from __future__ import annotations

import os
import shutil
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainer.atomic import temp_sibling
from trainer.faults import transient
from trainer.restart.books.ledger import HEARTBEAT_FILE, LEDGER_FILE
from trainer.restart.ownership.lease_object import LeaseLost
from trainer.restart.store.lifecycle import Store
from trainer.restart.store.safety import SafetyViolation, StoreAhead
from trainer.urls import one_line

RAN_OUT_FILE = "auto-out-of-memory.json"
"""The `auto` memory setting that ran out of memory (trainer/training/autofit.py): a run file, so a
replacement machine does not choose it again."""

METRICS_FILE = "metrics.jsonl"
"""The run's metrics rows (training/telemetry.py's JsonlSink, flushed per row)."""

RUN_FILES = ("config.yaml", METRICS_FILE, RAN_OUT_FILE, LEDGER_FILE, HEARTBEAT_FILE)
"""Uploaded after every checkpoint (absent ones skipped); the ledger before its heartbeat (see remote/run_files.py fetch_run_files)."""


@dataclass
class _Job:
    step: int
    staged: Path


class Uploader:
    """Uploads checkpoints of `run_dir` to `store` in a daemon thread."""

    def __init__(
        self,
        store: Store,
        run_dir: Path,
        keep_last: int,
        message: Callable[[str], None],
        *,
        heartbeat_seconds: float = 60.0,
        max_backoff: float = 60.0,
        on_violation: Callable[[str], object] = lambda why: None,
        before_run_files: Callable[[], object] = lambda: None,
        on_refused: Callable[[BaseException], object] = lambda error: None,
    ) -> None:
        self.store = store
        self.run_dir = run_dir
        self.keep_last = keep_last
        self.message = message
        self.on_violation = on_violation
        """Called (from the upload thread) with what a write the safety rule refused means: the run stops."""
        self.on_refused = on_refused
        """Called (from the upload thread) with `stopped_by`: the run stops with its exit code."""
        self.before_run_files = before_run_files
        """Called before each push of the run files: the ledger books what the lease learnt since (remote.py)."""
        self.heartbeat_seconds = heartbeat_seconds
        self.max_backoff = max_backoff
        self._cond = threading.Condition()
        self._pending: _Job | None = None
        self._busy = False
        self._stopping = False
        self.local_step: int | None = None
        self.remote_step: int | None = None
        self.failing = False
        self.refused = False
        """The store's floor refuses every write of this attempt (found ahead of it): nothing more is sent."""
        self.violation: str | None = None
        """A write the safety rule refused (a bug in spotune, trainer/restart/store/safety.py): nothing more is sent,
        and the run stops with exit 1 (`RemoteRun.exit_code`), not 143: a requeue would meet the bug again."""
        self.stopped_by: BaseException | None = None
        """An upload failed for good (not a fault of the moment): as the store's fault names it; nothing more is sent."""
        self.beside_failing = False
        """The last push beside the checkpoints (run files, heartbeat) failed with a fault of the moment: said once."""
        self.stats: dict[str, Any] = {"uploads_skipped": 0}
        self._thread = threading.Thread(target=self._run, name="spotune-upload", daemon=True)

    def start(self, remote_step: int | None) -> Uploader:
        self.remote_step = remote_step
        self._thread.start()
        return self

    @property
    def halted(self) -> bool:
        """Nothing more is uploaded: the store is ahead of this attempt, the rule refused a write, or the store
        refused one for good."""
        return self.refused or self.violation is not None or self.stopped_by is not None

    def caught_up(self) -> bool:
        """The store holds the newest checkpoint this attempt committed: nothing queued or in flight, and the
        last upload was that step's (a job dropped when the lease was lost or released is not uploaded)."""
        with self._cond:
            idle = not self._busy and self._pending is None
            return idle and not self.halted and (self.local_step is None or self.remote_step == self.local_step)

    # ------------------------------------------------------------------ the loop's side

    def submit(self, step: int, checkpoint: Path) -> None:
        """Queue committed checkpoint `step` for upload and return at once."""
        with self._cond:
            self.local_step = step
            if self.halted:
                return  # the local checkpoint stays; the next attempt reads the store's newer one
        staged = temp_sibling(checkpoint, "upload")
        _link_tree(checkpoint, staged)
        with self._cond:
            if self._pending is not None:  # superseded before its upload began: never uploaded
                self.stats["uploads_skipped"] += 1
                shutil.rmtree(self._pending.staged, ignore_errors=True)
            self._pending = _Job(step, staged)
            self._cond.notify_all()

    def metrics(self) -> dict[str, Any]:
        """Figures for the metrics row: last upload's seconds and bytes, how far the remote lags."""
        with self._cond:
            out = dict(self.stats)
            out["remote_step"] = self.remote_step
            if self.local_step is not None:
                out["remote_steps_behind"] = self.local_step - (self.remote_step or 0)
            return out

    def flush(self, timeout: float, run_files: bool = True) -> bool:
        """Wait until every submitted checkpoint (and, with `run_files`, the run files) is
        uploaded; False on timeout."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while (self._busy or self._pending is not None) and not self.halted:
                left = deadline - time.monotonic()
                if left <= 0 or not self._thread.is_alive():
                    return False
                self._cond.wait(min(left, 0.5))
        if not self.caught_up():
            return False
        if not run_files:
            return True
        try:
            self._push_run_files()  # the ledger row this attempt just closed
        except Exception as e:
            self.message(f"spotune: uploading the run files to {self.store.shown} failed: {one_line(e)}")
            return False
        return True

    def stop(self) -> None:
        """Stop the thread; staging links of uploads that will not happen are removed (an
        upload stuck in a network call leaves its own, which the next start cleans)."""
        with self._cond:
            self._stopping = True
            job, self._pending = self._pending, None
            self._cond.notify_all()
        if job is not None:
            shutil.rmtree(job.staged, ignore_errors=True)
        if self._thread.is_alive():
            self._thread.join(timeout=2.0)

    # ------------------------------------------------------------------ the thread

    def _run(self) -> None:
        # First the ledger row of a killed attempt (recovered at open) and this attempt's heartbeat,
        # so even an attempt killed before its first checkpoint is counted on the next machine.
        self._beside("uploading the run files", self._push_run_files)
        last_push = time.monotonic()
        while True:
            with self._cond:
                while self._pending is None and not self._stopping:
                    if not self._cond.wait(max(0.0, last_push + self.heartbeat_seconds - time.monotonic())):
                        break
                if self._stopping or self.halted:  # halted: nothing more is sent (`submit` drops what comes)
                    return
                job, self._pending = self._pending, None
                self._busy = job is not None
            if job is None:  # nothing to upload for a while: refresh the remote heartbeat only
                self._beside(
                    "refreshing the heartbeat", lambda: self.store.put(self.run_dir / HEARTBEAT_FILE, HEARTBEAT_FILE)
                )
            else:
                self._upload_with_retries(job)
            last_push = time.monotonic()
            with self._cond:
                self._busy = False
                self._cond.notify_all()

    def _upload_with_retries(self, job: _Job) -> None:
        delay = 1.0
        while True:
            started = time.monotonic()
            try:
                self.store.clean()  # leftovers of an upload killed midway (we are the only writer)
                self.store.put(self.run_dir / METRICS_FILE, METRICS_FILE)  # rows up to job.step, before its commit
                sent = self.store.upload(job.staged, job.step)
                with self._cond:
                    self.remote_step = job.step
                    self.stats.update(upload_seconds=round(time.monotonic() - started, 3), upload_bytes=sent)
                if self.failing:
                    self.message(
                        f"spotune: the remote store {self.store.shown} is reachable again; step {job.step} uploaded"
                    )
                self.failing = False
                self.store.prune(self.keep_last)
                self._push_run_files()
                break
            except StoreAhead:  # this attempt may write nothing there (trainer/restart/store/safety.py): it stops
                self.failing = self.refused = True
                break
            except LeaseLost:  # released (the attempt is ending) or lost: the lease's own path sets the stop and code
                self.failing = True
                break
            except Exception as e:
                self.failing = True
                if self._halts(e, f"uploading step {job.step} to {self.store.show_dir(job.step)}"):
                    break
                with self._cond:
                    behind = (self.local_step or job.step) - (self.remote_step or 0)
                    newer = self._pending
                self.message(
                    f"spotune: uploading step {job.step} to {self.store.show_dir(job.step)} failed "
                    f"({type(e).__name__}: {one_line(e)}); retrying in {delay:.0f}s, training goes on. The remote copy "
                    f"is {behind} step(s) behind (newest remote step: {self.remote_step}); local checkpoints are kept."
                )
                if newer is not None:  # a newer checkpoint is waiting: upload that one instead
                    with self._cond:
                        self.stats["uploads_skipped"] += 1
                    break
                with self._cond:
                    self._cond.wait_for(lambda: self._stopping or self._pending is not None, timeout=delay)
                    if self._stopping:
                        break
                delay = min(delay * 2, self.max_backoff)
        shutil.rmtree(job.staged, ignore_errors=True)

    def _push_run_files(self) -> None:
        self.before_run_files()
        for name in RUN_FILES:
            self.store.put(self.run_dir / name, name)

    def _halts(self, e: Exception, what: str) -> bool:
        """Whether the failed write `e` ends this attempt's uploads, and if so say so and ask the run to stop: a
        write the safety rule refused (a bug: exit 1), or one the store refused for good (trainer/faults.py:
        credentials, permissions, a full store, anything not known to pass; exit as the store's fault names it).
        A fault of the moment (False) is retried by the caller."""
        if isinstance(e, SafetyViolation):  # refused before it happened; write nothing more
            self.violation = f"a bug in spotune: {e}"
            self.message(
                f"spotune: {self.violation}. Nothing more is uploaded (the local checkpoints stay); saving a "
                "checkpoint and stopping with exit 1: report it, rerunning meets it again"
            )
            self.on_violation(self.violation)
            return True
        if transient(e):
            return False
        self.stopped_by = self.store.fault(e, "write") or e  # retrying changes nothing: stop, keep the local ones
        self.message(
            f"spotune: {what} failed for good: {self.stopped_by}. Nothing more is uploaded (the local checkpoints "
            "stay); saving a checkpoint and stopping"
        )
        self.on_refused(self.stopped_by)
        return True

    def _beside(self, what: str, fn: Callable[[], Any]) -> None:
        """A push beside the checkpoints (the run files at start, the heartbeat between checkpoints), which no
        training waits for: a fault of the moment is said once (not at every push while it lasts) and retried at
        the next push; a refusal for good stops the attempt as a failed checkpoint upload does, at once rather
        than at the next checkpoint, which may be many paid minutes away."""
        try:
            fn()
        except StoreAhead:
            self.refused = True
        except LeaseLost:  # released (the attempt is ending) or lost: the lease's own path sets the stop and code
            pass
        except Exception as e:
            if self._halts(e, f"{what} in {self.store.shown}"):
                return
            if not self.beside_failing:
                self.message(
                    f"spotune: {what} in {self.store.shown} failed ({type(e).__name__}: {one_line(e)}); "
                    f"trying again in {self.heartbeat_seconds:g}s, training goes on"
                )
            self.beside_failing = True
        else:
            self.beside_failing = False


def _link_tree(src: Path, dest: Path) -> None:
    """Hard-link every file of `src` into `dest` (copy where links are not supported)."""
    for f in sorted(src.rglob("*")):
        target = dest / f.relative_to(src)
        if f.is_dir():
            target.mkdir(parents=True, exist_ok=True)
            continue
        target.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.link(f, target)
        except OSError:
            shutil.copy2(f, target)
