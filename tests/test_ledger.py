"""Ledger rows and run totals across attempts, including one that was SIGKILLed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from trainer.restart.books import ledger as L
from trainer.restart.books.clock import seconds_since_process_start


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    c = Clock()
    monkeypatch.setattr(L.time, "time", c)
    return c


def test_attempts_including_a_killed_one(tmp_path: Path, clock: Clock) -> None:
    # Attempt 1 (2 devices): starts at 1000, first step at 1010, checkpoint at 1025, killed after 1031.
    clock.now = 1000.0
    a = L.Ledger.open(tmp_path, world_size=2, price_per_hour=3.6, process_start=1000.0)
    assert (tmp_path / L.HEARTBEAT_FILE).is_file()  # a kill before the first log step leaves a trace
    clock.now = 1010.0
    a.mark_first_step()
    a.add_productive(5.0), a.add_productive(5.0)
    a.add_checkpoint(2.0)
    clock.now = 1025.0
    carried = a.totals()  # what the loop stores in TrainState.ledger at that save
    a.checkpointed()
    a.add_productive(5.0)  # work after the checkpoint: lost when killed
    clock.now = 1031.0
    a.heartbeat(step=3)
    assert carried["attempts"] == 1 and carried["device_seconds"] == 50.0  # 25 s x 2 devices
    del a  # SIGKILL: no close(), no row

    # Attempt 2 resumes from that checkpoint; the heartbeat becomes attempt 1's row.
    clock.now = 2000.0
    b = L.Ledger.open(tmp_path, world_size=2, price_per_hour=3.6, carried_totals=carried, process_start=2000.0)
    rows = L.read_rows(tmp_path)
    assert len(rows) == 1
    killed = rows[0]
    assert killed["exit_reason"] == "killed" and killed["attempt"] == 1 and killed["last_step"] == 3
    assert killed["device_seconds"] == 62.0  # 31 s x 2 to the last heartbeat
    assert killed["startup_seconds"] == 20.0
    assert killed["productive_seconds"] == 20.0 and killed["lost_seconds"] == 10.0
    assert killed["checkpoint_seconds"] == 4.0
    assert killed["cost"] == pytest.approx(62.0 / 3600 * 3.6)
    assert b.attempt == 2
    clock.now = 2004.0
    b.mark_first_step()
    b.add_productive(6.0)
    b.add_checkpoint(1.0)
    b.checkpointed()
    clock.now = 2010.0
    row = b.close("preempted")
    assert b.close("again") is row  # idempotent
    assert row["exit_reason"] == "preempted" and row["lost_seconds"] == 0.0 and row["device_seconds"] == 20.0
    assert not (tmp_path / L.HEARTBEAT_FILE).exists()

    # Attempt 3 on one device: totals cover the whole run.
    clock.now = 3000.0
    c = L.Ledger.open(tmp_path, world_size=1, price_per_hour=3.6, carried_totals=b.totals(), process_start=3000.0)
    clock.now = 3001.0
    t = c.totals()
    assert t["attempts"] == 3
    assert t["device_seconds"] == 62.0 + 20.0 + 1.0
    assert t["productive_seconds"] == 20.0 + 12.0
    assert t["lost_seconds"] == 10.0 and t["checkpoint_seconds"] == 4.0 + 2.0
    assert t["startup_seconds"] == 20.0 + 8.0 + 1.0  # attempt 3 has not reached its first step yet
    assert t["goodput"] == pytest.approx(32.0 / 83.0)
    assert t["device_hours"] == pytest.approx(83.0 / 3600) and t["cost"] == pytest.approx(83.0 / 3600 * 3.6)
    c.close("finished")
    assert [r["exit_reason"] for r in L.read_rows(tmp_path)] == ["killed", "preempted", "finished"]


def test_carried_totals_win_when_the_ledger_file_is_gone(tmp_path: Path, clock: Clock) -> None:
    carried = {
        "attempts": 4,
        "device_seconds": 1000.0,
        "productive_seconds": 800.0,
        "checkpoint_seconds": 10.0,
        "startup_seconds": 50.0,
        "lost_seconds": 5.0,
        "device_hours": 0.27,
        "goodput": 0.8,
    }
    clock.now = 10.0
    led = L.Ledger.open(tmp_path, world_size=1, carried_totals=carried, process_start=10.0)
    clock.now = 20.0
    t = led.totals()
    assert t["attempts"] == 5 and t["device_seconds"] == 1010.0 and t["cost"] is None
    assert led.attempt == 5


def test_torn_line_and_unreadable_heartbeat_are_tolerated(tmp_path: Path, clock: Clock) -> None:
    (tmp_path / L.LEDGER_FILE).write_text(json.dumps({"attempt": 1, "device_seconds": 7.0}) + '\n{"attempt": 2, "dev')
    (tmp_path / L.HEARTBEAT_FILE).write_text("{not json")
    clock.now = 5.0
    led = L.Ledger.open(tmp_path, world_size=1, process_start=5.0)
    assert led.attempt == 2 and led.totals()["device_seconds"] == 7.0


def test_disabled_ledger_touches_no_files(tmp_path: Path, clock: Clock) -> None:
    led = L.Ledger.open(tmp_path / "rank1", world_size=2, enabled=False, process_start=0.0)
    led.heartbeat(1), led.checkpointed(), led.close("finished")
    assert not (tmp_path / "rank1").exists()


def test_phases_and_an_attempt_winding_down(tmp_path: Path, clock: Clock) -> None:
    """Fixed costs are itemised in the row; while final/ and the report are written the
    heartbeat already says how training ended, and the row (written last) counts that time."""
    from trainer.report.load import load_run

    clock.now = 100.0
    a = L.Ledger.open(tmp_path, world_size=1, process_start=90.0, phases={"imports": 4.0, "model": 3.0})
    a.data_reused = True
    clock.now = 101.0
    a.mark_first_step()
    a.add_productive(10.0)
    clock.now = 111.0
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 1.0}) + "\n")
    assert load_run(str(tmp_path)).attempts[0].exit_reason == "running"  # control
    a.winding_down("finished")
    assert load_run(str(tmp_path)).attempts[0].exit_reason == "finished"  # what a report written now shows
    clock.now = 112.0
    a.reporting()  # the page is drawn from the heartbeat written at 112
    assert load_run(str(tmp_path)).attempts[0].device_seconds == 22.0
    clock.now = 113.5
    row = a.close("finished")
    assert row["phases"] == {"imports": 4.0, "model": 3.0, "report": 1.5}  # the page's 22 s + 1.5 = the row's
    assert row["data_reused"] is True and row["wall_seconds"] == 23.5  # from process start to after the report
    assert seconds_since_process_start() >= 0.0


def test_a_start_that_reads_before_the_killed_attempts_end_is_rounding(tmp_path: Path, clock: Clock) -> None:
    """A restart right after a SIGKILL may read its start up to a second before the killed
    attempt's last heartbeat (clock rounding): the rows must still not overlap. A start earlier
    than the slack (control) is left as it is: that is not rounding."""
    clock.now = 1000.0
    a = L.Ledger.open(tmp_path, world_size=1, process_start=1000.0)
    clock.now = 1031.6
    a.heartbeat(step=3)
    del a  # SIGKILL
    b = L.Ledger.open(tmp_path, world_size=1, process_start=1030.9)
    killed = L.read_rows(tmp_path)[0]
    assert killed["end"] == "1970-01-01T00:17:11+00:00"  # 1031.6 in whole seconds
    assert b.start == 1031.0
    clock.now = 1040.0
    assert b.close("finished")["start"] == killed["end"]

    other = tmp_path / "control"
    clock.now = 1000.0
    L.Ledger.open(other, world_size=1, process_start=1000.0).heartbeat(step=1)
    clock.now = 1031.6
    assert L.Ledger.open(other, world_size=1, process_start=1029.0).start == 1029.0


def test_the_process_start_is_the_moment_the_process_began() -> None:
    """Within interpreter start-up of the first statement, and never after it; psutil's reading
    (an integer boot time plus the start tick) is up to a second earlier than this one."""
    import subprocess
    import sys

    code = (
        "import time; t = time.time()\n"
        "import psutil\n"
        "from trainer.restart.books.clock import process_start\n"
        "print(t, process_start(), psutil.Process().create_time())"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    first_statement, start, by_psutil = map(float, out.split())
    assert 0.0 <= first_statement - start < 5.0
    assert -0.02 <= start - by_psutil < 1.02


def test_attempts_known_only_from_the_lease_are_booked_once_with_an_estimated_tail(tmp_path: Path) -> None:
    """A wiped machine's attempt killed before its heartbeat reached the store: the lease it held is all
    that is left (its process start, its last renewal); the taker books it, the tail marked as estimated."""
    (tmp_path / L.LEDGER_FILE).write_text(json.dumps({"attempt": 1, "attempt_id": "a1", "end": L._iso(990)}) + "\n")

    def record(attempt_id: str, start: float, seen: float, renew_every: float) -> dict:
        return {
            "attempt_id": attempt_id,
            "host": "vm",
            "pid": 7,
            "process_start": start,
            "last_seen": seen,
            "renew_every": renew_every,
            "world_size": 2,
            "step": None,
        }

    lease_records = [
        record("a3", 1010.0, 1020.0, 6.0),  # its tail (3 s) would run past the next start: cut to 1 s
        record("a2", 1000.0, 1008.0, 2.0),  # half a renewal interval: 1 s
        record("a1", 980.0, 990.0, 2.0),  # has its row already
    ]
    rows = L.recover_killed(tmp_path, lease_records, before=1021.0)
    got = [(r["attempt"], r["attempt_id"], r["wall_seconds"], r["estimated_tail_seconds"]) for r in rows]
    assert got == [(2, "a2", 9.0, 1.0), (3, "a3", 11.0, 1.0)]
    assert all(r["exit_reason"] == "killed" and r["device_seconds"] == 2 * r["wall_seconds"] for r in rows)
    assert L.recover_killed(tmp_path, lease_records, before=1030.0) == []  # booked once
    assert len(L.read_rows(tmp_path)) == 3


def test_an_attempt_known_only_from_its_lease_is_booked_with_its_device_and_cost(tmp_path: Path) -> None:
    """The lease carries the holder's device and price: the attempt it books has both, so a GPU run's one
    killed-while-loading attempt neither drops the whole run's cost nor turns its GPU-hours into
    device-hours; a row without a cost (a lease written before it knew its rate) is priced at the run's."""
    import dataclasses

    from trainer.report.load import Attempt, RunData
    from trainer.report.totals import totals
    from trainer.restart.books.handover import attempt_record
    from trainer.restart.ownership.lease import Lease, read_lease
    from trainer.restart.store.lifecycle import Store

    (tmp_path / "bucket").mkdir()
    lease = Lease(Store(f"file://{tmp_path / 'bucket'}"), 30.0, tmp_path / "run")
    lease.device, lease.price_per_hour = "NVIDIA H100 80GB HBM3", 3.6
    lease.acquire()
    body, _ = read_lease(Store(f"file://{tmp_path / 'bucket'}"))
    assert body is not None
    record = attempt_record({**body, "renewed_at": body["process_start"] + 100.0})
    run = tmp_path / "run"
    first = {"attempt": 1, "attempt_id": "a1", "start": L._iso(body["process_start"] - 1000), "world_size": 1}
    first.update(end=L._iso(body["process_start"] - 500), device_seconds=500.0, cost=0.5, exit_reason="preempted")
    first.update(device="NVIDIA H100 80GB HBM3")
    run.mkdir(exist_ok=True)
    (run / L.LEDGER_FILE).write_text(json.dumps(first) + "\n")
    (row,) = L.recover_killed(run, [record])
    assert row["device"] == "NVIDIA H100 80GB HBM3" and row["cost"] == row["device_seconds"] / 3600 * 3.6
    data = RunData(source=str(run), config=None, train_rows=[], eval_rows=[], attempts=[])
    data.attempts = [Attempt.from_row(r) for r in L.read_rows(run)]
    got = totals(data)
    assert got.cost == 0.5 + row["cost"] and got.hours_unit == "GPU-hours"
    # A row without a cost or a device: priced at the run's rate (config.yaml's), and the GPU run stays GPU-hours.
    bare = dataclasses.replace(data.attempts[1], cost=None, device=None)
    priced = dataclasses.replace(data, attempts=[data.attempts[0], bare])
    assert totals(priced).cost is None  # the control: no rate known for the run, so no cost claimed
    from trainer import config as C

    cfg = C.from_dict({"model": {"name_or_path": "x"}, "data": {"path": "x"}, "metrics": {"price_per_hour": 3.6}})
    assert totals(dataclasses.replace(priced, config=cfg)).cost == got.cost
    assert totals(priced).hours_unit == "GPU-hours"


