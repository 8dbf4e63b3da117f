"""Stop `python -m trainer train` every way a spot machine does, restart the same command
until it finishes: SIGTERM (checkpoint, exit 143), SIGKILL inside a save (halfway through
fsyncing, before the manifest) and SIGKILL at a random moment. The final adapter and every
logged loss, redone steps included, equal an uninterrupted run's; the ledger has one row
per attempt. Also a two-process gloo run where only rank 1 gets SIGTERM, then the launcher
alone is SIGKILLed (tests/test_launcher_death.py: its ranks' watch)."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import warm_start
import yaml
from safetensors.torch import load_file
from warm_start import Started

from trainer import builtin_assets
from trainer.exit_codes import EXIT_PREEMPTED
from trainer.restart.books.ledger import read_rows
from trainer.restart.local.checkpoint import CheckpointManager
from trainer.restart.local.state import TrainState
from trainer.restart.ownership.lock import holder

pytestmark = pytest.mark.bitwise  # separate runs agree bit for bit: one intra-op thread (conftest.py)

REPO = Path(__file__).resolve().parents[1]
STEPS = 8


@pytest.fixture
def procs():
    """Every training process a test starts; whatever is still alive at teardown is killed."""
    started: list[subprocess.Popen] = []
    yield started
    for p in started:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)  # its own session: torchrun and its workers too
            p.wait()


def _recipe(out: Path, model: Path, data: Path, cache: Path) -> dict[str, Any]:
    return {
        "output_dir": str(out),
        "seed": 5,
        "model": {"name_or_path": str(model), "dtype": "float32"},
        "adapter": {"r": 4, "alpha": 8, "dropout": 0.1},
        # One loader worker, as on CUDA: the drill kills a process that has a child.
        "data": {"path": str(data), "seq_len": 128, "cache_dir": str(cache), "loader_workers": 1},
        "train": {
            "max_steps": STEPS,
            "micro_batch_size": 2,
            "grad_accum": 2,
            "lr": 1e-2,
            "schedule": "cosine",
            "warmup_steps": 2,
        },
        "checkpoint": {"every_steps": 2, "every_minutes": None, "keep_last": 2},
        "metrics": {"progress": False, "report": False, "log_every": 1},
    }


def _metric_rows(out: Path) -> list[dict[str, Any]]:
    path = out / "metrics.jsonl"
    if not path.is_file():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            pass  # a line being written as we read
    return [r for r in rows if "loss" in r]


def _wait(proc: subprocess.Popen, cond, timeout: float = 120.0) -> bool:
    """Poll until cond() holds (True) or the process exits (False)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            return False
        if cond():
            return True
        time.sleep(0.02)
    proc.kill()
    raise AssertionError("timed out waiting for the training process")


def start_attempt(procs: list, recipe: Path, log: Path, env: dict[str, str] | None = None) -> Started:
    """`python -m trainer train RECIPE` as a machine starts it: a session of its own (a kill takes its
    loader workers too), its output in `log`, registered in `procs` for the fixture to end. Forked from
    the worker's warm forkserver (tests/warm_start.py): a process of its own whose imports are done."""
    procs.append(warm_start.start(["train", str(recipe)], log, env=env))
    return procs[-1]


def same_final(a: Path, b: Path) -> bool:
    """Whether two runs' final adapters are equal bit for bit."""
    x, y = (load_file(run / "final" / "adapter_model.safetensors") for run in (a, b))
    return x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)


def finish_on_new_machines(start: Any, new_vm: Any, attempts: range, logs: Path) -> None:
    """The same command on a fresh machine each time (`new_vm` wipes it, `start(n)` runs attempt n) until
    an attempt finishes; fails naming the last attempt's log when none of `attempts` does."""
    for n in attempts:
        new_vm()
        p = start(n)
        if p.wait(timeout=300) == 0:
            return
    raise AssertionError((logs / f"attempt{n}.log").read_text())


def drill_seed() -> int:
    """A kill schedule of its own in every run: earlier tests seed `random`, which made a schedule
    drawn from it the same in every suite run. SPOTUNE_DRILL_SEED replays one."""
    return int(os.environ.get("SPOTUNE_DRILL_SEED") or random.SystemRandom().randrange(1 << 30))


