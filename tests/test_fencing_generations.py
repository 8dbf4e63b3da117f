"""Fencing by generation (trainer/restart/store/generations.py), against moto's S3 through s3fs: a write
of a fenced holder that lands late (a request already in flight when it was cut off) never replaces
what a newer holder wrote: for a run file its rows are merged in (no row is lost, none counted
twice), and a late checkpoint manifest counts as absent. Each has a control: the same late write
made the way it was before generations (every writer at generation 0) wins. The manifest rule
assumes a newer holder never commits below a checkpoint it saw committed: the floor of
trainer/restart/store/safety.py asserts that, and a test breaks it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from trainer.report.load import load_run
from trainer.restart.local.checkpoint import MANIFEST, CheckpointManager
from trainer.restart.ownership.lease import Lease
from trainer.restart.remote.run_files import fetch_run_files
from trainer.restart.store.generations import current_steps, merged_rows
from trainer.restart.store.lifecycle import Fence, Store
from trainer.restart.store.safety import Floor, SafetyViolation, StoreAhead


class InFlight(Fence):
    """A request of a holder of `generation` that was past its fence check when the holder was cut off."""

    def __init__(self, generation: int) -> None:
        self._generation = generation

    @property
    def generation(self) -> int | None:
        return self._generation


def _store(remote: str, generation: int) -> Store:
    store = Store(remote)
    store.fence = InFlight(generation)
    store.floor.choose(None, [], generation=generation)  # a late request's checks were passed before it was cut off
    return store


def _rows(path: Path, *steps: int) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    row = {"start": "2026-01-01T00:00:00+00:00", "end": "2026-01-01T00:01:00+00:00", "device_seconds": 60.0}
    path.write_text("".join(json.dumps({"step": s, "loss": 1.0 / s, "attempt": s, **row}) + "\n" for s in steps))
    return path


def _commit(manager: CheckpointManager, step: int) -> Path:
    def write(tmp: Path) -> None:
        (tmp / "adapter_model.safetensors").write_bytes(bytes([step % 256]) * 512)

    return manager.save(step, write).path


def test_the_rule_for_manifests() -> None:
    assert current_steps({}) == []
    assert current_steps({80: 0, 90: 0, 100: 0}) == [80, 90, 100]  # a run written before generations
    # Generation 2 committed 90, so it resumed from 80 or below: 100 landed after it chose (a late write).
    assert current_steps({80: 1, 90: 2, 100: 1}) == [80, 90]
    assert current_steps({80: 1, 90: 2, 100: 2}) == [80, 90, 100]  # an older generation's checkpoint stays good
    # Pruning the newest generation's older steps never revives a late one: its highest step is kept.
    assert current_steps({90: 3, 100: 2}) == [90]


def test_the_rule_holds_only_because_no_holder_commits_below_what_it_saw() -> None:
    """`current_steps` reads {80: 1, 90: 2, 100: 1} as "100 is late". That is true only if generation 2 did
    not see 100 committed when it chose: a holder that saw it (its download failed, say) and trained from
    80 would hide, and then delete, a paid-for checkpoint by committing 90. The floor refuses that commit."""
    before, after = current_steps({80: 1, 100: 1}), current_steps({80: 1, 90: 2, 100: 1})
    saw = Floor()
    saw.choose(80, [80, 100])
    with pytest.raises(SafetyViolation, match=r"committing step 90 would take committed step\(s\) \[100\]"):
        saw.allow("committing step 90", before, after)
    # 100 landed after it chose (a fenced holder's late write, or a listing that was stale or taken before the
    # lease): it cannot tell which, so it hides nothing and stops (StoreAhead: exit 143, the next attempt
    # resumes from the store's newest); the control: a step it committed itself may go out of sight.
    late = Floor()
    late.choose(80, [80])
    with pytest.raises(StoreAhead, match=r"holds committed step\(s\) \[100\].* did not see when it chose"):
        late.allow("committing step 90", before, after)
    own = Floor()
    own.choose(80, [80])
    own.committed(100)
    own.allow("committing step 90", before, after)
    corrupt = Floor()  # and 100 found corrupt when it chose: kept all the same, until it is retired (renamed)
    corrupt.choose(80, [80, 100], corrupt=[100])
    with pytest.raises(SafetyViolation, match="a checkpoint found corrupt is retired"):
        corrupt.allow("committing step 90", before, after)
    corrupt.allow("retiring", [80, 100], [80], retire=True)
    unchosen = Floor()  # before it chose, nothing committed may go out of sight
    with pytest.raises(SafetyViolation):
        unchosen.allow("committing step 90", before, after)


def test_a_fenced_holders_late_run_file_is_merged_and_replaces_nothing(tmp_path: Path, s3_remote: str) -> None:
    first = Lease(Store(s3_remote), 30.0, tmp_path / "a", message=lambda _: None)
    first.acquire()
    first.store.fence = first
    assert first.generation == 1
    first.store.put(_rows(tmp_path / "a" / "metrics.jsonl", 1, 2), "metrics.jsonl")
    first.store.put(_rows(tmp_path / "a" / "ledger.jsonl", 1), "ledger.jsonl")
    first.release()  # as if it was cut off and another machine took over
    second = Lease(Store(s3_remote), 30.0, tmp_path / "b", message=lambda _: None)
    second.acquire()
    second.store.fence = second
    assert second.generation == 2
    second.store.put(_rows(tmp_path / "b" / "metrics.jsonl", 1, 2, 3, 4), "metrics.jsonl")
    second.store.put(_rows(tmp_path / "b" / "ledger.jsonl", 1, 2), "ledger.jsonl")

    names = [p.rsplit("/", 1)[-1] for p in second.store.fs.ls(second.store.root, detail=False)]
    assert sorted(n for n in names if ".jsonl" in n) == [  # never swept: readers merge every copy
        "ledger.jsonl.gen-1",
        "ledger.jsonl.gen-2",
        "metrics.jsonl.gen-1",
        "metrics.jsonl.gen-2",
    ]

    # The first holder's uploads that were in flight land now, with what it held then: its metrics rows
    # are all in the second holder's copy already, and its ledger holds one row the second one lacks.
    late = _store(s3_remote, 1)
    late.put(_rows(tmp_path / "late" / "metrics.jsonl", 1, 2, 3), "metrics.jsonl")
    late.put(_rows(tmp_path / "late" / "ledger.jsonl", 1, 7), "ledger.jsonl")

    fresh = tmp_path / "fresh"  # a new machine resuming the run
    fetch_run_files(Store(s3_remote), fresh)
    assert (fresh / "metrics.jsonl").read_bytes() == (tmp_path / "b" / "metrics.jsonl").read_bytes()
    ledger_steps = [json.loads(x)["step"] for x in (fresh / "ledger.jsonl").read_text().splitlines()]
    assert ledger_steps == [1, 7, 2]  # each row once, none lost, in the order first seen (oldest copy first)
    report = load_run(s3_remote)  # `spotune report <url>`: the same merge
    assert [r["step"] for r in report.train_rows] == [1, 2, 3, 4] and [a.attempt for a in report.attempts] == [1, 2, 7]
    # A machine that holds an older copy still continues it with every generation's rows.
    stale = _rows(tmp_path / "old" / "metrics.jsonl", 1)
    fetch_run_files(Store(s3_remote), stale.parent)
    assert stale.read_bytes() == (tmp_path / "b" / "metrics.jsonl").read_bytes()
    # A disk whose rows the store lacks (it trained while cut off) keeps them, after the store's.
    diverged = _rows(tmp_path / "diverged" / "metrics.jsonl", 1, 9)
    fetch_run_files(Store(s3_remote), diverged.parent)
    assert [json.loads(x)["step"] for x in diverged.read_text().splitlines()] == [1, 2, 3, 4, 9]
    # ... so its next push loses nothing of the store's (it used to keep only its own rows, then sweep the rest).
    _store(s3_remote, 3).put(diverged, "metrics.jsonl")
    pushed = Store(s3_remote).read_run_file("metrics.jsonl") or b""
    assert [json.loads(x)["step"] for x in pushed.splitlines()] == [1, 2, 3, 4, 9]
    second.release()

    # Control: the same late write made as before generations (one key for every writer) wins.
    control = s3_remote + "-control"
    _store(control, 0).put(tmp_path / "b" / "metrics.jsonl", "metrics.jsonl")
    _store(control, 0).put(tmp_path / "late" / "metrics.jsonl", "metrics.jsonl")
    assert [r["step"] for r in load_run(control).train_rows] == [1, 2, 3]


def test_a_fenced_holders_late_manifest_changes_nothing_the_next_reader_sees(tmp_path: Path, s3_remote: str) -> None:
    manager = CheckpointManager(tmp_path / "local" / "checkpoints", keep_last=5)
    ckpt = {step: _commit(manager, step) for step in (80, 90, 100)}

    def history(remote: str, late_generation: int, current: int) -> Store:
        _store(remote, late_generation).upload(ckpt[80], 80)
        _store(remote, current).upload(ckpt[90], 90)  # the next holder resumed from 80
        _store(remote, late_generation).upload(ckpt[100], 100)  # the fenced holder's upload lands late
        return Store(remote)

    store = history(s3_remote, late_generation=1, current=2)
    assert store.committed() == [80, 90]  # what `resolve` on a fresh machine picks from
    got = store.download(store.committed()[-1], tmp_path / "fresh")
    assert json.loads((got / MANIFEST).read_text())["generation"] == 2
    assert not CheckpointManager(tmp_path / "fresh").verify(got)
    assert _store(s3_remote, 2).clean() == [100]  # the holder removes the late one, manifest first
    assert not store.fs.exists(store.step_path(100, MANIFEST))
    # A checkpoint committed by an older generation stays good under a newer one.
    _store(s3_remote, 3).upload(ckpt[100], 100)
    assert store.committed() == [80, 90, 100]

    control = history(s3_remote + "-control", late_generation=0, current=0)  # as before generations
    assert control.committed() == [80, 90, 100]


def test_clean_deletes_a_late_manifest_only_if_this_attempt_never_saw_it_committed(
    tmp_path: Path, s3_remote: str
) -> None:
    """The invariant broken on purpose: generation 2 chose seeing 100 committed (it resumed from 80, so it
    protects 100), then another writer committed 90 at generation 3 below it, so 100 now reads as a late
    write. `clean` judges the raw manifests with the floor: 100 stays. The control: a holder that never saw
    100 committed (it landed after it chose) removes it."""
    manager = CheckpointManager(tmp_path / "local" / "checkpoints", keep_last=5)
    ckpt = {step: _commit(manager, step) for step in (80, 90, 100)}
    for step in (80, 100):
        _store(s3_remote, 1).upload(ckpt[step], step)
    saw = _store(s3_remote, 2)
    saw.floor.choose(80, saw.committed(), generation=2)  # [80, 100]
    breach = _store(s3_remote, 3)  # the breach: a newer generation commits below 100 (its floor thinks it
    breach.floor.choose(100, [80, 100], generation=3)  # resumed from 100, so 100 is not its to keep)
    breach.upload(ckpt[90], 90)
    assert saw.committed() == [80, 90]  # 100 reads as late now
    with pytest.raises(SafetyViolation, match=r"removing late manifests would take committed step\(s\) \[100\]"):
        saw.clean()
    assert saw.fs.exists(saw.step_path(100, MANIFEST))
    never_saw = _store(s3_remote, 3)
    never_saw.floor.choose(90, [80, 90], generation=3)
    assert never_saw.clean() == [100]
    assert Store(s3_remote).committed() == [80, 90] and not Store(s3_remote).fs.exists(saw.step_path(100, MANIFEST))


def test_an_attempt_booked_as_killed_by_another_machine_and_by_its_own_row_counts_once() -> None:
    """An attempt closes its row during an outage (its release fails); another machine takes the lease over and
    books it from its heartbeat as killed; later the first disk's rows meet the store's. Whichever copy comes
    first, the attempt has one row, its own (the recovered one is a lower bound); other attempts' rows stay."""
    own = {"attempt_id": "a1", "attempt": 1, "exit_reason": "finished", "last_step": 8, "wall_seconds": 90.0}
    recovered = {
        "attempt_id": "a1",
        "attempt": 1,
        "exit_reason": "killed",
        "last_step": 6,
        "end_is_last_heartbeat": True,
    }
    other = {"attempt_id": "b2", "attempt": 2, "exit_reason": "finished", "last_step": 8, "wall_seconds": 5.0}

    def lines(*rows: dict) -> bytes:
        return b"".join(json.dumps(r).encode() + b"\n" for r in rows)

    for copies in ([lines(recovered, other), lines(own)], [lines(own), lines(recovered, other)]):
        merged = [json.loads(x) for x in merged_rows(copies).splitlines()]
        assert sorted((r["attempt_id"], r["exit_reason"]) for r in merged) == [("a1", "finished"), ("b2", "finished")]
    # The control: two recovered rows of different attempts are two attempts, both kept.
    both = merged_rows([lines(recovered), lines(dict(recovered, attempt_id="c3"))])
    assert len(both.splitlines()) == 2
