"""Process exit codes of every spotune command, defined once.

Supervisors (the docker entrypoint, SLURM, Kubernetes, SkyPilot templates under
scripts/launch/) decide from these whether to rerun the same command.

What a supervisor should do with each:
- `EXIT_FINISHED = 0`: training reached its end; `final/` holds the adapter. Do not rerun.
- `EXIT_ERROR = 1`: an unexpected error (a traceback), or a store write the safety rule refused (a bug
  in spotune; a local checkpoint was saved); look at it before rerunning.
- `EXIT_BAD_INPUT = 2`: bad configuration or data, a checkpoint that cannot be resumed, or a store
  that refuses these credentials (no such bucket, reading or writing denied: checked at start with
  a real probe write); the message names the key, file, line or permission to fix. Rerunning
  unchanged fails the same way. Never a fault of the moment.
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
  fault of the moment anywhere (`transient`): `checkpoint.remote` unreachable past
  `checkpoint.store_outage_seconds` (a local checkpoint saved), the store's checkpoints unreadable
  at start (retried first; never trained from an older step instead), the store found ahead of a
  stale disk (nothing written), the hub not answering, a several-node fetch or publish failing.
  Every rank exits with it alike. Rerun the same command to resume.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Iterator
from typing import Literal, NoReturn

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


def causes(e: BaseException) -> Iterator[BaseException]:
    """`e` and the exceptions below it: each one's cause, else the exception its `except` block was handling
    (libraries re-raise either way; s3fs drops the cause on some paths). The one walk of an error's chain
    (`transient` here, `trainer.restart.storage.denied`)."""
    seen: BaseException | None = e
    while seen is not None:
        yield seen
        seen = seen.__cause__ or (None if seen.__suppress_context__ else seen.__context__)


def transient(e: BaseException) -> bool:
    """Whether `e` is a fault of the moment (exit 143), by its chain of causes: a lost connection, a
    timeout, a broken transfer, an HTTP 5xx or 429 (throttling), a store or hub that does not answer, a
    lease cut off from its store. The one definition: what is retried (trainer/restart/choose.py) is what
    this says, and nothing else is. A setting the user chose is never one: offline mode (HF_HUB_OFFLINE), a
    refused credential; nor is a bug or this machine's own disk (full, refused)."""
    for seen in causes(e):
        names = {c.__name__ for c in type(seen).__mro__}
        if names & _SETTINGS:
            return False
        status = _status(getattr(seen, "response", None))
        if names & _FAULTS or (isinstance(status, int) and (status >= 500 or status == 429)):
            return True
    return False


def _status(response: object) -> object:
    """The HTTP status of an error's response: an attribute (requests, httpx), or botocore's dict."""
    if isinstance(response, dict):
        return response.get("ResponseMetadata", {}).get("HTTPStatusCode")
    return getattr(response, "status_code", None)


_FAULTS = {
    "ConnectionError",  # builtin (resets, refusals), requests', HubUnreachable
    "TimeoutError",
    "timeout",
    "IncompleteRead",
    "TransportError",  # httpx
    "ClientConnectionError",  # aiohttp
    "ClientPayloadError",
    "EndpointConnectionError",  # botocore
    "ConnectionClosedError",
    "ReadTimeoutError",
    "ConnectTimeoutError",
    "StoreUnreachable",  # trainer/restart/storage.py
    "StoreOffline",  # cut off from the store (its lease not renewed in time): uploads retry
}
_SETTINGS = {"OfflineModeIsEnabled", "PermissionError", "StoreDenied"}


def code_for(e: BaseException) -> int:
    """The exit code of a command that `e` ends, the one classifier of errors (trainer/cli/main.py asks it
    on every rank; trainer/restart/agree.py carries its answer from the rank that met the error to the
    others, so the ranks exit alike): a code the error carries (agreed across ranks), 143 for a fault of
    the moment (`transient`, by its causes), the code its class is listed with in `BY_CLASS` (by name:
    this module imports nothing of spotune), else 1 (a bug: the traceback says where)."""
    carried = getattr(e, "exit_code", None)
    if isinstance(carried, int) and not isinstance(carried, bool):
        return carried
    if transient(e):
        return EXIT_PREEMPTED
    for cls in type(e).__mro__:  # the most derived listed class decides (Corrupt before CheckpointError)
        if cls.__name__ in BY_CLASS:
            return BY_CLASS[cls.__name__]
    return EXIT_ERROR


BY_CLASS: dict[str, int] = {
    # Another attempt holds the run (trainer/restart/lock.py; LeaseLost derives from it).
    "RunBusy": EXIT_BUSY,
    # A store's bytes that disagree with their manifest (trainer/restart/storage.py): not retried (the one
    # reason to skip a checkpoint), but the next attempt reads the store again.
    "Corrupt": EXIT_PREEMPTED,
    # Settings and inputs to fix; each message names the key, file, line or permission. CheckpointError
    # covers "none verifies", ResumeMismatch, StoreDenied and a store backend that is not installed.
    "ConfigError": EXIT_BAD_INPUT,
    "DataError": EXIT_BAD_INPUT,
    "CheckpointError": EXIT_BAD_INPUT,
    "PlanError": EXIT_BAD_INPUT,
    "CatalogError": EXIT_BAD_INPUT,
    "ReportError": EXIT_BAD_INPUT,
}
"""Error classes (by name, matched along the exception's MRO) and the code each ends a command with."""


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
