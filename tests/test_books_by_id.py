"""Every paid attempt keeps its ledger row, whoever books it, identified by its id (never its number): a
disk that comes back after another machine trained books that machine's heartbeat from the store; an
attempt taken over by a lease taken late (cut off at start) is booked before the next ledger upload; two
attempts of one number on diverged disks are two rows. And every committed step keeps its metrics row,
carried by its checkpoint. In process, against a local-directory store."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest

from trainer.restart.books import ledger as L
from trainer.restart.ownership.lease import Lease
from trainer.restart.remote.run import RemoteRun
from trainer.restart.remote.run_files import fetch_run_files
from trainer.restart.store.lifecycle import Store


def _beat(attempt: int, attempt_id: str, pid: int, start: float, last_step: int) -> dict[str, Any]:
    """A killed attempt's heartbeat (ledger.current.json), as Ledger.heartbeat writes it."""
    return {
        "attempt": attempt,
        "attempt_id": attempt_id,
        "pid": pid,
        "start_time": start,
        "heartbeat_time": start + 60.0,
        "first_step_time": start + 5.0,
        "world_size": 1,
        "productive_wall": 50.0,
        "productive_at_checkpoint_wall": 40.0,
        "checkpoint_wall": 1.0,
        "last_step": last_step,
    }


def _store(tmp_path: Path) -> tuple[str, Path]:
    url = f"file://{tmp_path / 'bucket'}/run"
    root = tmp_path / "bucket" / "run"
    root.mkdir(parents=True)
    return url, root


def test_a_disk_that_comes_back_books_the_heartbeat_another_machine_left_in_the_store(tmp_path: Path) -> None:
    # A (attempt 1) is killed at step 8; B, on a fresh disk, books A from the store's heartbeat, trains
    # 8 -> 28 as attempt 2 and is killed: its heartbeat is in the store. A comes back with its own disk,
    # which still holds A's heartbeat: the store's one (B's, 20 paid steps) must be booked, not ignored.
    url, root = _store(tmp_path)
    t0 = time.time() - 10_000
    a, b = _beat(1, "a1", 100, t0, 8), _beat(2, "b2", 200, t0 + 1000, 28)
    a_row = {**L.row_from_progress(a, a["heartbeat_time"], keep_all=False), "exit_reason": "killed"}
    (root / L.LEDGER_FILE).write_text(json.dumps(a_row) + "\n")
    (root / L.HEARTBEAT_FILE).write_text(json.dumps(b))
    disk = tmp_path / "a"
    disk.mkdir()
    (disk / L.HEARTBEAT_FILE).write_text(json.dumps(a))
    fetch_run_files(Store(url), disk)
    L.Ledger.open(disk, 1, attempt_id="a3", process_start=time.time()).close("finished")
    rows = L.read_rows(disk)
    assert [(r["attempt_id"], r["exit_reason"], r["last_step"]) for r in rows] == [
        ("a1", "killed", 8),
        ("b2", "killed", 28),
        ("a3", "finished", None),
    ]
    # Once: a second fetch (the next attempt on this disk) books nothing more.
    fetch_run_files(Store(url), disk)
    assert len(L.read_rows(disk)) == 3


def test_two_attempts_of_one_number_on_diverged_disks_are_two_rows(tmp_path: Path) -> None:
    # B's attempt 2 closed its row in the store; A's disk, which never saw it, numbered its own next attempt 2
    # too and was killed (same pid: another machine). A's heartbeat is not B's row: it is booked.
    url, root = _store(tmp_path)
    t0 = time.time() - 10_000
    b = {**L.row_from_progress(_beat(2, "b2", 7, t0, 28), t0 + 60, keep_all=False), "exit_reason": "preempted"}
    (root / L.LEDGER_FILE).write_text(json.dumps(b) + "\n")
    disk = tmp_path / "a"
    disk.mkdir()
    (disk / L.HEARTBEAT_FILE).write_text(json.dumps(_beat(2, "a2", 7, t0 + 2000, 12)))
    fetch_run_files(Store(url), disk)
    L.Ledger.open(disk, 1, attempt_id="a3", process_start=time.time())
    assert [(r["attempt_id"], r["exit_reason"]) for r in L.read_rows(disk)] == [("b2", "preempted"), ("a2", "killed")]
    # Control: the heartbeat of the attempt whose row is there (a kill between the row and the heartbeat's
    # removal) is still dropped, not booked twice.
    (disk / L.HEARTBEAT_FILE).write_text(json.dumps(_beat(2, "b2", 7, t0, 28)))
    fetch_run_files(Store(url), disk)
    assert not (disk / L.HEARTBEAT_FILE).exists()


