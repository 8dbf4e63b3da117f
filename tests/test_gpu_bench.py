"""benchmarks/gpu.py keeps working: its --tiny CPU run writes the JSON the GPU table (docs/gpu.md) is made from."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def test_gpu_benchmark_tiny_run_writes_its_json(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    cmd = [sys.executable, "benchmarks/gpu.py", "--tiny", "--profile", "--json", str(out), "--steps", "2"]
    cmd += ["--seq", "128"]
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}  # the CPU path even on a GPU runner
    done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    assert set(result) == {
        "date",
        "device",
        "versions",
        "setup",
        "spotune",
        "hf_peft",
        "hf_peft_liger",
        "levers",
        "qlora_peak_memory_gib",
        "memory_estimate_gib",
    }
    assert result["memory_estimate_gib"]["lora"]["estimate"] > 0  # measured on CUDA only
    assert "lora peak memory GiB: estimate" in done.stdout
    side_keys = {"attn_implementation", "tokens_per_s", "step_seconds", "peak_memory_gib", "first_step_seconds"}
    side_keys |= {"mfu", "mfu_lora", "mfu_6n"}  # trainer/model/flops.py MFU_COUNTS
    assert set(result["spotune"]) == side_keys | {"profile"} and set(result["hf_peft"]) == side_keys
    for side in ("spotune", "hf_peft"):
        assert result[side]["tokens_per_s"] > 0 and result[side]["step_seconds"] > 0
    assert result["spotune"]["attn_implementation"] == "sdpa"  # `auto` on CPU
    assert set(result["qlora_peak_memory_gib"]) == {"spotune", "hf_peft"}
    assert "tokens/s ratio spotune / HF+PEFT" in done.stdout
    # The profile: every bucket and idle, summing to the step's span; printed as the profile summary.
    profile = result["spotune"]["profile"]
    assert sum(profile["ms"].values()) == pytest.approx(profile["total_ms"]) and profile["ms"]["base_matmul"] > 0
    assert "profile of one step" in done.stdout
    # HF + Liger: measured where liger-kernel and CUDA are, else skipped with the reason printed.
    liger = result["hf_peft_liger"]
    assert set(liger) == {"skipped"} and "HF+PEFT+Liger skipped" in done.stdout
    assert result["levers"] == {}
