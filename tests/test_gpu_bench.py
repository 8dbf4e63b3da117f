"""benchmarks/gpu.py keeps working: its --tiny CPU run writes the JSON the GPU table (docs/gpu.md) is made from."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

QLORA_ON_CPU = "QLoRA arms are timed on CUDA only (the CPU 4-bit path is tested, not benchmarked)"
"""benchmarks/gpu.py's reason, as a reader of its JSON sees it."""


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
        "memory_estimate_gib",
        "arms",
        "pending",
        "levers",
        "ratios",
    }
    assert result["memory_estimate_gib"]["lora"]["estimate"] > 0  # measured on CUDA only
    assert "lora peak memory GiB: estimate" in done.stdout
    # Every arm, in the order that keeps Liger's module-wide patches last; each measured or skipped with why.
    assert list(result["arms"]) == [
        "spotune",
        "hf_peft",
        "spotune_qlora",
        "hf_peft_qlora",
        "hf_peft_liger",
        "hf_peft_liger_qlora",
    ]
    assert result["pending"] == []
    side_keys = {"attn_implementation", "tokens_per_s", "step_seconds", "peak_memory_gib", "first_step_seconds"}
    side_keys |= {"mfu", "mfu_lora", "mfu_6n"}  # trainer/model/flops.py MFU_COUNTS
    assert set(result["arms"]["spotune"]) == side_keys | {"profile"} and set(result["arms"]["hf_peft"]) == side_keys
    for side in ("spotune", "hf_peft"):
        assert result["arms"][side]["tokens_per_s"] > 0 and result["arms"][side]["step_seconds"] > 0
    assert result["arms"]["spotune"]["attn_implementation"] == "sdpa"  # `auto` on CPU
    for qlora in ("spotune_qlora", "hf_peft_qlora", "hf_peft_liger_qlora"):  # bitsandbytes 4-bit training: CUDA
        assert result["arms"][qlora] == {"skipped": QLORA_ON_CPU}
        assert f"{qlora} skipped: {QLORA_ON_CPU}" in done.stdout
    assert "LoRA spotune / HF+PEFT: tokens/s" in done.stdout
    assert [r.split(":")[0] for r in result["ratios"]] == ["LoRA spotune / HF+PEFT"]  # QLoRA's: CUDA only
    # The profile: every bucket and idle, summing to the step's span; printed as the profile summary.
    profile = result["arms"]["spotune"]["profile"]
    assert sum(profile["ms"].values()) == pytest.approx(profile["total_ms"]) and profile["ms"]["base_matmul"] > 0
    assert "profile of one step" in done.stdout
    # HF + Liger: measured where liger-kernel and CUDA are, else skipped with the reason printed.
    assert set(result["arms"]["hf_peft_liger"]) == {"skipped"} and "hf_peft_liger skipped" in done.stdout
    assert result["levers"] == {}


def test_the_json_is_rewritten_after_every_arm_and_names_what_is_pending(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A run cut short after its first arm (as a cap's kill would) still has that arm's figures and
    says which are missing; the arms run in ARMS's order whatever the order asked."""
    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    import gpu

    measured = gpu.run_arm

    def cut_after_the_first(name: str, *args: object) -> dict:
        if name != "spotune":
            raise KeyboardInterrupt  # the process ends here
        return measured(name, *args)

    monkeypatch.setattr(gpu, "run_arm", cut_after_the_first)
    out = tmp_path / "bench.json"
    with pytest.raises(KeyboardInterrupt):
        gpu.main(["--tiny", "--json", str(out), "--steps", "2", "--seq", "64", "--arms", "hf_peft,spotune"])
    result = json.loads(out.read_text())
    assert list(result["arms"]) == ["spotune"] and result["arms"]["spotune"]["tokens_per_s"] > 0
    assert result["pending"] == ["hf_peft"]
    assert result["memory_estimate_gib"]["lora"]["estimate"] > 0
    with pytest.raises(SystemExit, match="unknown arm dpo"):
        gpu.chosen_arms("spotune,dpo")
