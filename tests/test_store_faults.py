"""Faults a healthy run survives, the pieces: the lease against moto's S3 through a fault-injecting
proxy (tests/fault_proxy.py). A store cut off past the lease's expiry, a PUT delivered twice, a
store that ignores conditional writes, a taker whose wall clock is far ahead, a retire cut off midway. The end-to-end drills
(`spotune train` through the proxy, the wiped-machine kill drill for the ledger) are in
test_store_fault_drill.py."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fault_proxy import FaultProxy
from moto_fixture import free_port, s3_env

from trainer import exit_codes as E
from trainer.faults import transient
from trainer.restart.books.ledger import HEARTBEAT_FILE
from trainer.restart.local.checkpoint import MANIFEST, CheckpointManager, file_digest
from trainer.restart.ownership.lease import Lease, LeaseLost, read_lease
from trainer.restart.ownership.lock import RunBusy
from trainer.restart.ownership.owner import break_lease
from trainer.restart.store.conditional import conditional
from trainer.restart.store.errors import StoreDenied, StoreOffline
from trainer.restart.store.lifecycle import RETIRED, Fence, Store

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def proxy(moto_endpoint: str, s3_remote: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[FaultProxy]:
    """The proxy in front of moto, and this process's S3 client pointed at it (one try per request)."""
    p = FaultProxy(moto_endpoint, tmp_path)
    monkeypatch.setenv("AWS_ENDPOINT_URL", p.url)
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")
    yield p
    p.stop()


def _lease(remote: str, run: Path, ttl: float = 30.0, **kw: float) -> tuple[Lease, list[str], list[str]]:
    lost: list[str] = []
    said: list[str] = []
    lease = Lease(Store(remote), ttl, run, message=said.append, **kw)
    lease.on_lost = lost.append  # instead of exiting the process
    return lease, lost, said


def _wait_for(cond, timeout: float) -> bool:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.05)
    return False


def test_cut_off_past_expiry_keeps_training_and_takes_the_lease_back(
    tmp_path: Path, s3_remote: str, proxy: FaultProxy
) -> None:
    """(a) Today's lease calls itself lost and exits 75 after ttl without renewal; now it only stops writing."""
    a, lost, said = _lease(s3_remote, tmp_path / "a", ttl=2.0)
    a.acquire()
    a.start()
    proxy.set(down=True)
    assert _wait_for(lambda: a.offline_since is not None, timeout=10), said
    with pytest.raises(StoreOffline):
        a.check()  # every write asks this: refused while cut off
    time.sleep(1.0)
    assert not lost and a.lost is None
    proxy.set()
    assert _wait_for(lambda: a.offline_since is None, timeout=15), said
    a.check()
    assert a.generation == 2 and not lost
    assert any("took it back as generation 2" in m for m in said)
    lease, _ = read_lease(Store(s3_remote))
    # Still a's; a later generation only if a loaded machine delayed a renewal past the ttl again since.
    assert lease is not None and lease["holder"] == a.id and lease["generation"] >= 2
    assert a.keeper.refused is None  # an outage is a fault of the moment: never "refused for good"
    a.release()


def test_cut_off_while_another_machine_takes_over_exits_busy_having_written_nothing(
    tmp_path: Path, s3_remote: str, proxy: FaultProxy, moto_endpoint: str
) -> None:
    a, lost, said = _lease(s3_remote, tmp_path / "a", ttl=2.0)
    a.acquire()
    a.start()
    proxy.set(down=True)  # a is cut off; b reaches moto directly
    b = Lease(Store(s3_remote, {"endpoint_url": moto_endpoint}), 30.0, tmp_path / "b", message=lambda m: None)
    b.acquire(wait=20)  # only after a's lease stood still for its ttl on b's clock
    assert b.generation == 2 and b.waited >= 1.5
    assert a.offline_since is not None and not lost  # a stopped writing before b could take it
    proxy.set()
    assert _wait_for(lambda: bool(lost), timeout=15), said
    assert "another attempt took the run's lease" in lost[0]
    with pytest.raises(LeaseLost):
        a.check()
    lease, _ = read_lease(b.store)
    assert lease is not None and lease["holder"] == b.id and lease["generation"] == 2  # a wrote nothing more


