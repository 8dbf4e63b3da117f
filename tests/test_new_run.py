"""`checkpoint.resume=never` in a used run directory starts a new run (trainer/restart/remote/new_run.py): a new
config.yaml, a new ledger and metrics, new tracker runs, the old run's final/ out of the way of `chat`
and `export`; the old run's files set aside, renamed and kept, locally and in `checkpoint.remote`, and
named in the log. Before, the new run inherited the old config.yaml (and so its hub data pin), its
trackers.json (W&B and MLflow then skipped every step up to the old run's last), its ledger totals."""

from __future__ import annotations

import contextlib
import hashlib
import json
from pathlib import Path
from typing import Any

import pytest
import yaml
from safetensors.torch import load_file

from trainer import builtin_assets
from trainer import config as C
from trainer.restart.store.lifecycle import Store
from trainer.training import run


def _cfg(out: Path, model: Path, data: Path, remote: str, lr: float, **extra: Any) -> C.RunConfig:
    raw = {
        "output_dir": str(out),
        "seed": 3,
        "model": {"name_or_path": str(model), "dtype": "float32"},
        "adapter": {"r": 4, "alpha": 8},
        "data": {"path": str(data), "seq_len": 128, "cache_dir": str(data.parent / "cache")},
        "train": {"max_steps": 2, "micro_batch_size": 2, "lr": lr, "schedule": "constant"},
        "checkpoint": {"every_steps": 1, "every_minutes": None, "keep_last": 2, "remote": remote},
        "metrics": {"progress": False, "report": False, "trackers": ["tensorboard"]},  # no report read here
    }
    return C.from_dict(raw).replace(**extra) if extra else C.from_dict(raw)


@pytest.mark.parametrize("kind", ["s3", "file"])
def test_resume_never_starts_a_new_run_and_sets_the_old_one_aside(
    kind: str, tmp_path: Path, tiny_llama: Path, request: pytest.FixtureRequest, capsys: pytest.CaptureFixture[str]
) -> None:
    """On an object store and on a local directory (`file://`), where a move needs its folder made first."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    s3_remote = request.getfixturevalue("s3_remote") if kind == "s3" else (tmp_path / "store").as_uri()

    data = builtin_assets.write_dataset(tmp_path / "data" / "train.jsonl", n=16)
    out = tmp_path / "run"
    assert run.train(_cfg(out, tiny_llama, data, s3_remote, lr=1e-2)) == 0
    old_adapter = load_file(out / "final" / "adapter_model.safetensors")
    capsys.readouterr()

    assert run.train(_cfg(out, tiny_llama, data, s3_remote, lr=5e-3, **{"checkpoint.resume": "never"})) == 0
    text = "".join(capsys.readouterr())
    aside = [p for p in out.iterdir() if p.name.startswith("previous-run-")]
    assert len(aside) == 1, list(out.iterdir())
    old = aside[0]
    assert f"the old run's files are set aside in {old}" in text and "config.yaml" in text, text
    assert f"{s3_remote}/{old.name}/" in text, text  # and the store's copies, named too

    # The new run's own files: its config, one ledger row, each step once, a new TensorBoard log.
    assert yaml.safe_load((out / "config.yaml").read_text())["train"]["lr"] == 5e-3
    assert yaml.safe_load((old / "config.yaml").read_text())["train"]["lr"] == 1e-2  # kept, set aside
    assert len((out / "ledger.jsonl").read_text().splitlines()) == 1
    assert len((old / "ledger.jsonl").read_text().splitlines()) == 1
    assert [json.loads(x)["step"] for x in (out / "metrics.jsonl").read_text().splitlines()] == [1, 2]
    events = EventAccumulator(str(out / "tensorboard"))
    events.Reload()
    new_losses = [json.loads(x)["loss"] for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [e.value for e in events.Scalars("loss")] == pytest.approx(new_losses)
    assert (old / "tensorboard").is_dir() and (old / "trackers.json").is_file()
    # final/ is the new run's adapter (what chat and export read); the old one is kept aside.
    new_adapter = load_file(out / "final" / "adapter_model.safetensors")
    kept = load_file(old / "final" / "adapter_model.safetensors")
    assert all((kept[k] == old_adapter[k]).all() for k in kept)
    assert any(not (new_adapter[k] == old_adapter[k]).all() for k in new_adapter)  # another lr, another adapter

    # The store: the new run's files, the old run's under the same folder name, its checkpoints retired.
    store = Store(s3_remote)
    assert yaml.safe_load(store.read_run_file("config.yaml") or b"")["train"]["lr"] == 5e-3
    assert len((store.read_run_file("ledger.jsonl") or b"").splitlines()) == 1
    old_files = {p.rsplit("/", 1)[1] for p in store.fs.ls(store.path(old.name), detail=False)}
    assert {f.split(".gen-")[0] for f in old_files} >= {"config.yaml", "ledger.jsonl", "metrics.jsonl"}
    retired = sorted(
        p.rsplit("/", 1)[1] for p in store.fs.ls(store.path("checkpoints"), detail=False) if ".retired-" in p
    )
    # Step 2 at least: the uploader coalesces saves, so the old run's step 1 may never have been uploaded.
    assert sorted(n.split(".retired-")[0] for n in retired) in (["step-000002"], ["step-000001", "step-000002"])
    for name in retired:  # the old run's checkpoints, whole: the new run's steps 1 and 2 overwrote none of it
        kept = store.fs.cat_file(store.path("checkpoints", name, "adapter_model.safetensors"))
        manifest = json.loads(store.fs.cat_file(store.path("checkpoints", name, "RETIRED-MANIFEST.json")))
        assert len(kept) == manifest["files"]["adapter_model.safetensors"]["size"]
        assert hashlib.sha256(kept).hexdigest() == manifest["files"]["adapter_model.safetensors"]["sha256"]
    assert store.committed() == [1, 2]  # the new run's
    assert f"set aside remote checkpoint(s) above step 0, kept as {s3_remote}/checkpoints/{retired[0]}" in text


def test_resume_never_with_the_store_out_of_reach_sets_nothing_aside(
    tmp_path: Path, tiny_llama: Path, moto_endpoint: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """resume=never is one step: the store is reached first, then the old run's files and checkpoints go
    aside, here and there. A store that does not answer stops the attempt (exit 143) before anything moved:
    a later `auto` finds the old run whole (its checkpoints with their ledger), never a half-new run."""
    from moto_fixture import SECRET, free_port

    from trainer.restart.local.checkpoint import CheckpointManager
    from trainer.restart.store.errors import StoreUnreachable
    from trainer.training import process, run

    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{free_port()}")  # nothing listens there
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "spotune-test-key")
    data = builtin_assets.write_dataset(tmp_path / "data" / "train.jsonl", n=16)
    out = tmp_path / "run"
    CheckpointManager(out / "checkpoints").save(2, lambda tmp: (tmp / "adapter_model.safetensors").write_bytes(b"x"))
    (out / "config.yaml").write_text("old run\n")
    (out / "ledger.jsonl").write_text('{"attempt": 1}\n')
    cfg = _cfg(out, tiny_llama, data, "s3://spotune-unreachable/run", lr=1e-2)
    cfg = cfg.replace(**{"checkpoint.resume": "never", "checkpoint.store_retry_seconds": 1.0})
    with contextlib.ExitStack() as closing, pytest.raises(StoreUnreachable):
        process.start(run.process_settings(cfg), {}, closing)
    assert sorted(p.name for p in out.iterdir()) == ["checkpoints", "config.yaml", "ledger.jsonl"]
    assert [p.name for p in CheckpointManager(out / "checkpoints").committed()] == ["step-000002"]


def test_a_request_applies_once_and_a_rerun_of_the_same_command_resumes(
    tmp_path: Path, tiny_llama: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`checkpoint.resume=never` in a job spec: the supervisor reruns the same command after a preemption (here:
    after the new run's first attempt). The rerun resumes the new run, says why, and sets nothing aside again
    (before, every rerun started from scratch and retired the new run's checkpoints too)."""
    from trainer.restart.books.ledger import read_rows

    data = builtin_assets.write_dataset(tmp_path / "data" / "train.jsonl", n=16)
    out = tmp_path / "run"
    remote = (tmp_path / "store").as_uri()
    assert run.train(_cfg(out, tiny_llama, data, remote, lr=1e-2)) == 0
    never = _cfg(out, tiny_llama, data, remote, lr=5e-3, **{"checkpoint.resume": "never"})
    assert run.train(never) == 0
    capsys.readouterr()
    new_final = (out / "final" / "adapter_model.safetensors").read_bytes()
    assert run.train(never) == 0  # the same command again
    text = "".join(capsys.readouterr())
    assert "checkpoint.resume=never was applied by an earlier start of this command" in text, text
    assert "set aside" not in text, text
    assert len([p for p in out.iterdir() if p.name.startswith("previous-run-")]) == 1
    retired = sorted(p.name.split(".retired-")[0] for p in (out / "checkpoints").iterdir() if ".retired-" in p.name)
    assert retired == ["step-000001", "step-000002"]  # the old run's, once
    assert (out / "final" / "adapter_model.safetensors").read_bytes() == new_final
    assert [r.get("resume_request") for r in read_rows(out)] == ["never"]  # the rerun found it finished: no row
    assert Store(remote).committed() == [1, 2]


