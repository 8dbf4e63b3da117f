"""`spotune status RUN`: where a run stands, read from a run directory or its `checkpoint.remote`
URL without writing to it: finished, training (on which machine, at which step, how fresh its
heartbeat), or stopped (how, at which step); its newest committed checkpoint; the device-hours and
cost so far and every attempt. The figures are the report's (load.py, totals.py); who holds the run
is the lock's and the lease's own reading (trainer/restart/ownership/lock.py `holder`, lease_object.py).

A directory or URL that holds nothing of a run (no config.yaml, metrics, ledger, heartbeat,
checkpoint, lock or lease) is not a run: `NotARun`, exit 2. A run directory whose checkpoint.remote
does not answer (or refuses these credentials) still shows its own state, the lease "unknown" and why;
a URL whose store does not answer shows the state `unknown` and why (never a traceback), and points to the
run directory on the training machine, whose own view needs no store.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from trainer.report.load import CONFIG_FILE, RUNNING, ReportError, RunData, load_run, read_config
from trainer.report.totals import FINISHED, Totals, ago, redone_by_attempt, totals
from trainer.restart.local.checkpoint import CheckpointManager
from trainer.restart.ownership.lease_object import describe_lease, read_lease
from trainer.restart.ownership.lock import describe, holder
from trainer.restart.store.lifecycle import Store
from trainer.urls import one_line, redact

TRAINING, STARTING, STOPPED, UNKNOWN = "training", "starting", "stopped", "unknown"
KILLED = "killed"


class NotARun(ReportError):
    """The directory or URL holds nothing of a run; the message names it and what to give instead."""


@dataclass
class Status:
    """Where a run stands (`spotune status --json` prints it as a dict)."""

    run: str
    state: str
    """`finished`, `training` (an attempt holds the run and has trained a step), `starting` (it holds the
    run, no step yet), `stopped` (no attempt holds it; `how` says why the last one ended), or `unknown` (a
    URL whose store could not be read: `lease_unknown` says why)."""
    how: str | None
    """The last attempt's exit reason (finished, preempted, killed, budget, error, ...), None while training."""
    step: int | None
    total_steps: int | None
    machine: str | None
    """Where the attempt that holds the run is (its lock or lease), else where the last step was logged."""
    heartbeat_age_s: float | None
    checkpoint: dict[str, Any] | None
    """The newest committed checkpoint: {step, where} (the store's for a URL, else the directory's)."""
    device_hours: float
    hours_unit: str
    cost: float | None
    redone_steps: int
    restart_hours: float = 0.0
    """What the restarts cost in device- or GPU-hours: every later attempt's start-up plus the step time
    it redid (the report's figure, `Totals.restart_hours`)."""
    restart_cost: float | None = None
    """`restart_hours` priced at each attempt's rate (None without metrics.price_per_hour)."""
    attempts: list[dict[str, Any]] = field(default_factory=list)
    held_by: str | None = None
    """`lock held by ...` or `lease held by ...`, described (None: nothing holds the run)."""
    lease_unknown: str | None = None
    """Why the remote's lease could not be read (the store did not answer, or refused): another machine may hold the run."""


def run_status(run: str, storage_options: dict[str, Any] | None = None) -> Status:
    """The status of `run` (an output_dir, or a checkpoint.remote URL); NotARun when it holds no run. A URL
    whose store could not be read (not answering, refusing these credentials) is `unknown`, with why."""
    try:
        return _status(run, storage_options)
    except NotARun:
        raise
    except Exception as e:
        if "://" not in run or run.startswith("file://"):  # a local directory: its own error says it
            raise
        why = f"{redact(run)} could not be read ({type(e).__name__}: {one_line(e)})"
        return Status(
            redact(run), UNKNOWN, None, None, None, None, None, None, 0.0, "device-hours", None, 0, lease_unknown=why
        )


