"""Where the device-hours went: one `ledger.jsonl` row per attempt, totals over the whole run.

Every duration is in device-seconds (wall seconds x devices) so attempts on different
device counts add up. Per attempt:
- `device_seconds`: process start to exit.
- `startup_seconds`: process start to the first optimizer step (imports, model, data, resume).
- `productive_seconds`: optimizer-step time whose result was kept by a checkpoint.
- `checkpoint_seconds`: time spent saving.
- `lost_seconds`: optimizer-step time after the last checkpoint; the next attempt redoes it.
- `resume_request`: `checkpoint.resume` when the attempt was started with a request (`never`, a path), so
  a rerun of the same command does not apply it again (trainer/restart/remote/new_run.py).
- `last_step`: the last step logged or saved; `resumed_from`: the step its training started from
  (the checkpoint's, 0 without one; absent when it never got that far).
- `phases`: wall seconds of the attempt's fixed costs, for the forecast to itemise
  (`trainer/plan/timeline.py`): `imports` (process start to `train()`), `store` (remote
  connect), `data` (prepare or cache hit; `data_reused` says which), `model` (load + adapter),
  `resolve` (choose, and download, the checkpoint), `restore`, `final` (write final/),
  `report` (from the heartbeat the page is drawn from to this row, so the page's totals plus
  this phase are the row's exactly). Only interpreter exit is outside the row. With
  `model.compile`, `compile`: seconds torch spent compiling in the first steps (inside their
  step time), and `compile_cache` says whether an earlier attempt's artifacts were loaded
  (`hit: ...`, `miss: ...`, `refused: <what differs>`, `off: ...`).
Run `goodput` = productive / device seconds.

A SIGKILLed attempt cannot write its row, so the attempt keeps `ledger.current.json` up to
date (atomically replaced at each log step and checkpoint). The next `Ledger.open` turns a
leftover heartbeat into that attempt's row with exit reason `killed`. With `checkpoint.remote`,
the lease an attempt takes first names its process start and machine, and each renewal is a
sign of life; the attempt that takes the lease over books every such record without a row
(`lost_attempts`, matched by `attempt_id`) up to its last sign of life plus an estimated tail
of half a renewal interval (`estimated_tail_seconds`), never past the next attempt's start.

Run totals are carried in every checkpoint (`TrainState.ledger`). At open, the run totals
so far are, key by key, the larger of the sum of `ledger.jsonl` rows and the carried
totals: each alone undercounts when the other was lost (a checkpoint copied to a new
machine without its ledger; a ledger that holds attempts after the resumed checkpoint).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
from collections.abc import Iterator, Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from trainer.atomic import append_line, write_text
from trainer.restart.books import clock

log = logging.getLogger(__name__)

LEDGER_FILE = "ledger.jsonl"
HEARTBEAT_FILE = "ledger.current.json"
START_SLACK_S = 1.0
"""How much earlier than the previous attempt's end a start may read and still be the clocks' rounding."""
ADDITIVE = ("attempts", "device_seconds", "productive_seconds", "checkpoint_seconds", "startup_seconds", "lost_seconds")


def _iso(t: float) -> str:
    return datetime.fromtimestamp(t, tz=timezone.utc).isoformat(timespec="seconds")


def row_time(iso: str) -> float:
    """A row's `start` or `end` (ISO 8601, whole seconds) as a Unix time."""
    return datetime.fromisoformat(iso).timestamp()


def _not_before_previous(start: float, rows: list[dict[str, Any]]) -> float:
    """`start`, moved up to the latest earlier attempt's end when that end is at most
    `START_SLACK_S` later: the lock ended that attempt before this one could open the ledger,
    so such a gap is the clocks' rounding (a start tick, an integer `btime`), not an overlap."""
    ends = [row_time(r["end"]) for r in rows if isinstance(r.get("end"), str)]
    latest = max(ends, default=start)
    return latest if start < latest <= start + START_SLACK_S else start


