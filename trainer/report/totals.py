"""The figures a person wants first, derived once from the records of load.py.

Money and hours come from the ledger only (every attempt's row, plus the open attempt's
heartbeat), so the report's totals are the ledger's: device-hours = sum of device_seconds,
cost = sum of the rows' cost, goodput = productive / device seconds. What the restarts cost
is the start-up of every attempt after the first plus the step time they redid
(`lost_seconds`), priced at each attempt's own rate.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass
from typing import Any

from trainer.report.load import Attempt, RunData, finite

FINISHED = "finished"
UNKNOWN = "unknown"  # metrics but neither a ledger row nor a heartbeat (a run from before the ledger)


@dataclass(frozen=True)
class Totals:
    status: str
    """finished | running | the last attempt's exit reason (preempted, killed, budget, error, ...)."""
    step: int | None
    total_steps: int | None
    final_loss: float | None
    final_eval_loss: float | None
    tokens_per_s: float | None
    """Sustained real tokens/s of the latest attempt (the meter restarts its window per attempt)."""
    mfu: float | None
    peak_memory_gib: float | None
    data_stall_share: float | None
    attempts: int
    restarts: int
    stops: dict[str, int]
    """Exit reasons of the attempts that did not end the run (preempted: 2, killed: 1, ...)."""
    device_hours: float
    productive_hours: float
    checkpoint_hours: float
    cost: float | None
    goodput: float
    restart_hours: float
    restart_cost: float | None
    redone_steps: int
    """Steps trained again over every restart (`redone_by_attempt`)."""
    hours_unit: str
    """`GPU-hours` or `device-hours` (a CPU run): `hours_unit`."""
    heartbeat_age_s: float | None
    eta_s: float | None = None
    """A live run's remaining steps at its latest attempt's mean step time (pauses for saves not counted)."""
    projected_cost: float | None = None
    """The meter's projected total cost in the latest metrics row (cost so far + the remaining steps)."""


def redone_by_attempt(run: RunData) -> dict[int, int]:
    """Steps each attempt trained again (attempts that redid none are left out): `redone_steps`, and
    for a row that predates `resumed_from` the logged steps it wrote again (`metrics.log_every` > 1
    then hides some; the ledger's lost seconds are exact either way)."""
    seen: set[int] = set()
    logged: dict[int, int] = {}
    for row in run.train_rows:
        step = int(row["step"])
        if step in seen:
            owner = attempt_of(run.attempts, row)
            logged[owner.attempt if owner else 0] = logged.get(owner.attempt if owner else 0, 0) + 1
        seen.add(step)
    out: dict[int, int] = {}
    furthest: int | None = None
    for a in run.attempts:
        if a.resumed_from is not None:
            n = redone_steps(furthest, a.resumed_from, a.last_step)
        else:
            n = logged.get(a.attempt, 0)
        if n:
            out[a.attempt] = n
        if a.last_step is not None:
            furthest = max(furthest or 0, a.last_step)
    return out


def redone_steps(furthest: int | None, resumed_from: int, reached: int | None) -> int:
    """The steps an attempt trains again: from the step it resumed from to the furthest step an
    earlier attempt reached (logged or saved), or to the step it reached itself if that is less.
    Killed at step 25, resumed from the checkpoint of step 20: 5."""
    if furthest is None:
        return 0
    upto = furthest if reached is None else min(furthest, max(reached, resumed_from))
    return max(0, upto - resumed_from)


def resume_line(attempts: list[Attempt], resumed_from: int) -> str | None:
    """What an attempt says as it starts training after earlier ones: how the last one ended and
    where this one starts ("attempt 1 killed at step 25; resuming from step 20: ... (5 redone)");
    None when the last one saved where it stopped and nothing is trained again."""
    if not attempts:
        return None
    last = attempts[-1]
    furthest = max((a.last_step for a in attempts if a.last_step is not None), default=None)
    at = f"at step {last.last_step}" if last.last_step is not None else "before its first step"
    start = f"resuming from step {resumed_from}" if resumed_from else "starting from step 0 (no checkpoint)"
    redo = redone_steps(furthest, resumed_from, None)
    if not redo and last.exit_reason in ("preempted", "budget") and last.last_step == resumed_from:
        return None  # it saved where it stopped: "resuming from ... at step N" says it all
    tail = (
        f": steps {resumed_from + 1}-{resumed_from + redo} are trained again ({redo} redone{_lost(last)})"
        if redo
        else ""
    )
    return f"attempt {last.attempt} {last.exit_reason} {at}; {start}{tail}"


def _lost(a: Attempt) -> str:
    """The step time an attempt trained after its last checkpoint (`lost_seconds`), which the next one
    redoes, with its cost when priced: what the redone steps cost."""
    if a.lost_seconds <= 0:
        return ""
    price = a.price_per_device_second
    money = f", ${a.lost_seconds * price:,.4f}" if price is not None else ""
    return f": {a.lost_seconds:,.1f} device-seconds of attempt {a.attempt}'s step time{money}"


def hours_unit(devices: list[str | None]) -> str:
    """What the run's device-hours are called: `GPU-hours` when every attempt whose device is recorded ran
    on a GPU, else `device-hours` (a CPU run, or none recorded). An attempt killed before it knew its device
    (known only from a lease) does not make a GPU run's hours device-hours."""
    known = [d for d in devices if d]
    return "GPU-hours" if known and all(d != "cpu" for d in known) else "device-hours"