def test_kill_anywhere_then_finish_equals_uninterrupted(
    tmp_path: Path, tiny_llama: Path, procs: list, uninterrupted: Any
) -> None:
    """`uninterrupted`: the shared reference run of tests/drill_reference.py (which imports this module)."""
    seed = drill_seed()
    rnd = random.Random(seed)
    print(f"kill schedule seed {seed}")
    data = uninterrupted.data
    cache = data.parent / "cache"
    ref_out, out = uninterrupted.out, tmp_path / "killed"
    reference = uninterrupted.losses

    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump(_recipe(out, tiny_llama, data, cache)))
    ck = CheckpointManager(out / "checkpoints", keep_last=2)
    logs = tmp_path / "logs"
    logs.mkdir()

    def start(n: int, pause: float = 0.0) -> subprocess.Popen:
        env = {**os.environ, "SPOTUNE_TEST_SAVE_PAUSE": str(pause)}
        return start_attempt(procs, recipe, logs / f"attempt{n}.log", env)

    def steps_logged() -> int:
        return max((r["step"] for r in _metric_rows(out)), default=0)

    # Attempt 1: SIGTERM mid-run -> finish the step, checkpoint it, exit 143.
    p = start(1)
    assert _wait(p, lambda: steps_logged() >= 1), (logs / "attempt1.log").read_text()
    time.sleep(rnd.uniform(0.0, 0.2))
    p.send_signal(signal.SIGTERM)
    assert p.wait(timeout=120) == EXIT_PREEMPTED, (logs / "attempt1.log").read_text()
    newest = ck.committed()[-1]
    assert ck.verify(newest) == []
    stopped_at = TrainState.from_json((newest / "trainer_state.json").read_text()).step
    assert stopped_at == steps_logged() < STEPS  # the checkpoint holds the step it stopped at

    # Attempt 2: SIGKILL inside a save, halfway through fsyncing its files, before the manifest.
    p = start(2, pause=3.0)
    committed = ck.committed()
    assert _wait(p, lambda: any(ck.root.glob("step-*.tmp-*"))), (logs / "attempt2.log").read_text()
    p.kill(), p.wait()
    assert ck.committed() == committed and any(ck.root.glob("step-*.tmp-*"))  # never committed

    # Attempt 3: SIGKILL at a random moment after it has trained a step.
    p = start(3)
    before = steps_logged()
    if _wait(p, lambda: steps_logged() > before):
        time.sleep(rnd.uniform(0.0, 1.0))
        p.kill()
    p.wait()

    def finished() -> bool:
        """final/ written and the run's last row says so. Not the exit code: the random SIGKILL may land
        after the finished row, in interpreter shutdown, and a rerun then is a no-op without a row."""
        rows = read_rows(out)
        return (
            (out / "final" / "adapter_model.safetensors").exists()
            and bool(rows)
            and rows[-1]["exit_reason"] == "finished"
        )

    # Then the same command until it finishes.
    for n in range(4, 8):
        if finished():
            break
        p = start(n)
        p.wait(timeout=300)
    assert finished(), (logs / f"attempt{n}.log").read_text()

    assert same_final(ref_out, out)
    # Every logged loss, including steps redone after a kill, equals the uninterrupted run's.
    for r in _metric_rows(out):
        assert r["loss"] == reference[r["step"]], (r["step"], seed)
    # One ledger row per attempt, the SIGKILLed ones recovered from their heartbeat.
    expected = {-signal.SIGKILL: "killed", EXIT_PREEMPTED: "preempted", 0: "finished"}
    reasons = [json.loads(x)["exit_reason"] for x in (out / "ledger.jsonl").read_text().splitlines()]
    assert len(reasons) == len(procs), reasons
    for q, reason in zip(procs, reasons, strict=False):
        # A SIGKILL that lands after the row was written (interpreter shutdown) keeps that row.
        assert reason == expected[q.returncode] or (q.returncode == -signal.SIGKILL and reason != "killed"), reasons
    assert reasons[:2] == ["preempted", "killed"] and reasons[-1] == "finished"
    assert not list(ck.root.glob("*.tmp-*"))  # the save killed in flight was cleaned up


def _torchrun(procs: list, recipe: Path, log: Path) -> Started:
    """torchrun of two ranks in a session of its own: the launcher forked from the warm forkserver
    (tests/warm_start.py), and its ranks as well; one intra-op thread each (`bitwise`)."""
    args = ["--standalone", "--nproc_per_node", "2", "-m", "trainer", "train", str(recipe)]
    procs.append(warm_start.start(args, log, module="torch.distributed.run"))
    return procs[-1]