def chronological(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Ledger rows in the order their attempts ran: by end, then attempt number (ends are whole seconds),
    then attempt id. One writer at a time, so the attempts' ends are in the order they ran (a start is this
    process's, which one process running several attempts in a row shares). The file's order is not
    chronology: the store's rows are merged first and a stale disk's own rows after them. Readers of "the
    last attempt" ask this (`read_rows`, trainer/report/load.py). A row without an end comes first."""

    def when(row: dict[str, Any]) -> tuple[float, int, str]:
        end = row.get("end")
        number = row.get("attempt")
        at = (row_time(end) if isinstance(end, str) else float("-inf"), number if isinstance(number, int) else 0)
        return (*at, str(row.get("attempt_id") or ""))

    return sorted(rows, key=when)


def read_rows(run_dir: Path | str) -> list[dict[str, Any]]:
    """The ledger rows of `run_dir` in the order their attempts ran (`chronological`), skipping (and
    logging) a torn last line."""
    path = Path(run_dir) / LEDGER_FILE
    if not path.is_file():
        return []
    rows = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            log.warning("%s line %d is not JSON (a torn write?); ignored", path, n)
    return chronological(rows)


class Ledger:
    """The current attempt's clock plus the run's totals from earlier attempts."""

    def __init__(
        self,
        run_dir: Path,
        world_size: int,
        price_per_hour: float | None,
        base: dict[str, float],
        enabled: bool,
        process_start: float,
        attempt: int,
        phases: dict[str, float] | None = None,
        attempt_id: str | None = None,
        resume_request: str | None = None,
    ) -> None:
        self.run_dir = run_dir
        self.resume_request = resume_request
        """`checkpoint.resume` when this attempt was started with a request (`never`, a path): the next start
        of the same command resumes instead of applying it again (trainer/restart/remote/new_run.py `rerun_of`)."""
        self.attempt_id = attempt_id
        """The lease holder id of this attempt (with checkpoint.remote): how a later attempt tells it is booked."""
        self.world_size = world_size
        self.price_per_hour = price_per_hour
        self.base = base
        self.enabled = enabled
        self.start = process_start
        self.attempt = attempt
        self.first_step_time: float | None = None
        self.productive = 0.0  # wall seconds of optimizer steps in this attempt
        self.productive_at_checkpoint = 0.0
        self.checkpoint = 0.0
        self.last_step: int | None = None
        self.resumed_from: int | None = None
        """The step this attempt's training started from (its checkpoint's, 0 without one): with the
        step an earlier attempt reached, the steps it trains again (trainer/report/totals.py)."""
        self.closed: dict[str, Any] | None = None
        self.phases: dict[str, float] = dict(phases or {})
        self.data_reused: bool | None = None
        self.compile_cache: str | None = None
        """With model.compile: whether this attempt loaded compiled artifacts (trainer/model/compile_cache.py)."""
        self.device: str | None = None
        """What the attempt ran on (`NVIDIA H100 80GB HBM3`, `cpu`), for the report's header."""
        self.ending: str | None = None
        """The exit reason once the attempt is winding down (report, upload flush) but not closed."""
        self._beat_time: float | None = None
        self._report_from: float | None = None

    @classmethod
    def open(
        cls,
        run_dir: Path | str,
        world_size: int,
        price_per_hour: float | None = None,
        carried_totals: dict[str, Any] | None = None,
        *,
        enabled: bool = True,
        process_start: float | None = None,
        phases: dict[str, float] | None = None,
        attempt_id: str | None = None,
        lost_attempts: Sequence[dict[str, Any]] = (),
        resume_request: str | None = None,
    ) -> Ledger:
        """Start this attempt's ledger; `enabled=False` on non-main ranks (no files touched).

        `phases`: fixed costs timed before the ledger could open (see the module docstring).
        `lost_attempts`: the lease's records of the attempts this one took the run from.
        `resume_request`: checkpoint.resume when it is not `auto` (recorded in the heartbeat and row)."""
        run_dir = Path(run_dir)
        rows: list[dict[str, Any]] = []
        begun = process_start if process_start is not None else clock.process_start()
        if enabled:
            run_dir.mkdir(parents=True, exist_ok=True)
            recover_killed(run_dir, lost_attempts, before=begun)
            rows = read_rows(run_dir)
        carried = carried_totals or {}
        base = {
            k: max(
                float(sum(r.get(k, 0) for r in rows) if k != "attempts" else len(rows)), float(carried.get(k, 0) or 0)
            )
            for k in ADDITIVE
        }
        start = _not_before_previous(begun, rows)
        ledger = cls(
            run_dir,
            world_size,
            price_per_hour,
            base,
            enabled,
            start,
            attempt=int(base["attempts"]) + 1,
            phases=phases,
            attempt_id=attempt_id,
            resume_request=resume_request,
        )
        ledger.heartbeat()  # a kill before the first log step still leaves a row behind
        return ledger

    # ------------------------------------------------------------------ what the loop calls

    def mark_first_step(self) -> None:
        """Call right before the first optimizer step of this attempt: start-up ends here."""
        if self.first_step_time is None:
            self.first_step_time = time.time()

    @contextlib.contextmanager
    def timed(self, phase: str) -> Iterator[None]:
        """Add the wall time of the block to `phase` (fixed costs: restore, final, report)."""
        with timed(self.phases, phase):
            yield

    def winding_down(self, exit_reason: str) -> None:
        """Training is over (`exit_reason`) but the process still works (final/, report, flush):
        the heartbeat says so, so a report written now shows the attempt as ended, not running."""
        self.ending = exit_reason
        self.heartbeat()

    def reporting(self) -> None:
        """Call right before writing the report: the page reads the heartbeat refreshed here, and
        the time from it to this attempt's row is phase `report` (the page misses only that)."""
        self.heartbeat()
        self._report_from = self._beat_time

    def add_productive(self, seconds: float) -> None:
        """Wall seconds of one optimizer step (forward, backward, optimizer)."""
        self.productive += seconds

    def add_checkpoint(self, seconds: float) -> None:
        self.checkpoint += seconds

    def checkpointed(self) -> None:
        """Call after a checkpoint (or the final adapter) is committed: the work so far is kept."""
        self.productive_at_checkpoint = self.productive
        self.heartbeat()

    def heartbeat(self, step: int | None = None) -> None:
        """Record progress for the next attempt in case this one is killed (at each log step)."""
        if step is not None:
            self.last_step = step
        if self.enabled and self.closed is None:
            self._beat_time = time.time()
            write_text(self.run_dir / HEARTBEAT_FILE, json.dumps(self._progress(self._beat_time)))

    def totals(self) -> dict[str, Any]:
        """Whole-run totals including this attempt so far (store them in TrainState.ledger)."""
        mine = self._row(time.time(), keep_all=True) if self.closed is None else self.closed
        out: dict[str, Any] = {k: self.base[k] + mine[k] for k in ADDITIVE if k != "attempts"}
        out["attempts"] = int(self.base["attempts"]) + 1
        return _derived(out, self.price_per_hour)

    def close(self, exit_reason: str) -> dict[str, Any]:
        """Write this attempt's row and remove the heartbeat; returns the row. Idempotent."""
        if self.closed is not None:
            return self.closed
        now = time.time()
        if self._report_from is not None:
            self.phases["report"] = now - self._report_from
        row = self._row(now, keep_all=False)
        row["exit_reason"] = exit_reason
        self.closed = row
        if self.enabled:
            append_line(self.run_dir / LEDGER_FILE, json.dumps(row, sort_keys=True))
            (self.run_dir / HEARTBEAT_FILE).unlink(missing_ok=True)
        return row

    # ------------------------------------------------------------------ internals

    def _progress(self, now: float) -> dict[str, Any]:
        return {
            "attempt": self.attempt,
            "attempt_id": self.attempt_id,
            "pid": os.getpid(),
            "start_time": self.start,
            "heartbeat_time": now,
            "first_step_time": self.first_step_time,
            "world_size": self.world_size,
            "productive_wall": self.productive,
            "productive_at_checkpoint_wall": self.productive_at_checkpoint,
            "checkpoint_wall": self.checkpoint,
            "last_step": self.last_step,
            "resumed_from": self.resumed_from,
            "price_per_hour": self.price_per_hour,
            "phases": self.phases,
            "data_reused": self.data_reused,
            "device": self.device,
            "compile_cache": self.compile_cache,
            "ending": self.ending,
            "resume_request": self.resume_request,
        }

    def _row(self, now: float, keep_all: bool) -> dict[str, Any]:
        return row_from_progress(self._progress(now), now, keep_all)


def row_from_progress(p: dict[str, Any], end: float, keep_all: bool) -> dict[str, Any]:
    """An attempt's ledger row; `keep_all` counts uncommitted step time as productive (a live snapshot)."""
    w = p["world_size"]
    start = p["start_time"]
    first = p["first_step_time"]
    lost = 0.0 if keep_all else max(0.0, p["productive_wall"] - p["productive_at_checkpoint_wall"])
    row = {
        "attempt": p["attempt"],
        "pid": p["pid"],
        "world_size": w,
        "start": _iso(start),
        "end": _iso(end),
        "wall_seconds": round(end - start, 3),
        "device_seconds": (end - start) * w,
        "startup_seconds": ((first if first is not None else end) - start) * w,
        "productive_seconds": (p["productive_wall"] - lost) * w,
        "checkpoint_seconds": p["checkpoint_wall"] * w,
        "lost_seconds": lost * w,
        "last_step": p["last_step"],
    }
    if p.get("resumed_from") is not None:
        row["resumed_from"] = p["resumed_from"]
    if p.get("attempt_id"):
        row["attempt_id"] = p["attempt_id"]
    if p.get("price_per_hour") is not None:
        row["cost"] = row["device_seconds"] / 3600 * p["price_per_hour"]
    if p.get("phases"):
        row["phases"] = {k: round(v, 4) for k, v in p["phases"].items()}
    if p.get("data_reused") is not None:
        row["data_reused"] = p["data_reused"]
    if p.get("device"):
        row["device"] = p["device"]
    if p.get("compile_cache"):
        row["compile_cache"] = p["compile_cache"]
    if p.get("resume_request"):
        row["resume_request"] = p["resume_request"]
    return row


@contextlib.contextmanager
def timed(phases: dict[str, float], phase: str) -> Iterator[None]:
    """Add the wall time of the block to `phases[phase]`, also when it raises."""
    started = time.monotonic()
    try:
        yield
    finally:
        phases[phase] = phases.get(phase, 0.0) + time.monotonic() - started


def attempt_key(entry: dict[str, Any]) -> tuple[Any, ...]:
    """Who an attempt is, in a ledger row, a heartbeat or a lease record: its `attempt_id` (the lease holder
    id, unique across machines), else (number, pid) for an attempt without a lease. Numbers alone collide:
    two disks that diverged each number their next attempt `len(rows) + 1`."""
    ident = entry.get("attempt_id")
    return ("id", ident) if ident else ("number", entry.get("attempt"), entry.get("pid"))


def recover_killed(
    run_dir: Path | str,
    lost_attempts: Sequence[dict[str, Any]] = (),
    before: float | None = None,
    *,
    heartbeats: Sequence[dict[str, Any]] = (),
    leftover: bool = True,
) -> list[dict[str, Any]]:
    """Book the attempts that never closed: a leftover heartbeat, every heartbeat in `heartbeats` (another
    machine's, found in the store) and every lease record in `lost_attempts` without a row (see the module
    docstring); returns the rows appended. Each attempt is booked once, by `attempt_key`: one that already has
    a row here, or appears twice among these, gets none more. `before`: this attempt's start, which no booked
    row may run past. `leftover=False`: this directory's heartbeat is the live attempt's own, left alone."""
    run_dir = Path(run_dir)
    earlier = read_rows(run_dir)
    booked = {attempt_key(r) for r in earlier}
    records = {r["attempt_id"]: r for r in lost_attempts if r.get("attempt_id") and attempt_key(r) not in booked}
    found = [_leftover_heartbeat(run_dir)] if leftover else []
    spans: list[tuple[dict[str, Any], dict[str, Any] | None]] = []  # (progress, lease record)
    for progress in [*found, *(_readable(p) for p in heartbeats)]:
        if progress is None:
            continue
        key = attempt_key(progress)
        if key in booked:
            continue
        booked.add(key)
        spans.append((progress, records.pop(progress.get("attempt_id"), None)))
    spans += [(_progress_of(r), r) for r in records.values() if r.get("process_start") and r.get("last_seen")]
    spans.sort(key=lambda s: float(s[0]["start_time"]))
    rows: list[dict[str, Any]] = []
    # Past every number in use, the live attempt's too (its heartbeat, when it books late: `leftover=False`).
    live = [] if leftover else [_leftover_heartbeat(run_dir) or {}]
    numbers = [r.get("attempt") for r in [*earlier, *live, *(p for p, _ in spans)]]
    number = max([len(earlier), *(n for n in numbers if isinstance(n, int))])
    for i, (p, record) in enumerate(spans):
        end = max(float(p["heartbeat_time"]), float((record or {}).get("last_seen") or 0))
        later = [float(q["start_time"]) for q, _ in spans[i + 1 :]] + ([before] if before is not None else [])
        tail = float((record or {}).get("renew_every") or 0) / 2
        tail = max(0.0, min([tail, *(t - end for t in later)]))
        row = row_from_progress(p, end + tail, keep_all=False)
        if p.get("attempt") is None:  # known from the lease only: numbered in the order it is booked
            row["attempt"] = number = number + 1
        row.update(exit_reason="killed", end_is_last_heartbeat=True)
        if record is not None:
            row.update(estimated_tail_seconds=round(tail, 3), host=record.get("host"))
        append_line(run_dir / LEDGER_FILE, json.dumps(row, sort_keys=True))
        rows.append(row)
    if leftover:
        (run_dir / HEARTBEAT_FILE).unlink(missing_ok=True)
    return rows


def _readable(progress: dict[str, Any]) -> dict[str, Any] | None:
    """A heartbeat found elsewhere (the store's), when it holds every field a row needs."""
    try:
        row_from_progress(progress, progress["heartbeat_time"], keep_all=False)
    except (ValueError, KeyError, TypeError) as e:
        log.warning("a heartbeat %s is unreadable (%s); the killed attempt it described is not counted", progress, e)
        return None
    return dict(progress)


def _leftover_heartbeat(run_dir: Path) -> dict[str, Any] | None:
    path = run_dir / HEARTBEAT_FILE
    if not path.is_file():
        return None
    try:
        progress = json.loads(path.read_text())
        row_from_progress(progress, progress["heartbeat_time"], keep_all=False)  # every field it needs is there
    except (ValueError, KeyError, TypeError) as e:
        log.warning("%s is unreadable (%s); the killed attempt it described is not counted", path, e)
        return None
    return dict(progress)


def _progress_of(record: dict[str, Any]) -> dict[str, Any]:
    """A heartbeat-shaped description of an attempt known only from the lease it held."""
    zero = dict.fromkeys(("productive_wall", "productive_at_checkpoint_wall", "checkpoint_wall"), 0.0)
    return {
        **zero,
        "attempt": None,
        "attempt_id": record["attempt_id"],
        "pid": record.get("pid"),
        "start_time": float(record["process_start"]),
        "heartbeat_time": float(record["last_seen"]),
        "first_step_time": None,
        "world_size": int(record.get("world_size") or 1),
        "last_step": record.get("step"),
        "device": record.get("device"),
        "price_per_hour": record.get("price_per_hour"),
    }


def _derived(totals: dict[str, Any], price_per_hour: float | None) -> dict[str, Any]:
    device = totals["device_seconds"]
    totals["device_hours"] = device / 3600
    totals["cost"] = totals["device_hours"] * price_per_hour if price_per_hour is not None else None
    totals["goodput"] = totals["productive_seconds"] / device if device > 0 else 0.0
    return totals
