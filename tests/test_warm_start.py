"""tests/warm_start.py, which the drills start `python -m trainer train` with: an attempt forked from the
warm forkserver is the process a fresh interpreter would be (its exit code and output, its own session,
a SIGKILL's return code, its loader workers killed with it), minus the imports; an environment that
differs in what a library may read while importing gets a fresh interpreter (the control)."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import psutil
import warm_start
import yaml
from test_kill_anywhere import _recipe

from trainer.exit_codes import EXIT_BAD_INPUT
from trainer.restart.local.checkpoint import PAUSE_ENV


def _dump(tmp_path: Path, name: str, **extra: str) -> tuple[dict[str, str], Path]:
    dump = tmp_path / f"{name}.modules"
    return {**os.environ, "SPOTUNE_WARM_DUMP": str(dump), **extra}, dump


def test_an_attempt_is_the_process_a_fresh_interpreter_is_without_the_imports(tmp_path: Path) -> None:
    args = ["train", "train.no_such_key=1"]
    env, dump = _dump(tmp_path, "warm")
    warm = warm_start.start(args, tmp_path / "warm.log", env=env)
    assert isinstance(warm, warm_start.Attempt)
    assert warm.wait(timeout=120) == EXIT_BAD_INPUT
    fresh = warm_start.start(args, tmp_path / "fresh.log", env={**os.environ, warm_start.FRESH_ENV: "1"})
    assert isinstance(fresh, subprocess.Popen)  # the control: a fresh interpreter
    assert fresh.wait(timeout=120) == EXIT_BAD_INPUT
    said = (tmp_path / "warm.log").read_text()
    assert "no_such_key" in said and said == (tmp_path / "fresh.log").read_text()
    assert "torch" not in dump.read_text().split()  # its imports were done: torch came from the forkserver

    # A variable a library may read while importing: a fresh interpreter, not a fork.
    env, _ = _dump(tmp_path, "hashseed", PYTHONHASHSEED="7")
    other = warm_start.start(args, tmp_path / "other.log", env=env)
    assert isinstance(other, subprocess.Popen) and other.wait(timeout=120) == EXIT_BAD_INPUT


def test_a_sigkilled_attempt_in_its_own_session_takes_its_loader_worker_along(
    tmp_path: Path, tiny_llama: Path, tiny_data: Path
) -> None:
    out, recipe = tmp_path / "run", tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump(_recipe(out, tiny_llama, tiny_data, tmp_path / "cache")))  # one loader worker
    p = warm_start.start(["train", str(recipe)], tmp_path / "train.log", env={**os.environ, PAUSE_ENV: "120"})
    assert isinstance(p, warm_start.Attempt)
    assert os.getsid(p.pid) == p.pid  # a session of its own, as start_new_session gives
    deadline = time.monotonic() + 240
    while not any((out / "checkpoints").glob("step-*.tmp-*")):  # paused inside its first save
        assert p.poll() is None and time.monotonic() < deadline, (tmp_path / "train.log").read_text()
        time.sleep(0.05)
    session = [q for q in psutil.process_iter() if _sid(q.pid) == p.pid]
    assert p.pid in [q.pid for q in session] and "pt_data_worker" in [q.name() for q in session], session
    # The attempt alone, as a machine's kill -9 of the trainer: its loader worker sees its parent gone and ends
    # (torch's watchdog), as under a fresh interpreter, whose workers are forked from the trainer itself. A
    # forkserver child's default start method is the forkserver's: workers started through a forkserver of the
    # attempt's own outlived it, both, with a copy of the model each (66 pairs, 11.7 GB, in a day of runs here).
    os.kill(p.pid, signal.SIGKILL)
    assert p.wait(timeout=60) == -signal.SIGKILL
    psutil.wait_procs(session, timeout=60)
    assert not [q for q in session if q.is_running() and q.status() != psutil.STATUS_ZOMBIE], session


def _sid(pid: int) -> int | None:
    try:
        return os.getsid(pid)
    except (ProcessLookupError, PermissionError):
        return None


def test_torchrun_ranks_are_the_launchers_children_in_sessions_of_their_own_without_the_imports(
    tmp_path: Path, tiny_llama: Path, tiny_data: Path
) -> None:
    """The ranks of a forked torchrun are forked too: each the launcher's child (a rank watches its parent
    for the launcher's death), in a session of its own (torchrun's start_new_session), its imports done,
    reaped by the agent with its exit code."""
    out, recipe = tmp_path / "run", tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump(_recipe(out, tiny_llama, tiny_data, tmp_path / "cache")))
    args = ["--standalone", "--nproc_per_node", "2", "-m", "trainer", "train", str(recipe)]
    env, dump = _dump(tmp_path, "torchrun")
    log = tmp_path / "torchrun.log"
    launcher = warm_start.start(args, log, env=env, module="torch.distributed.run")
    assert isinstance(launcher, warm_start.Attempt)
    seen: dict[int, tuple[int, int | None]] = {}  # rank pid -> (parent, session) while it runs
    while launcher.poll() is None:
        try:
            for q in psutil.Process(launcher.pid).children():
                seen.setdefault(q.pid, (q.ppid(), _sid(q.pid)))
        except psutil.Error:
            pass
        time.sleep(0.01)
    assert launcher.returncode == 0, log.read_text()[-3000:]
    ranks = {pid for pid, (_, session) in seen.items() if session == pid}
    assert len(ranks) == 2 and all(seen[pid][0] == launcher.pid for pid in ranks), seen
    assert (out / "final" / "adapter_model.safetensors").is_file()
    for rank in (0, 1):  # each imported neither torch nor the trainer: the forkserver had
        modules = Path(f"{dump}.rank{rank}").read_text().split()
        assert "trainer.training.run" not in modules and "torch" not in modules

    # The control: a rank that runs anything but the trainer is started by Popen, a fresh interpreter
    # (so nothing dumped by it), and the launcher still reaps it.
    (tmp_path / "x.json").write_text("{}")
    args = ["--standalone", "--nproc_per_node", "1", "-m", "json.tool", str(tmp_path / "x.json")]
    env, dump = _dump(tmp_path, "other")
    other = warm_start.start(args, tmp_path / "other.log", env=env, module="torch.distributed.run")
    assert isinstance(other, warm_start.Attempt) and other.wait(timeout=120) == 0, (tmp_path / "other.log").read_text()
    assert "{}" in (tmp_path / "other.log").read_text() and not list(tmp_path.glob("other.modules.rank*"))
