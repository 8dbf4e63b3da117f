"""FSDP2 with activation offloading: two gloo ranks train with `model.activation_offload=on` and
end bit-identical to the same FSDP run without it (offloading moves values, never changes them)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch
from test_fsdp import REPO, _adapter, _free_port, _overrides, _rows, _step

# Test-only: every rank appends the bytes each forward moved to host memory, so the test knows
# that offloading happened under FSDP (an equality of two runs that both skipped it proves nothing).
SITECUSTOMIZE = """
import os
from trainer.model import offload

_exit = offload.ActivationOffload.exit

def exit(self):
    if self._hooks is not None:
        with open(os.path.join(os.environ["OFFLOAD_LOG"], "rank" + os.environ.get("RANK", "0")), "a") as f:
            f.write(f"{self.offloaded_bytes}\\n")
    _exit(self)

offload.ActivationOffload.exit = exit
"""


def _torchrun(overrides: dict[str, Any], log: Path, pythonpath: str = str(REPO)) -> str:
    args = [f"{k}={'null' if v is None else v}" for k, v in overrides.items()]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1"]
    cmd += ["--master_port", str(_free_port()), "-m", "trainer", "train", *args]
    # Extends PYTHONPATH: packages installed with --target (the GPU check's carried wheels) stay importable.
    pythonpath = os.pathsep.join(p for p in (pythonpath, os.environ.get("PYTHONPATH", "")) if p)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": pythonpath}
    done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    log.write_text(done.stdout + done.stderr)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    return done.stdout + done.stderr


@pytest.mark.slow
def test_fsdp_with_activation_offload_matches_fsdp_without(
    tmp_path: Path, tiny_llama: Path, tiny_data: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "inject").mkdir()
    (tmp_path / "inject" / "sitecustomize.py").write_text(textwrap.dedent(SITECUSTOMIZE))
    (tmp_path / "moved").mkdir()
    monkeypatch.setenv("OFFLOAD_LOG", str(tmp_path / "moved"))
    sharded = {"train.distributed": "fsdp", "model.gradient_checkpointing": True}
    cache = tmp_path / "cache"
    plain, offloaded = tmp_path / "plain", tmp_path / "offloaded"
    _torchrun(_overrides(tiny_llama, tiny_data, cache, plain, 2, **sharded), tmp_path / "plain.log")
    log = _torchrun(
        # quoted: YAML reads a bare `on` as true
        _overrides(tiny_llama, tiny_data, cache, offloaded, 2, **sharded, **{"model.activation_offload": "'on'"}),
        tmp_path / "offloaded.log",
        pythonpath=f"{tmp_path / 'inject'}{os.pathsep}{REPO}",
    )
    assert "activation offloading on" in log and "FSDP: sharding over 2 processes" in log
    for rank in ("rank0", "rank1"):  # every training forward of every rank moved its layer inputs
        moved = [int(x) for x in (tmp_path / "moved" / rank).read_text().split()]
        assert len(moved) >= 4 and min(moved) > 0, moved
    assert [r["loss"] for r in _rows(offloaded).values()] == [r["loss"] for r in _rows(plain).values()]
    a, b = _adapter(offloaded / "final"), _adapter(plain / "final")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    # Control: the comparison sees one step's difference.
    one = _adapter(_step(plain, 1))
    assert not all(torch.equal(one[k], b[k]) for k in b)
