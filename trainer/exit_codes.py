"""Process exit codes of every spotune command, defined once.

Supervisors (the docker entrypoint, SLURM, Kubernetes, SkyPilot templates under
scripts/launch/) decide from these whether to rerun the same command.

What a supervisor should do with each:
- `EXIT_FINISHED = 0`: training reached its end; `final/` holds the adapter. Do not rerun.
- `EXIT_ERROR = 1`: an unexpected error (a traceback), or a store write the safety rule refused (a bug
  in spotune; a local checkpoint was saved); look at it before rerunning.
- `EXIT_BAD_INPUT = 2`: bad configuration or data, a model or data path that exists neither here nor
  on the hub, a checkpoint that cannot be resumed, or a store that refused for a reason rerunning will
  not change (credentials, a permission, no such bucket, a skewed clock, a full store, an unknown error:
  trainer/faults.py; checked at start with a real probe write, and mid-run by the uploads and the
  lease); the message names the key, file, line, permission or setting to fix. Rerunning unchanged
  fails the same way. Never a fault of the moment.
- `EXIT_BUDGET = 3`: stopped at `train.max_gpu_hours` or `train.max_cost` after saving a
  checkpoint. Raise the budget and rerun the same command to continue.
- `EXIT_BAD_STEPS = 4`: `train.max_bad_steps` consecutive non-finite steps; fix the run
  (learning rate, data) before rerunning.
- `EXIT_OUT_OF_MEMORY = 5`: the GPU ran out of memory; the message names the step, the
  estimate's peak and what to change (micro-batch, gradient checkpointing, seq_len, QLoRA).
  Rerunning unchanged fails the same way on the same GPU: do not restart it.
- `EXIT_BUSY = 75` (EX_TEMPFAIL): another attempt holds the run (its directory's lock, or the
  lease in `checkpoint.remote`): refused at start, or this attempt lost the lease mid-run and
  stopped without writing more. Do not restart now: the holder is training. `spotune status`
  names it; `spotune train --wait SECONDS` resumes after it.
- `EXIT_ABORTED = 130`: a second SIGINT; no checkpoint was saved for the step in flight.
  Rerunning resumes from the last committed checkpoint.
- `EXIT_PREEMPTED = 143` (128 + SIGTERM): stopped by a signal after saving a checkpoint, or by a
  fault of the moment anywhere (`transient`, trainer/faults.py): `checkpoint.remote` unreachable past
  `checkpoint.store_outage_seconds` (a local checkpoint saved), the store's checkpoints unreadable
  at start (retried first; never trained from an older step instead), the store found ahead of a
  stale disk (nothing written), the hub not answering, a several-node fetch or publish failing.
  Every rank exits with it alike. Rerun the same command to resume.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from typing import Literal, NoReturn

from trainer.faults import transient  # the one classifier (whether an error is a fault of the moment)

EXIT_FINISHED = 0
EXIT_ERROR = 1
EXIT_BAD_INPUT = 2
EXIT_BUDGET = 3
EXIT_BAD_STEPS = 4
EXIT_OUT_OF_MEMORY = 5
EXIT_BUSY = 75
EXIT_ABORTED = 130
EXIT_PREEMPTED = 143

EXIT_FILE_ENV = "SPOTUNE_EXIT_FILE"
"""Where every rank of a machine also writes its exit code. A launcher reads it because torchrun
reports any rank's non-zero exit as 1, which would turn a requeue (143) into an error
(docker/entrypoint.sh). The ranks merge into the one file: it holds the code of `PRIORITY` that
comes first among theirs, so a rank 1 out of memory reads 5, not rank 0's 1. The launcher gives
each attempt an empty file (the templates use mktemp)."""

PRIORITY: tuple[int, ...] = (
    EXIT_BAD_INPUT,
    EXIT_OUT_OF_MEMORY,
    EXIT_BAD_STEPS,
    EXIT_BUSY,
    EXIT_BUDGET,
    EXIT_PREEMPTED,
    EXIT_ABORTED,
    EXIT_ERROR,
    EXIT_FINISHED,
)
"""Which rank's code the run reports when ranks differ: the most specific first. A code that names
its cause (bad input, out of memory, non-finite steps, busy) beats the plain error, which on a
several-rank run is mostly a rank whose collective broke because another rank stopped; a saved
stop (budget, preemption) beats an error too, since ranks only stop together after agreeing on
it. Finished counts only when every rank finished. A code not listed (a signal's) ranks with 1."""


_aborts = 0


def abort() -> NoReturn:
    """The user's second Ctrl-C: counted, then SystemExit(130). A signal handler's exception is lost
    when the signal lands while Python runs code whose exceptions it ignores (a weakref callback, a
    `__del__`: "Exception ignored in ..."), and the run then ends as the first signal asked (143); the
    command's exit code still says what the user asked for (`aborts`, read by trainer/cli/main.py)."""
    global _aborts
    _aborts += 1
    raise SystemExit(EXIT_ABORTED)


def aborts() -> int:
    """How many times `abort` was called in this process: a command compares the count before and after."""
    return _aborts


def most_specific(codes: list[int]) -> int:
    """The code the run reports for the codes of its ranks (`PRIORITY`)."""

    def rank(code: int) -> int:
        return PRIORITY.index(code) if code in PRIORITY else PRIORITY.index(EXIT_ERROR)

    return min(codes, key=rank)


StopReason = Literal["finished", "preempted", "budget", "bad_steps"]
"""Why the training loop returned."""

FOR_STOP: dict[str, int] = {
    "finished": EXIT_FINISHED,
    "preempted": EXIT_PREEMPTED,
    "budget": EXIT_BUDGET,
    "bad_steps": EXIT_BAD_STEPS,
}
"""The exit code of `spotune train` for each way the loop can stop."""


def class_code(e: BaseException) -> int | None:
    """The exit code `e`'s class names (its `exit_code` class attribute, inherited: ConfigError, DataError,
    CheckpointError... 2, RunBusy 75, Corrupt 143), or None: matched by type, along the class hierarchy."""
    code = getattr(type(e), "exit_code", None)
    return code if isinstance(code, int) and not isinstance(code, bool) else None


def code_for(e: BaseException) -> int:
    """The exit code of a command that `e` ends, the one classifier of errors (trainer/cli/main.py asks it
    on every rank; trainer/restart/agree.py carries its answer from the rank that met the error to the
    others, so the ranks exit alike): a code this very error carries (`Agreed`: decided on another rank),
    143 for a fault of the moment (`transient`: trainer/faults.py, by its causes), the code its class names
    (`class_code`), else 1 (a bug: the traceback says where)."""
    carried = vars(e).get("exit_code")
    if isinstance(carried, int) and not isinstance(carried, bool):
        return carried
    if transient(e):
        return EXIT_PREEMPTED
    code = class_code(e)
    return EXIT_ERROR if code is None else code


MTIME_SLACK = 0.05
"""Seconds a file's modification time may lag the clock (the kernel stamps it from a coarse clock)."""


def record(code: int, since: float, path: str | None = None) -> None:
    """Merge this rank's `code` into the exit file (`EXIT_FILE_ENV`, or `path`), if one is named.

    Every rank of the machine writes; what the file holds after the last is `most_specific` of the
    codes written since the attempt began (`since`, this process's start, as time.time()): content
    older than that is an earlier attempt's and is replaced, so a reused path cannot leak a code.
    Written in place under a `flock` of the file, not by rename: a rank waiting on the lock must
    read what the rank before it wrote (a rename would leave it on the old inode). Where the
    filesystem has no flock, the ranks write unlocked (they end seconds apart).
    """
    path = path or os.environ.get(EXIT_FILE_ENV)
    if not path:
        return
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        with contextlib.suppress(OSError):
            fcntl.flock(fd, fcntl.LOCK_EX)
        codes = [code]
        old = os.pread(fd, 32, 0).decode(errors="replace").strip()
        if old.isdigit() and os.fstat(fd).st_mtime >= since - MTIME_SLACK:
            codes.append(int(old))
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{most_specific(codes)}\n".encode(), 0)
        os.fsync(fd)
    finally:
        os.close(fd)  # drops the flock
