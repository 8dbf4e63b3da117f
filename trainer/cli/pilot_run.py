"""The pilot of `spotune pilot` (trainer/cli/pilot.py): its config and its processes.

The pilot is a real training run (trainer/plan/pilot.py says what it measures); this module
starts it: as child `spotune train` processes timed from outside, or in-process under
torchrun. trainer/cli/world.py reads the world for the estimate that follows.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from trainer import exit_codes
from trainer.atomic import write_text
from trainer.cli.world import fingerprint, pilot_dir
from trainer.config import RunConfig, to_yaml
from trainer.data.cache import MANIFEST, data_cache_root
from trainer.plan import PlanError, pilot
from trainer.plan.pilot import DEFAULT_STEPS
from trainer.restart.books.clock import seconds_since_process_start
from trainer.restart.remote import new_run
from trainer.restart.signals.preemption import STOP_AFTER_ENV
from trainer.training import run


def pilot_config(
    cfg: RunConfig, steps: int | None = None, minutes: float | None = None, used_seconds: float | None = None
) -> RunConfig:
    """The run's config, changed only in what a pilot must change.

    `used_seconds`: process time the budget guard has counted already when the pilot starts
    (default: this process's age, for an in-process pilot; 0 for pilot processes of their own)."""
    if steps is not None and minutes is not None:
        raise PlanError("give --steps or --minutes, not both")
    if minutes is not None and minutes <= 0:
        raise PlanError(f"--minutes must be above 0, got {minutes}")
    warm = cfg.metrics.warmup_steps
    n = steps if steps is not None else DEFAULT_STEPS
    if minutes is None and n < warm + 3:
        raise PlanError(
            f"--steps {n} leaves fewer than 3 steps after metrics.warmup_steps={warm}; give at least {warm + 3}"
        )
    budget_hours = None
    if minutes is not None:
        # Stop by time through the budget guard. It counts device-hours from process start,
        # so what this process has used already is added: the pilot gets `minutes` from now
        # (its own startup included). The step cap is just "more than will fit".
        n = 10**9 if cfg.train.max_steps is None else cfg.train.max_steps
        world = int(os.environ.get("WORLD_SIZE", "1"))
        used = seconds_since_process_start() if used_seconds is None else used_seconds
        budget_hours = (used + 60.0 * minutes) * world / 3600.0
    remote = cfg.checkpoint.remote
    return cfg.replace(
        **{
            "output_dir": str(pilot_dir(cfg)),
            # Its own prefix in the run's store: the upload is measured and the run never resumes from it.
            "checkpoint.remote": remote.rstrip("/") + "/pilot" if remote else None,
            "data.cache_dir": str(data_cache_root(cfg.data.cache_dir, cfg.output_dir)),  # share the run's prepared data
            "train.max_steps": n,
            "train.max_gpu_hours": budget_hours,
            "train.max_cost": None,
            "train.eval_every": n if cfg.train.eval_every else None,  # one evaluation, at the end, timed
            "checkpoint.resume": "never",
            "checkpoint.every_steps": None,
            "checkpoint.every_minutes": None,  # one save, at the end: the one we time
            "metrics.log_every": 1,  # one row per step: the step-time distribution
        }
    )


def run_pilot(
    cfg: RunConfig,
    steps: int | None = None,
    minutes: float | None = None,
    *,
    fresh_process: bool = True,
    restart: bool = True,
) -> dict[str, Any]:
    """Run the pilot, write `<output_dir>/pilot/pilot.json`, return its content.

    From the command line (`fresh_process`, one process) the pilot is `spotune train` in child
    processes timed from outside, stopped halfway by SIGTERM and resumed (`restart`): every
    second of a process is measured, interpreter exit included, and so is a restart. Under
    torchrun, or from a long-lived process (tests, notebooks: `fresh_process=False`), it runs in
    this process: one attempt, exit not measured, and the time this process had already run
    before the call is not counted as start-up."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    children = fresh_process and world == 1
    pcfg = pilot_config(cfg, steps, minutes, used_seconds=0.0 if children else None)
    out = pilot_dir(cfg)
    main_rank = int(os.environ.get("RANK", "0")) == 0
    if main_rank and out.exists():
        # A pilot is always fresh: old metrics or ledger rows would mix in. Under torchrun the
        # other ranks cannot run ahead of this: train() starts with the process-group rendezvous.
        shutil.rmtree(out)
    outside: dict[int, float] | None = None
    earlier = 0.0
    if children:
        outside = _pilot_processes(pcfg, out, minutes, restart)
    else:
        earlier = 0.0 if fresh_process else seconds_since_process_start()
        os.environ[new_run.APPLY_ENV] = "1"  # a new pilot run each time, whatever the last one was started with
        try:
            code = run.train(pcfg)
        finally:
            os.environ.pop(new_run.APPLY_ENV, None)
        # With --minutes the pilot ends through the budget guard, which also saves: both are fine.
        if code not in (exit_codes.EXIT_FINISHED, exit_codes.EXIT_BUDGET):
            raise PlanError(f"the pilot run in {out} stopped with exit code {code}; see the messages above")
    if not main_rank:
        return {}  # rank 0 writes the logs, and summarises them
    result = pilot.summarise(out, cfg.metrics.warmup_steps, pilot.device_name(), outside, earlier)
    fp = fingerprint(pcfg)
    if fp is not None:
        result["data_manifest"] = str(data_cache_root(pcfg.data.cache_dir, pcfg.output_dir) / fp / MANIFEST)
    write_text(out / "pilot.json", json.dumps(result, indent=2))  # atomic: a train may read the run dir meanwhile
    return result


def _pilot_processes(pcfg: RunConfig, out: Path, minutes: float | None, restart: bool) -> dict[int, float]:
    """`spotune train` of the pilot recipe in child processes; returns each one's wall seconds.

    The first stops halfway as on a preemption (after half the steps, planned through
    SPOTUNE_STOP_AFTER_STEP; with --minutes a SIGTERM after half the time): it saves and exits
    143. The second resumes and finishes."""
    out.mkdir(parents=True)
    recipe = out / "pilot.yaml"
    recipe.write_text(to_yaml(pcfg))
    env = {k: v for k, v in os.environ.items() if k not in (exit_codes.EXIT_FILE_ENV, STOP_AFTER_ENV)}
    steps = pcfg.train.max_steps or 0
    half = steps // 2
    if minutes is None and min(half, steps - half) < pcfg.metrics.warmup_steps + 2:
        restart = False  # too short to leave two sustained steps on both sides of a restart
    first = {**env, new_run.APPLY_ENV: "1"}  # its resume=never applies, whatever the last pilot was started with
    if restart and minutes is None:
        first[STOP_AFTER_ENV] = str(half)
    command = [sys.executable, "-m", "trainer", "train", str(recipe)]
    outside: dict[int, float] = {}
    started = time.time()
    code = _child(command, first, 30.0 * minutes if restart and minutes is not None else None)
    outside[1] = time.time() - started
    if code == exit_codes.EXIT_PREEMPTED:
        print("spotune pilot: first process stopped as a preemption would; resuming to measure a restart", flush=True)
        started = time.time()
        code = _child([*command, "checkpoint.resume=auto"], env, None)
        outside[2] = time.time() - started
    if code not in (exit_codes.EXIT_FINISHED, exit_codes.EXIT_BUDGET):
        raise PlanError(f"the pilot run in {out} stopped with exit code {code}; see the messages above")
    return outside


def _child(command: list[str], env: dict[str, str], stop_after: float | None) -> int:
    """Run one pilot process; SIGTERM it (a preemption notice) once `stop_after` seconds have passed."""
    proc = subprocess.Popen(command, env=env)
    try:
        try:
            return proc.wait(timeout=stop_after)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGTERM)
            return proc.wait()
    except BaseException:  # the parent was interrupted: take the child down with it
        proc.kill()
        proc.wait()
        raise