def test_an_outage_past_the_limit_asks_for_the_save_and_exit(tmp_path: Path, s3_remote: str, proxy: FaultProxy) -> None:
    a, lost, said = _lease(s3_remote, tmp_path / "a", ttl=1.5, outage_seconds=2.0)
    stops: list[str] = []
    a.on_outage = stops.append
    a.acquire()
    a.start()
    proxy.set(down=True)
    assert _wait_for(lambda: bool(stops), timeout=15), said
    assert "store_outage_seconds" in stops[0] and not lost  # 143 via the stop path, never 75
    proxy.set()
    a.release()


def test_a_put_delivered_twice_is_still_ours(tmp_path: Path, s3_remote: str, proxy: FaultProxy) -> None:
    """(b) The first copy lands, the second is refused (412): today's renew and put_new call that a loss."""
    a, lost, _ = _lease(s3_remote, tmp_path / "a")
    assert conditional(a.store)  # the probe's own PUTs go through once
    proxy.set(double_put=1)
    a.acquire()  # If-None-Match on the creating PUT
    proxy.set(double_put=1)
    a.renew()  # If-Match on the renewal
    manifest = tmp_path / "MANIFEST.json"
    manifest.write_text('{"files": {}}')
    store = Store(s3_remote)
    store.fence = a
    proxy.set(double_put=2)
    a.commit(lambda: a.put_new(store, manifest, store.path("m.json")))  # the renewal, then the manifest
    assert not lost
    doubled = [(e["path"].rsplit("/", 1)[1], e["status"]) for e in proxy.log() if e.get("times") == 2]
    assert doubled == [("lease.json", "412")] * 3 + [("m.json", "412")], doubled  # the proxy did resend
    lease, _ = read_lease(store)
    assert lease is not None and lease["holder"] == a.id
    # The control: a manifest someone else committed is still refused.
    other = tmp_path / "other.json"
    other.write_text('{"files": {"x": 1}}')
    with pytest.raises(LeaseLost):
        a.put_new(store, other, store.path("m.json"))


def test_a_take_back_delivered_twice_is_still_ours(tmp_path: Path, s3_remote: str, proxy: FaultProxy) -> None:
    """Taking the lease back after an outage is a conditional PUT too: when s3fs resends it after the
    first copy landed, the refused resend is settled by a re-read (ours: go on), not called a takeover."""
    a, lost, said = _lease(s3_remote, tmp_path / "a", ttl=2.0)
    a.acquire()
    a.start()
    proxy.set(down=True)
    assert _wait_for(lambda: a.offline_since is not None, timeout=10), said
    proxy.set(double_put=1)  # the store answers again: the take-back PUT lands, its resend gets 412
    assert _wait_for(lambda: a.offline_since is None or bool(lost), timeout=15), said
    assert not lost, lost
    a.check()
    assert a.generation == 2 and any("took it back as generation 2" in m for m in said)
    doubled = [(e["path"].rsplit("/", 1)[1], e["status"]) for e in proxy.log() if e.get("times") == 2]
    assert doubled == [("lease.json", "412")], doubled  # the proxy did resend the take-back
    a.release()
    # The control: a take-back refused because another machine wrote the lease in between is a loss.
    b, b_lost, _ = _lease(s3_remote, tmp_path / "b", ttl=2.0)
    b.acquire()
    stale = (b.body, b.etag)  # what b reads before c's write lands
    b.offline("a test's outage")
    break_lease(s3_remote)
    c, _, _ = _lease(s3_remote, tmp_path / "c", ttl=30.0)
    c.acquire()
    reads = iter([stale])
    real_read = b._read
    b._read = lambda: next(reads, None) or real_read()  # type: ignore[method-assign]
    with pytest.raises(LeaseLost):
        b.keeper.tick()  # its If-Match PUT is refused (c wrote meanwhile); the re-read shows c
    assert b_lost and "another machine took" in b_lost[0]
    lease, _ = read_lease(Store(s3_remote))
    assert lease is not None and lease["holder"] == c.id


def test_a_store_that_ignores_conditions_is_found_out_and_reread(
    tmp_path: Path, s3_remote: str, proxy: FaultProxy
) -> None:
    """(c) The proxy drops If-Match / If-None-Match: the probe sees it, so a holder whose lease was broken
    is stopped by the re-read before its commit (today the stripped If-Match renewal lets it write)."""
    proxy.set(strip_conditions=True)
    assert conditional(Store(s3_remote)) is False
    a, lost, _ = _lease(s3_remote, tmp_path / "a")
    a.acquire()
    wrote: list[int] = []
    a.commit(lambda: wrote.append(1))
    break_lease(s3_remote)
    with pytest.raises(LeaseLost):
        a.commit(lambda: wrote.append(2))
    assert wrote == [1] and lost
    proxy.set()  # the control: the same S3 with conditions kept is found to enforce them
    assert conditional(Store(s3_remote)) is True


