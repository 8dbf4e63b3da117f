"""Experiment trackers (`metrics.trackers`: wandb, mlflow, tensorboard): one tracker run per
spotune run, continued by every attempt on every machine, each step on its chart once.

The run's tracker ids are made once (W&B's id by us, MLflow's by its server) and kept in two
places: `trackers.json` in the run directory, and every checkpoint's `trainer_state.json`
(`TrainState.trackers`), so a fresh machine that resumes from the store's checkpoint gets
them back. The run directory's copy wins; without either, a new tracker run starts.

Steps never go backwards and none is charted twice, although a SIGKILLed attempt may have
logged steps past the checkpoint the next attempt resumes from, and may have lost rows on the
way to a tracker. `metrics.jsonl` (flushed per row) is the record: a resumed attempt first
sends the rows up to its checkpoint that a tracker lacks (`backfill`), then logs the steps it
redoes and the new ones, each tracker by its own rule of what it already holds:
- W&B: rows carry `step=` (W&B's `_step` is the optimizer step), and the run is resumed with
  `resume="allow"`. W&B refuses a step below the run's current one (`run.step`, the server's
  on a resume), so what the killed attempt got to W&B stays, and the rest is filled in. Its
  last rows are often lost: W&B buffers them in its service process, which ends with ours.
  We skip steps below `run.step` ourselves, W&B's own rule, to spare its warnings. Offline,
  each attempt writes its own `wandb/offline-run-*` directory with the same id and sends
  every row up to its checkpoint again; `wandb sync` of them all, in order, applies the same
  rule on the server. A custom x-axis (`define_metric`) would accept the redone steps
  instead and chart them twice; W&B's rewind (`resume_from`) needs the server.
- MLflow: the history of every metric of the run is read at start (MLflow writes
  synchronously, so the tracking server is the record of what arrived), and a value is
  logged only at a step above that metric's last.
- TensorBoard: the same log directory, opened with `purge_step` = the checkpoint's step + 1 (0
  on a start at step 0), TensorBoard's own rewind: events the killed attempt wrote past the
  checkpoint are hidden and the redone steps written again. Its writer is flushed at each row, so no backfill is needed.
Every row carries `attempt` (the ledger's attempt number) and, where the tracker takes text
(W&B), `machine` (the host name); MLflow and TensorBoard get `machine` as a tag / text per attempt.

The trackers' own settings win over spotune's defaults: `WANDB_DIR` (else the run directory),
`WANDB_PROJECT` / `MLFLOW_EXPERIMENT_NAME` when `metrics.project` is unset (else `spotune`), and
`MLFLOW_TRACKING_URI` (spotune never sets one).
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import secrets
import socket
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trainer.atomic import write_text
from trainer.config import MetricsConfig

log = logging.getLogger(__name__)

IDS_FILE = "trackers.json"
DEFAULT_PROJECT = "spotune"
"""The W&B project / MLflow experiment when neither `metrics.project` nor the tracker's own variable names one."""


@dataclass(frozen=True)
class TrackerRun:
    """What the trackers are told about the run and this attempt."""

    kinds: tuple[str, ...]
    project: str | None
    """`metrics.project`; unset: the tracker's own setting, else DEFAULT_PROJECT."""
    run_name: str
    tags: tuple[str, ...]
    run_dir: Path
    config: dict[str, Any]
    """The flat `a.b: value` config (telemetry.flat_config)."""
    resume_step: int
    """The checkpoint step this attempt resumes from (0 on a fresh start)."""
    attempt: int
    machine: str = field(default_factory=socket.gethostname)


def read_ids(run_dir: Path, carried: dict[str, str] | None) -> dict[str, str]:
    """The tracker ids of the run: the run directory's, else those a checkpoint carried."""
    path = run_dir / IDS_FILE
    if path.is_file():
        try:
            ids = json.loads(path.read_text())
            if isinstance(ids, dict):
                return {str(k): str(v) for k, v in ids.items()}
        except ValueError:
            log.warning("%s is not JSON; the checkpoint's tracker ids are used", path)
    return dict(carried or {})


