"""The one save the loop calls (`Hooks.save`): a crash-consistent checkpoint of every rank's state.

Collective: every rank's RNG is gathered and, under FSDP, the adapter and optimizer state are
gathered whole; rank 0 commits them (trainer/restart/local/checkpoint.py) and hands the directory to
the background uploader; every rank then waits, so nobody runs ahead of a checkpoint that is
not committed yet.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from trainer.model.compile_cache import CompileCache
from trainer.restart.local.checkpoint import CheckpointManager
from trainer.restart.local.rng import gather_rng
from trainer.restart.local.state import Counters, TrainState, snapshot, write_training_state
from trainer.restart.signals import preemption


@dataclass
class Saver:
    model: Any
    optimizer: Any
    accelerator: Any
    state: TrainState
    """What every checkpoint of this run shares (structure, fingerprints, config); counters are added per save."""
    position: Callable[[int], tuple[int, int]]
    """(epoch, cursor) of the sampler after a number of steps."""
    manager: CheckpointManager
    remote: Any
    """The run's store (`RemoteRun`): a committed checkpoint is submitted for upload."""
    ledger_totals: Callable[[], dict[str, Any]]
    notice_seconds: float
    message: Callable[[str], None]
    on_saved: Callable[[int, float], None]
    """(step, seconds) once every rank has the checkpoint."""
    compiled: CompileCache | None = None
    """`model.compile`: what torch compiled goes into each checkpoint's `compile/` (trainer/model/compile_cache.py)."""

    def __call__(self, counters: Counters) -> float:
        started = time.monotonic()
        is_main = self.accelerator.is_main_process
        rng = gather_rng(self.accelerator.num_processes)  # collective: every rank's generators
        tensors = snapshot(self.model, self.optimizer, keep=is_main)  # collective under FSDP
        state = dataclasses.replace(self.state, **vars(counters.counters()), ledger=self.ledger_totals(), scaler=None)
        state.epoch, state.cursor = self.position(counters.step)
        if is_main:

            def write(tmp: Any) -> None:
                write_training_state(
                    tmp,
                    model=self.model,
                    optimizer=self.optimizer,
                    state=state,
                    rng=rng,
                    scaler=self.accelerator.scaler,
                    tensors=tensors,
                )
                if self.compiled is not None:  # hard links of the staged artifacts, listed in the manifest
                    self.compiled.write_into(tmp)

            result = self.manager.save(counters.step, write)
            if not result.skipped:
                self.remote.submit(counters.step, result.path)  # returns at once; uploads in the background
            warning = preemption.save_fits_notice(result.seconds, self.notice_seconds)
            if warning:
                self.message(f"spotune: {warning}")
        self.accelerator.wait_for_everyone()  # nobody runs ahead of a checkpoint that is not committed yet
        seconds = time.monotonic() - started
        self.on_saved(counters.step, seconds)
        return seconds