_LIVE_HOLDER = """
import sys, time
from pathlib import Path
from trainer.restart.ownership.lease import Lease
from trainer.restart.store.lifecycle import Store
lease = Lease(Store(sys.argv[1]), 2.0, Path(sys.argv[2]), message=lambda m: None)
lease.acquire()
lease.start()
print("held", flush=True)
time.sleep(60)
"""


def test_a_taker_whose_clock_is_an_hour_ahead_never_takes_a_live_lease(
    tmp_path: Path, s3_remote: str, moto_endpoint: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """(c) Expiry is judged on the taker's own clock: the holder's expires_at, an hour in the past by the
    taker's wall clock, is only a reason to look; a lease that keeps changing is live."""
    env = {**s3_env(moto_endpoint), "PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO)}
    holder = subprocess.Popen(
        [sys.executable, "-c", _LIVE_HOLDER, s3_remote, str(tmp_path / "holder")],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        real = time.time
        monkeypatch.setattr(time, "time", lambda: real() + 3600)
        taker, _, _ = _lease(s3_remote, tmp_path / "taker")
        with pytest.raises(RunBusy):
            taker.acquire(wait=2)  # today: taken at once, two writers
        assert (read_lease(Store(s3_remote))[0] or {}).get("generation") == 1
        holder.kill()
        holder.wait()
        taker.acquire(wait=20)  # now it stands still: taken after its ttl on the taker's clock
        assert taker.generation == 2 and taker.waited >= 1.5
        assert taker.previous and taker.previous[0]["pid"] == holder.pid  # the ledger books the dead holder
    finally:
        holder.kill()
        holder.wait()


def test_a_retire_cut_off_midway_keeps_every_object_and_the_next_one_finishes_it(
    tmp_path: Path, s3_remote: str, proxy: FaultProxy, monkeypatch: pytest.MonkeyPatch
) -> None:
    """resume=never retires the store's checkpoints object by object; the store fails one move (every
    retry of it) of step 10. The next attempt's `clean` must not take step 10's data for an unfinished
    upload (it is a retired checkpoint's, paid for), and its `retire` finishes the move into the same
    folder: each retired checkpoint whole, its marker beside its data."""
    local = CheckpointManager(tmp_path / "local", keep_last=5)
    for step in (5, 10):
        path = local.save(
            step, lambda tmp, step=step: (tmp / "adapter_model.safetensors").write_bytes(b"%d" % step * 300)
        ).path
        Store(s3_remote).upload(path, step)

    def never() -> Store:  # an attempt of checkpoint.resume=never: a new timeline from step 0
        store = Store(s3_remote)
        store.floor.choose(None, store.committed(), new_timeline=True)
        return store

    moving = r"^PUT /[^/]+/run/checkpoints/step-000010\.retired-[^/]+/adapter_model"
    import s3fs

    # s3fs tries a request 5 times, sleeping 1.9 s in all between them: 2 tries fail the move the same way.
    monkeypatch.setattr(s3fs.S3FileSystem, "retries", 2)
    proxy.set(refuse=[{"match": moving, "as": "flaky", "times": 2}])  # every try of it
    with pytest.raises(Exception, match="reduce your request rate|Could not connect"):  # a 503 or a reset
        never().retire(-1)
    proxy.set()
    store = never()
    assert store.committed() == [] and store.clean() == []  # nothing deleted
    store.retire(-1)
    listing = store.fs.find(store.path("checkpoints"), detail=False)
    folders = sorted({p.split("/checkpoints/")[1].split("/")[0] for p in listing})
    assert [f.split(".retired-")[0] for f in folders] == ["step-000005", "step-000010"], folders
    for step, folder in zip((5, 10), folders, strict=True):
        marker = json.loads(store.fs.cat_file(store.path("checkpoints", folder, RETIRED)))
        data = tmp_path / f"{step}.bin"
        store.fs.get_file(store.path("checkpoints", folder, "adapter_model.safetensors"), str(data))
        assert list(file_digest(data, fsync=False)) == [
            marker["files"]["adapter_model.safetensors"][k] for k in ("size", "sha256")
        ]
    assert MANIFEST not in str(listing).replace(RETIRED, "")


# A role whose s3:ListBucket is scoped by s3:prefix to `run/*` (the proxy plays IAM): any bucket-level request
# not listing under run/ (the bucket root, a HeadBucket) is refused AccessDenied.
OUTSIDE_THE_PREFIX = r"^(GET|HEAD) /spotune-[0-9a-f]+/?(\?(?!.*prefix=run(/|%2F)).*)?$"


def test_a_role_scoped_to_the_runs_prefix_may_start_and_a_missing_bucket_is_named(
    s3_remote: str, proxy: FaultProxy
) -> None:
    from trainer.restart.store.errors import StoreDenied

    proxy.set(refuse=[{"match": OUTSIDE_THE_PREFIX, "as": "denied"}])
    Store(s3_remote + "/fresh").check()  # a prefix nothing is under yet: fine, the bucket exists
    Store(s3_remote).check()
    refused = [e for e in proxy.log() if e.get("action", "").startswith("refused")]
    assert refused == [], refused  # it never looked outside run/
    bucket = s3_remote.split("/")[2]
    with pytest.raises(StoreDenied, match="list refused"):  # the control: the rule is live
        Store(f"s3://{bucket}").check()
    proxy.set()
    with pytest.raises(StoreDenied, match="check the bucket name"):
        Store("s3://spotune-no-such-bucket/run").check()


# ---------------------------------------------------------------------------- refused for good (trainer/faults.py)


def _probe_answered(status: int, code: str) -> dict:
    """A rule: the conditional PUTs of the probe (and of the lease) answered `status` `code`, plain PUTs let through."""
    return {"match": r"^PUT ", "header": "if-none-match", "as": "answer", "status": status, "code": code}


def test_a_conditional_probe_refused_otherwise_than_412_means_no_conditional_writes(
    tmp_path: Path, s3_remote: str, proxy: FaultProxy
) -> None:
    """An S3-compatible store answering the conditional probe with 501 NotImplemented or a 400 has no
    conditional writes: the lease is taken on the re-read path. Today the probe's error propagates as an outage,
    so the lease is never taken and every attempt trains cut off and exits 143, for ever."""
    for status, code in ((501, "NotImplemented"), (400, "InvalidArgument")):
        proxy.set(refuse=[_probe_answered(status, code)])
        assert conditional(Store(s3_remote)) is False, code
    a, lost, _ = _lease(s3_remote, tmp_path / "a")
    a.acquire()  # the probe refused again (501): the lease is created by a plain write, then re-read
    assert a.held and a.generation == 1 and a.store.conditional is False and not lost
    a.release()
    # The control: a store that does not answer the probe (503 SlowDown, resets) is a fault of the moment.
    proxy.set(refuse=[{**_probe_answered(503, "SlowDown"), "as": "flaky"}])
    with pytest.raises(Exception) as got:
        conditional(Store(s3_remote))
    assert transient(got.value), repr(got.value)


def test_the_lease_thread_ends_the_attempt_on_a_permanent_error(
    tmp_path: Path, s3_remote: str, proxy: FaultProxy
) -> None:
    """A renewal answered 403 AccessDenied (the role lost its permission mid-run) is no blip: the lease thread
    stops writing and asks for the save-and-exit with exit 2, naming the permission. Today it retries for ever as
    a blip (the run trains on, uploading nothing, then exits 143 after store_outage_seconds, again and again)."""
    a, lost, said = _lease(s3_remote, tmp_path / "a", ttl=1.5, outage_seconds=600.0)
    refused: list[BaseException] = []
    a.keeper.on_refused = refused.append
    a.acquire()
    a.start()
    proxy.set(refuse=[{"match": r"lease\.json", "as": "denied"}])
    assert _wait_for(lambda: bool(refused), timeout=15), said
    assert isinstance(refused[0], StoreDenied) and E.code_for(refused[0]) == E.EXIT_BAD_INPUT
    assert "s3:" in str(refused[0]) and not lost
    with pytest.raises(StoreOffline):
        a.check()  # nothing more is written there
    proxy.set()
    a.release()


def _uploading_step_10(store: Store, run: Path, said: list[str], refused: list[BaseException]) -> tuple[Any, Path]:
    """An uploader on `store` (its refusals into `refused`) sending a saved checkpoint of step 10; both returned."""
    from trainer.restart.remote.uploader import Uploader

    uploader = Uploader(store, run, 2, said.append, on_refused=refused.append).start(None)
    saved = CheckpointManager(run / "checkpoints", keep_last=5).save(
        10, lambda d: (d / "adapter_model.safetensors").write_bytes(b"x" * 64)
    )
    uploader.submit(10, saved.path)
    return uploader, saved.path


def test_an_upload_refused_for_good_stops_the_run_instead_of_retrying_for_ever(
    tmp_path: Path, s3_remote: str, proxy: FaultProxy
) -> None:
    """The store refuses the checkpoint's PUTs (403): the uploader stops, asks the run to stop (saved locally)
    with exit 2 naming s3:PutObject. Today it retries every error with backoff for ever."""
    store = Store(s3_remote)
    store.floor.choose(None, [])
    proxy.set(refuse=[{"match": r"^PUT /[^/]+/run/checkpoints/", "as": "denied"}])
    refused: list[BaseException] = []
    said: list[str] = []
    uploader, saved = _uploading_step_10(store, tmp_path / "run", said, refused)
    try:
        assert _wait_for(lambda: bool(refused), timeout=30), said
        assert isinstance(refused[0], StoreDenied) and "s3:PutObject" in str(refused[0])
        assert E.code_for(refused[0]) == E.EXIT_BAD_INPUT and uploader.halted
        assert sum("retrying in" in m for m in said) == 0, said
        assert saved.is_dir()  # the local checkpoint stays
    finally:
        uploader.stop()


def test_an_upload_after_this_attempt_released_its_lease_is_no_refusal(tmp_path: Path) -> None:
    """A lease released while an upload waits (the attempt is ending) or lost to another holder: the uploader
    writes nothing more and asks no stop of its own. The lease's path decides the stop and its code; a
    refusal here would turn a preempted attempt's 143 into 75, which supervisors do not requeue."""
    from trainer.restart.ownership.lease_object import LeaseLost

    class Released(Fence):
        def check(self) -> None:
            raise LeaseLost("this attempt released the lease")

    (tmp_path / "store").mkdir()
    store = Store(f"file://{tmp_path / 'store'}")
    store.floor.choose(None, [])
    store.fence = Released()
    refused: list[BaseException] = []
    said: list[str] = []
    uploader, saved = _uploading_step_10(store, tmp_path / "run", said, refused)
    try:
        assert _wait_for(lambda: uploader.failing, timeout=30), said
        assert refused == [] and uploader.remote_step is None, (refused, said)
        assert store.committed() == [] and saved.is_dir()
    finally:
        uploader.stop()


def _beating(store: Store, run: Path, said: list[str], refused: list[BaseException]) -> Any:
    """An uploader on `store` with nothing to upload: it pushes the run files once, then the heartbeat every 0.2 s."""
    from trainer.restart.remote.uploader import Uploader

    run.mkdir(parents=True, exist_ok=True)
    (run / HEARTBEAT_FILE).write_text('{"step": 3}\n')
    return Uploader(store, run, 2, said.append, heartbeat_seconds=0.2, on_refused=refused.append).start(None)


def test_a_heartbeat_refused_for_good_stops_the_run_at_once(tmp_path: Path, s3_remote: str, proxy: FaultProxy) -> None:
    """Between checkpoints only the heartbeat goes up. The store refusing it (403: the role lost s3:PutObject) stops
    the attempt with exit 2 naming the permission at once, said once, and nothing more is pushed. Before, the
    heartbeat's errors were swallowed: the run trained on, paid, until its next checkpoint upload found the same."""
    store = Store(s3_remote)
    store.floor.choose(None, [])
    refused: list[BaseException] = []
    said: list[str] = []
    uploader = _beating(store, tmp_path / "run", said, refused)
    try:
        assert _wait_for(lambda: store.fs.exists(store.path(HEARTBEAT_FILE)), timeout=15), said
        proxy.set(refuse=[{"match": r"^PUT /[^/]+/run/ledger\.current", "as": "denied"}])
        assert _wait_for(lambda: bool(refused), timeout=30), said
        assert isinstance(refused[0], StoreDenied) and "s3:PutObject" in str(refused[0])
        assert E.code_for(refused[0]) == E.EXIT_BAD_INPUT and uploader.halted
        time.sleep(1.0)  # five heartbeat periods: nothing more is tried, nothing more is said
        assert len(refused) == 1 and sum("failed for good" in m for m in said) == 1, said
        assert "refreshing the heartbeat" in said[-1], said
    finally:
        uploader.stop()


def test_a_heartbeat_that_blips_is_said_once_and_sent_again(tmp_path: Path, s3_remote: str, proxy: FaultProxy) -> None:
    """A store failing for a moment (503 SlowDown, resets) while only the heartbeat goes up: said once, not at every
    push, no stop asked; the heartbeat lands again when the store answers. Control: the refusal test above."""
    store = Store(s3_remote)
    store.floor.choose(None, [])
    refused: list[BaseException] = []
    said: list[str] = []
    proxy.set(refuse=[{"match": r"^PUT /[^/]+/run/ledger\.current", "as": "flaky"}])
    uploader = _beating(store, tmp_path / "run", said, refused)
    try:
        assert _wait_for(lambda: uploader.beside_failing, timeout=30), said
        time.sleep(1.0)  # several failed pushes
        assert sum("failed (" in m and "training goes on" in m for m in said) == 1, said
        assert refused == [] and not uploader.halted
        proxy.set()
        assert _wait_for(lambda: not uploader.beside_failing, timeout=30), said
        assert store.fs.exists(store.path(HEARTBEAT_FILE))
    finally:
        uploader.stop()


def test_every_store_reads_the_endpoint_anew_and_botocores_models_once(
    s3_remote: str, moto_endpoint: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each Store is a filesystem of its own, its endpoint and credentials read from the environment of the moment
    (a cached one would keep what the environment no longer holds); the sessions share one loader of botocore's
    service models (each new one parsed S3's model again: ~175 ms of CPU, twice in every attempt). A session with
    options of its own (a profile) is s3fs's to make."""
    before = Store(s3_remote)
    assert before.committed() == []  # a working client on moto
    elsewhere = f"http://127.0.0.1:{free_port()}"
    monkeypatch.setenv("AWS_ENDPOINT_URL", elsewhere)
    after = Store(s3_remote)
    after.fs.connect()  # the client, no request
    assert (before.fs.s3.meta.endpoint_url, after.fs.s3.meta.endpoint_url) == (moto_endpoint, elsewhere)
    assert before.fs is not after.fs and before.fs.session is not after.fs.session
    assert before.fs.session.get_component("data_loader") is after.fs.session.get_component("data_loader")
    # The control: the comparison above can fail; a profile's session is s3fs's own, made with it.
    assert Store(s3_remote, {"profile": "spotune-test"}).fs.session is None


def test_a_run_file_removed_while_it_uploads_is_absent_not_a_refusal(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The heartbeat is removed when its attempt closes its ledger row; the uploader may be pushing it just then
    (an attempt that resumed a finished run closes at once). The upload found it, then the file was gone: absent,
    as a file never written is, not the store refusing the write for good (which stopped the finished attempt with
    exit 1). The control: the same error from the store's side, the file still there, is raised."""
    (tmp_path / "store").mkdir()
    store = Store(f"file://{tmp_path / 'store'}")
    store.floor.choose(None, [])
    heartbeat = tmp_path / "run" / HEARTBEAT_FILE
    heartbeat.parent.mkdir()
    real = store.fs.put_file

    def closed_meanwhile(lpath: str, rpath: str, **kwargs: Any) -> None:
        Path(lpath).unlink()  # the attempt closed its row between put's look and the upload
        real(lpath, rpath, **kwargs)

    heartbeat.write_text('{"step": 8}\n')
    monkeypatch.setattr(store.fs, "put_file", closed_meanwhile)
    assert store.put(heartbeat, HEARTBEAT_FILE) == 0
    assert not store.fs.exists(store.path(HEARTBEAT_FILE))

    def missing_on_the_store(lpath: str, rpath: str, **kwargs: Any) -> None:
        raise FileNotFoundError(2, "No such file or directory", rpath)

    heartbeat.write_text('{"step": 8}\n')
    monkeypatch.setattr(store.fs, "put_file", missing_on_the_store)
    with pytest.raises(FileNotFoundError):
        store.put(heartbeat, HEARTBEAT_FILE)
    monkeypatch.setattr(store.fs, "put_file", real)
    assert store.put(heartbeat, HEARTBEAT_FILE) == len('{"step": 8}\n')
