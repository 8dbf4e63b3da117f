"""The ledger hand-over between lease holders (trainer/restart/books/handover.py) when a run is run again after it
finished: in process, against a local-directory store."""

from __future__ import annotations

import json
import time
from pathlib import Path
from types import SimpleNamespace

from trainer.restart.books import ledger as L
from trainer.restart.local.checkpoint import CheckpointManager
from trainer.restart.ownership.lease import Lease, read_lease
from trainer.restart.store.lifecycle import Store
from trainer.training.attempts import finished_already


def _lease(url: str, run: Path) -> Lease:
    lease = Lease(Store(url), 30.0, run, message=lambda m: None)
    lease.on_lost = lambda why: None
    return lease


def test_a_finished_run_run_again_is_no_attempt_and_books_what_its_lease_carries(tmp_path: Path) -> None:
    """A finished run is started again: that process trains nothing, so the next holder must not book it as a
    killed paid attempt; and the attempt killed before its ledger opened, known only to the lease it held,
    is booked by the process that finds the run finished (before it returns 0), in the store too."""
    url = f"file://{tmp_path / 'bucket'}/run"
    (tmp_path / "bucket").mkdir()  # a file:// store's parent must exist, as a bucket must
    run = tmp_path / "run"
    step = CheckpointManager(run / "checkpoints", keep_last=2).save(
        50, lambda d: (d / "adapter_model.safetensors").write_bytes(b"a" * 64)
    )
    setup = Store(url)
    setup.check()
    setup.floor.choose(None, [])
    setup.upload(step.path, 50)
    (run / "final").mkdir()
    t0 = time.time() - 1000
    finished = {"attempt": 1, "attempt_id": "F", "exit_reason": "finished", "start": L._iso(t0)}
    finished.update(end=L._iso(t0 + 100), wall_seconds=100.0, device_seconds=100.0, last_step=50)
    (run / L.LEDGER_FILE).write_text(json.dumps(finished) + "\n")

    killed = _lease(url, run)  # started again, killed while loading: before any ledger of its own
    killed.acquire()
    again = _lease(url, run)  # the same directory's rerun: takes the dead holder's lease at once
    again.acquire()
    assert [r["attempt_id"] for r in again.previous] == [killed.id]
    store = Store(url)
    store.fence = again
    store.floor.choose(50, [50])
    proc = SimpleNamespace(out=run, is_main=True, remote=SimpleNamespace(url=url, reachable=True, store=store))
    assert finished_already(proc, 50, step.path, again)  # type: ignore[arg-type]
    again.release()
    rows = L.read_rows(run)
    assert [(r["attempt_id"], r["exit_reason"]) for r in rows] == [("F", "finished"), (killed.id, "killed")]
    assert killed.id in (Store(url).read_run_file(L.LEDGER_FILE) or b"").decode()
    body, _ = read_lease(Store(url))
    assert body is not None and body["no_attempt"] and body["unbooked"] == []

    after = _lease(url, run)  # train.max_steps raised: a real attempt
    after.acquire()
    assert after.previous == []  # neither the no-attempt holder nor the one already booked
    ledger = L.Ledger.open(run, 1, attempt_id=after.id, lost_attempts=after.hand_over())
    assert [r["attempt_id"] for r in L.read_rows(run)] == ["F", killed.id] and ledger.attempt == 3
    after.release()
