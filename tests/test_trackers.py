"""Experiment trackers across attempts: a run SIGKILLed twice is one W&B run, one MLflow run and
one TensorBoard log, every step charted exactly once, each row saying which attempt and machine
wrote it. W&B runs offline (its .wandb transaction log read back with W&B's own protobuf
records), MLflow on a local SQLite store read back with MlflowClient."""

from __future__ import annotations

import json
import os
import socket
import struct
import subprocess
from collections.abc import Iterator
from importlib.util import find_spec
from pathlib import Path
from typing import Any

import pytest
import yaml
from drill_reference import train_here
from test_kill_anywhere import (  # noqa: F401 (procs: a fixture)
    REPO,
    STEPS,
    _metric_rows,
    _recipe,
    _wait,
    procs,
    start_attempt,
)

from trainer import builtin_assets
from trainer.restart.local.checkpoint import CheckpointManager
from trainer.restart.local.state import TrainState
from trainer.training import trackers

# Asked of the installed packages, not imported: importing W&B and MLflow costs each test worker ~2 s
# at collection, paid only where this module runs.
pytestmark = pytest.mark.skipif(
    find_spec("wandb") is None or find_spec("mlflow") is None,
    reason="W&B and MLflow are not installed (the `test` extra)",
)


@pytest.fixture(scope="module")
def mlflow_uri(tmp_path_factory: pytest.TempPathFactory) -> str:
    """One SQLite tracking store for the module: creating its tables takes seconds."""
    from mlflow import MlflowClient

    uri = f"sqlite:///{tmp_path_factory.mktemp('mlflow') / 'mlflow.db'}"
    MlflowClient(uri).search_experiments()
    return uri


