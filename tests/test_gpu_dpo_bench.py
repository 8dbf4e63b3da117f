"""benchmarks/gpu_dpo.py keeps working: its --tiny CPU run times spotune's DPO step and TRL's on the same pairs
and writes the JSON a GPU measurement will fill in (docs/gpu.md)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def test_dpo_benchmark_tiny_run_writes_its_json(tmp_path: Path) -> None:
    pytest.importorskip("trl", reason="TRL is the peer compared against: the `bench` extra")
    out = tmp_path / "bench.json"
    cmd = [sys.executable, "benchmarks/gpu_dpo.py", "--tiny", "--json", str(out), "--steps", "2", "--pairs", "4"]
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}  # the CPU path even on a GPU runner
    done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    assert set(result) == {"device", "spotune", "trl", "setup"}
    for side in ("spotune", "trl"):
        assert set(result[side]) == {
            "pairs_per_s",
            "tokens_per_s",
            "step_seconds",
            "mfu",
            "peak_memory_gib",
            "first_step_seconds",
        }
        assert result[side]["pairs_per_s"] > 0 and result[side]["mfu"] is None  # no peak FLOP/s on CPU
    assert "pairs/s ratio spotune / TRL" in done.stdout