def test_two_process_ddp_sigterm_on_one_rank_then_launcher_killed_then_resume(
    tmp_path: Path, tiny_llama: Path, procs: list
) -> None:
    """Two torchrun ranks (gloo), stopped twice before the same command finishes them. First SIGTERM
    reaches only rank 1: both ranks agree on the stop step, save, exit. Then the launcher alone is
    SIGKILLed: torchrun starts its ranks in sessions of their own, so the kill reaches none of them;
    each sees its parent gone, they agree on a step, save and exit within seconds, and the same
    command resumes at once (no 75: no rank holds the run). The run ends with the same adapter as an
    uninterrupted two-process run. (One drill for both stops: each alone started a torchrun more.)"""
    import psutil

    steps = 16  # the launcher's death is seen within a poll (0.5 s): steps enough that the ranks are still training
    data = builtin_assets.write_dataset(tmp_path / "train.jsonl", n=16)
    recipes = {}
    for name in ("straight", "stopped"):
        raw = _recipe(tmp_path / name, tiny_llama, data, tmp_path / "cache")
        raw["train"].update(max_steps=steps, micro_batch_size=1, grad_accum=2)
        raw["checkpoint"]["every_steps"] = None
        recipes[name] = tmp_path / f"{name}.yaml"
        recipes[name].write_text(yaml.safe_dump(raw))

    straight = _torchrun(procs, recipes["straight"], tmp_path / "straight.log")
    assert straight.wait(timeout=300) == 0, (tmp_path / "straight.log").read_text()

    out = tmp_path / "stopped"
    ck = CheckpointManager(out / "checkpoints", keep_last=2)
    logs = [tmp_path / f"stopped{n}.log" for n in (1, 2, 3)]

    def ranks(launcher: Started) -> list[psutil.Process]:
        """The ranks themselves: the launcher's children in sessions of their own (torchrun's
        start_new_session), not their DataLoader workers (the ranks' children)."""
        found = [c for c in psutil.Process(launcher.pid).children() if os.getsid(c.pid) == c.pid]
        assert len(found) == 2, found
        return found

    def reasons() -> list[str]:
        return [json.loads(x)["exit_reason"] for x in (out / "ledger.jsonl").read_text().splitlines()]

    def newest() -> tuple[Path, TrainState]:
        path = ck.committed()[-1]
        return path, TrainState.from_json((path / "trainer_state.json").read_text())

    # 1: SIGTERM to rank 1 alone, once the ranks train.
    p = _torchrun(procs, recipes["stopped"], logs[0])
    assert _wait(p, lambda: bool(_metric_rows(out)), timeout=300), logs[0].read_text()
    (rank1,) = [r for r in ranks(p) if r.pid != (holder(out) or {}).get("pid")]  # rank 0 holds the run
    rank1.send_signal(signal.SIGTERM)
    p.wait(timeout=120)
    assert reasons() == ["preempted"], logs[0].read_text()
    first, state = newest()
    assert 1 <= state.step < steps and state.world_size == 2
    assert {k.split(".")[0] for k in load_file(first / "rng.safetensors")} == {"rank0", "rank1"}

    # 2: the same command, then SIGKILL of the launcher alone once the resumed ranks train.
    p = _torchrun(procs, recipes["stopped"], logs[1])
    assert _wait(p, lambda: max(r["step"] for r in _metric_rows(out)) > state.step, timeout=300), logs[1].read_text()
    family = ranks(p)
    try:
        p.kill()  # the launcher alone: the ranks are in sessions of their own
        p.wait()
        killed = time.monotonic()
        _, alive = psutil.wait_procs(family, timeout=30)
        assert not alive, logs[1].read_text()
        print(f"ranks gone {time.monotonic() - killed:.1f}s after the launcher")
    finally:
        for r in family:
            if r.is_running():
                r.kill()
    assert reasons() == ["preempted", "preempted"], logs[1].read_text()
    second, after = newest()
    assert state.step < after.step < steps, logs[1].read_text()

    # 3: the same command resumes at once from the launcher-less save and finishes.
    p = _torchrun(procs, recipes["stopped"], logs[2])
    assert p.wait(timeout=300) == 0, logs[2].read_text()
    assert f"resuming from {second}" in logs[2].read_text()
    assert reasons() == ["preempted", "preempted", "finished"]
    a = load_file(tmp_path / "straight" / "final" / "adapter_model.safetensors")
    b = load_file(out / "final" / "adapter_model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
