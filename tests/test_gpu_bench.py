"""benchmarks/gpu.py keeps working: its --tiny CPU run writes the JSON the README's GPU table is made from."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_gpu_benchmark_tiny_run_writes_its_json(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    cmd = [sys.executable, "benchmarks/gpu.py", "--tiny", "--json", str(out), "--steps", "2", "--seq", "128"]
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
        "qlora_peak_memory_gib",
        "memory_estimate_gib",
    }
    assert result["memory_estimate_gib"]["lora"]["estimate"] > 0  # measured on CUDA only
    assert "lora peak memory GiB: estimate" in done.stdout
    side_keys = {"attn_implementation", "tokens_per_s", "step_seconds", "mfu_lora", "mfu_6n", "peak_memory_gib"}
    for side in ("spotune", "hf_peft"):
        assert set(result[side]) == side_keys
        assert result[side]["tokens_per_s"] > 0 and result[side]["step_seconds"] > 0
    assert result["spotune"]["attn_implementation"] == "sdpa"  # `auto` on CPU
    assert set(result["qlora_peak_memory_gib"]) == {"spotune", "hf_peft"}
    assert "tokens/s ratio spotune / HF+PEFT" in done.stdout


def test_gpu_recipes_keep_the_fast_path_settings() -> None:
    """bf16 autocast on, LoRA dropout off (it copies every adapted input), and activation
    checkpointing plus paged 8-bit AdamW for the 8B QLoRA recipe."""
    from trainer import config as C

    recipes = sorted((REPO / "recipes" / "gpu").glob("*.yaml"))
    assert len(recipes) == 3
    for path in recipes:
        cfg = C.load(path)
        assert cfg.train.mixed_precision == "bf16" and cfg.adapter.dropout == 0.0, path.name
    big = C.load(REPO / "recipes" / "gpu" / "llama-3.1-8b-qlora.yaml")
    assert big.model.gradient_checkpointing and big.train.optimizer == "paged_adamw_8bit"
    assert big.adapter.method == "qlora" and big.model.dtype == "bfloat16"  # NF4 with bf16 compute
