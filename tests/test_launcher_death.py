"""A launcher that dies leaves no rank behind: torchrun starts its ranks in sessions of their own,
so a SIGKILL of torchrun alone reaches none of them. Each rank sees its parent gone, the ranks
agree on a step, save, and exit within seconds; the same command then resumes at once (no 75)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from trainer import builtin_assets
from trainer.exit_codes import EXIT_FILE_ENV, EXIT_PREEMPTED
from trainer.restart.local.checkpoint import CheckpointManager
from trainer.restart.local.state import TrainState
from trainer.restart.signals import launcher

REPO = Path(__file__).resolve().parents[1]


def test_watch_requests_the_stop_then_exits_by_the_deadline(monkeypatch: pytest.MonkeyPatch) -> None:
    asked: list[str] = []
    exited: list[int] = []
    watch = launcher.LauncherWatch(asked.append, deadline_seconds=0.2, poll_seconds=0.01, exit_now=exited.append)
    watch.start()
    time.sleep(0.1)
    assert asked == [] and exited == []  # the parent lives: nothing happens
    monkeypatch.setattr(os, "getppid", lambda: 1)  # re-parented to init: the launcher died
    assert watch.gone.wait(2.0)
    assert asked == [f"the launcher (pid {watch.parent}) is gone"]
    deadline = time.monotonic() + 2.0
    while not exited and time.monotonic() < deadline:
        time.sleep(0.01)
    assert exited == [EXIT_PREEMPTED]


def test_stopped_watch_does_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    asked: list[str] = []
    watch = launcher.LauncherWatch(asked.append, deadline_seconds=0.0, poll_seconds=0.01, exit_now=asked.append)
    watch.start().stop()
    monkeypatch.setattr(os, "getppid", lambda: 1)
    time.sleep(0.1)
    assert asked == [] and not watch.gone.is_set()


def _torchrun(recipe: Path, log: Path, env: dict[str, str] | None = None) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    return subprocess.Popen(
        [*cmd, "-m", "trainer", "train", str(recipe)],
        cwd=REPO,
        env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO), **(env or {})},
        stdout=open(log, "w"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )


@pytest.mark.slow
def test_sigkill_of_torchrun_ranks_save_and_exit_then_resume(tmp_path: Path, tiny_llama: Path) -> None:
    import psutil

    data = builtin_assets.write_dataset(tmp_path / "train.jsonl", n=16)
    out = tmp_path / "run"
    recipe = tmp_path / "recipe.yaml"
    raw = {
        "output_dir": str(out),
        "model": {"name_or_path": str(tiny_llama), "dtype": "float32"},
        "data": {"path": str(data), "seq_len": 128, "cache_dir": str(tmp_path / "cache")},
        "train": {"max_steps": 400, "micro_batch_size": 1, "grad_accum": 1},
        "checkpoint": {"every_steps": None, "every_minutes": None},
        "metrics": {"progress": False, "report": False, "log_every": 1},
    }
    recipe.write_text(yaml.safe_dump(raw))
    p = _torchrun(recipe, tmp_path / "first.log")
    ranks: list[psutil.Process] = []
    try:
        deadline = time.monotonic() + 240
        while not (out / "metrics.jsonl").is_file() or not (out / "metrics.jsonl").read_text().strip():
            assert p.poll() is None and time.monotonic() < deadline, (tmp_path / "first.log").read_text()
            time.sleep(0.05)
        ranks = [c for c in psutil.Process(p.pid).children() if c.environ().get("RANK") in ("0", "1")]
        assert len(ranks) == 2
        p.kill()  # the launcher alone: the ranks are in sessions of their own
        p.wait()
        killed = time.monotonic()
        _, alive = psutil.wait_procs(ranks, timeout=30)
        assert not alive, (tmp_path / "first.log").read_text()
        print(f"ranks gone {time.monotonic() - killed:.1f}s after the launcher")
    finally:
        for r in ranks:
            if r.is_running():
                r.kill()
    ledger = [json.loads(x)["exit_reason"] for x in (out / "ledger.jsonl").read_text().splitlines()]
    assert ledger == ["preempted"]
    newest = CheckpointManager(out / "checkpoints", keep_last=2).committed()[-1]
    stopped = TrainState.from_json((newest / "trainer_state.json").read_text()).step
    assert 1 <= stopped < 400

    # The same command resumes at once (stopped after one more step to keep the test short).
    # torchrun reports any rank's non-zero exit as 1: the ranks' own code is in the exit file.
    env = {"SPOTUNE_STOP_AFTER_STEP": str(stopped + 1), EXIT_FILE_ENV: str(tmp_path / "exit")}
    again = _torchrun(recipe, tmp_path / "second.log", env)
    again.wait(timeout=240)
    assert (tmp_path / "exit").read_text().strip() == str(EXIT_PREEMPTED), (tmp_path / "second.log").read_text()
    assert f"resuming from {newest}" in (tmp_path / "second.log").read_text()