def _status(run: str, storage_options: dict[str, Any] | None) -> Status:
    url = run.rstrip("/") if "://" in run else None
    data = _data(run)
    config = data.config if data is not None else read_config(run)
    remote = url or (config.checkpoint.remote if config is not None else None)
    options = storage_options or (dict(config.checkpoint.storage_options) if config is not None else {})
    lock = holder(run) if url is None and Path(run).is_dir() else None
    lease, unknown = _live_lease(remote, options) if remote else (None, None)
    checkpoint = _newest_checkpoint(run, url, options)
    if data is None and checkpoint is None and lock is None and lease is None and not _has_config(run, options):
        shown = redact(run)
        raise NotARun(
            f"{shown} holds no run: no {CONFIG_FILE}, metrics.jsonl, ledger.jsonl, checkpoint, lock or lease there; "
            "give a run's output_dir (the recipe's `output_dir`, e.g. runs/tiny-cpu) or its checkpoint.remote URL"
        )
    t = totals(data) if data is not None else None
    held = (
        f"lock held by {describe(lock, Path(run))}"
        if lock
        else f"lease held by {describe_lease(lease)}"
        if lease
        else None
    )
    how = t.status if t is not None else None
    return Status(
        run=redact(run),
        state=_state(t, held is not None),
        # An open attempt that holds nothing is gone (its heartbeat stays until the next attempt books it).
        how=None if held else (KILLED if how == RUNNING else how),
        step=t.step if t is not None else None,
        total_steps=t.total_steps if t is not None else None,
        machine=(lock or lease or {}).get("host") or _last_machine(data),
        heartbeat_age_s=t.heartbeat_age_s if t is not None else None,
        checkpoint=checkpoint,
        device_hours=t.device_hours if t is not None else 0.0,
        hours_unit=t.hours_unit if t is not None else "device-hours",
        cost=t.cost if t is not None else None,
        redone_steps=t.redone_steps if t is not None else 0,
        restart_hours=t.restart_hours if t is not None else 0.0,
        restart_cost=t.restart_cost if t is not None else None,
        attempts=_attempts(data, held is not None),
        held_by=held,
        lease_unknown=None if lock else unknown,
    )


def run_remote(run: str) -> tuple[str | None, dict[str, Any]]:
    """The checkpoint.remote of `run` and its storage options: `run` itself for a URL, else what the run
    directory's config.yaml names (None: no config.yaml, or no remote)."""
    if "://" in run:
        return run.rstrip("/"), {}
    config = read_config(run)
    if config is None:
        return None, {}
    return config.checkpoint.remote, dict(config.checkpoint.storage_options)


def as_dict(status: Status) -> dict[str, Any]:
    return asdict(status)


def format_status(s: Status) -> str:
    """A few lines a person reads at once: the state, the checkpoint, the money, the attempts."""
    of = f" of {s.total_steps}" if s.total_steps else ""
    step = f"step {s.step}{of}" if s.step is not None else f"no step yet{of}"
    beat = f", last heartbeat {ago(s.heartbeat_age_s)} ago" if s.heartbeat_age_s is not None else ""
    if s.state == UNKNOWN:
        return (
            f"{s.run}: unknown: {s.lease_unknown}. Run `spotune status` again once the store answers, or give the "
            "run's output_dir on the training machine for its own view"
        )
    if s.state == TRAINING:
        head = f"training on {s.machine or '?'}: {step}{beat}"
    elif s.state == STARTING:
        head = f"starting on {s.machine or '?'}: held, {step}"
    elif s.state == FINISHED:
        head = f"finished: {step}"
    elif s.how is None:  # a config.yaml (or checkpoints) but no ledger, metrics or heartbeat
        head = "stopped before its ledger opened: no attempt has booked any time; `spotune train` starts it"
    else:
        again = "; `spotune train` with the same recipe resumes it" if s.how != "unknown" else ""
        head = f"stopped: {s.how} at {step}{beat if s.how == KILLED else ''}{again}"
    ck = s.checkpoint
    cost = f", cost ${s.cost:,.4f}" if s.cost is not None else ", cost n/a (metrics.price_per_hour unset)"
    lines = [
        f"{s.run}: {head}",
        f"  newest checkpoint: step {ck['step']} ({ck['where']})" if ck else "  newest checkpoint: none committed",
        f"  {s.device_hours:.4f} {s.hours_unit} so far (devices x wall time, every attempt){cost}",
        f"  attempts: {len(s.attempts)}" + (f" ({_attempt_list(s.attempts)})" if s.attempts else ""),
    ]
    if s.redone_steps or s.restart_hours:
        money = f", ${s.restart_cost:,.4f}" if s.restart_cost is not None else ""
        lines.append(
            f"  steps trained again after restarts: {s.redone_steps}; the restarts cost {s.restart_hours:.4f} "
            f"{s.hours_unit}{money} (start-up + redone work, as the report counts it)"
        )
    if s.held_by:
        lines.append(f"  {s.held_by}")
    if s.lease_unknown:
        lines.append(f"  lease unknown: {s.lease_unknown}; another machine may hold the run")
    return "\n".join(lines)


