"""The storage seam and the uploader against a real S3 API (moto on localhost, via s3fs).

Checkpoints here are committed by the real CheckpointManager from small files, so each
test takes a fraction of a second; tests/test_remote_resume.py trains.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from pathlib import Path

import pytest
from moto_fixture import SECRET, free_port, s3_env

from trainer import config as C
from trainer.restart.local.checkpoint import MANIFEST, CheckpointManager
from trainer.restart.remote.run import RemoteRun
from trainer.restart.remote.run_files import fetch_run_files
from trainer.restart.remote.uploader import Uploader
from trainer.restart.store.errors import StoreError, StoreUnreachable
from trainer.restart.store.lifecycle import UPLOAD_PAUSE_ENV, Store
from trainer.urls import redact


def _commit(manager: CheckpointManager, step: int) -> Path:
    def write(tmp: Path) -> None:
        (tmp / "adapter_model.safetensors").write_bytes(bytes([step % 256]) * 4096)
        (tmp / "trainer_state.json").write_text(json.dumps({"step": step}))
        (tmp / "rng.safetensors").write_bytes(b"r" * 100 + bytes([step % 256]))

    return manager.save(step, write).path


def _attempt(store: Store) -> Store:
    """`store` as written by one attempt that began at step 0 on an empty store: the rule of
    trainer/restart/store/safety.py protects nothing it did not commit itself."""
    store.floor.choose(None, [])
    return store


def _wait_for_object(store: Store, step: int) -> None:
    """Until the first file of checkpoint `step` is in the store (an upload is under way)."""
    deadline = time.monotonic() + 30
    while not store.fs.exists(store.step_path(step, "adapter_model.safetensors")):
        assert time.monotonic() < deadline, "the upload never started"
        time.sleep(0.05)
        store.fs.invalidate_cache()


def test_upload_puts_the_manifest_last_and_an_unfinished_upload_is_never_trusted(
    tmp_path: Path, s3_remote: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    manager = CheckpointManager(tmp_path / "checkpoints", keep_last=3)
    local = _commit(manager, 2)
    store = Store(s3_remote)
    monkeypatch.setenv(UPLOAD_PAUSE_ENV, "1.5")  # halfway through the files, before the manifest
    upload = threading.Thread(target=store.upload, args=(local, 2))
    upload.start()
    _wait_for_object(store, 2)
    # Mid-upload: objects exist, the manifest does not, so the checkpoint does not exist.
    assert store.fs.exists(store.step_path(2, "adapter_model.safetensors"))
    assert not store.fs.exists(store.step_path(2, MANIFEST)) and store.committed() == []
    upload.join()
    assert store.committed() == [2]

    # What a kill mid-upload leaves (files, no manifest) is ignored and removed by `clean`.
    store.fs.put_file(str(_commit(manager, 4) / "rng.safetensors"), store.step_path(4, "rng.safetensors"))
    assert store.committed() == [2] and store.clean() == [4]
    assert not store.fs.exists(store.step_path(4)) and store.committed() == [2]


def test_uploading_a_committed_checkpoint_again_sends_nothing_and_keeps_it_committed(
    tmp_path: Path, s3_remote: str
) -> None:
    """A resumed checkpoint caught up after a start that could not see the store may be there already:
    the same bytes are left committed (a kill mid-way cannot uncommit them); other bytes at that step
    replace it when the rule allows (a step this attempt committed itself, or a corrupt one)."""
    store = _attempt(Store(s3_remote))
    local = _commit(CheckpointManager(tmp_path / "a", keep_last=3), 2)
    assert store.upload(local, 2) > 0
    assert store.upload(local, 2) == 0 and store.committed() == [2]
    redone = _commit(CheckpointManager(tmp_path / "b", keep_last=3), 3)  # other bytes ...
    assert store.upload(redone, 2) > 0  # ... at step 2: the control, sent again
    assert store.committed() == [2]
    there = json.loads(store.fs.cat_file(store.step_path(2, MANIFEST)))["files"]
    assert there == json.loads((redone / MANIFEST).read_text())["files"]


def test_download_verifies_size_and_sha256_and_names_the_bad_object(tmp_path: Path, s3_remote: str) -> None:
    store = Store(s3_remote)
    manager = CheckpointManager(tmp_path / "a" / "checkpoints")
    for step in (1, 2):
        store.upload(_commit(manager, step), step)
    good = store.download(2, tmp_path / "b")
    assert good.name == "step-000002" and CheckpointManager(good.parent).verify(good) == []

    bad = store.step_path(2, "adapter_model.safetensors")
    blob = bytearray(store.fs.cat_file(bad))
    blob[-1] ^= 0xFF  # same size: only the sha256 can tell
    store.fs.pipe_file(bad, bytes(blob))
    with pytest.raises(StoreError, match=f"{s3_remote}/checkpoints/step-000002/adapter_model.safetensors: sha256"):
        store.download(2, tmp_path / "c")
    store.fs.pipe_file(bad, b"short")
    with pytest.raises(StoreError, match="adapter_model.safetensors: 5 bytes, the manifest says 4096"):
        store.download(2, tmp_path / "c")
    assert not list((tmp_path / "c").glob("*"))  # nothing half-downloaded is left behind

    # Resume on an empty disk skips the corrupt newest one, says which object, takes step 1.
    fresh = RemoteRun(s3_remote, {}, tmp_path / "fresh", keep_last=2, is_main=True, is_local_main=True)
    fresh.connect()
    path, notes = fresh.resolve("auto")
    assert path == tmp_path / "fresh" / "checkpoints" / "step-000001"
    assert any(f"{s3_remote}/checkpoints/step-000002/adapter_model.safetensors: 5 bytes" in n for n in notes), notes
    assert CheckpointManager(path.parent).verify(path) == []


def test_prune_deletes_the_manifest_first(tmp_path: Path, s3_remote: str, monkeypatch: pytest.MonkeyPatch) -> None:
    store = _attempt(Store(s3_remote))
    manager = CheckpointManager(tmp_path / "checkpoints", keep_last=5)
    for step in (1, 2, 3):
        store.upload(_commit(manager, step), step)
    assert store.prune(keep_last=2) == [1] and store.committed() == [2, 3]

    # A kill (here: the connection dropping) after the manifest went and before the data did:
    # the checkpoint no longer exists, and its leftovers are cleaned at the next start.
    def dropped(*args: object, **kwargs: object) -> None:
        raise ConnectionError("connection reset")

    monkeypatch.setattr(store.fs, "rm", dropped)
    with pytest.raises(ConnectionError):
        store.prune(keep_last=1)
    assert store.committed() == [3]
    assert store.fs.exists(store.step_path(2, "adapter_model.safetensors"))
    monkeypatch.undo()
    assert store.clean() == [2] and not store.fs.exists(store.step_path(2))


def test_uploader_coalesces_saves_and_reports_per_save_figures(
    tmp_path: Path, s3_remote: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    run_dir = tmp_path / "run"
    manager = CheckpointManager(run_dir / "checkpoints", keep_last=2)
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text('{"step": 1}\n')
    messages: list[str] = []
    uploader = Uploader(Store(s3_remote), run_dir, keep_last=2, message=messages.append).start(None)
    monkeypatch.setenv(UPLOAD_PAUSE_ENV, "1.0")
    uploader.submit(1, _commit(manager, 1))
    _wait_for_object(Store(s3_remote), 1)  # step 1 is in flight
    for step in (2, 3, 4):  # the local prune deletes steps 1 and 2 while they wait or upload
        uploader.submit(step, _commit(manager, step))
    assert uploader.flush(timeout=30)
    figures = uploader.metrics()
    assert figures["uploads_skipped"] == 2  # 2 and 3 were replaced in the one pending slot
    assert figures["remote_step"] == 4 and figures["remote_steps_behind"] == 0
    assert figures["upload_bytes"] == sum(f.stat().st_size for f in (run_dir / "checkpoints/step-000004").iterdir())
    assert figures["upload_seconds"] > 0
    store = Store(s3_remote)
    assert store.committed() == [1, 4]  # step 1 uploaded from its staged links although pruned locally
    assert store.fs.cat_file(store.path("metrics.jsonl")) == b'{"step": 1}\n'
    assert not list((run_dir / "checkpoints").glob("*.tmp-*")) and messages == []
    uploader.stop()


def test_unreachable_store_names_the_url_and_the_fix(tmp_path: Path, moto_endpoint: str, monkeypatch) -> None:
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{free_port()}")
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")  # without one, botocore's NoCredentialsError: exit 2
    import s3fs

    monkeypatch.setattr(s3fs.S3FileSystem, "retries", 1)  # s3fs's own retries would spend the budget: ours are tested
    said: list[str] = []
    remote = RemoteRun(
        "s3://some-bucket/run",
        {},
        tmp_path / "run",
        keep_last=2,
        is_main=True,
        is_local_main=True,
        message=said.append,
        retry_seconds=3.0,  # a first try takes a second or more on a busy machine: room for a retry
    )
    with pytest.raises(StoreUnreachable) as err:  # a fault of the moment: exit 143, after retrying
        remote.connect()
    text = str(err.value)
    assert "checkpoint.remote=s3://some-bucket/run is unreachable" in text and "(tried for 3s)" in text
    assert said and all("retrying in" in m for m in said), said
    assert "credentials" in text and "AWS_ENDPOINT_URL" in text and SECRET not in text
    # A missing backend names the extra to install (gcsfs is a test dependency: hidden from the import here).
    # fsspec keeps the classes it imported: another test of this worker may have imported gcsfs already.
    from fsspec.registry import _registry  # `fsspec.registry` itself is a read-only view of it

    monkeypatch.setitem(sys.modules, "gcsfs", None)
    for protocol in ("gs", "gcs"):
        monkeypatch.delitem(_registry, protocol, raising=False)
    with pytest.raises(StoreError, match=r"pip install 'spotune\[gcs\]'"):
        Store("gs://bucket/run")


def test_fetch_run_files_does_not_count_a_closed_attempt_twice(tmp_path: Path, s3_remote: str) -> None:
    """The uploader sends ledger.jsonl before the heartbeat; a kill between the two leaves a
    remote heartbeat whose attempt already has its row."""
    store = Store(s3_remote)
    src = tmp_path / "src"
    src.mkdir()
    (src / "ledger.jsonl").write_text(json.dumps({"attempt": 1, "pid": 7, "exit_reason": "killed"}) + "\n")
    (src / "ledger.current.json").write_text(json.dumps({"attempt": 1, "pid": 7}))
    for name in ("ledger.jsonl", "ledger.current.json"):
        store.put(src / name, name)
    assert fetch_run_files(store, tmp_path / "a") == ["ledger.jsonl"]
    assert not (tmp_path / "a" / "ledger.current.json").exists()
    # Control: a heartbeat of an attempt without a row is kept (it becomes its `killed` row).
    (src / "ledger.current.json").write_text(json.dumps({"attempt": 2, "pid": 9}))
    store.put(src / "ledger.current.json", "ledger.current.json")
    (tmp_path / "b").mkdir()
    assert fetch_run_files(store, tmp_path / "b") == ["ledger.jsonl", "ledger.current.json"]


def test_redact_and_config_validation() -> None:
    assert redact("s3://AKIA:topsecret@bucket/run?X-Amz-Signature=abc") == "s3://bucket/run"
    assert redact("https://acct.blob.core.windows.net/c/p?sv=2022&sig=xyz") == "https://acct.blob.core.windows.net/c/p"
    assert redact("/data/run") == "/data/run"
    ok = C.from_dict({"checkpoint": {"remote": "s3://b/p", "storage_options": {"client_kwargs": {"region_name": "x"}}}})
    assert ok.checkpoint.storage_options == {"client_kwargs": {"region_name": "x"}}
    cases = {
        "nope://bucket/run": "checkpoint.remote: unknown URL scheme 'nope'",
        "s3://AKIA:pw@bucket/run": "checkpoint.remote: the URL carries credentials",
        "s3://bucket/run?X-Amz-Signature=1": "checkpoint.remote: the URL carries credentials or a query string",
    }
    for url, message in cases.items():
        with pytest.raises(C.ConfigError, match=message.replace("?", r"\?")) as err:
            C.from_dict({"checkpoint": {"remote": url}})
        assert "pw@" not in str(err.value) and "Signature=1" not in str(err.value)
    with pytest.raises(C.ConfigError, match="checkpoint.storage_options.secret: credentials do not belong"):
        C.from_dict({"checkpoint": {"remote": "s3://b/p", "storage_options": {"key": "AKIA", "secret": "x"}}})
    with pytest.raises(C.ConfigError, match="checkpoint.storage_options: expected a mapping"):
        C.from_dict({"checkpoint": {"storage_options": ["a"]}})


def test_store_unreachable_mid_run_retries_warns_and_catches_up(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its own moto server, stopped while the uploader works and started again on the same port."""
    from moto.server import ThreadedMotoServer

    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    for key, value in s3_env(f"http://127.0.0.1:{port}").items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")
    run_dir = tmp_path / "run"
    manager = CheckpointManager(run_dir / "checkpoints", keep_last=2)
    store = Store("s3://mid-run-bucket/run")
    store.fs.mkdir("mid-run-bucket")
    messages: list[str] = []
    uploader = Uploader(store, run_dir, keep_last=2, message=messages.append, max_backoff=1.0).start(None)
    try:
        uploader.submit(1, _commit(manager, 1))
        assert uploader.flush(timeout=30) and uploader.metrics()["remote_steps_behind"] == 0
        server.stop()
        for step in (2, 3):
            uploader.submit(step, _commit(manager, step))
        assert not uploader.flush(timeout=2)  # the store is gone: flushing gives up, training would go on
        assert uploader.metrics()["remote_steps_behind"] == 2
        warning = next(m for m in messages if "failed" in m)
        assert "s3://mid-run-bucket/run/checkpoints/step-00000" in warning and "retrying in" in warning
        assert "newest remote step: 1" in warning and "local checkpoints are kept" in warning
        assert [p.name for p in manager.committed()] == ["step-000002", "step-000003"]  # only keep_last pruned
        server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
        server.start()  # moto keeps its buckets in this process: the same store comes back
        assert uploader.flush(timeout=30)
        assert uploader.metrics()["remote_steps_behind"] == 0 and store.committed() == [1, 3]
        assert any("reachable again" in m for m in messages)
        assert all(SECRET not in m for m in messages)
    finally:
        uploader.stop()
        server.stop()


