"""Elastic resume: a run is defined by its global batch, so it continues on any world size.

2 ranks -> killed -> 1 rank -> killed -> 3 ranks trains every step on the same rows as an
uninterrupted single process (equal `sample_digest` at every step) and ends with the same
adapter within fp32 summation tolerance (LoRA dropout 0: dropout masks are drawn per rank and
cannot match across world sizes). The 3 ranks take uneven shares of the global batch of 8.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import time
from pathlib import Path
from typing import Any

import psutil
import pytest
import torch
import warm_start
from drill_reference import train_here
from safetensors.torch import load_file
from warm_start import Started

from trainer.data.sampler import StepSampler
from trainer.restart.local.checkpoint import MANIFEST, CheckpointManager

STEPS = 6


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _args(model: Path, data: Path, cache: Path, out: Path, global_batch: int) -> list[str]:
    o: dict[str, Any] = {
        "output_dir": out,
        "model.name_or_path": model,
        "model.dtype": "float32",
        "adapter.dropout": 0.0,
        "data.path": data,
        "data.seq_len": 128,
        "data.cache_dir": cache,
        "train.max_steps": STEPS,
        "train.global_batch_size": global_batch,
        "train.micro_batch_size": 1,
        "train.lr": 1e-3,
        "train.adam_eps": 1e-6,  # as tests/test_ddp.py: no +/-lr steps from gradients that are rounding noise
        "metrics.progress": False,
        "metrics.report": False,
        "metrics.log_every": 1,
        "checkpoint.every_steps": 1,
        "checkpoint.every_minutes": "null",
    }
    return [f"{k}={v}" for k, v in o.items()]


def _start(world: int, args: list[str], log: Path) -> Started:
    """`python -m trainer train` for one rank, torchrun for more: forked from the warm forkserver
    (tests/warm_start.py), unbuffered (a SIGKILLed attempt's log is whole)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    if world == 1:
        return warm_start.start(["train", *args], log, env=env)
    launcher = ["--nproc_per_node", str(world), "--master_addr", "127.0.0.1", "--master_port", str(_free_port())]
    return warm_start.start([*launcher, "-m", "trainer", "train", *args], log, env=env, module="torch.distributed.run")


def _newest_step(out: Path) -> int:
    """The newest committed step (a directory being pruned, `step-N.tmp-pruned-*`, is not one)."""
    store = CheckpointManager(out / "checkpoints")
    return max((store.step_of(p) for p in store.committed() if (p / MANIFEST).is_file()), default=0)


def _run(world: int, args: list[str], log: Path, kill_after: int | None = None, out: Path | None = None) -> int:
    """Run to the end, or SIGKILL the whole process group once this attempt has committed `kill_after`
    checkpoints beyond the newest one the run had when it started."""
    start = _newest_step(out) if out is not None else 0
    proc = _start(world, args, log)
    deadline = time.monotonic() + 600
    while proc.poll() is None and time.monotonic() < deadline:
        if kill_after is not None and out is not None and _newest_step(out) >= start + kill_after:
            _kill_tree(proc)  # the machine is gone: no handler runs anywhere
            return -signal.SIGKILL
        time.sleep(0.05)
    if proc.poll() is None:
        _kill_tree(proc)
        raise AssertionError(f"timed out; see {log}")
    assert proc.returncode is not None
    return proc.returncode


def _kill_tree(proc: Started) -> None:
    """SIGKILL the launcher and every descendant: torchrun starts its workers in sessions of their
    own, so killing its process group alone would leave the ranks training."""
    family = psutil.Process(proc.pid).children(recursive=True)
    os.killpg(proc.pid, signal.SIGKILL)
    for p in family:
        with contextlib.suppress(psutil.NoSuchProcess):
            p.kill()
    proc.wait()
    psutil.wait_procs(family, timeout=30)


def _digests(out: Path) -> dict[int, str]:
    """Step -> sample_digest over every attempt's rows (a step redone after a kill must agree)."""
    seen: dict[int, str] = {}
    for line in (out / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        if "sample_digest" in row:
            assert seen.setdefault(row["step"], row["sample_digest"]) == row["sample_digest"], row["step"]
    return seen


def _adapter(out: Path) -> dict[str, torch.Tensor]:
    return load_file(out / "final" / "adapter_model.safetensors")


def _assert_close(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    scale = max(float(t.abs().max()) for t in b.values())
    worst = max(float((a[k] - b[k]).abs().max()) for k in b)
    assert worst <= 1e-5 * scale, f"max abs difference {worst:.3g} > 1e-5 x {scale:.3g}"


@pytest.mark.slow
def test_two_one_three_ranks_equal_one_uninterrupted_process(tmp_path: Path, tiny_llama: Path, tiny_data: Path) -> None:
    """The last attempt's 3 ranks take uneven shares of the global batch of 8 (3, 3 and 2 rows, the
    short rank running a filler micro-batch in lockstep). One drill for shrinking, growing and uneven
    shares: a separate 3-rank run from scratch would start a fourth launcher and three more ranks."""
    cache = tmp_path / "cache"
    ref = tmp_path / "reference"
    assert train_here(_args(tiny_llama, tiny_data, cache, ref, 8)) == 0

    out = tmp_path / "elastic"
    args = _args(tiny_llama, tiny_data, cache, out, 8)
    assert _run(2, args, tmp_path / "a.log", kill_after=2, out=out) == -signal.SIGKILL
    assert _run(1, args, tmp_path / "b.log", kill_after=2, out=out) == -signal.SIGKILL
    resumed_at = _newest_step(out)
    assert resumed_at < STEPS, "the 3 ranks train at least one step"
    assert _run(3, args, tmp_path / "c.log") == 0, (tmp_path / "c.log").read_text()[-3000:]
    for log in ("b.log", "c.log"):
        assert "world size" in (tmp_path / log).read_text(), f"{log}: a resume on another world size says so"

    expected = _digests(ref)
    assert sorted(expected) == list(range(1, STEPS + 1))
    assert _digests(out) == expected
    _assert_close(_adapter(out), _adapter(ref))

    # Control: had a world size reseeded the order, the digests would show it at once.
    n_rows = StepSampler(10**4, 8, seed=0).num_rows  # any dataset size: only the seed differs
    reseeded = StepSampler(n_rows, 8, seed=1)
    assert any(reseeded.digest(s - 1) != StepSampler(n_rows, 8, seed=0).digest(s - 1) for s in expected)
    # Control: a different global batch is a different run.
    assert StepSampler(1000, 8, seed=0).digest(0) != StepSampler(1000, 6, seed=0).digest(0)
