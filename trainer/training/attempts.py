"""How an attempt of `spotune train` takes up from the earlier ones: whether the run finished
already (then it opens no attempt: no ledger row, no device-hours), the one restore of a
checkpoint, and where it resumes against where the last attempt got (said at once, and put in its
ledger row so the report counts the steps trained again: trainer/report/totals.py `redone_steps`).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from trainer.restart import agree
from trainer.restart.books.clock import process_start
from trainer.restart.books.ledger import LEDGER_FILE, Ledger, read_rows, recover_killed
from trainer.restart.local.checkpoint import CheckpointManager
from trainer.restart.local.state import Counters, restore_training_state
from trainer.restart.ownership.lease import Lease
from trainer.training import process
from trainer.urls import one_line


def finished_already(proc: process.Process, steps: int, resume_dir: Path | None, lease: Lease | None = None) -> bool:
    """The run trained all `steps`, wrote final/, a ledger row says `finished`, and (with
    checkpoint.remote) the store holds its last checkpoint: say so, and the attempt ends here. Rank 0
    decides (its disk, its store); every rank follows. A run short of any of these goes on and does
    what is missing: trains, writes final/, uploads.

    Ending here is no attempt (no row, no device-hours), yet its books are closed first: the attempts
    killed since (a heartbeat left on this disk, the records `lease` carries) are booked and the
    ledger pushed to the store; `lease` is marked `no_attempt`, so the next holder does not book this
    process as a killed attempt (trainer/restart/books/handover.py)."""

    def decide() -> bool:
        assert resume_dir is not None
        step = CheckpointManager.step_of(resume_dir)
        if not (step >= steps and (proc.out / "final").is_dir() and _stored(proc.remote, step)):
            return False
        _book_carried(proc, lease)
        if not any(r.get("exit_reason") == "finished" for r in read_rows(proc.out)):
            return False  # final/ written but never closed (killed at the end): an attempt closes it
        if lease is not None:
            lease.no_attempt = True
        print(
            f"spotune: {proc.out} finished already: step {step} of {steps} is trained and final/ written; "
            "nothing to do (no new attempt, no device-hours). To train further raise train.max_steps or "
            "train.epochs; to start over set checkpoint.resume=never or another output_dir.",
            flush=True,
        )
        return True

    if resume_dir is None:  # the same on every rank (broadcast by resolve): nothing trained yet
        return False
    return agree.on_rank0(decide, proc.is_main, "tell whether the run finished already")


def _book_carried(proc: process.Process, lease: Lease | None) -> None:
    """Book the attempts killed since the run finished (a leftover heartbeat, the lease's records), and
    push the ledger: the records leave the lease once the store has it (else the next holder books them)."""
    booked = recover_killed(proc.out, lease.hand_over() if lease is not None else (), before=process_start())
    store = proc.remote.store
    if booked and store is not None and proc.remote.reachable:
        try:
            store.put(proc.out / LEDGER_FILE, LEDGER_FILE)
        except Exception as e:  # the lease keeps the records for the next holder
            print(
                f"spotune: pushing {LEDGER_FILE} to {store.shown} failed ({one_line(e)}); the next attempt does",
                flush=True,
            )


def restore(resume_dir: Path, model: torch.nn.Module, optimizer: Any, accelerator: Any) -> Counters:
    """Adapter, optimizer, grad scaler and this rank's RNG from `resume_dir`, every field; returns
    the checkpoint's counters. The ledger totals it carried were read when the ledger opened."""
    where = dict(rank=accelerator.process_index, world_size=accelerator.num_processes, scaler=accelerator.scaler)
    return restore_training_state(resume_dir, model=model, optimizer=optimizer, **where).counters()


def _stored(remote: Any, step: int) -> bool:
    """No checkpoint.remote, or the store holds `step` (else the attempt uploads it: RemoteRun.start_uploads)."""
    if remote.url is None:
        return True
    try:
        return bool(remote.reachable and remote.store is not None and step in remote.store.committed())
    except Exception:  # the store cannot say now: the attempt goes on and uploads
        return False


def account_resume(
    ledger: Ledger,
    message: Callable[[str], None],
    proc: process.Process,
    step: int,
    resume_dir: Path | None,
    steps: int,
) -> None:
    """The step this attempt trains from goes into its ledger row; the message says where it resumes
    and, after earlier attempts, how the last one ended and which steps are trained again."""
    ledger.resumed_from = step
    ledger.heartbeat(step)  # where it stands until its first log step; a kill from here on leaves both in its row
    if resume_dir is not None:
        message(f"spotune: resuming from {resume_dir} at step {step} of {steps}")
    if not proc.is_main:
        return
    from trainer.report.load import Attempt
    from trainer.report.totals import resume_line

    line = resume_line([Attempt.from_row(r) for r in read_rows(proc.out)], step)
    if line is not None:
        message(f"spotune: {line}")