def test_a_local_directory_is_a_store_too(tmp_path: Path) -> None:
    """`file://` (an NFS mount, a second disk) goes through the same seam."""
    (tmp_path / "bucket").mkdir()  # its parent must exist (a mount): never created
    store = _attempt(Store(f"file://{tmp_path / 'bucket'}/run"))
    store.check()  # creates the run's own directory
    manager = CheckpointManager(tmp_path / "a" / "checkpoints", keep_last=5)
    for step in (1, 2, 3):
        store.upload(_commit(manager, step), step)
    (tmp_path / "bucket/run/checkpoints/step-000009").mkdir()  # a killed upload's leftovers
    (tmp_path / "bucket/run/checkpoints/step-000009/rng.safetensors").write_bytes(b"x")
    assert store.committed() == [1, 2, 3] and store.clean() == [9]
    assert store.prune(keep_last=2) == [1] and store.committed() == [2, 3]
    got = store.download(3, tmp_path / "b")
    assert CheckpointManager(got.parent).verify(got) == [] and got.name == "step-000003"
    assert (got / "adapter_model.safetensors").read_bytes() == bytes([3]) * 4096


def test_a_write_the_rule_refuses_stops_the_run_with_exit_1(tmp_path: Path) -> None:
    """A SafetyViolation in the uploader is a bug in spotune: nothing more is uploaded, the run is asked to
    stop (a checkpoint is saved locally) and it exits 1 (look before rerunning), not 143 (a requeue into the
    same bug, training for hours with no remote copy). Against a local-directory store, in process."""
    from trainer import exit_codes as E

    url = f"file://{tmp_path / 'bucket'}/run"
    (tmp_path / "bucket").mkdir()  # a file:// store's parent must exist, as a bucket must
    first = _attempt(Store(url))
    first.check()
    first.upload(_commit(CheckpointManager(tmp_path / "a" / "checkpoints", keep_last=5), 20), 20)
    remote = RemoteRun(url, {}, tmp_path / "run", keep_last=2, is_main=True, is_local_main=True, message=print)
    remote.store = Store(url)
    remote.store.floor.choose(16, [20])  # resumed from 16: replacing 20 with other bytes would lose it
    remote.reachable = True
    stops: list[str] = []
    remote.on_violation = stops.append
    remote.start_uploads()
    assert remote.uploader is not None
    manager = CheckpointManager(tmp_path / "run" / "checkpoints", keep_last=5)
    other = manager.save(20, lambda d: (d / "adapter_model.safetensors").write_bytes(b"other bytes")).path
    remote.submit(20, other)
    remote.finish(preempted=False, notice_seconds=5)
    assert stops and "a bug in spotune" in stops[0] and "replacing step 20" in stops[0], stops
    assert not remote.flushed and remote.uploader.violation == stops[0]
    assert remote.exit_code(E.EXIT_PREEMPTED, tmp_path / "run" / "final") == E.EXIT_ERROR
    assert remote.exit_code(E.EXIT_FINISHED, tmp_path / "run" / "final") == E.EXIT_ERROR
    assert remote.exit_reason("preempted") == "error"  # booked as the error it exits with, not a preemption
    assert Store(url).committed() == [20]
    remote.close()
    # The control: the store ahead of this attempt (refused, not a bug) keeps 143.
    remote.uploader.violation, remote.uploader.refused = None, True
    assert remote.exit_code(E.EXIT_FINISHED, tmp_path / "run" / "final") == E.EXIT_PREEMPTED
    assert remote.exit_reason("preempted") == "preempted"