def attempt_of(attempts: list[Attempt], row: dict[str, Any]) -> Attempt | None:
    """The attempt that wrote a metrics row: the row's own `attempt` number (written since the
    rows carry it), else by time, the first attempt not ended by then.

    Attempts run one after another, so their ends are in order. The ledger keeps whole
    seconds (rounded down) and a killed attempt ends at its last heartbeat, written just
    before its last row: hence the slack."""
    number = row.get("attempt")
    if isinstance(number, int):
        return next((a for a in attempts if a.attempt == number), None)
    t = row.get("time")
    if not isinstance(t, (int, float)) or not finite(t):
        return None
    for a in attempts:
        if t <= a.end + END_SLACK_S:
            return a
    return attempts[-1] if attempts else None


END_SLACK_S = 2.0


def _last(rows: list[dict[str, Any]], key: str) -> float | None:
    for row in reversed(rows):
        if finite(row.get(key)):
            return float(row[key])
    return None


def _stall(rows: list[dict[str, Any]]) -> float | None:
    """Share of step time spent waiting for data, weighted by each row's step time."""
    pairs = [(r["data_stall_share"], r["step_time_s"]) for r in rows if finite(r.get("data_stall_share"))]
    pairs = [(s, t) for s, t in pairs if finite(t)]
    weight = sum(t for _, t in pairs)
    return sum(s * t for s, t in pairs) / weight if weight > 0 else None


def totals(run: RunData) -> Totals:
    a = run.attempts
    device = sum(x.device_seconds for x in a)
    productive = sum(x.productive_seconds for x in a)
    restart_s = [x.lost_seconds + (x.startup_seconds if i > 0 else 0.0) for i, x in enumerate(a)]
    # A row without a cost (an attempt known only from a lease that predates its rate) is priced at the run's.
    rate = run.price_per_hour / 3600.0 if run.price_per_hour is not None else None
    prices = [x.price_per_device_second if x.price_per_device_second is not None else rate for x in a]
    priced = bool(a) and all(p is not None for p in prices)
    last = a[-1] if a else None
    stops = Counter(x.exit_reason for x in a[:-1])
    memory = [float(r["peak_memory_gib"]) for r in run.train_rows if finite(r.get("peak_memory_gib"))]
    last_row = run.train_rows[-1] if run.train_rows else None
    return Totals(
        status=last.exit_reason if last else UNKNOWN,
        step=int(last_row["step"]) if last_row else (last.last_step if last else None),
        total_steps=run.total_steps,
        final_loss=_last(run.train_rows, "loss"),
        final_eval_loss=_last(run.eval_rows, "eval_loss"),
        tokens_per_s=_last(run.train_rows, "sustained_tokens_per_s") or _last(run.train_rows, "tokens_per_s"),
        mfu=_last(run.train_rows, "sustained_mfu") or _last(run.train_rows, "mfu"),
        peak_memory_gib=max(memory) if memory else None,
        data_stall_share=_stall(run.train_rows),
        attempts=len(a),
        restarts=max(0, len(a) - 1),
        stops=dict(stops),
        device_hours=device / 3600.0,
        productive_hours=productive / 3600.0,
        checkpoint_hours=sum(x.checkpoint_seconds for x in a) / 3600.0,
        cost=sum(
            x.cost if x.cost is not None else x.device_seconds * (p or 0.0) for x, p in zip(a, prices, strict=True)
        )
        if priced
        else None,
        goodput=productive / device if device > 0 else 0.0,
        restart_hours=sum(restart_s) / 3600.0,
        restart_cost=sum(s * (p or 0.0) for s, p in zip(restart_s, prices, strict=True)) if priced else None,
        redone_steps=sum(redone_by_attempt(run).values()),
        hours_unit=hours_unit([x.device for x in a]),
        heartbeat_age_s=time.time() - run.heartbeat_time if run.heartbeat_time is not None else None,
        eta_s=_eta(run, last, int(last_row["step"]) if last_row else None),
        projected_cost=_last(run.train_rows, "projected_cost") if last is not None and last.running else None,
    )


def _eta(run: RunData, last: Attempt | None, step: int | None) -> float | None:
    """Seconds to the last step for a run still training, at its latest attempt's step time."""
    if last is None or not last.running or run.total_steps is None or step is None:
        return None
    times = [
        float(r["step_time_s"])
        for r in run.train_rows
        if finite(r.get("step_time_s")) and attempt_of(run.attempts, r) is last
    ]
    if not times:
        return None
    return max(0, run.total_steps - step) * sum(times) / len(times)


def headline(t: Totals) -> str:
    """One sentence: where the run stands."""
    of = f" of {t.total_steps}" if t.total_steps else ""
    steps = f"step {t.step}{of}" if t.step is not None else f"start-up, before step 1{of}"
    if t.status == FINISHED:
        return f"Finished at {steps}."
    if t.status == "running":
        age = f"; last heartbeat {ago(t.heartbeat_age_s)} ago" if t.heartbeat_age_s is not None else ""
        return f"In progress at {steps}{age} (no heartbeat for long means the machine is gone: rerun to resume)."
    if t.status == UNKNOWN:
        return f"No ledger.jsonl: whether it finished, and its hours and cost, are unknown; metrics reach {steps}."
    if t.status == "budget":
        return f"Stopped by the budget at {steps}: raise train.max_gpu_hours / train.max_cost and rerun to continue."
    return f"Not finished: the last attempt ended '{t.status}' at {steps}. Rerun the same train command to resume."


def ago(seconds: float | None) -> str:
    """`42 s`, `7 min`, `3.5 h`."""
    s = max(0.0, seconds or 0.0)
    return f"{s:.0f} s" if s < 120 else f"{s / 60:.0f} min" if s < 7200 else f"{s / 3600:.1f} h"
