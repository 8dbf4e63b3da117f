"""Graceful stop on preemption signals and the same stop step on every rank.

SIGTERM (what spot/preemptible VMs, Kubernetes and Slurm send), SIGINT (Ctrl-C) and
SIGUSR1 (Slurm's `--signal=USR1@90`) only set a flag, and so does a cloud preemption notice
(`trainer.restart.signals.notice`): both go through `Preemption.request`, the one stop path. The loop finishes the optimizer
step it is in, every rank agrees to stop at the same step (`agree`), a checkpoint is
saved, and the process exits with `EXIT_PREEMPTED`. A second SIGINT aborts at once.

`SPOTUNE_STOP_AFTER_STEP=N` asks for the same stop once step N is done: a preemption planned in
advance, which is how `spotune pilot` measures a restart at a step it chose, whatever the
step time (a signal sent on seeing step N in the log lands a few steps later on a fast run).

Exit codes live in `trainer.exit_codes`.
"""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Sequence
from types import FrameType
from typing import Any

import torch

from trainer import exit_codes

SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)
STOP_AFTER_ENV = "SPOTUNE_STOP_AFTER_STEP"


class Preemption:
    """Signal flag. `install()` from the main thread; poll `requested` once per step."""

    def __init__(self) -> None:
        self.requested = False
        self.signal_name: str | None = None
        """The signal that stopped the run, if a signal did."""
        self.reason: str | None = None
        """What stopped the run: a signal or a cloud notice, as printed."""
        self.planned = False
        """The stop is the one planned in advance (`SPOTUNE_STOP_AFTER_STEP`, the pilot's), not a preemption."""
        self._previous: dict[int, Any] = {}
        planned = os.environ.get(STOP_AFTER_ENV)
        self.stop_after = int(planned) if planned else None
        """Stop as on a signal once this many steps are done (`SPOTUNE_STOP_AFTER_STEP`)."""

    def due(self, step: int) -> bool:
        """A stop was asked for, or the planned one is reached at `step` steps done."""
        if not self.requested and self.stop_after is not None and step >= self.stop_after:
            self.planned = self.request(f"planned stop after step {self.stop_after} ({STOP_AFTER_ENV})")
        return self.requested

    def request(self, reason: str, hint: str = "") -> bool:
        """Ask for the save-and-exit at the next step boundary; True when this request was the first.

        Called by the signal handler (main thread) and by the notice watcher (its own thread).
        No lock: the flag is one assignment, and a lock taken here could deadlock when a
        signal handler interrupts the main thread inside it. The worst race is two messages.
        """
        if self.requested:
            return False
        self.requested = True
        self.reason = reason
        # Printed here, not through the console: a signal handler must not wait on the bar's lock. On a
        # terminal the newline ends the bar's line first; a log file gets the plain line alone.
        lead = "\n" if sys.stderr.isatty() else ""
        print(
            f"{lead}{reason}: finishing this step, saving a checkpoint, then exiting{hint}", file=sys.stderr, flush=True
        )
        return True

    def install(self) -> Preemption:
        for sig in SIGNALS:
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def uninstall(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        name = signal.Signals(signum).name
        if self.requested and signum == signal.SIGINT:
            # The user means it: no checkpoint, stop now. SystemExit unwinds `finally` blocks
            # (an unfinished save's temp dir is removed, the ledger row is written).
            print(f"\n{name} again: aborting without a checkpoint", file=sys.stderr, flush=True)
            exit_codes.abort()
        hint = " (press Ctrl-C again to abort without saving)" if signum == signal.SIGINT else ""
        if self.request(f"{name} received", hint):
            self.signal_name = name


def agree(flag: bool, accelerator: Any = None) -> bool:
    """True on every rank when any rank's flag is set."""
    return agree_all([flag], accelerator)[0]


def agree_all(flags: Sequence[bool], accelerator: Any = None) -> list[bool]:
    """Each flag true on every rank when it is set on any rank: one small all-reduce MAX for all.

    Signals reach ranks at different moments; without agreement one rank would stop and the
    others would hang in the next collective. The loop folds every per-step decision (stop,
    budget, time-based save) into one call, so a step costs one extra collective, not several.
    """
    flags = [bool(f) for f in flags]
    num = getattr(accelerator, "num_processes", 1) if accelerator is not None else 1
    if num == 1 or not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return flags
    device = accelerator.device if torch.distributed.get_backend() == "nccl" else torch.device("cpu")
    t = torch.tensor([int(f) for f in flags], dtype=torch.int32, device=device)
    torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
    return [bool(x) for x in t.tolist()]


def save_fits_notice(seconds: float, notice: float) -> str | None:
    """A warning when a checkpoint save of `seconds` would not fit the preemption notice."""
    if seconds <= notice:
        return None
    return (
        f"the last checkpoint save took {seconds:.1f}s, longer than checkpoint.notice_seconds={notice:g}: "
        "a preemption would kill this run mid-save and lose the work since the previous checkpoint. "
        "Save to faster local disk, checkpoint more often (checkpoint.every_steps / every_minutes), "
        "or raise checkpoint.notice_seconds if your provider gives more notice."
    )
