"""Training against a real S3 API (moto on localhost, through s3fs): a machine with an empty
output_dir resumes from the bucket bit-for-bit; the run's ledger and metrics travel with it;
an unreachable store fails at start (or warns when a local checkpoint exists) and never stops
training mid-run; no credential reaches a file, a metrics row or a log. (A corrupt remote
checkpoint being skipped is in test_remote_storage.py: it needs no training.)

Resume uses the test_resume.py trick: a constant LR schedule makes `max_steps` free to change,
so "K steps, then K more on a new machine" must equal "2K steps straight".
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from moto_fixture import SECRET, free_port
from safetensors.torch import load_file

from trainer import builtin_assets
from trainer import config as C
from trainer.exit_codes import EXIT_PREEMPTED
from trainer.restart.books.ledger import read_rows
from trainer.restart.local.checkpoint import CheckpointManager
from trainer.restart.store.errors import StoreUnreachable
from trainer.restart.store.lifecycle import UPLOAD_PAUSE_ENV, Store
from trainer.training import run

K = 3


def _cfg(out: Path, model: Path, data: Path, max_steps: int, **extra: Any) -> C.RunConfig:
    raw = {
        "output_dir": str(out),
        "seed": 3,
        "model": {"name_or_path": str(model), "dtype": "float32"},
        "adapter": {"r": 4, "alpha": 8, "dropout": 0.1},
        "data": {"path": str(data), "seq_len": 128, "cache_dir": str(data.parent / "cache")},
        "train": {"max_steps": max_steps, "micro_batch_size": 2, "grad_accum": 2, "lr": 1e-2, "schedule": "constant"},
        "checkpoint": {"every_steps": 1, "every_minutes": None, "keep_last": 2},
        "metrics": {"progress": False, "report": False},
    }
    return C.from_dict(raw).replace(**extra) if extra else C.from_dict(raw)


def _adapter(out: Path) -> dict[str, torch.Tensor]:
    return load_file(out / "final" / "adapter_model.safetensors")


def _equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _rows(out: Path) -> list[dict[str, Any]]:
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if x.strip()]


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return builtin_assets.write_dataset(tmp_path_factory.mktemp("remote-data") / "train.jsonl", n=16)


@pytest.fixture(scope="module")
def straight(tmp_path_factory: pytest.TempPathFactory, tiny_llama: Path, data: Path) -> dict[str, torch.Tensor]:
    """2K steps without a remote, never interrupted."""
    out = tmp_path_factory.mktemp("straight")
    assert run.train(_cfg(out, tiny_llama, data, 2 * K)) == 0
    return _adapter(out)


def test_empty_output_dir_resumes_from_s3_bit_identical(
    tmp_path: Path, tiny_llama: Path, data: Path, s3_remote: str, straight: dict, capsys: pytest.CaptureFixture
) -> None:
    out = tmp_path / "run"
    assert run.train(_cfg(out, tiny_llama, data, K, **{"checkpoint.remote": s3_remote})) == 0
    first = _adapter(out)
    first_ledger = read_rows(out)
    # Rows are written before the step's save, and uploads run beside training: from the
    # second row on each says how far the remote lags (its figures race the upload thread).
    assert all({"remote_step", "remote_steps_behind", "uploads_skipped"} <= r.keys() for r in _rows(out)[1:])
    store = Store(s3_remote)
    assert len(store.committed()) == 2 and store.committed()[-1] == K  # keep_last=2 applies remotely too

    shutil.rmtree(out)  # a new VM: nothing local
    assert run.train(_cfg(out, tiny_llama, data, 2 * K, **{"checkpoint.remote": s3_remote})) == 0
    logs = capsys.readouterr()
    assert f"downloaded {s3_remote}/checkpoints/step-{K:06d}" in logs.out + logs.err
    # Control: K steps differ from 2K, so equality below is not the trivial outcome.
    assert not _equal(first, straight)
    assert _equal(_adapter(out), straight)
    # It resumed (a restart from step 0 would end equal too, being deterministic): the history
    # came down with the checkpoint and continues at K+1, and the ledger counts both machines.
    steps = [r["step"] for r in _rows(out) if "loss" in r]
    assert steps == list(range(1, 2 * K + 1))
    ledger = read_rows(out)
    assert [r["exit_reason"] for r in ledger] == ["finished", "finished"]
    assert ledger[0] == first_ledger[0]
    # The newest is there; the one before it may be 2K-1 or older (a save that came while an
    # upload ran and was replaced by the next one is never uploaded).
    assert len(store.committed()) == 2 and store.committed()[-1] == 2 * K
    # No credential anywhere: local files, remote objects, logs.
    _assert_no_secret(out, logs.out + logs.err)
    for path in store.fs.find(store.root):
        assert SECRET.encode() not in store.fs.cat_file(path), path


def _assert_no_secret(out: Path, logs: str) -> None:
    assert SECRET not in logs
    for f in out.rglob("*"):
        if f.is_file():
            assert SECRET.encode() not in f.read_bytes(), f


def test_unreachable_store_at_start_fails_without_a_local_checkpoint_and_warns_with_one(
    tmp_path: Path, tiny_llama: Path, data: Path, s3_remote: str, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    out = tmp_path / "run"
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    monkeypatch.setenv("AWS_ENDPOINT_URL", dead)
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")
    opts = {"checkpoint.remote": s3_remote, "checkpoint.notice_seconds": 0.5, "checkpoint.store_retry_seconds": 1.0}
    cfg = _cfg(out, tiny_llama, data, 2, **opts)
    with pytest.raises(StoreUnreachable) as err:  # retried for store_retry_seconds first
        run.train(cfg)
    message = str(err.value)
    assert s3_remote in message and "unreachable" in message and "AWS_ENDPOINT_URL" in message
    assert "No local checkpoint lets training start without it" in message  # the CLI exits 143: restartable
    assert not (out / "checkpoints").exists()

    # With a local checkpoint the run goes on: a warning at start, uploads retried in the
    # background (training never waits for them), every local checkpoint kept.
    assert run.train(cfg.replace(**{"checkpoint.remote": None})) == 0
    # It finishes, but the store lacks its last checkpoint: 143 (rerun to upload it), never 0.
    assert run.train(cfg.replace(**{"train.max_steps": 4})) == EXIT_PREEMPTED
    logs = capsys.readouterr()
    text = logs.out + logs.err
    assert "lacks its last checkpoint: exit 143; run the same command again to upload it" in text
    assert f"checkpoint.remote={s3_remote} is unreachable" in text
    assert "Continuing from the local checkpoint step-000002" in text
    assert f"uploading step 3 to {s3_remote}/checkpoints/step-000003 failed" in text
    assert "training goes on" in text and "local checkpoints are kept" in text
    assert [p.name for p in CheckpointManager(out / "checkpoints").committed()] == ["step-000003", "step-000004"]
    assert (out / "final" / "adapter_model.safetensors").is_file()
    behind = [r["remote_steps_behind"] for r in _rows(out) if "remote_steps_behind" in r]
    assert behind and behind[-1] >= 3  # nothing reached the store: 4 steps behind a remote at step 0
    _assert_no_secret(out, text)


def test_sigterm_flushes_the_upload_or_exits_143_anyway_naming_the_safe_step(
    tmp_path: Path, tiny_llama: Path, data: Path, s3_remote: str, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    """A preemption notice: the stop step is saved, then its upload gets checkpoint.notice_seconds.
    Here every upload stalls for 2 s (the test hook) and the notice is 0.5 s, so it cannot finish."""
    out = tmp_path / "run"
    monkeypatch.setenv(UPLOAD_PAUSE_ENV, "2")
    cfg = _cfg(out, tiny_llama, data, 50, **{"checkpoint.remote": s3_remote, "checkpoint.notice_seconds": 0.5})

    def notice() -> None:  # like the spot VM's SIGTERM, once a step is done
        while not ((out / "metrics.jsonl").is_file() and (out / "metrics.jsonl").read_text().strip()):
            time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=notice, daemon=True).start()
    started = time.monotonic()
    assert run.train(cfg) == EXIT_PREEMPTED
    stopped = CheckpointManager(out / "checkpoints").committed()[-1].name
    text = "".join(capsys.readouterr())
    local = int(stopped.split("-")[1])
    found = re.search(
        r"the upload did not finish within 0\.5s; the newest checkpoint safe remotely is step (None|\d+)", text
    )
    assert found and f"the local one is step {local}" in text, text[-2000:]
    # Which step is safe depends on how far earlier uploads got on a loaded machine; never the stop step.
    assert found.group(1) == "None" or int(found.group(1)) < local
    assert time.monotonic() - started < 60  # it did not wait for the stalled upload