@pytest.mark.parametrize("ahead", [True, False])
def test_a_run_finished_on_a_disk_the_store_is_ahead_of_is_booked_and_said_as_not_done(
    tmp_path: Path, ahead: bool
) -> None:
    """A machine back with its stale disk trained to the last step cut off (the store did not answer when it
    chose); the store, once it answers, holds a step another machine committed meanwhile. Nothing is uploaded,
    it exits 143, and its ledger row says `preempted` (the run is not done: the rerun continues from the
    store's newest), not `finished` beside exit 143, and the message does not promise an upload that the rerun
    will not make. The control: the same attempt where the store held nothing newer uploads and is done."""
    from trainer import exit_codes as E

    url = f"file://{tmp_path / 'bucket'}/run"
    (tmp_path / "bucket").mkdir()
    if ahead:  # another machine resumed from the store and trained further while this disk was away
        _attempt(Store(url)).upload(_commit(CheckpointManager(tmp_path / "b" / "checkpoints", keep_last=5), 20), 20)
    said: list[str] = []
    remote = RemoteRun(url, {}, tmp_path / "run", keep_last=2, is_main=True, is_local_main=True, message=said.append)
    remote.store = Store(url)
    remote.store.floor = remote.floor
    remote.floor.choose(16, None)  # resumed from its own step 16; the store could not be read then
    stops: list[str] = []
    remote.floor.on_ahead = stops.append
    remote.reachable = True
    remote.start_uploads()
    remote.submit(24, _commit(CheckpointManager(tmp_path / "run" / "checkpoints", keep_last=5), 24))
    remote.finish(preempted=False, notice_seconds=5)
    remote.close()
    code = remote.exit_code(E.EXIT_FINISHED, tmp_path / "run" / "final")
    if ahead:
        assert stops and "holds step 20, newer than step 16" in stops[0], stops
        assert (code, remote.exit_reason("finished"), Store(url).committed()) == (E.EXIT_PREEMPTED, "preempted", [20])
        assert "is ahead of it (another machine trained further): exit 143" in said[-1], said
        assert "upload" not in said[-1], said
    else:
        assert (code, remote.exit_reason("finished"), Store(url).committed()) == (E.EXIT_FINISHED, "finished", [24])
        assert not stops