def test_an_attempt_taken_over_after_the_ledger_opened_is_booked_before_the_next_upload(tmp_path: Path) -> None:
    # B holds the run and is killed. A starts cut off from the store: its ledger opens with nothing handed over,
    # then its lease thread takes the lease from B. A then finishes the run: nobody takes the lease after it,
    # so A itself must book B before it pushes its ledger.
    url, _ = _store(tmp_path)
    run = tmp_path / "run"
    killed = Lease(Store(url), 30.0, run, message=lambda m: None)
    killed.on_lost = lambda why: None
    killed.acquire()
    late = Lease(Store(url), 30.0, run, message=lambda m: None)
    late.on_lost = lambda why: None
    ledger = L.Ledger.open(run, 1, attempt_id=late.id, lost_attempts=late.hand_over())  # cut off: nothing yet
    late.acquire()  # the lease thread takes it once the store answers
    assert [r["attempt_id"] for r in late.previous] == [killed.id]
    assert L.read_rows(run) == []  # what the old code left: B known to the lease only
    remote = RemoteRun(url, {}, run, keep_last=2, is_main=True, is_local_main=True, message=print)
    remote.fence = late
    booked = remote.book_late()
    assert [(r["attempt_id"], r["exit_reason"]) for r in booked] == [(killed.id, "killed")]
    assert (run / L.HEARTBEAT_FILE).exists()  # the live attempt's own heartbeat is left alone
    assert remote.book_late() == []  # once
    store = Store(url)
    store.fence = late
    store.put(run / L.LEDGER_FILE, L.LEDGER_FILE)
    assert late.previous == []  # booked in the store: it leaves the lease
    ledger.close("finished")
    rows = {r["attempt_id"]: r["attempt"] for r in L.read_rows(run)}
    assert rows == {late.id: 1, killed.id: 2}  # numbered past the live attempt's: no two attempts share one
    late.release()


def test_a_kill_right_after_the_store_committed_a_step_loses_no_metrics_row(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The uploader commits step 2 (its manifest is in the store) and the machine dies before the run files
    follow. The rows up to step 2 must be in the store already: the resumed run does not log step 2 again
    (before, the store's history had a hole at 2). The kill: the first call after the commit never returns."""
    from trainer.restart.local.checkpoint import CheckpointManager
    from trainer.restart.remote.uploader import Uploader

    url, _ = _store(tmp_path)
    run = tmp_path / "run"
    saved = CheckpointManager(run / "checkpoints", keep_last=2).save(
        2, lambda d: (d / "adapter_model.safetensors").write_bytes(b"x" * 64)
    )
    store = Store(url)
    store.floor.choose(None, [])
    uploader = Uploader(store, run, 2, message=print)  # not started: its upload runs here, in this thread
    (run / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "loss": 1.0 / s}) + "\n" for s in (1, 2)))

    class Killed(BaseException):
        pass

    def killed(keep_last: int) -> list[int]:
        raise Killed

    monkeypatch.setattr(store, "prune", killed)  # what comes right after the commit
    uploader.submit(2, saved.path)
    job, uploader._pending = uploader._pending, None
    assert job is not None
    with pytest.raises(Killed):
        uploader._upload_with_retries(job)
    assert Store(url).committed() == [2]
    rows = (Store(url).read_run_file("metrics.jsonl") or b"").splitlines()
    assert [json.loads(r)["step"] for r in rows] == [1, 2]
