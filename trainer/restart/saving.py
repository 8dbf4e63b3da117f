"""The one save the loop calls (`Hooks.save`): a crash-consistent checkpoint of every rank's state.

Collective: every rank's RNG is gathered and, under FSDP, the adapter and optimizer state are
gathered whole; rank 0 commits them (trainer/restart/checkpoint.py) and hands the directory to
the background uploader; every rank then waits, so nobody runs ahead of a checkpoint that is
not committed yet.

Checkpoint N carries the run's metrics rows up to step N (`METRICS_FILE`, listed in its manifest like
every file): the store commits them with it, so a machine killed right after that commit and before its
run files followed loses no row; the attempt that resumes from N puts back the rows its metrics.jsonl
lacks (`carry_metrics`).
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainer.atomic import write_bytes
from trainer.model.compile_cache import CompileCache
from trainer.restart import preemption
from trainer.restart.checkpoint import CheckpointManager
from trainer.restart.rng import gather_rng
from trainer.restart.state import Counters, TrainState, snapshot, write_training_state

METRICS_FILE = "metrics.jsonl"
"""The run's metrics rows (training/telemetry.py's JsonlSink), a copy of which each checkpoint carries."""


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
    metrics: Path | None = None
    """The run's metrics.jsonl (rank 0): each checkpoint carries a copy, its rows up to this step."""

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
                if self.metrics is not None and self.metrics.is_file():  # flushed per row: up to this step
                    shutil.copyfile(self.metrics, tmp / METRICS_FILE)

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


def carry_metrics(checkpoint: Path, metrics: Path) -> int:
    """Put back into `metrics` the rows that checkpoint `checkpoint` carries and `metrics` lacks (a machine
    killed after the store committed the checkpoint, before the run's metrics.jsonl followed), rows of steps
    up to the checkpoint's only, after the rows it has; returns how many. Rows are compared whole, as the
    store's copies are merged (trainer/restart/generations.py)."""
    carried = checkpoint / METRICS_FILE
    if not carried.is_file():  # a checkpoint written before they travelled, or with no row logged yet
        return 0
    step = CheckpointManager.step_of(checkpoint) if checkpoint.name.startswith("step-") else None
    mine = metrics.read_bytes() if metrics.is_file() else b""
    have = set(mine.splitlines())
    missing = []
    for line in carried.read_bytes().splitlines():
        try:
            row = json.loads(line)
        except ValueError:  # a torn last line of the copy
            continue
        if line in have or not isinstance(row, dict):
            continue
        if step is not None and isinstance(row.get("step"), int) and row["step"] > step:
            continue
        missing.append(line)
        have.add(line)
    if missing:
        ended = mine if not mine or mine.endswith(b"\n") else mine + b"\n"
        write_bytes(metrics, ended + b"".join(line + b"\n" for line in missing))
    return len(missing)
