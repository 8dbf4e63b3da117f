"""One writer per run, the pieces: the run directory's kernel lock (trainer/restart/ownership/lock.py) and
the remote lease with its fencing (trainer/restart/ownership/lease.py) against moto's S3, plus `spotune
status`. The multi-process drills (the same command twice, two machines, SIGSTOP past expiry)
are in test_one_writer_drill.py."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from trainer.cli import main as cli
from trainer.exit_codes import EXIT_BUSY
from trainer.report.status import NotARun, run_status
from trainer.restart.ownership.lease import LEASE_FILE, Lease, LeaseLost, read_lease
from trainer.restart.ownership.lock import LOCK_FILE, RunBusy, RunLock, holder
from trainer.restart.ownership.owner import break_lease, take
from trainer.restart.store.lifecycle import Store

REPO = Path(__file__).resolve().parents[1]


def test_second_lock_refuses_at_once_naming_the_holder(tmp_path: Path) -> None:
    run = tmp_path / "run"
    with RunLock.take(run, "train"):
        (run / "ledger.current.json").write_text(json.dumps({"last_step": 7}))
        started = time.monotonic()
        with pytest.raises(RunBusy) as e:
            RunLock.take(run, "train")
        assert time.monotonic() - started < 3
        text = str(e.value)
        assert f"pid {os.getpid()}" in text and "step 7" in text and "--wait" in text and "since " in text
        assert holder(run)["pid"] == os.getpid()  # a reader probe does not block the holder
    assert holder(run) is None and (run / LOCK_FILE).exists()
    with RunLock.take(run, "train"):  # released: the next one takes it
        pass


def test_a_sigkilled_holder_leaves_no_stale_lock(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from trainer.restart.ownership import lock

    # A refusal retries for PROBE_GRACE (1 s) first; how long is test_second_lock_refuses_at_once's claim.
    monkeypatch.setattr(lock, "PROBE_GRACE", 0.1)
    run = tmp_path / "run"
    code = f"from trainer.restart.ownership.lock import RunLock; RunLock.take({str(run)!r}, 'train'); print('held', flush=True); import time; time.sleep(60)"
    p = subprocess.Popen([sys.executable, "-c", code], cwd=REPO, stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout is not None and p.stdout.readline().strip() == "held"
        assert holder(run)["pid"] == p.pid
        with pytest.raises(RunBusy):
            RunLock.take(run, "train")
        p.send_signal(signal.SIGKILL)
        p.wait()
        started = time.monotonic()
        with RunLock.take(run, "train") as lock:
            assert lock.waited == 0.0
        assert time.monotonic() - started < 1.5
    finally:
        p.kill()
        p.wait()


def test_wait_takes_the_lock_once_the_holder_ends(tmp_path: Path) -> None:
    run = tmp_path / "run"
    first = RunLock.take(run, "train")
    import threading

    threading.Timer(1.5, first.release).start()
    with RunLock.take(run, "train", wait=30) as second:
        assert second.waited >= 1.0 and second.clock_start() == second.acquired_at


def _lease(s3_remote: str, run: Path, ttl: float = 30.0) -> tuple[Lease, list[str]]:
    lost: list[str] = []
    lease = Lease(Store(s3_remote), ttl, run, message=lambda m: None)
    lease.on_lost = lost.append  # instead of exiting the process
    return lease, lost


def test_lease_live_refuses_expired_is_taken_with_a_higher_generation(tmp_path: Path, s3_remote: str) -> None:
    a, a_lost = _lease(s3_remote, tmp_path / "a", ttl=2.0)
    a.acquire()
    assert a.generation == 1
    b, _ = _lease(s3_remote, tmp_path / "b")
    with pytest.raises(RunBusy) as e:
        b.acquire()
    assert f"pid {os.getpid()}" in str(e.value) and "generation 1" in str(e.value) and "--break-lease" in str(e.value)
    b.acquire(wait=10)  # a never renews: expired after 2 s
    assert b.generation == 2 and 1.0 < b.waited < 10
    # The old holder finds out at its next renewal, and its local deadline had passed anyway.
    with pytest.raises(LeaseLost):
        a.keeper.tick()
    assert a_lost and "paused" in a_lost[0]
    with pytest.raises(LeaseLost):
        a.check()
    # Its commits are refused before any byte is written.
    store = Store(s3_remote)
    store.fence = a
    local = tmp_path / "ledger.jsonl"
    local.write_text("{}\n")
    with pytest.raises(LeaseLost):
        store.put(local, "ledger.jsonl")
    assert store.run_file("ledger.jsonl") is None  # no copy of any generation
    b.release()
    lease, _ = read_lease(Store(s3_remote))
    assert lease is not None and lease["released"] and lease["generation"] == 2


def test_conditional_renewal_fences_a_holder_whose_lease_was_replaced(tmp_path: Path, s3_remote: str) -> None:
    """The holder's clock says it still holds the lease, but the object names someone else (broken
    by hand): the conditional renewal before a commit refuses it; no manifest is written."""
    a, a_lost = _lease(s3_remote, tmp_path / "a")
    a.acquire()
    assert "broke the lease" in break_lease(s3_remote)
    store = Store(s3_remote)
    store.fence = a
    manifest = tmp_path / "MANIFEST.json"
    manifest.write_text("{}")
    with pytest.raises(LeaseLost):
        store.fence.commit(lambda: store.fence.put_new(store, manifest, store.path("m.json")))
    assert a_lost and not store.fs.exists(store.path("m.json"))
    b, _ = _lease(s3_remote, tmp_path / "b")
    b.acquire()  # a broken lease is free at once, with a higher generation
    assert b.generation == 3


def test_manifest_never_overwrites_another_writers(tmp_path: Path, s3_remote: str) -> None:
    a, a_lost = _lease(s3_remote, tmp_path / "a")
    a.acquire()
    store = Store(s3_remote)
    store.fs.pipe_file(store.path("m.json"), b"theirs")
    mine = tmp_path / "m.json"
    mine.write_text("mine")
    with pytest.raises(LeaseLost):
        a.put_new(store, mine, store.path("m.json"))
    assert store.fs.cat_file(store.path("m.json")) == b"theirs" and a_lost


def test_same_directory_same_host_takes_over_a_dead_holders_live_lease(tmp_path: Path, s3_remote: str) -> None:
    """A SIGKILLed holder's lease is still live, but this process holds the directory's kernel lock
    that the holder held: it is dead, so the rerun does not wait for the expiry."""
    run = tmp_path / "run"
    dead, _ = _lease(s3_remote, run, ttl=600)
    dead.acquire()
    with take(run, s3_remote, {}, 600.0) as holding:
        assert holding.lease is not None and holding.lease.generation == 2
        with pytest.raises(RunBusy):  # another directory (another machine) is refused
            with take(tmp_path / "other", s3_remote, {}, 600.0):
                pass
    lease, _ = read_lease(Store(s3_remote))
    assert lease is not None and lease["released"]


def test_status_names_the_holder_and_never_blocks(
    tmp_path: Path, s3_remote: str, capsys: pytest.CaptureFixture
) -> None:
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text(f"checkpoint:\n  remote: {s3_remote}\n")
    with take(run, s3_remote, {}, 120.0):
        held = run_status(str(run)).held_by or ""
        assert f"lock held by pid {os.getpid()}" in held and "spotune train" in held
        held = run_status(s3_remote).held_by or ""
        assert "lease held by" in held and "generation 1" in held and "expires in" in held
        assert cli.main(["status", s3_remote]) == 0
        assert "lease held by" in capsys.readouterr().out
    assert run_status(str(run)).held_by is None  # released
    with pytest.raises(NotARun):
        run_status(s3_remote.rsplit("/", 1)[0] + "/elsewhere")


def test_status_break_lease_prints_one_line_or_one_json_document(
    tmp_path: Path, s3_remote: str, capsys: pytest.CaptureFixture
) -> None:
    """`--break-lease` adds one line to the status (inside the JSON document with --json); its remote comes
    from the run directory's config.yaml as the config loader reads it."""
    from trainer import config as C

    run = tmp_path / "run"
    gone, _ = _lease(s3_remote, run, ttl=600)
    gone.acquire()  # its machine is gone; the lease would live ten more minutes
    run.mkdir()
    (run / "config.yaml").write_text(C.to_yaml(C.load(None, [f"output_dir={run}", f"checkpoint.remote={s3_remote}"])))
    assert cli.main(["status", "--json", "--break-lease", str(run)]) == 0
    shown = json.loads(capsys.readouterr().out)  # one document, nothing before it
    assert shown["break_lease"].startswith(f"{s3_remote}: broke the lease of pid {os.getpid()}")
    assert shown["held_by"] is None and shown["state"] == "stopped"
    lease, _ = read_lease(Store(s3_remote))
    assert lease is not None and lease["released"] and lease["generation"] == 2
    assert cli.main(["status", "--break-lease", str(run)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith(f"spotune: {s3_remote}: broke the lease of pid {os.getpid()}")
    assert [line for line in lines if line.startswith(f"{run}:")] == [lines[1]]  # the status block, once
    assert not any("not held on this machine" in line for line in lines)
    assert cli.main(["status", "--break-lease", str(tmp_path / "no-remote")]) == 2  # nothing to break


_REFUSED = """
import sys
from trainer.cli.main import main
code = main(sys.argv[1:])
print(code, *(m for m in ("torch", "transformers", "peft") if m in sys.modules))
"""


def test_train_refused_exits_busy_with_the_message_before_importing_torch(tmp_path: Path) -> None:
    """In a fresh process, as a rerun starts: refused with the holder's name before torch, transformers and
    peft are imported (about 6 s of CPU), so a supervisor's second copy of the command answers in a second."""
    run = tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE")}
    with RunLock.take(run, "train"):
        done = subprocess.run(
            [sys.executable, "-c", _REFUSED, "train", f"output_dir={run}"],
            cwd=REPO,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
    assert done.stdout.split() == [str(EXIT_BUSY)], done.stdout + done.stderr[-3000:]  # nothing heavy imported
    assert f"is in use by pid {os.getpid()}" in done.stderr and "one writer per run" in done.stderr
    assert sorted(p.name for p in run.iterdir()) == [LOCK_FILE]  # it touched nothing


def test_lease_request_cost(tmp_path: Path, s3_remote: str) -> None:
    """Requests per hour: one conditional PUT per renewal (every ttl/3), nothing per step."""
    lease, _ = _lease(s3_remote, tmp_path / "a", ttl=1.5)
    lease.acquire()
    lease.start()
    time.sleep(3.2)
    store = Store(s3_remote)
    store.fence = lease
    for _ in range(5):
        lease.check()  # each store write asks this: no request
    renewals = lease.requests - 2 - 3  # the first read and the creating write; the probe's three PUTs
    lease.release()
    assert 5 <= renewals <= 7  # every 0.5 s for 3.2 s
    assert LEASE_FILE in {p.rsplit("/", 1)[-1] for p in store.fs.ls(store.root, detail=False)}


def test_store_without_conditional_writes_rereads_the_lease_around_a_commit(tmp_path: Path) -> None:
    remote = f"file://{tmp_path / 'bucket'}"
    (tmp_path / "bucket").mkdir()
    a, a_lost = _lease(remote, tmp_path / "a")
    a.acquire()
    b, _ = _lease(remote, tmp_path / "b")
    with pytest.raises(RunBusy):
        b.acquire()
    wrote: list[int] = []
    a.commit(lambda: wrote.append(1))  # the lease read before and after still names a
    assert wrote == [1]
    break_lease(remote)
    with pytest.raises(LeaseLost):
        a.commit(lambda: wrote.append(2))
    assert wrote == [1] and a_lost
    b.acquire()
    assert b.generation == 3


def test_a_released_lease_is_never_taken_again_by_a_late_upload(tmp_path: Path, s3_remote: str) -> None:
    a, a_lost = _lease(s3_remote, tmp_path / "a")
    a.acquire()
    a.release()
    with pytest.raises(LeaseLost):
        a.commit(lambda: None)
    with pytest.raises(LeaseLost):
        a.check()
    lease, _ = read_lease(Store(s3_remote))
    assert lease is not None and lease["released"] and lease["generation"] == 1 and not a_lost


_FORKING_HOLDER = """
import fcntl, os, sys, time
from trainer.restart.ownership.lock import RunLock
run = sys.argv[1]
if sys.argv[2] == "runlock":
    RunLock.take(run, "train")
else:  # the control: the same flock without RunLock's fork rule
    os.makedirs(run, exist_ok=True)
    fd = os.open(os.path.join(run, ".spotune.lock"), os.O_RDWR | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_EX)
if os.fork() == 0:  # a loader worker: outlives its parent for a while
    time.sleep(30)
    os._exit(0)
print("held", flush=True)
time.sleep(60)
"""


@pytest.mark.parametrize("how", ["runlock", "bare flock"])
def test_a_forked_worker_does_not_keep_a_sigkilled_holders_lock(
    tmp_path: Path, how: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SIGKILL the holder while its forked child lives on: the run must be free at once.
    The control (a bare flock, no fork rule) shows the child would keep it locked."""
    from trainer.restart.ownership import lock

    monkeypatch.setattr(lock, "PROBE_GRACE", 0.1)  # the control's refusal: 0.1 s of retries, not 1 s
    run = tmp_path / "run"
    p = subprocess.Popen(
        [sys.executable, "-c", _FORKING_HOLDER, str(run), how.split()[0]],
        cwd=REPO,
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        assert p.stdout is not None and p.stdout.readline().strip() == "held"
        p.send_signal(signal.SIGKILL)
        p.wait()
        if how == "runlock":
            with RunLock.take(run, "train") as lock:
                assert lock.waited == 0.0
        else:
            with pytest.raises(RunBusy):
                RunLock.take(run, "train")
    finally:
        os.killpg(p.pid, signal.SIGKILL)  # the orphaned child too
        p.wait()


def test_status_of_a_local_run_whose_store_does_not_answer(
    tmp_path: Path, s3_remote: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    """`spotune status RUN_DIR` shows the directory's own state while checkpoint.remote does not answer,
    with who holds the lease unknown and why; it neither fails nor guesses."""
    from moto_fixture import free_port

    from trainer import config as C

    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text(C.to_yaml(C.load(None, [f"output_dir={run}", f"checkpoint.remote={s3_remote}"])))
    (run / "metrics.jsonl").write_text(json.dumps({"step": 3, "loss": 1.5, "machine": "here"}) + "\n")
    assert cli.main(["status", str(run)]) == 0  # control: the store answers
    assert "lease unknown" not in capsys.readouterr().out
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{free_port()}")  # nothing listens there
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")
    assert cli.main(["status", str(run)]) == 0
    out = capsys.readouterr().out
    assert f"{run}: stopped" in out and "step 3" in out
    assert f"lease unknown: {s3_remote} could not be read (" in out and "another machine may hold the run" in out
    assert cli.main(["status", "--json", str(run)]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["step"] == 3 and shown["lease_unknown"].startswith(f"{s3_remote} could not be read (")


def test_a_lease_not_taken_at_start_is_taken_with_what_is_left_of_wait_and_never_under_the_lock(
    tmp_path: Path,
) -> None:
    """The store blipped at start, and a killed predecessor's lease has not expired yet: the lease thread
    takes it with what is left of --wait (not 75, which supervisors never restart), waiting without
    `lease.lock` (a `check` meanwhile answers at once); held by a live attempt past the wait, it asks for
    the save-and-exit path (143), never 75; and a release stops the wait at once. In process, a
    local-directory store."""
    import threading

    remote = f"file://{tmp_path / 'bucket'}"
    (tmp_path / "bucket").mkdir()
    dead, _ = _lease(remote, tmp_path / "dead", ttl=1.5)
    dead.acquire()  # killed: never renews
    new, new_lost = _lease(remote, tmp_path / "new", ttl=1.5)
    stops: list[str] = []
    new.on_outage = stops.append
    new.offline("a blip", wait=20.0)  # take(): the first request failed, --wait 20
    ticking = threading.Thread(target=new.keeper.tick)
    ticking.start()
    time.sleep(0.3)
    started = time.monotonic()
    with pytest.raises(Exception, match="cut off"):  # StoreOffline, at once: the lock is free
        new.check()
    assert time.monotonic() - started < 0.2 and ticking.is_alive()
    ticking.join(timeout=20)
    assert new.held and new.generation == 2 and new_lost == [] and stops == []
    assert not new.keeper.cut_off

    # Held by a live attempt past the wait: 143 (the stop path), not 75; the stop asked before the stop
    # path was set up still reaches it.
    new.keeper.start()  # renews every ttl / 3: a live holder
    time.sleep(0.6)
    late, late_lost = _lease(remote, tmp_path / "late", ttl=1.5)
    late.offline("a blip", wait=None)
    late.keeper.tick()
    heard: list[str] = []
    late.on_outage = heard.append
    assert late_lost == [] and not late.held and len(heard) == 1 and "exit 143" in heard[0], heard
    late.keeper.tick()  # gave up: asks the store nothing more
    assert len(heard) == 1

    # Waiting for a live holder, the attempt ends: the release stops the wait at once.
    slow, slow_lost = _lease(remote, tmp_path / "slow", ttl=1.5)
    slow.offline("a blip", wait=60.0)
    slow.keeper.start()
    time.sleep(0.5)
    started = time.monotonic()
    slow.release()
    assert time.monotonic() - started < 1.5 and slow_lost == [] and not slow.held
    new.release()
