"""A rank that hangs must not keep the others (and the bill) waiting torch's default 10 (NCCL)
or 30 (gloo) minutes: once training runs, a collective gives up after
`train.collective_timeout_seconds` and the waiting rank exits non-zero, so a supervisor
restarts the run from its last checkpoint (trainer/model/distributed.py, CollectiveTimeout).

Two gloo processes on CPU stand in for the GPUs: gloo honours the same group timeout that
NCCL's watchdog enforces."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from test_ddp import _free_port

from trainer import config as C
from trainer.model.distributed import CollectiveTimeout

REPO = Path(__file__).resolve().parents[1]

# Rank 1 stops answering after the armed barrier; rank 0 waits in an all-reduce and prints
# how long it waited before the collective gave up.
TWO_RANKS = """
import sys, time
import torch, torch.distributed as dist
from trainer.model.distributed import CollectiveTimeout, end_process_group
port, rank, seconds = sys.argv[1], int(sys.argv[2]), sys.argv[3]
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
timeout = CollectiveTimeout(None if seconds == "none" else float(seconds))
timeout.arm()
if rank == 1:
    time.sleep(120)
started = time.monotonic()
try:
    dist.all_reduce(torch.ones(1))
except RuntimeError as e:
    print(f"gave up after {time.monotonic() - started:.1f}s: {e}", flush=True)
    end_process_group()  # as `spotune` does on its way out (trainer/cli/main.py)
    sys.exit(1)
"""


def test_a_hung_rank_ends_the_waiting_one_within_the_timeout() -> None:
    """Two pairs at once, so the control's wait overlaps the armed pair's: the armed one gives up
    after its 3 s; the control (torch's default) is still waiting when the armed one's bound ends."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    pairs = {}
    started = time.monotonic()
    for seconds in ("3", "none"):
        port = str(_free_port())
        pairs[seconds] = [
            subprocess.Popen(
                [sys.executable, "-c", TWO_RANKS, port, str(r), seconds],
                cwd=REPO,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
            for r in (0, 1)
        ]
    try:
        armed, control = pairs["3"][0], pairs["none"][0]
        out, _ = armed.communicate(timeout=120)
        assert armed.returncode == 1, out
        waited = float(out.split("gave up after ")[1].split("s:")[0])
        assert 2.5 <= waited < 15, out  # the timeout, not the default, and not at once
        # The control: torch's default keeps rank 0 waiting (15 s from its start, as before, even
        # though most of it passed while the armed pair ran).
        left = 15 - (time.monotonic() - started)
        if left > 0:
            with pytest.raises(subprocess.TimeoutExpired):
                control.wait(timeout=left)
        assert control.poll() is None, control.communicate()[0]
    finally:
        for p in [p for pair in pairs.values() for p in pair]:
            p.kill()
            p.wait()


def test_one_process_and_no_timeout_leave_torch_alone(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import torch.distributed as dist

    from trainer.model import distributed

    changed: list[float] = []
    monkeypatch.setattr(distributed, "_set_timeout", lambda group, seconds: changed.append(seconds))
    t = CollectiveTimeout(None)
    t.arm()
    assert not t.armed  # no timeout asked for: nothing armed, nothing to disarm
    t = CollectiveTimeout(30.0)
    t.arm()  # no process group: nothing to change, nothing raised
    assert t.armed and changed == []
    t.disarm()
    assert not t.armed and changed == []
    # A group of one process: no other rank to wait for, so its timeout stays torch's.
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        t = CollectiveTimeout(30.0)
        t.arm()
        t.disarm()
        assert changed == []
        # Control: the same calls on a group of two change the timeout (the spy sees them).
        monkeypatch.setattr(CollectiveTimeout, "_group", staticmethod(lambda: dist.group.WORLD))
        t = CollectiveTimeout(30.0)
        t.arm()
        assert changed == [30.0]
    finally:
        dist.destroy_process_group()


def test_the_timeout_is_validated() -> None:
    with pytest.raises(C.ConfigError) as e:
        C.RunConfig().replace(**{"train.collective_timeout_seconds": 5})
    assert "train.collective_timeout_seconds: must be at least 10 (or null for torch's default), got 5" in str(e.value)
    assert C.RunConfig().replace(**{"train.collective_timeout_seconds": None}).train.collective_timeout_seconds is None


# The trainer, rank 1 hanging in its forward from the second step on (a stuck GPU).
HANG = """
import os, sys, time
from trainer.model import objective  # the loop's SFT objective calls the loss there
original, calls = objective.token_loss_sum, [0]
def hanging(*args, **kwargs):
    calls[0] += 1
    if calls[0] > 2 and os.environ["RANK"] == "1":
        open(os.environ["HUNG_AT"], "w").write(repr(time.time()))
        time.sleep(600)
    return original(*args, **kwargs)
objective.token_loss_sum = hanging
from trainer.cli.main import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.slow
def test_spotune_train_ends_when_a_rank_hangs(tmp_path: Path, tiny_llama: Path, tiny_data: Path) -> None:
    """Through `spotune train` (armed after the first step): rank 0 exits non-zero with gloo's
    timeout in its log within the timeout plus a bound, instead of 30 minutes. Under torchrun the
    launcher then ends the hung rank (SIGTERM, SIGKILL 30 s later)."""
    recipe = {
        "output_dir": str(tmp_path / "run"),
        "model": {"name_or_path": str(tiny_llama), "dtype": "float32"},
        "adapter": {"r": 4, "alpha": 8},
        "data": {"path": str(tiny_data), "seq_len": 128, "cache_dir": str(tmp_path / "cache")},
        "train": {"max_steps": 6, "micro_batch_size": 2, "grad_accum": 2, "collective_timeout_seconds": 10},
        "checkpoint": {"every_steps": 2, "every_minutes": None},
        "metrics": {"progress": False, "report": False, "log_every": 1},
    }
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    hung_at = tmp_path / "hung_at"
    base = {
        **os.environ,
        "PYTHONPATH": str(REPO),
        "OMP_NUM_THREADS": "1",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(_free_port()),
        "WORLD_SIZE": "2",
        "LOCAL_WORLD_SIZE": "2",
        "HUNG_AT": str(hung_at),
    }
    logs = [tmp_path / f"rank{r}.log" for r in (0, 1)]
    ranks = [
        subprocess.Popen(
            [sys.executable, "-c", HANG, "train", str(path)],
            cwd=REPO,
            env={**base, "RANK": str(r), "LOCAL_RANK": str(r)},
            stdout=open(logs[r], "w"),
            stderr=subprocess.STDOUT,
        )
        for r in (0, 1)
    ]
    try:
        # 1 (an error), not 134: the broken group is destroyed before exit instead of aborting in its destructor
        assert ranks[0].wait(timeout=300) == 1, logs[0].read_text()
        ended = time.time()
        assert hung_at.exists(), logs[0].read_text()
        assert ended - float(hung_at.read_text()) < 10 + 20, logs[0].read_text()
        assert "Timed out" in logs[0].read_text()
    finally:
        for p in ranks:
            p.kill()
            p.wait()