def wandb_records(path: Path) -> Iterator[Any]:
    """The records of an offline run's `.wandb` file: W&B's record log (a LevelDB-style log of 32 KiB
    blocks, each record a `wandb_internal_pb2.Record`), as `wandb sync` reads it."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    assert data[:4] == b":W&B", path
    pos, block, buf = 7, 32768, b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if length == 0 and kind == 0:
            break
        buf += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # FULL or LAST: a whole record
            record = pb.Record()
            record.ParseFromString(buf)
            buf = b""
            yield record


def wandb_history(path: Path) -> tuple[str, list[dict[str, Any]]]:
    """(run id, history rows) of an offline run's `.wandb` file."""
    run_id, rows = "", []
    for record in wandb_records(path):
        if record.WhichOneof("record_type") == "run":
            run_id = record.run.run_id
        elif record.WhichOneof("record_type") == "history":
            rows.append(
                {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
            )
    return run_id, rows


def as_wandb_keeps(files: list[list[dict[str, Any]]]) -> dict[int, dict[str, Any]]:
    """The run's history as W&B keeps it when the attempts' offline runs are synced in order:
    a row whose step is below the run's current step is refused (W&B's resume rule)."""
    kept: dict[int, dict[str, Any]] = {}
    for rows in files:
        for row in rows:
            step = row["_step"]
            if not kept or step >= max(kept):
                kept.setdefault(step, {}).update(row)
    return kept


@pytest.mark.slow
def test_sigkilled_twice_is_one_tracker_run_with_every_step_once(
    tmp_path: Path,
    tiny_llama: Path,
    mlflow_uri: str,
    procs: list,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
    capfd: pytest.CaptureFixture[str],
) -> None:
    from mlflow import MlflowClient

    data = builtin_assets.write_dataset(tmp_path / "train.jsonl", n=16)
    out = tmp_path / "run"
    raw = _recipe(out, tiny_llama, data, tmp_path / "cache")
    raw["metrics"].update(trackers=["wandb", "mlflow", "tensorboard"], project="drill", tags=["spot"])
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump(raw))
    uri = mlflow_uri
    trackers_env = {"WANDB_MODE": "offline", "WANDB_SILENT": "true", "MLFLOW_TRACKING_URI": uri}
    env = {**os.environ, **trackers_env}
    ck = CheckpointManager(out / "checkpoints", keep_last=2)

    def start(n: int) -> subprocess.Popen:
        return start_attempt(procs, recipe, tmp_path / f"attempt{n}.log", env)

    def logged() -> int:
        return max((r["step"] for r in _metric_rows(out)), default=0)

    # Two SIGKILLs, each after the attempt logged a step past its newest checkpoint (every 2 steps).
    for n, past in ((1, 3), (2, 6)):
        p = start(n)
        assert _wait(p, lambda past=past: logged() >= past), (tmp_path / f"attempt{n}.log").read_text()
        p.kill(), p.wait()
    (out / trackers.IDS_FILE).unlink()  # the run directory's copy is lost: the checkpoint's must do
    # The third attempt is neither killed nor about its process: it runs in this one (the same command,
    # the same trackers' environment), without a child's ~6 s of imports.
    for key, value in trackers_env.items():
        monkeypatch.setenv(key, value)
    try:
        assert train_here([str(recipe)]) == 0, capfd.readouterr()
    finally:
        import wandb

        wandb.teardown()  # W&B keeps a process's first settings (WANDB_DIR...): the tests below set their own

    # Control: the kills made the attempts redo steps (metrics.jsonl keeps every attempt's rows).
    jsonl = [r["step"] for r in _metric_rows(out)]
    assert len(jsonl) > len(set(jsonl)) and set(jsonl) == set(range(1, STEPS + 1))

    ids = json.loads((out / trackers.IDS_FILE).read_text())
    assert set(ids) == {"wandb", "mlflow"}
    for step_dir in ck.committed():  # every checkpoint carries them to a fresh machine
        assert TrainState.from_json((step_dir / "trainer_state.json").read_text()).trackers == ids

    # W&B: one run id over the three attempts' offline runs; steps rise within each.
    files = sorted(out.glob("wandb/offline-run-*/run-*.wandb"))
    assert len(files) == 3
    histories = []
    for f in files:
        assert f.parent.name.endswith(f"-{ids['wandb']}"), f  # W&B names an offline run's directory by its id
        run_id, rows = wandb_history(f)
        assert run_id in ("", ids["wandb"]), f  # "": a SIGKILL before W&B's service wrote the run record
        steps = [r["_step"] for r in rows]
        assert steps == sorted(set(steps)), (f, steps)  # rising, and no step twice within an attempt
        histories.append(rows)
    kept = as_wandb_keeps(histories)
    assert sorted(kept) == list(range(1, STEPS + 1))
    assert all(row["machine"] == socket.gethostname() and row["attempt"] in (1, 2, 3) for row in kept.values())
    assert kept[1]["attempt"] == 1 and kept[STEPS]["attempt"] == 3  # which attempt measured each step

    # MLflow: one run in the experiment, each step of each metric once, the attempts tagged with their machine.
    client = MlflowClient(uri)
    experiment = client.get_experiment_by_name("drill")
    runs = client.search_runs([experiment.experiment_id])
    assert [r.info.run_id for r in runs] == [ids["mlflow"]]
    assert runs[0].info.status == "FINISHED" and runs[0].data.tags["spot"] == "true"
    for key in ("loss", "attempt", "tokens_per_s"):
        history = client.get_metric_history(ids["mlflow"], key)
        assert sorted(m.step for m in history) == list(range(1, STEPS + 1)), key
    losses = {m.step: m.value for m in client.get_metric_history(ids["mlflow"], "loss")}
    reference = {r["step"]: r["loss"] for r in _metric_rows(out)}
    assert losses == pytest.approx(reference, rel=1e-6)  # exact resume: redone steps equal the first
    assert runs[0].data.tags["spotune.attempt.3.machine"] == socket.gethostname()

    # TensorBoard: one log directory; the resumed attempts' purge_step hides what the killed ones wrote past it.
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(out / "tensorboard"))
    events.Reload()
    assert sorted(e.step for e in events.Scalars("loss")) == list(range(1, STEPS + 1))


def test_ids_come_from_the_run_directory_then_the_checkpoint(tmp_path: Path) -> None:
    assert trackers.read_ids(tmp_path, None) == {}
    assert trackers.read_ids(tmp_path, {"wandb": "fromckpt"}) == {"wandb": "fromckpt"}
    (tmp_path / trackers.IDS_FILE).write_text(json.dumps({"wandb": "fromdir"}))
    assert trackers.read_ids(tmp_path, {"wandb": "fromckpt"}) == {"wandb": "fromdir"}
    (tmp_path / trackers.IDS_FILE).write_text("{torn")
    assert trackers.read_ids(tmp_path, {"wandb": "fromckpt"}) == {"wandb": "fromckpt"}