def test_rerun_of_reads_the_last_attempt_row_or_heartbeat(monkeypatch: pytest.MonkeyPatch) -> None:
    """The unit under the test above: the last attempt decides, a killed one's heartbeat included."""
    from trainer.restart.books.ledger import row_from_progress
    from trainer.restart.remote import new_run
    from trainer.restart.remote.new_run import rerun_of

    def beat(n: int, at: float, request: str | None) -> dict[str, Any]:
        zero = dict.fromkeys(("productive_wall", "productive_at_checkpoint_wall", "checkpoint_wall"), 0.0)
        p = {**zero, "attempt": n, "pid": n, "start_time": at, "heartbeat_time": at + 10, "first_step_time": None}
        return {**p, "world_size": 1, "last_step": None, "resume_request": request}

    def row(n: int, at: float, request: str | None) -> bytes:
        return json.dumps({**row_from_progress(beat(n, at, request), at + 10, False), "exit_reason": "x"}).encode()

    never, auto = row(1, 1000.0, "never"), row(2, 2000.0, None)
    assert rerun_of("never", [never], [None]) is not None
    assert rerun_of("never", [never + b"\n" + auto], [None]) is None  # an auto start since: a new request
    assert rerun_of("/ck/step-000004", [never], [None]) is None  # another request
    killed = json.dumps(beat(3, 3000.0, "never")).encode()  # killed before its row: its heartbeat says it
    assert rerun_of("never", [never + b"\n" + auto], [killed]) is not None
    assert rerun_of("never", [], [None]) is None  # nothing ran yet: apply it
    monkeypatch.setenv(new_run.APPLY_ENV, "1")  # `spotune pilot`: a new pilot run each time
    assert rerun_of("never", [never], [None]) is None
