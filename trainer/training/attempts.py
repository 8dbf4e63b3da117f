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
from trainer.restart.checkpoint import CheckpointManager
from trainer.restart.ledger import HEARTBEAT_FILE, Ledger, read_rows
from trainer.restart.state import Counters, restore_training_state
from trainer.training import process


def finished_already(proc: process.Process, steps: int, resume_dir: Path | None) -> bool:
    """The run trained all `steps`, wrote final/, its books are closed (the last ledger row says
    `finished` and no killed attempt's heartbeat waits to be booked) and (with checkpoint.remote) the
    store holds its last checkpoint: say so, and the attempt ends here. Rank 0 decides (its disk, its
    store); every rank follows. A run short of any of these goes on and does what is missing: trains,
    writes final/, books an attempt killed after it (then closes with a finished row), uploads."""

    def decide() -> bool:
        assert resume_dir is not None
        step = CheckpointManager.step_of(resume_dir)
        rows = read_rows(proc.out)
        closed = bool(rows) and rows[-1].get("exit_reason") == "finished" and not (proc.out / HEARTBEAT_FILE).exists()
        done = step >= steps and (proc.out / "final").is_dir() and closed and _stored(proc.remote, step)
        if done:
            print(
                f"spotune: {proc.out} finished already: step {step} of {steps} is trained and final/ written; "
                "nothing to do (no new attempt, no device-hours). To train further raise train.max_steps or "
                "train.epochs; to start over set checkpoint.resume=never or another output_dir.",
                flush=True,
            )
        return done

    if resume_dir is None:  # the same on every rank (broadcast by resolve): nothing trained yet
        return False
    return agree.on_rank0(decide, proc.is_main, "tell whether the run finished already")


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