class Trackers:
    """The started trackers of the main rank; `log` each metrics row, `finish` once."""

    def __init__(self, run: TrackerRun, carried: dict[str, str] | None) -> None:
        self.run = run
        self.ids = read_ids(run.run_dir, carried)
        self._open: dict[str, Any] = {}
        for kind in run.kinds:
            try:
                self._open[kind] = _OPENERS[kind](run, self.ids)
            except Exception as e:  # a tracker's outage must not end a run that can train without it
                _warn(f"{kind} could not start ({type(e).__name__}: {e})")
        run.run_dir.mkdir(parents=True, exist_ok=True)
        write_text(run.run_dir / IDS_FILE, json.dumps(self.ids, sort_keys=True))
        self._finished = False
        self.backfill(logged_rows(run.run_dir / "metrics.jsonl", run.resume_step))

    def log(self, row: dict[str, Any], step: int) -> None:
        numbers = {
            k: float(v)
            for k, v in row.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool) and k != "step" and math.isfinite(v)
        }
        numbers.setdefault("attempt", float(self.run.attempt))
        machine = str(row.get("machine", self.run.machine))
        for kind, tracker in list(self._open.items()):
            try:
                tracker.log(numbers, machine, step)
            except Exception as e:  # a network or server error: the rest of this attempt goes on without it
                del self._open[kind]
                _warn(f"{kind} failed at step {step} ({type(e).__name__}: {e})")

    def backfill(self, rows: list[dict[str, Any]]) -> None:
        """Send the rows of steps up to the checkpoint that a tracker lacks (each tracker's rule
        decides which): a SIGKILLed attempt's rows reach metrics.jsonl (flushed per row) but may
        never have reached W&B, whose service process buffers them."""
        for row in rows:
            self.log(row, int(row["step"]))

    def on_exit(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: Any) -> bool:
        """An ExitStack exit callback: an attempt that ends by an exception ends its tracker runs too."""
        self.finish("error", 1)
        return False

    def finish(self, reason: str, exit_code: int) -> None:
        """End this attempt's part of the runs (idempotent): `reason` is the stop reason, or "error"."""
        if self._finished:
            return
        self._finished = True
        for kind, tracker in self._open.items():
            try:
                tracker.finish(reason, exit_code)
            except Exception as e:  # a tracker that fails at the end must not hide how the run ended
                _warn(f"{kind} failed to close ({type(e).__name__}: {e})")


class _Wandb:
    def __init__(self, run: TrackerRun, ids: dict[str, str]) -> None:
        import wandb

        ids.setdefault("wandb", secrets.token_hex(8))  # W&B takes [a-z0-9] ids; made once per run
        where = None if os.environ.get("WANDB_DIR") else str(run.run_dir)  # W&B's own setting wins
        if where is not None:
            (run.run_dir / "wandb").mkdir(parents=True, exist_ok=True)
        self.wandb_run = wandb.init(
            project=run.project or os.environ.get("WANDB_PROJECT") or DEFAULT_PROJECT,
            id=ids["wandb"],
            resume="allow",
            name=run.run_name,
            tags=list(run.tags) or None,
            dir=where,
        )
        # Settings may change on a resume (checkpoint.allow_config_change): the latest wins.
        self.wandb_run.config.update(run.config, allow_val_change=True)
        self.floor = int(getattr(self.wandb_run, "step", 0) or 0)  # W&B refuses steps below this

    def log(self, numbers: dict[str, float], machine: str, step: int) -> None:
        if step >= self.floor:
            self.wandb_run.log({**numbers, "machine": machine}, step=step)

    def finish(self, reason: str, exit_code: int) -> None:
        if reason == "preempted":
            self.wandb_run.mark_preempting()
        self.wandb_run.finish(exit_code=exit_code)