# ---------------------------------------------------------------------------- reading


def _data(run: str) -> RunData | None:
    try:
        return load_run(run, example=False)  # status shows no example: no tokenizer, no torch
    except ReportError:  # no metrics, ledger or heartbeat (yet): the rest may still show a run
        return None


def _has_config(run: str, options: dict[str, Any]) -> bool:
    """A config.yaml (in a store, any generation's copy: trainer/restart/store/generations.py)."""
    return Store(run, options if "://" in run else {}).run_file(CONFIG_FILE) is not None


def _live_lease(remote: str, options: dict[str, Any]) -> tuple[dict[str, Any] | None, str | None]:
    """The remote's lease while an attempt holds it (not released, not expired), else None; and why it
    could not be read, if it could not (a store that does not answer, or refuses: status only reads)."""
    try:
        store = Store(remote, options)
        lease, _ = read_lease(store)
    except Exception as e:
        return None, f"{redact(remote)} could not be read ({type(e).__name__}: {one_line(e)})"
    if lease is None or lease.get("released") or float(lease.get("expires_at", 0)) <= time.time():
        return None, None
    return lease, None


def _newest_checkpoint(run: str, url: str | None, options: dict[str, Any]) -> dict[str, Any] | None:
    if url is not None:
        store = Store(url, options)
        steps = store.committed()
        return {"step": steps[-1], "where": store.show_dir(steps[-1])} if steps else None
    committed = CheckpointManager(Path(run) / "checkpoints").committed()
    if not committed:
        return None
    return {"step": CheckpointManager.step_of(committed[-1]), "where": str(committed[-1])}


def _last_machine(data: RunData | None) -> str | None:
    rows = data.train_rows if data is not None else []
    return str(rows[-1]["machine"]) if rows and rows[-1].get("machine") else None


def _attempts(data: RunData | None, held: bool) -> list[dict[str, Any]]:
    """Every attempt; an open one that holds nothing is gone: `killed`, never `running`, and its booked end
    is its last heartbeat (as for one a later attempt booked), so its hours are a lower bound."""
    if data is None:
        return []
    redone = redone_by_attempt(data)
    return [
        {
            "attempt": a.attempt,
            "exit_reason": KILLED if a.running and not held else a.exit_reason,
            "end_is_last_heartbeat": a.end_is_last_heartbeat or (a.running and not held),
            "last_step": a.last_step,
            "resumed_from": a.resumed_from,
            "redone_steps": redone.get(a.attempt, 0),
            "device": a.device,
            "device_hours": a.device_seconds / 3600.0,
            "cost": a.cost,
        }
        for a in data.attempts
    ]


def _state(t: Totals | None, held: bool) -> str:
    if held:
        return TRAINING if t is not None and t.step is not None else STARTING
    if t is not None and t.status == FINISHED:
        return FINISHED
    return STOPPED


def _attempt_list(attempts: list[dict[str, Any]]) -> str:
    """`1 killed at step 25 (booked to its last heartbeat: a lower bound), 2 finished at step 80`."""
    return ", ".join(
        f"{a['attempt']} {a['exit_reason']}"
        + (f" at step {a['last_step']}" if a["last_step"] is not None else "")
        + (" (booked to its last heartbeat: a lower bound)" if a.get("end_is_last_heartbeat") else "")
        for a in attempts
    )
