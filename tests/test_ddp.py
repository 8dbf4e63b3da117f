"""Two CPU processes (gloo, started by torchrun) against one process with the same global
batch: the same per-step loss and gradient norm, and the same adapter, within fp32
reduction tolerance. Checks the loss scaling (x world size against DDP's averaging) and
the rank sharding of every step's rows."""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path
from typing import Any

import torch
import warm_start
from safetensors.torch import load_file

from trainer import config as C
from trainer.training import run

REPO = Path(__file__).resolve().parents[1]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _overrides(model: Path, data: Path, cache: Path, out: Path, **extra: Any) -> dict[str, Any]:
    o: dict[str, Any] = {
        "output_dir": str(out),
        "model.name_or_path": str(model),
        "model.dtype": "float32",
        "adapter.dropout": 0.0,
        "data.path": str(data),
        "data.seq_len": 128,
        "data.cache_dir": str(cache),
        "train.max_steps": 3,
        "train.micro_batch_size": 2,
        "train.lr": 1e-3,
        # Adam turns a gradient that is zero up to rounding into a +/-lr step (m/sqrt(v) ~ its sign);
        # an eps above that noise keeps such steps proportional to the gradient, so the comparison
        # measures the loss scaling and the sharding, not the sign of rounding noise.
        "train.adam_eps": 1e-6,
        "metrics.progress": False,
        "metrics.report": False,
        "checkpoint.every_minutes": None,
    }
    o.update(extra)
    return o


def _rows(out: Path) -> list[dict[str, Any]]:
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]


def test_two_processes_match_one(tmp_path: Path, tiny_llama: Path, tiny_data: Path) -> None:
    cache = tmp_path / "cache"
    one = tmp_path / "one"
    assert (
        run.train(C.RunConfig().replace(**_overrides(tiny_llama, tiny_data, cache, one, **{"train.grad_accum": 2})))
        == 0
    )

    two = tmp_path / "two"
    args = [f"{k}={'null' if v is None else v}" for k, v in _overrides(tiny_llama, tiny_data, cache, two).items()]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    launcher = ["--nproc_per_node", "2", "--master_addr", "127.0.0.1", "--master_port", str(_free_port())]
    log = tmp_path / "torchrun.log"  # the launcher forked from the warm forkserver (tests/warm_start.py)
    proc = warm_start.start([*launcher, "-m", "trainer", "train", *args], log, env=env, module="torch.distributed.run")
    assert proc.wait(timeout=300) == 0, log.read_text()[-4000:]

    a, b = _rows(one), _rows(two)
    assert [r["step"] for r in b] == [1, 2, 3]
    for ra, rb in zip(a, b, strict=False):
        assert ra["trainable_tokens"] == rb["trainable_tokens"] and ra["real_tokens"] == rb["real_tokens"]
        assert abs(ra["loss"] - rb["loss"]) <= 1e-5 * abs(ra["loss"])
        # The gradient norm is where a missing (or doubled) world-size factor would show.
        assert abs(ra["grad_norm"] - rb["grad_norm"]) <= 1e-4 * ra["grad_norm"]
    wa = load_file(one / "final" / "adapter_model.safetensors")
    wb = load_file(two / "final" / "adapter_model.safetensors")
    assert wa.keys() == wb.keys()
    for k in wa:
        torch.testing.assert_close(wb[k], wa[k], rtol=1e-4, atol=1e-6)

    # Control: half the global batch (one process, no accumulation) trains on other rows.
    half = tmp_path / "half"
    assert (
        run.train(C.RunConfig().replace(**_overrides(tiny_llama, tiny_data, cache, half, **{"train.max_steps": 1})))
        == 0
    )
    assert (
        abs(_rows(half)[0]["loss"] - a[0]["loss"]) > 1e-3
        or _rows(half)[0]["trainable_tokens"] != a[0]["trainable_tokens"]
    )