def test_the_last_attempt_is_the_one_that_ran_last_not_the_last_line(tmp_path: Path) -> None:
    """A disk that comes back after another machine finished the run: the store's rows are merged first and
    its own stale row (an attempt the store was found ahead of) after them. "The last attempt" is the
    one that ended last (then by attempt id), for the resume line and the report alike."""
    from trainer.report.load import Attempt, load_run
    from trainer.report.totals import resume_line

    def row(attempt: int, attempt_id: str, start: float, reason: str, step: int) -> dict:
        times = {"start": L._iso(start), "end": L._iso(start + 50), "device_seconds": 50.0, "world_size": 1}
        return {"attempt": attempt, "attempt_id": attempt_id, "exit_reason": reason, "last_step": step, **times}

    merged = [row(1, "a", 1000, "preempted", 20), row(3, "c", 1200, "finished", 50)]  # the store's rows
    merged.append(row(2, "b", 1100, "preempted", 30))  # this disk's own, found stale: appended after them
    (tmp_path / L.LEDGER_FILE).write_text("".join(json.dumps(r) + "\n" for r in merged))
    rows = L.read_rows(tmp_path)
    assert [r["attempt_id"] for r in rows] == ["a", "b", "c"]
    line = resume_line([Attempt.from_row(r) for r in rows], 50)
    assert line is not None and line.startswith("attempt 3 finished at step 50"), line
    assert [a.attempt for a in load_run(str(tmp_path)).attempts] == [1, 2, 3]
    # Same end (whole seconds): the attempt id decides, whatever the file order.
    tied = [row(4, "z", 1300, "killed", 50), row(4, "y", 1300, "preempted", 50)]
    (tmp_path / L.LEDGER_FILE).write_text("".join(json.dumps(r) + "\n" for r in tied))
    assert [r["attempt_id"] for r in L.read_rows(tmp_path)] == ["y", "z"]


def test_a_torn_last_line_never_swallows_the_next_row(tmp_path: Path, clock: Clock) -> None:
    # A kill mid-append leaves a line without its newline; the next attempt's row is appended after it.
    (tmp_path / L.LEDGER_FILE).write_text(json.dumps({"attempt": 1, "device_seconds": 7.0}) + '\n{"attempt": 2, "dev')
    clock.now = 5.0
    led = L.Ledger.open(tmp_path, world_size=1, process_start=5.0)
    clock.now = 9.0
    led.close("finished")
    rows = L.read_rows(tmp_path)
    assert [r["attempt"] for r in rows] == [1, 2] and rows[-1]["exit_reason"] == "finished"
    # Control: the torn line stays as it was (one line, still skipped), not mended into something else.
    assert (tmp_path / L.LEDGER_FILE).read_text().splitlines()[1] == '{"attempt": 2, "dev'