class _Mlflow:
    def __init__(self, run: TrackerRun, ids: dict[str, str]) -> None:
        from mlflow import MlflowClient
        from mlflow.entities import Param

        self.client = client = MlflowClient()  # MLFLOW_TRACKING_URI, else mlflow's default
        self.held: dict[str, int] = {}
        run_id = ids.get("mlflow")
        if run_id is not None and self._resume(run_id):
            self.run_id = run_id
        else:
            name = run.project or os.environ.get("MLFLOW_EXPERIMENT_NAME") or DEFAULT_PROJECT
            experiment = client.get_experiment_by_name(name)
            experiment_id = experiment.experiment_id if experiment else client.create_experiment(name)
            tags = {tag: "true" for tag in run.tags}
            self.run_id = client.create_run(experiment_id, run_name=run.run_name, tags=tags).info.run_id
            ids["mlflow"] = self.run_id
            params = [Param(k, str(v)[:6000]) for k, v in sorted(run.config.items())]
            for i in range(0, len(params), 100):  # log_batch takes 100 params at a time
                client.log_batch(self.run_id, params=params[i : i + 100])
        client.set_tag(self.run_id, f"spotune.attempt.{run.attempt}.machine", run.machine)

    def _resume(self, run_id: str) -> bool:
        from mlflow.exceptions import MlflowException

        try:
            held = self.client.get_run(run_id).data.metrics
        except MlflowException as e:
            log.warning("MLflow run %s is not on this tracking server (%s); starting a new run", run_id, e)
            return False
        for key in held:
            self.held[key] = max((m.step for m in self.client.get_metric_history(run_id, key)), default=-1)
        self.client.update_run(run_id, status="RUNNING")
        return True

    def log(self, numbers: dict[str, float], machine: str, step: int) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(k, v, now, step) for k, v in numbers.items() if step > self.held.get(k, -1)]
        if metrics:
            self.client.log_batch(self.run_id, metrics=metrics)

    def finish(self, reason: str, exit_code: int) -> None:
        status = "FINISHED" if reason in ("finished", "budget") else "KILLED" if reason == "preempted" else "FAILED"
        self.client.set_terminated(self.run_id, status=status)


class _TensorBoard:
    def __init__(self, run: TrackerRun, ids: dict[str, str]) -> None:
        from torch.utils.tensorboard import SummaryWriter

        # TensorBoard's rewind to the checkpoint: past its step, or everything when the run starts at step 0
        # (an earlier attempt killed before its first checkpoint logged steps this one redoes).
        purge = run.resume_step + 1 if run.resume_step else 0
        self.writer = SummaryWriter(log_dir=str(run.run_dir / "tensorboard"), purge_step=purge)
        self.writer.add_text("machine", run.machine, global_step=run.resume_step)
        self.resume_step = run.resume_step

    def log(self, numbers: dict[str, float], machine: str, step: int) -> None:
        if step <= self.resume_step:  # a backfilled row: the log directory holds it (flushed per row)
            return
        for key, value in numbers.items():
            self.writer.add_scalar(key, value, global_step=step)
        self.writer.flush()  # a SIGKILL must not take the last rows with it (its default: every 120 s)

    def finish(self, reason: str, exit_code: int) -> None:
        self.writer.close()


_OPENERS: dict[str, Any] = {"wandb": _Wandb, "mlflow": _Mlflow, "tensorboard": _TensorBoard}


def _warn(problem: str) -> None:
    print(
        f"spotune: metrics.trackers: {problem}; this attempt trains on without it (metrics.jsonl keeps every row)",
        file=sys.stderr,
        flush=True,
    )


def logged_rows(path: Path, upto: int) -> list[dict[str, Any]]:
    """The metrics rows of steps 1..`upto` (the checkpoint's), the last of each step and kind
    (training or eval row): redone steps were logged again by the attempt that redid them."""
    last: dict[tuple[int, bool], dict[str, Any]] = {}
    if upto > 0 and path.is_file():
        for line in path.read_text().splitlines():
            try:
                row = json.loads(line)
            except ValueError:  # a torn last line of a killed attempt
                continue
            if isinstance(row, dict) and isinstance(row.get("step"), int) and 0 < row["step"] <= upto:
                last[(row["step"], "eval_loss" in row)] = row
    return [last[key] for key in sorted(last)]


def start(
    metrics: MetricsConfig,
    run_dir: Path,
    config: dict[str, Any],
    saved: Any,
    attempt: int,
    closing: contextlib.ExitStack,
) -> Trackers:
    """The trackers of `metrics.trackers` for this attempt (main rank only); `saved`: the TrainState
    of the checkpoint it resumes from, or None. An exception that ends the attempt ends its
    tracker runs (as failed) through `closing`."""
    run = TrackerRun(
        kinds=tuple(metrics.trackers),
        project=metrics.project,
        run_name=metrics.run_name or run_dir.resolve().name,
        tags=tuple(metrics.tags),
        run_dir=run_dir,
        config=config,
        resume_step=saved.step if saved is not None else 0,
        attempt=attempt,
    )
    tracked = Trackers(run, saved.trackers if saved is not None else None)
    closing.push(tracked.on_exit)
    return tracked