@pytest.mark.parametrize("comes_back", [True, False])
def test_a_finished_run_whose_last_upload_lands_after_the_flush_gave_up_exits_0(
    tmp_path: Path, comes_back: bool
) -> None:
    """The store is down when training ends: `finish` waits the notice window and gives up. When the
    uploader's retry lands the last step before the attempt closes (the report and the row take a while), the
    finished run exits 0, not 143 with "step 8 uploaded" above it (seen in CI); the control, a store still
    down at close, exits 143 so the supervisor reruns it to upload."""
    from trainer import exit_codes as E

    url = f"file://{tmp_path / 'bucket'}/run"
    (tmp_path / "bucket").mkdir()
    remote = RemoteRun(url, {}, tmp_path / "run", keep_last=2, is_main=True, is_local_main=True, message=print)
    remote.store = _attempt(Store(url))
    remote.store.check()
    remote.reachable = True
    down = threading.Event()
    down.set()
    upload = remote.store.upload

    def flaky(staged: Path, step: int) -> int:
        if down.is_set():
            raise ConnectionResetError("connection reset by peer")
        return upload(staged, step)

    remote.store.upload = flaky  # type: ignore[method-assign]
    remote.start_uploads()
    assert remote.uploader is not None
    remote.uploader.max_backoff = 0.2
    manager = CheckpointManager(tmp_path / "run" / "checkpoints", keep_last=5)
    remote.submit(8, _commit(manager, 8))
    deadline = time.monotonic() + 30
    while not remote.uploader.failing and time.monotonic() < deadline:
        time.sleep(0.05)
    remote.finish(preempted=False, notice_seconds=0.5)  # failing: the notice window only
    assert not remote.flushed
    if comes_back:
        down.clear()
        deadline = time.monotonic() + 30
        while not remote.uploader.caught_up() and time.monotonic() < deadline:
            time.sleep(0.05)
    remote.close()
    code = remote.exit_code(E.EXIT_FINISHED, tmp_path / "run" / "final")
    assert (code, Store(url).committed()) == ((E.EXIT_FINISHED, [8]) if comes_back else (E.EXIT_PREEMPTED, []))
    # Either way it trained the run to its end: booked `finished` (unlike a disk the store is ahead of, above).
    assert remote.exit_reason("finished") == "finished"


def test_a_run_file_in_a_folder_reaches_a_local_store_and_an_object_store(tmp_path: Path, s3_remote: str) -> None:
    """The run's copy of its starting adapter travels as run files in a folder (init_adapter/...): a store
    on a local or mounted filesystem makes the folder (an object store has none to make)."""
    local = tmp_path / "adapter.json"
    local.write_text('{"r": 4}')
    for url in (str(tmp_path / "store"), s3_remote):
        store = Store(url)
        assert store.put(local, "init_adapter/adapter_config.json") == local.stat().st_size
        assert store.read_run_file("init_adapter/adapter_config.json") == b'{"r": 4}'