def test_mlflow_resume_logs_only_steps_the_run_lacks(
    tmp_path: Path, mlflow_uri: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A second attempt that redoes steps 3..4 (the first logged 1..4) adds only 5..6 to the same run."""
    from mlflow import MlflowClient

    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_uri)

    def attempt(n: int, resume_step: int, steps: range, carried: dict[str, str] | None) -> trackers.Trackers:
        run = trackers.TrackerRun(("mlflow",), "p", "r", (), tmp_path, {"a": 1}, resume_step, attempt=n)
        t = trackers.Trackers(run, carried)
        for s in steps:
            t.log({"step": s, "loss": float(s) + n / 10, "note": "text", "flag": True}, s)
        t.finish("preempted" if n == 1 else "finished", 0)
        return t

    first = attempt(1, 0, range(1, 5), None)
    (tmp_path / trackers.IDS_FILE).unlink()
    second = attempt(2, 2, range(3, 7), first.ids)
    assert second.ids == first.ids
    client = MlflowClient(mlflow_uri)
    history = client.get_metric_history(first.ids["mlflow"], "loss")
    assert [(m.step, m.value) for m in sorted(history, key=lambda m: m.step)] == [
        (1, 1.1), (2, 2.1), (3, 3.1), (4, 4.1), (5, 5.2), (6, 6.2)
    ]  # fmt: skip
    assert "flag" not in client.get_run(first.ids["mlflow"]).data.metrics  # booleans and text are not metrics


def test_a_tracker_that_cannot_start_is_named_and_the_others_go_on(
    tmp_path: Path, mlflow_uri: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "nosuchscheme://tracking")
    run = trackers.TrackerRun(("mlflow", "tensorboard"), "p", "r", (), tmp_path, {}, 0, attempt=1)
    t = trackers.Trackers(run, None)
    t.log({"loss": 1.0}, 1)
    t.finish("finished", 0)
    err = capsys.readouterr().err
    assert "spotune: metrics.trackers: mlflow could not start (" in err and "nosuchscheme" in err, err
    assert list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))  # TensorBoard still wrote its row


def test_the_trackers_own_settings_win_over_spotunes_defaults(
    tmp_path: Path, mlflow_uri: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """WANDB_DIR holds W&B's files (not the run directory), WANDB_PROJECT and MLFLOW_EXPERIMENT_NAME name
    the project when metrics.project is unset, MLFLOW_TRACKING_URI is the store; a project set in the
    recipe still wins, and without the variables spotune's defaults apply (the control)."""
    from mlflow import MlflowClient

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_uri)

    def attempt(run_dir: Path, project: str | None) -> trackers.Trackers:
        run = trackers.TrackerRun(("wandb", "mlflow"), project, "r", (), run_dir, {}, 0, attempt=1)
        t = trackers.Trackers(run, None)
        t.log({"loss": 1.0}, 1)
        t.finish("finished", 0)
        return t

    mine = tmp_path / "my-wandb"
    monkeypatch.setenv("WANDB_DIR", str(mine))
    monkeypatch.setenv("WANDB_PROJECT", "team-project")
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "team-experiment")
    t = attempt(tmp_path / "run", None)
    assert list(mine.glob("wandb/offline-run-*")) and not (tmp_path / "run" / "wandb").exists()
    client = MlflowClient(mlflow_uri)
    assert (
        client.get_run(t.ids["mlflow"]).info.experiment_id
        == client.get_experiment_by_name("team-experiment").experiment_id
    )
    assert _wandb_project(mine) == "team-project"
    named = attempt(tmp_path / "named", "from-recipe")  # the recipe's own choice wins over the variables
    assert (
        client.get_run(named.ids["mlflow"]).info.experiment_id
        == client.get_experiment_by_name("from-recipe").experiment_id
    )
    for name in ("WANDB_DIR", "WANDB_PROJECT", "MLFLOW_EXPERIMENT_NAME"):
        monkeypatch.delenv(name)
    plain = attempt(tmp_path / "plain", None)  # control: spotune's defaults
    assert list((tmp_path / "plain" / "wandb").glob("offline-run-*"))
    assert _wandb_project(tmp_path / "plain") == trackers.DEFAULT_PROJECT
    experiment = client.get_experiment_by_name(trackers.DEFAULT_PROJECT)
    assert client.get_run(plain.ids["mlflow"]).info.experiment_id == experiment.experiment_id


def _wandb_project(root: Path) -> str:
    """The project recorded in the (one) offline W&B run under `root`."""
    (path,) = root.glob("wandb/offline-run-*/run-*.wandb")
    return next(r.run.project for r in wandb_records(path) if r.WhichOneof("record_type") == "run")


def test_an_attempt_killed_before_its_first_checkpoint_is_redone_once_on_tensorboard(tmp_path: Path) -> None:
    """The first attempt logs steps 1..3 and is killed before any checkpoint; the next starts again at
    step 0 and logs them again: TensorBoard rewinds to 0 (`purge_step`), so each step is charted once."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    for attempt in (1, 2):
        run = trackers.TrackerRun(("tensorboard",), "p", "r", (), tmp_path, {}, 0, attempt=attempt)
        t = trackers.Trackers(run, None)
        for step in (1, 2, 3):
            t.log({"loss": float(step) + attempt / 10}, step)
        if attempt == 2:
            t.finish("finished", 0)  # the first is killed: never finished, its rows flushed one by one
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert [(e.step, round(e.value, 3)) for e in events.Scalars("loss")] == [(1, 1.2), (2, 2.2), (3, 3.2)]
